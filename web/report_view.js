// A report node's report drawn on the node: its text as it is, and its pipe tables as tables. No app import, so that
// tests/test_report_view.py can run it in Node.js too; patch_attention.js puts it on the nodes.
//
// The reports (nodes/definitions.py, measure/) are lines of text with GitHub pipe tables between them: a header row,
// a |---| row, body rows. Text keeps its line breaks and spacing (Attention Backends Info aligns its columns with
// spaces); `code` spans show as code. Everything is set as text content: nothing in a report is parsed as HTML.

const SEPARATOR = /^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;

/** The cells of one pipe-table row: split at unescaped pipes, outer pipes dropped, cells trimmed. */
export function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

/** A report as blocks, in order: {type: "text", text} and {type: "table", head: [...], rows: [[...]]}. */
export function reportBlocks(text) {
  const lines = String(text ?? "").split("\n");
  const blocks = [];
  let prose = [];
  const flush = () => {
    if (prose.length) blocks.push({ type: "text", text: prose.join("\n") });
    prose = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.trim().startsWith("|") && i + 1 < lines.length && SEPARATOR.test(lines[i + 1].trim())) {
      const head = cells(line);
      const rows = [];
      i += 2;
      while (i < lines.length && lines[i].trim().startsWith("|")) rows.push(cells(lines[i++]));
      i -= 1;
      // a row with fewer cells is padded, one with more keeps them: nothing of the report is dropped
      const width = Math.max(head.length, ...rows.map((r) => r.length));
      const pad = (r) => [...r, ...Array(width - r.length).fill("")];
      flush();
      blocks.push({ type: "table", head: pad(head), rows: rows.map(pad) });
    } else {
      prose.push(line);
    }
  }
  flush();
  // blank lines around a table are the markdown's, not the report's
  return blocks
    .map((b) => (b.type === "text" ? { ...b, text: b.text.replace(/^\n+|\n+$/g, "") } : b))
    .filter((b) => b.type === "table" || b.text.length);
}

// The size a report needs on the node at the frontend's own zoom, in canvas pixels: a monospace character and a
// line of the node's text box (the frontends' textarea font), a table cell's padding and border.
export const CHAR_PX = 7.2;
export const LINE_PX = 15;
const CELL_PAD_PX = 13;
const ROW_PX = LINE_PX + 5;

/** How many lines ``line`` takes wrapped at ``perLine`` characters, at its spaces as the page wraps it (a word longer
 * than a line broken). */
export function wrappedLines(line, perLine) {
  if (!(perLine >= 1) || line.length <= perLine) return 1;
  let lines = 1;
  let used = 0;
  for (const word of line.split(/(?<= )/)) {
    const width = word.trimEnd().length;
    if (used > 0 && used + width > perLine) {
      lines++;
      used = 0;
    }
    used += width;
    while (used > perLine) {
      lines++;
      used -= perLine;
    }
    used += word.length - width; // its spaces: at a line's end they hang past it
  }
  return lines;
}

/** [width, height] the report's blocks take: text lines at their length (their height wrapped at ``wrapPx``, where
 * given), tables at their widest cells (tables do not wrap). */
export function reportSize(text, wrapPx = Infinity) {
  let width = 0;
  let height = 0;
  const perLine = Math.floor(wrapPx / CHAR_PX);
  for (const b of reportBlocks(text)) {
    if (b.type === "text") {
      const lines = b.text.split("\n");
      width = Math.max(width, ...lines.map((l) => l.length * CHAR_PX));
      height += lines.reduce((n, l) => n + wrappedLines(l, perLine), 0) * LINE_PX + 6;
    } else {
      const all = [b.head, ...b.rows];
      const cols = b.head.map((_, c) => Math.max(...all.map((r) => r[c].length)));
      width = Math.max(width, cols.reduce((sum, n) => sum + n * CHAR_PX + CELL_PAD_PX, 0));
      height += all.length * ROW_PX + 6;
    }
  }
  return [Math.ceil(width), Math.ceil(height)];
}

/** Text with its `code` spans as <code> elements, appended to ``parent``. */
function appendInline(doc, parent, text) {
  const parts = text.split(/(`[^`\n]+`)/);
  for (const part of parts) {
    if (!part) continue;
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      const code = doc.createElement("code");
      code.textContent = part.slice(1, -1);
      parent.append(code);
    } else {
      parent.append(doc.createTextNode(part));
    }
  }
}

/** Fills ``container`` with the report: a <div> per run of text, a <table> per pipe table. */
export function renderReport(doc, container, text) {
  container.replaceChildren();
  for (const b of reportBlocks(text)) {
    if (b.type === "text") {
      const p = doc.createElement("div");
      p.className = "pa-report-text";
      appendInline(doc, p, b.text);
      container.append(p);
      continue;
    }
    const table = doc.createElement("table");
    const head = table.createTHead().insertRow();
    for (const c of b.head) {
      const th = doc.createElement("th");
      appendInline(doc, th, c);
      head.append(th);
    }
    const body = table.createTBody();
    for (const r of b.rows) {
      const tr = body.insertRow();
      for (const c of r) appendInline(doc, tr.insertCell(), c);
    }
    container.append(table);
  }
}
