// How frontend 1.49 ranks a node search's match in a node's name (its FuseSearch.calcAuxSingle, without the fuzzy
// score it adds last), for patch_attention.js to rank Patch Attention's search aliases the same way. No app import,
// so that tests/test_report_view.py runs it in Node.js too.

/** [rank, position, length] of ``query`` (lower case) in ``name``, as frontend 1.49 ranks a node's name. */
export function nameRank(query, name) {
  const words = name.split(/ |\b|(?<=[a-z])(?=[A-Z])|(?=[A-Z][a-z])/).map((w) => w.toLocaleLowerCase());
  const typed = query.split(" ");
  const t = name.toLocaleLowerCase();
  if (t === query) return [0, 0, 0];
  if (t.startsWith(query)) return [1, 0, t.length];
  if (words.includes(query)) return [2, t.indexOf(query) + t.length * 0.5, t.length];
  if (t.includes(query)) return [3, t.indexOf(query) + t.length * 0.5, t.length];
  if (typed.every((w) => words.includes(w))) {
    const at = typed.map((w) => words.indexOf(w));
    const [lo, hi] = [Math.min(...at), Math.max(...at)];
    return [4, hi - lo + hi * 0.5 + t.length * 0.5, t.length];
  }
  if (typed.every((w) => t.includes(w))) {
    const lo = Math.min(...typed.map((w) => t.indexOf(w)));
    const hi = Math.max(...typed.map((w) => t.indexOf(w) + w.length));
    return [5, hi - lo + hi * 0.5 + t.length * 0.5, t.length];
  }
  return [9, 0, 0];
}

export function byRank(a, b) {
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return a[i] - b[i];
  return 0;
}
