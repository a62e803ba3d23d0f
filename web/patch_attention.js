// Patch Attention in ComfyUI's frontend. No build step: ComfyUI serves this file from WEB_DIRECTORY as it is.
//
// 1. The report nodes show their report on the node after they run. They return it as `{"ui": {"text": [report]}}`
//    (ComfyUI's PreviewText); the frontends that ComfyUI 0.3.64 and 0.33 pin (1.27, 1.49) draw that text only on
//    their own Preview Any node. Each report node gets a box that shows the report with its pipe tables as tables
//    (report_view.js), and its text, read-only, to select or copy. The note nodes return a line the same way beside
//    their outputs (Context Parallel: why it does not split here), and may send it again, longer, while a prompt runs
//    (what a sampling run could not split).
// 2. A workflow saved before an input or type was renamed opens with the current names: both frontends keep a saved
//    node's slots as the file has them (name, type and link), so the old names are replaced here, links kept.
// 3. The pack's templates open at the view they were made for (zoom 1 in a 1600x1000 window) from the template
//    browser too: frontend 1.49 fits every template opened there into 75 % of the canvas, which drew them at 82 %.
// 4. The node search ranks Patch Attention first for the kernel names people type (frontend 1.49).
import { app } from "../../scripts/app.js";
import { renderReport, reportSize } from "./report_view.js";
import { byRank, nameRank } from "./search_rank.js";

// nodes/definitions.py: the nodes whose first output is a text report (tests/test_browser.py checks the two agree)
const REPORT_NODES = ["AttentionBackendsInfo", "AttentionBenchmark", "AttentionBenchmarkE2E"];
// nodes/definitions.py: the nodes that show a note beside their outputs (tests/test_context_parallel.py checks it)
const NOTE_NODES = ["ContextParallel"];
const TEXT_NODES = [...REPORT_NODES, ...NOTE_NODES];
const WIDGET = "report_text";
const PLACEHOLDER = "The report appears here when the node has run.";
const NOTE_PLACEHOLDER = "What this node does on this machine appears here when it has run.";
const STYLE = `
.pa-report { display: flex; flex-direction: column; gap: 3px; box-sizing: border-box; overflow: hidden;
  font-family: monospace; font-size: var(--comfy-textarea-font-size, 10px); color: var(--input-text, #ddd);
  background: var(--comfy-input-bg, #222); border-radius: 4px; padding: 3px; }
.pa-report-bar { display: flex; gap: 4px; flex: none; }
.pa-report-bar button { font: inherit; padding: 1px 8px; border-radius: 3px; cursor: pointer;
  color: var(--input-text, #ddd); background: var(--comfy-menu-bg, #353535); border: 1px solid var(--border-color, #4e4e4e); }
.pa-report-bar button[aria-pressed="true"] { background: var(--comfy-input-bg, #222); border-color: var(--input-text, #ddd); }
.pa-report-view { flex: 1 1 auto; min-height: 0; overflow: auto; padding: 0 2px; }
.pa-report-view:empty::before { content: attr(data-placeholder); opacity: 0.6; }
.pa-report-text { white-space: pre-wrap; margin: 0 0 6px; }
.pa-report-view table { border-collapse: collapse; margin: 0 0 8px; }
.pa-report-view th, .pa-report-view td { border: 1px solid var(--border-color, #4e4e4e); padding: 1px 6px;
  text-align: left; white-space: nowrap; }
.pa-report-view th { background: var(--comfy-menu-bg, #353535); }
.pa-report-view code { background: var(--comfy-menu-bg, #353535); border-radius: 3px; padding: 0 3px; }
.pa-report textarea { display: none; flex: 1 1 auto; min-height: 0; width: 100%; margin: 0; }
.pa-report.pa-as-text textarea { display: block; }
.pa-report.pa-as-text .pa-report-view { display: none; }
`;

function addStyle() {
  if (document.getElementById("patch-attention-style")) return;
  const style = document.createElement("style");
  style.id = "patch-attention-style";
  style.textContent = STYLE;
  document.head.append(style);
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", (e) => {
    e.stopPropagation();
    onClick(b);
  });
  return b;
}

async function copyText(textarea) {
  try {
    await navigator.clipboard.writeText(textarea.value);
    return true;
  } catch {
    // no clipboard API here (a page not served from localhost or https): the browser's own copy of a selection
    const shown = textarea.style.display;
    textarea.style.display = "block";
    textarea.select();
    const ok = document.execCommand("copy");
    textarea.style.display = shown;
    return ok;
  }
}

// The report box: the report drawn (tables as tables) or its text, a button for each, and Copy.
function reportElement(node) {
  addStyle();
  const box = document.createElement("div");
  box.className = "pa-report";
  box.dataset.patchAttentionNode = node.type;
  const view = document.createElement("div");
  view.className = "pa-report-view";
  const placeholder = NOTE_NODES.includes(node.type) ? NOTE_PLACEHOLDER : PLACEHOLDER;
  view.dataset.placeholder = placeholder;
  const text = document.createElement("textarea");
  text.className = "comfy-multiline-input";
  text.readOnly = true;
  text.placeholder = placeholder;
  text.dataset.patchAttentionReport = node.type;
  const show = (asText) => {
    box.classList.toggle("pa-as-text", asText);
    drawn.setAttribute("aria-pressed", String(!asText));
    raw.setAttribute("aria-pressed", String(asText));
  };
  const drawn = button("Report", () => show(false));
  const raw = button("Text", () => show(true));
  const copy = button("Copy", async (b) => {
    b.textContent = (await copyText(text)) ? "Copied" : "Copy failed";
    setTimeout(() => (b.textContent = "Copy"), 1500);
  });
  const bar = document.createElement("div");
  bar.className = "pa-report-bar";
  bar.append(drawn, raw, copy);
  box.append(bar, view, text);
  show(false);
  // keys typed in the box (Ctrl+A, Ctrl+C in the text) are the box's, not the canvas's shortcuts
  box.addEventListener("keydown", (e) => e.stopPropagation());
  return { box, view, text };
}

// room for a report: as wide as its widest line or table up to MAX_WIDTH, as tall as it is up to MAX_HEIGHT (the box
// scrolls beyond), and the bar above it. That height is the box's least, so that a node with another text box (the
// benchmark's shapes) gives the report the room and not half of it.
const MAX_WIDTH = 900;
const MAX_HEIGHT = 360;
const BAR_PX = 26;
const TEXT_MARGIN_PX = 40; // the node's width beyond its text's: the node's and the box's edges, the scroll bar
const EMPTY_PX = 50; // the least of an empty box: a text box's, as tests/tools/make_workflows.py sizes the templates

function reportWidget(node) {
  const have = node.widgets?.find((w) => w.name === WIDGET);
  if (have) return have;
  if (typeof node.addDOMWidget !== "function") return null;
  const { box, view, text } = reportElement(node);
  let least = {};
  const widget = node.addDOMWidget(WIDGET, "patch_attention_report", box, {
    getValue: () => text.value,
    setValue: (v) => {
      text.value = v ?? "";
      renderReport(document, view, text.value);
    },
    // its lines wrapped at the node's width (a long line capped at MAX_WIDTH takes several); the frontend asks at
    // every layout, so the last answer is kept for the same text and width
    getMinHeight: () => {
      if (!text.value) return EMPTY_PX;
      const width = node.size[0] - TEXT_MARGIN_PX;
      if (least.text !== text.value || least.width !== width) {
        least = { text: text.value, width, px: BAR_PX + Math.min(MAX_HEIGHT, reportSize(text.value, width)[1]) };
      }
      return least.px;
    },
    serialize: false, // a report is output, not a setting: saved workflows keep only the inputs
  });
  widget.serialize = false;
  return widget;
}

function fitReport(node, text) {
  const width = Math.max(node.size[0], Math.min(MAX_WIDTH, reportSize(text)[0] + TEXT_MARGIN_PX), 360);
  if (width !== node.size[0]) node.setSize([width, node.size[1]]); // first: the height wraps at this width
  const height = Math.max(node.size[1], (node.computeSize?.() ?? node.size)[1]);
  if (height !== node.size[1]) node.setSize([width, height]);
}

function showReport(node, output) {
  const text = output?.text;
  if (text == null) return;
  const widget = reportWidget(node);
  if (!widget) return;
  widget.value = Array.isArray(text) ? text.join("\n\n") : String(text);
  fitReport(node, widget.value);
  node.setDirtyCanvas?.(true, true);
}

// node type -> {"inputs" | "outputs": {old slot name or type: [current name, current type]}}
const RENAMED = {
  PatchAttention: { inputs: { sparge_settings: ["sparse_settings", "SPARSE_SETTINGS"] } },
  SpargeAttnSettings: { outputs: { sparge_settings: ["sparse_settings", "SPARSE_SETTINGS"] } },
  SolAttnSettings: { outputs: { sparge_settings: ["sparse_settings", "SPARSE_SETTINGS"] } },
};
const OLD_TYPES = { SPARGE_SETTINGS: "SPARSE_SETTINGS" };

function linkOf(graph, id) {
  if (id == null || !graph?.links) return null;
  return typeof graph.links.get === "function" ? graph.links.get(id) : graph.links[id];
}

function renameSlots(node) {
  const renamed = RENAMED[node.type];
  if (!renamed) return;
  for (const kind of ["inputs", "outputs"]) {
    const slots = node[kind] ?? [];
    for (const slot of [...slots]) {
      const to = renamed[kind]?.[slot.name];
      const type = to ? to[1] : OLD_TYPES[slot.type];
      if (!type) continue;
      const ids = kind === "inputs" ? [slot.link].filter((id) => id != null) : [...(slot.links ?? [])];
      const current = to && slots.find((s) => s !== slot && s.name === to[0]);
      if (current) {
        // The frontend built the current slot from the node's definition and kept the saved one beside it, with
        // the link: the link moves to the current slot, and the saved one goes.
        const at = slots.indexOf(current);
        if (kind === "inputs" && current.link == null && ids.length) {
          current.link = ids[0];
          slot.link = null;
        } else if (kind === "outputs" && ids.length) {
          current.links = [...(current.links ?? []), ...ids];
          slot.links = [];
        }
        for (const id of ids) {
          const link = linkOf(node.graph, id);
          if (!link) continue;
          link.type = current.type;
          if (kind === "inputs") link.target_slot = at;
          else link.origin_slot = at;
        }
        if (kind === "inputs") node.removeInput(slots.indexOf(slot));
        else node.removeOutput(slots.indexOf(slot));
        continue;
      }
      if (to) {
        if (slot.label === to[0] || slot.label === slot.name) delete slot.label;
        slot.name = to[0];
        if ("localized_name" in slot) slot.localized_name = to[0];
      }
      slot.type = type;
      for (const id of ids) {
        const link = linkOf(node.graph, id);
        if (link) link.type = type;
      }
    }
  }
}

// The pack's templates carry extra.patch_attention.saved_view (tests/tools/make_workflows.py): their extra.ds is the
// view they were laid out for. The frontend has applied it already when a template is opened as a file.
const TEMPLATE_KEY = "patch_attention";

/** Whether the canvas, at ``ds`` (scale, offset), shows every node of ``graph`` whole. */
function showsEveryNode(graph, ds, width, height) {
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const nodes = graph._nodes ?? graph.nodes ?? [];
  return nodes.length > 0 && nodes.every((n) => {
    const x = (n.pos[0] + ds.offset[0]) * ds.scale;
    const y = (n.pos[1] - title + ds.offset[1]) * ds.scale;
    return x >= 0 && y >= 0 && x + n.size[0] * ds.scale <= width && y + (n.size[1] + title) * ds.scale <= height;
  });
}

function restoreSavedView() {
  const graph = app.graph;
  const saved = graph?.extra?.ds;
  const canvas = app.canvas;
  if (!graph?.extra?.[TEMPLATE_KEY]?.saved_view || !saved?.offset || !canvas?.ds) return;
  const ds = canvas.ds;
  if (ds.scale === saved.scale && ds.offset[0] === saved.offset[0] && ds.offset[1] === saved.offset[1]) return;
  const rect = canvas.canvas?.getBoundingClientRect?.();
  // in a window too small for it, the frontend's fit (the whole graph, smaller) stays
  if (!rect?.width || !showsEveryNode(graph, saved, rect.width, rect.height)) return;
  ds.scale = saved.scale;
  ds.offset[0] = saved.offset[0];
  ds.offset[1] = saved.offset[1];
  canvas.setDirty?.(true, true);
}

// Frontend 1.49 ranks a node search's matches by where the typed words are in each node's name or display name
// (0: the whole name, 1: its start, 2: one of its words, 3: inside it, 4: all its words, 5: all inside it, 9: none),
// then by how often the node is used in shared workflows (a table it bundles), then by the fuzzy score. Search
// aliases only decide whether a node matches: words found only in Patch Attention's aliases ("sageattention", "flash
// attention", "sparge") ranked it 9, below the core nodes with a usage count that matched as loosely (UNet Self
// Attention Multiply, Self-Attention Guidance), and below SpargeAttn Settings for "sparge". The frontend hands each
// match's scores to the node definition's postProcessSearchScores (it copies the fields of the definition it is given
// onto its own): there Patch Attention's aliases are ranked as its name is, by the frontend's rules above.
const SEARCH_BY_ALIASES = ["PatchAttention"];

// The frontend does not pass the query on: during a search it is the text of the focused search box.
function typedQuery() {
  const el = document.activeElement;
  return el instanceof HTMLInputElement && el.value ? el.value.toLocaleLowerCase() : null;
}

function rankAliasesAsNames(defs) {
  for (const def of defs ?? []) {
    if (!SEARCH_BY_ALIASES.includes(def?.name) || !def.search_aliases?.length) continue;
    const aliases = [...def.search_aliases];
    def.postProcessSearchScores = function (scores) {
      const own = Object.getPrototypeOf(this)?.postProcessSearchScores; // puts the usage count second
      const out = typeof own === "function" ? own.call(this, scores) : [...scores];
      const query = typedQuery();
      if (!query) return out;
      const best = aliases.map((a) => nameRank(query, a)).sort(byRank)[0];
      if (byRank(best, [out[0], out[2], out[3]]) < 0) [out[0], out[2], out[3]] = best;
      return out;
    };
  }
}

// The frontend draws a node's progress text (ComfyUI's send_progress_text: the benchmark's plan and estimate) in a widget
// of its own; frontend 1.27 saves that widget's text with the workflow, as if it were an input. On the pack's nodes it is
// output, not a setting: it is left out of what is saved.
const PROGRESS_TEXT_WIDGET = "$$node-text-preview";

function unsavedProgressText(event) {
  const node = app.graph?.getNodeById?.(event.detail?.nodeId) ?? app.graph?.getNodeById?.(Number(event.detail?.nodeId));
  if (!node || !TEXT_NODES.includes(node.type)) return;
  const widget = node.widgets?.find((w) => w.name === PROGRESS_TEXT_WIDGET);
  if (!widget) return;
  widget.serialize = false;
  widget.options = { ...(widget.options ?? {}), serialize: false };
}

app.registerExtension({
  name: "PatchAttention",
  setup() {
    // after the frontend's own handler has made the widget (listeners run in the order they were added)
    window.comfyAPI?.api?.api?.addEventListener?.("progress_text", (e) => setTimeout(() => unsavedProgressText(e), 0));
  },
  loadedGraphNode(node) {
    renameSlots(node);
  },
  async afterConfigureGraph() {
    restoreSavedView();
  },
  beforeRegisterVueAppNodeDefs(defs) {
    rankAliasesAsNames(defs);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.includes(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      // a report node has its box from the start; a note node gets one when it has something to say (showReport),
      // so a template keeps the layout it was made with
      if (REPORT_NODES.includes(nodeData.name) && reportWidget(this)) {
        this.setSize([Math.max(this.size[0], 360), Math.max(this.size[1], 160)]);
      }
      return r;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      showReport(this, output);
    };
  },
  // frontend 1.49: outputs restored when a workflow tab is opened again
  onNodeOutputsUpdated(outputs) {
    for (const [id, output] of Object.entries(outputs ?? {})) {
      const node = app.graph?.getNodeById?.(id) ?? app.graph?.getNodeById?.(Number(id));
      if (node && TEXT_NODES.includes(node.type)) showReport(node, output);
    }
  },
});
