// FastAR: shows the statistics text of a FastAR Stats node on the node itself after each run.
// The server sends it as the node's UI output ({"text": [...]}); this adds a read-only text box.
import { app } from "../../../scripts/app.js";
import { ComfyWidgets } from "../../../scripts/widgets.js";

const WIDGET = "fastar_stats";

function showStats(node, text) {
  let widget = node.widgets?.find((w) => w.name === WIDGET);
  if (!widget) {
    widget = ComfyWidgets.STRING(node, WIDGET, ["STRING", { multiline: true }], app).widget;
    widget.serialize = false; // a display, not a setting: never saved in the workflow
    if (widget.options) widget.options.serialize = false;
    if (widget.inputEl) {
      widget.inputEl.readOnly = true;
      widget.inputEl.style.opacity = 0.9;
    }
  }
  widget.value = text;
  const [w, h] = node.size;
  const wanted = node.computeSize?.() ?? [w, h];
  node.setSize?.([Math.max(w, wanted[0]), Math.max(h, 230)]);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "FastAR.StatsDisplay",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== "FastARStats") return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      const result = onExecuted?.apply(this, arguments);
      const text = Array.isArray(message?.text) ? message.text.join("\n") : message?.text;
      if (text) showStats(this, text);
      return result;
    };
  },
});
