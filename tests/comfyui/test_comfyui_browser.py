"""A real browser on the real web UI: headless Debian Chromium (driven by Playwright from
tools/comfyui/browser.py, no browser download) opens ComfyUI, picks the demo workflow in the template
browser, presses Run, and the run succeeds with the stats shown on the node; every workflow is saved with
nodes at least as large as the frontend makes them; the template browser lists the bundled demos first. The
screenshots stay in the test's temporary folder (printed) as the CI artifact."""
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from comfyui_helpers import ROOT, WORKFLOWS
from workflows import node_height

import harness

CHROMIUM = Path("/usr/bin/chromium")


def browser_ready() -> str | None:
    if not CHROMIUM.exists():
        return "Debian chromium is not installed (apt-get install chromium)"
    if harness.installed() is None:
        check = subprocess.run([str(harness.python()), "-c", "import playwright"], capture_output=True)
        if check.returncode != 0:
            return "playwright is not installed in the ComfyUI environment"
    return None


needs_browser = pytest.mark.skipif(browser_ready() is not None, reason=str(browser_ready()))
MODEL_FILE_ENDINGS = (".safetensors", ".pt", ".pth", ".ckpt", "/")  # a loader's file, or folder, as a widget value


@needs_browser
@pytest.mark.parametrize("workflow", ["fastar_demo_sjd", "fastar_demo_lantern_compare"])
def test_workflow_from_template_browser_runs_in_chromium(comfy, tmp_path, workflow):
    comfy.free_memory()  # a real run, not a cached one
    screenshot = tmp_path / f"{workflow}.png"
    result = subprocess.run(
        [str(harness.python()), str(ROOT / "tools" / "comfyui" / "browser.py"), "run", "--url", comfy.url,
         "--workflow", str(ROOT / "workflows" / f"{workflow}.json"), "--screenshot", str(screenshot),
         "--timeout", "240"], capture_output=True, text=True, timeout=420)
    print(f"browser screenshots: {screenshot} and {screenshot.with_name(screenshot.stem + '_loaded.png')}")
    print(result.stderr[-2000:])
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["result"] == "execution_success", report
    assert report["loaded_from"] == "template browser", report
    assert report["queued_with"] != "app.queuePrompt", report  # the Run button was clicked
    assert not report["errors"]
    assert any("step compression" in text for text in report["stats_text"]), report
    assert report["previews"] > 0, "no live preview reached the browser"
    assert all(not values for values in report["saved_stats_widgets"]), "the stats display was saved in the workflow"
    assert all(set(inputs) <= {"stats", "ar_baseline"} for inputs in report["queued_stats_inputs"])
    assert screenshot.stat().st_size > 20_000
    artifacts = ROOT / "out" / "comfyui"
    if artifacts.parent.exists():  # the git-ignored out/ folder: easy to find after a local run
        artifacts.mkdir(exist_ok=True)
        shutil.copy(screenshot, artifacts / screenshot.name)


@needs_browser
def test_workflows_save_nodes_at_least_as_large_as_the_frontend_makes_them(comfy, object_info):
    """After each workflow loads, the page reports each node's LGraphNode.computeSize(), in the frontend's Arial as
    this machine draws it and in DejaVu Sans, what Chromium draws for Arial on a machine without an Arial-wide font:
    no node is saved smaller (a smaller node clips its title or hides its last widgets), and workflows.py's height
    estimate is at least the frontend's."""
    result = subprocess.run(
        [str(harness.python()), str(ROOT / "tools" / "comfyui" / "browser.py"), "sizes", "--url", comfy.url,
         "--workflow", *map(str, WORKFLOWS)], capture_output=True, text=True, timeout=420)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "DejaVu Sans" in report["fonts"], f"measured in {report['fonts']}: apt-get install fonts-dejavu-core"
    computed = report["computed_sizes"]
    too_small, underestimated = [], []
    for path in WORKFLOWS:
        for node in json.loads(path.read_text())["nodes"]:
            width, height = computed[path.stem][str(node["id"])]
            if node["size"][0] < width or node["size"][1] < height:
                too_small.append((path.stem, node["type"], node["size"], [width, height]))
            if node["type"] in object_info and node_height(object_info[node["type"]]) < height:
                underestimated.append((node["type"], node_height(object_info[node["type"]]), height))
    assert not too_small
    assert not underestimated


def model_files(workflow: Path) -> set[str]:
    return {value for node in json.loads(workflow.read_text())["nodes"] for value in node.get("widgets_values", [])
            if isinstance(value, str) and value.endswith(MODEL_FILE_ENDINGS)}


def test_the_template_browser_lists_the_bundled_demos_first():
    """ComfyUI lists a pack's workflows in the order its server finds the files (the folder's order on disk: by name
    on Windows) and, sorted Alphabetical, by name: the names put the workflows that run on the bundled demo files,
    each named fastar_demo_*, before those that need a download."""
    bundled = {path.stem: all((ROOT / "demo" / name).exists() for name in model_files(path)) for path in WORKFLOWS}
    assert all(model_files(path) for path in WORKFLOWS)
    assert all(demo == name.startswith("fastar_demo_") for name, demo in bundled.items()), bundled
    names = sorted(bundled)
    assert names == sorted(names, key=lambda name: not bundled[name]), names


@needs_browser
def test_the_template_browser_gets_the_demos_first_whatever_order_the_server_lists(comfy):
    """The server lists a pack's workflows in the order it meets the files (the disk's hash order on Linux, a set's
    in newer ComfyUI): web/js/fastar_templates.js reorders FastAR's list, demos first, each group by name."""
    served = json.loads(urllib.request.urlopen(f"{comfy.url}/workflow_templates", timeout=30).read())
    result = subprocess.run([str(harness.python()), str(ROOT / "tools" / "comfyui" / "browser.py"), "templates",
                             "--url", comfy.url], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = json.loads(result.stdout.strip().splitlines()[-1])["templates"]
    pack = next(name for name, workflows in served.items() if "fastar_demo_sjd" in workflows)
    demos = sorted(name for name in served[pack] if name.startswith("fastar_demo_"))
    assert shown[pack] == demos + sorted(set(served[pack]) - set(demos))
    assert {name: sorted(workflows) for name, workflows in shown.items() if name != pack} == \
        {name: sorted(workflows) for name, workflows in served.items() if name != pack}  # the others as they came
