"""Drive the real ComfyUI web UI in headless Debian Chromium (through Playwright, no browser download):
load a workflow from workflows/ into the canvas, press Run, wait for the run to finish, take screenshots;
or report the size the frontend computes for each node of workflows.

    python tools/comfyui/browser.py run --url URL --workflow workflows/x.json --screenshot out.png
    python tools/comfyui/browser.py thumbnail --url URL --workflow workflows/x.json --out workflows/x.jpg
    python tools/comfyui/browser.py sizes --url URL --workflow workflows/x.json [workflows/y.json ...]
    python tools/comfyui/browser.py templates --url URL

Runs under .comfyui/venv (which has playwright). Prints one JSON line with what happened; exits non-zero
when the run did not succeed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

# Registered before the app loads: records the server's execution events of this tab.
LISTEN = """
window.__fastar = {events: [], previews: 0};
"""
HOOK = """
() => {
  const api = window.comfyAPI?.api?.api ?? window.app?.api;
  for (const kind of ["execution_start", "execution_success", "execution_error", "execution_interrupted",
                      "executed", "progress"]) {
    api.addEventListener(kind, (e) => window.__fastar.events.push({kind, detail: e.detail}));
  }
  api.addEventListener("b_preview", () => { window.__fastar.previews += 1; });
  return true;
}
"""


def open_ui(playwright, url: str, size=(1600, 1000)):
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    page.add_init_script(LISTEN)
    page.goto(url, wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_function("() => window.app && window.app.graph && (window.comfyAPI?.api?.api ?? window.app.api)",
                           timeout=120_000)
    page.evaluate(HOOK)
    time.sleep(1.5)  # first-run dialogs (the template browser for a new user) open now
    return browser, page


def close_dialogs(page, timeout: float = 10.0) -> None:
    """Press Escape until no dialog is open; the first-run template browser may open seconds late."""
    deadline = time.time() + timeout
    quiet_since = None
    while time.time() < deadline:
        if page.locator(".p-dialog:visible").count():
            page.keyboard.press("Escape")
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since > 1.0:
            return
        time.sleep(0.2)


def load_from_templates(page, workflow: Path) -> bool:
    """What an artist does: open the template browser, pick the pack, click the workflow's card."""
    name = Path(workflow).stem
    expected = len(json.loads(Path(workflow).read_text())["nodes"])
    try:
        card = page.get_by_text(name, exact=True).first
        if not card.is_visible():
            close_dialogs(page)
            page.get_by_text("Templates", exact=True).first.click(timeout=5_000)
        page.get_by_text("FastAR", exact=True).first.click(timeout=10_000)
        page.get_by_text(name, exact=True).first.click(timeout=10_000)
        page.wait_for_function("(n) => window.app.graph._nodes.length === n", arg=expected, timeout=20_000)
    except Exception as e:  # noqa: BLE001 - any UI difference: report and fall back
        print(f"template browser path failed ({type(e).__name__}: {str(e).splitlines()[0]})", file=sys.stderr)
        return False
    close_dialogs(page)
    return True


def load_workflow(page, workflow: Path) -> None:
    """What opening the file in the UI does: the graph replaces the canvas."""
    data = json.loads(Path(workflow).read_text())
    page.evaluate("async (data) => { await window.app.loadGraphData(data); }", data)
    page.wait_for_function("(n) => window.app.graph._nodes.length === n",
                           arg=len(data["nodes"]), timeout=30_000)
    time.sleep(0.5)


FIT = """
() => {
  const c = window.app.canvas, g = window.app.graph;
  const boxes = g._nodes.map(n => [n.pos[0], n.pos[1] - 30, n.pos[0] + n.size[0], n.pos[1] + n.size[1]])
    .concat((g._groups || []).map(gr => { const b = gr._bounding ?? gr.bounding;
                                           return [b[0], b[1], b[0] + b[2], b[1] + b[3]]; }));
  if (!boxes.length) return null;
  const x0 = Math.min(...boxes.map(b => b[0])), y0 = Math.min(...boxes.map(b => b[1]));
  const x1 = Math.max(...boxes.map(b => b[2])), y1 = Math.max(...boxes.map(b => b[3]));
  // clear of the side bar (left) and the menu bar and tabs (top), which lie over the canvas
  const [left, top, right, bottom] = [80, 110, 40, 40];
  const w = c.canvas.width / (window.devicePixelRatio || 1), h = c.canvas.height / (window.devicePixelRatio || 1);
  const scale = Math.min(1.0, (w - left - right) / (x1 - x0), (h - top - bottom) / (y1 - y0));
  c.ds.scale = scale;
  c.ds.offset = [left / scale - x0, top / scale - y0];
  c.setDirty(true, true);
  return {x: left, y: top, width: (x1 - x0) * scale, height: (y1 - y0) * scale};
}
"""


# Hides the UI's bars and buttons that float over the canvas; keeps the canvas and the nodes' DOM widgets.
HIDE_OVERLAYS = """
() => {
  const widgets = [...document.querySelectorAll('.dom-widget')];
  const keep = new Set();
  for (const start of [document.getElementById('graph-canvas'), ...widgets])
    for (let e = start; e; e = e.parentElement) keep.add(e);
  for (const e of keep) {
    if (widgets.includes(e)) continue;
    for (const child of e.children) if (!keep.has(child)) child.style.visibility = 'hidden';
  }
}
"""


def fit_view(page) -> dict | None:
    """Show the whole graph (as the UI's fit-view does); returns where it lies on the page."""
    rect = page.evaluate(FIT)
    time.sleep(0.3)
    return rect


def press_run(page) -> str:
    """Click the UI's Run (Queue) button; falls back to the app's own queue call if no button is found."""
    for selector in ('[data-testid="queue-button"]', 'button:has-text("Run")', 'button:has-text("Queue")'):
        button = page.locator(selector).first
        if button.count() and button.is_visible():
            button.click()
            return selector
    page.evaluate("() => window.app.queuePrompt(0, 1)")
    return "app.queuePrompt"


def wait_for_run(page, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = page.evaluate("() => window.__fastar.events.map(e => e.kind)")
        for end in ("execution_success", "execution_error", "execution_interrupted"):
            if end in events:
                return {"result": end, "events": events}
        time.sleep(0.5)
    return {"result": "timeout", "events": page.evaluate("() => window.__fastar.events.map(e => e.kind)")}


def command_run(args) -> int:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = open_ui(p, args.url)
        try:
            from_templates = load_from_templates(page, args.workflow)
            if not from_templates:
                close_dialogs(page)
                load_workflow(page, args.workflow)
            fit_view(page)
            page.screenshot(path=str(args.screenshot.with_name(args.screenshot.stem + "_loaded.png")))
            how = press_run(page)
            outcome = wait_for_run(page, args.timeout)
            time.sleep(1.5)  # images and the stats text arrive with the last events
            fit_view(page)
            page.screenshot(path=str(args.screenshot))
            errors = page.evaluate(
                "() => window.__fastar.events.filter(e => e.kind === 'execution_error').map(e => e.detail)")
            executed = page.evaluate(
                "() => window.__fastar.events.filter(e => e.kind === 'executed').map(e => e.detail.node)")
            previews = page.evaluate("() => window.__fastar.previews")
            saved = page.evaluate("""() => window.app.graph.serialize().nodes
                .filter(n => n.type === 'FastARStats').map(n => n.widgets_values ?? [])""")
            queued = page.evaluate("""async () => Object.values((await window.app.graphToPrompt()).output)
                .filter(n => n.class_type === 'FastARStats').map(n => Object.keys(n.inputs))""")
            stats_text = page.evaluate("""() => window.app.graph._nodes.filter(n => n.type === 'FastARStats')
                .map(n => (n.widgets || []).filter(w => w.name === 'fastar_stats').map(w => w.value).join(''))""")
        finally:
            browser.close()
    report = {"loaded_from": "template browser" if from_templates else "app.loadGraphData", "queued_with": how,
              "result": outcome["result"], "executed_nodes": executed, "errors": errors,
              "previews": previews, "stats_text": stats_text,
              "saved_stats_widgets": saved, "queued_stats_inputs": queued, "screenshot": str(args.screenshot)}
    print(json.dumps(report))
    return 0 if outcome["result"] == "execution_success" else 1


# LiteGraph measures a node's title and labels in its NODE_FONT, Arial: Arial's widths on Windows and macOS and in
# Liberation Sans (fonts-liberation, which Debian's chromium recommends), but where no Arial-wide font is installed
# Chromium draws DejaVu Sans, about 13% wider: a node sized for Arial clips its title there.
WIDE_FONTS = ["DejaVu Sans"]
# What the frontend makes each node at least (LiteGraph's LGraphNode.computeSize), by node id: the larger of its
# sizes in the frontend's font and in each of the wide fonts this machine has (a font it lacks is not measured)
COMPUTED_SIZES = """
(wide) => {
  const lg = window.LiteGraph, own = lg.NODE_FONT, probe = "Acceptance map: AR (baseline)";
  const width = (font) => { const c = document.createElement("canvas").getContext("2d");
                            c.font = `14px ${font}`; return c.measureText(probe).width; };
  // an installed font measures apart from the generic fonts it would fall back to
  const measured = [own, ...wide.filter(f => ["monospace", "serif"].some(g => width(`"${f}", ${g}`) !== width(g)))];
  const sizes = {};
  for (const font of measured) {
    lg.NODE_FONT = font;
    for (const n of window.app.graph._nodes) {
      const [w, h] = n.computeSize(), [wasW, wasH] = sizes[n.id] ?? [0, 0];
      sizes[n.id] = [Math.max(w, wasW), Math.max(h, wasH)];
    }
  }
  lg.NODE_FONT = own;
  return {sizes, fonts: measured};
}
"""


def command_sizes(args) -> int:
    from playwright.sync_api import sync_playwright

    sizes, fonts = {}, []
    with sync_playwright() as p:
        browser, page = open_ui(p, args.url)
        try:
            close_dialogs(page)
            for workflow in args.workflow:
                load_workflow(page, workflow)
                computed = page.evaluate(COMPUTED_SIZES, WIDE_FONTS)
                sizes[workflow.stem], fonts = computed["sizes"], computed["fonts"]
        finally:
            browser.close()
    print(json.dumps({"computed_sizes": sizes, "fonts": fonts}))
    return 0


def command_thumbnail(args) -> int:
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = open_ui(p, args.url, size=(1600, 1000))
        try:
            close_dialogs(page)
            load_workflow(page, args.workflow)
            rect = fit_view(page)
            close_dialogs(page)  # a thumbnail shows the workflow, never a dialog over it
            page.evaluate(HIDE_OVERLAYS)
            png = args.out.with_suffix(".png.tmp")
            margin = 16  # the graph itself, not the empty canvas or the UI's bars around it
            page.screenshot(path=str(png), type="png", clip={
                "x": rect["x"] - margin, "y": rect["y"] - margin,
                "width": rect["width"] + 2 * margin, "height": rect["height"] + 2 * margin})
        finally:
            browser.close()
    image = Image.open(png).convert("RGB")
    image.thumbnail((args.width, args.width))
    image.save(args.out, "JPEG", quality=82)
    png.unlink()
    print(json.dumps({"thumbnail": str(args.out), "size": image.size}))
    return 0


TEMPLATES = "async () => await (window.comfyAPI?.api?.api ?? window.app.api).getWorkflowTemplates()"


def command_templates(args) -> int:
    """The custom packs' example workflows as the template browser gets them (the frontend's own call)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page = open_ui(p, args.url)
        try:
            templates = page.evaluate(TEMPLATES)
        finally:
            browser.close()
    print(json.dumps({"templates": templates}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--url", required=True)
    run.add_argument("--workflow", type=Path, required=True)
    run.add_argument("--screenshot", type=Path, required=True)
    run.add_argument("--timeout", type=float, default=300)
    thumb = sub.add_parser("thumbnail")
    thumb.add_argument("--url", required=True)
    thumb.add_argument("--workflow", type=Path, required=True)
    thumb.add_argument("--out", type=Path, required=True)
    thumb.add_argument("--width", type=int, default=640)
    sizes = sub.add_parser("sizes")
    sizes.add_argument("--url", required=True)
    sizes.add_argument("--workflow", type=Path, nargs="+", required=True)
    sub.add_parser("templates").add_argument("--url", required=True)
    args = parser.parse_args(argv)
    commands = {"run": command_run, "thumbnail": command_thumbnail, "sizes": command_sizes,
                "templates": command_templates}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
