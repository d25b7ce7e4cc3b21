// FastAR: shows the statistics text of a FastAR Stats node on the node itself after each run.
// The server sends it as the node's UI output ({"text": [...]}); this adds a read-only text box
// through the frontend's public API (node.addDOMWidget), not its internal widget modules.
import { app } from "../../../scripts/app.js";

const WIDGET = "fastar_stats";
const HEIGHT = 230; // tools/comfyui/workflows.py saves Stats nodes this tall, so growing moves nothing

function statsWidget(node) {
  const existing = node.widgets?.find((w) => w.name === WIDGET);
  if (existing) return existing;
  const box = document.createElement("textarea");
  box.className = "comfy-multiline-input"; // the frontend's own text box look
  box.readOnly = true;
  box.style.opacity = 0.9;
  const widget = node.addDOMWidget(WIDGET, "fastar_stats", box, {
    getValue: () => box.value,
    setValue: (text) => { box.value = text; },
    serialize: false, // never sent with the prompt: the node has no such input
  });
  widget.serialize = false; // never saved in the workflow: a display, not a setting
  return widget;
}

function showStats(node, text) {
  statsWidget(node).value = text;
  const [w, h] = node.size;
  const [minW, minH] = node.computeSize();
  node.setSize([Math.max(w, minW), Math.max(h, minH, HEIGHT)]);
  node.setDirtyCanvas(true, true);
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
