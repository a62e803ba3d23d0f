// Patch Attention in ComfyUI's frontend. No build step: ComfyUI serves this file from WEB_DIRECTORY as it is.
//
// 1. The report nodes show their report on the node after they run. They return it as `{"ui": {"text": [report]}}`
//    (ComfyUI's PreviewText); the frontends that ComfyUI 0.3.64 and 0.33 pin (1.27, 1.49) draw that text only on
//    their own Preview Any node. Each report node gets a read-only text box, filled from its executed message. The
//    note nodes return a line the same way beside their outputs (Context Parallel: why it does not split here), and
//    may send it again, longer, while a prompt runs (what a sampling run could not split).
// 2. A workflow saved before an input or type was renamed opens with the current names: both frontends keep a saved
//    node's slots as the file has them (name, type and link), so the old names are replaced here, links kept.
import { app } from "../../scripts/app.js";

// nodes/definitions.py: the nodes whose first output is a text report (tests/test_browser.py checks the two agree)
const REPORT_NODES = ["AttentionBackendsInfo", "AttentionBenchmark", "AttentionBenchmarkE2E"];
// nodes/definitions.py: the nodes that show a note beside their outputs (tests/test_context_parallel.py checks it)
const NOTE_NODES = ["ContextParallel"];
const TEXT_NODES = [...REPORT_NODES, ...NOTE_NODES];
const WIDGET = "report_text";
const PLACEHOLDER = "The report appears here when the node has run.";
const NOTE_PLACEHOLDER = "What this node does on this machine appears here when it has run.";

function reportWidget(node) {
  const have = node.widgets?.find((w) => w.name === WIDGET);
  if (have) return have;
  // the frontend's own multiline text widget (a textarea), as Preview Any uses it
  const STRING = window.comfyAPI?.widgets?.ComfyWidgets?.STRING;
  if (!STRING) return null;
  const widget = STRING(node, WIDGET, ["STRING", { multiline: true }], app).widget;
  widget.serialize = false; // a report is output, not a setting: saved workflows keep only the inputs
  widget.options = { ...(widget.options ?? {}), serialize: false };
  const el = widget.element ?? widget.inputEl;
  if (el) {
    el.readOnly = true;
    el.placeholder = NOTE_NODES.includes(node.type) ? NOTE_PLACEHOLDER : PLACEHOLDER;
    el.dataset.patchAttentionReport = node.type;
  }
  return widget;
}

// room for a report: its longest line up to 100 characters, its lines up to 30 (the box scrolls beyond)
const CHAR_PX = 7.2;
const LINE_PX = 15;

function fitReport(node, text) {
  const lines = text.split("\n");
  const longest = Math.min(100, Math.max(0, ...lines.map((l) => l.length)));
  const base = node.computeSize?.() ?? node.size;
  const width = Math.max(node.size[0], Math.ceil(longest * CHAR_PX) + 40, 360);
  const height = Math.max(node.size[1], base[1] + Math.min(30, lines.length) * LINE_PX);
  if (width !== node.size[0] || height !== node.size[1]) node.setSize([width, height]);
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

app.registerExtension({
  name: "PatchAttention",
  loadedGraphNode(node) {
    renameSlots(node);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.includes(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      if (reportWidget(this)) this.setSize([Math.max(this.size[0], 360), Math.max(this.size[1], 160)]);
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
