// Patch Attention's report nodes show their report on the node after they run.
//
// These nodes return their report as `{"ui": {"text": [report]}}` (ComfyUI's PreviewText); the frontends that
// ComfyUI 0.3.64 and 0.33 pin (1.27, 1.49) draw that text only on their own Preview Any node. This extension gives
// each report node a read-only text box and fills it from the node's executed message. No build step: ComfyUI
// serves this file from WEB_DIRECTORY as it is.
import { app } from "../../scripts/app.js";

// nodes/definitions.py: the nodes whose first output is a text report (tests/test_browser.py checks the two agree)
const REPORT_NODES = ["AttentionBackendsInfo", "AttentionBenchmark", "AttentionBenchmarkE2E"];
const WIDGET = "report_text";
const PLACEHOLDER = "The report appears here when the node has run.";

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
    el.placeholder = PLACEHOLDER;
    el.dataset.patchAttentionReport = node.type;
  }
  return widget;
}

function showReport(node, output) {
  const text = output?.text;
  if (text == null) return;
  const widget = reportWidget(node);
  if (!widget) return;
  widget.value = Array.isArray(text) ? text.join("\n\n") : String(text);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "PatchAttention.Reports",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!REPORT_NODES.includes(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      reportWidget(this);
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
      if (node && REPORT_NODES.includes(node.type)) showReport(node, output);
    }
  },
});
