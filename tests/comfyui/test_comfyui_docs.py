"""The pack's documentation and metadata (no ComfyUI needed): every node documented in docs/nodes.md
with every input, the per-node help in web/docs/ in step with it, the workflows with their thumbnails,
and the registry metadata in pyproject.toml."""
import re
import sys
import tomllib

from comfyui_helpers import ROOT, WORKFLOWS

sys.path.insert(0, str(ROOT / "tools" / "comfyui"))
import node_docs  # noqa: E402
from test_comfyui_nodes import NODES  # noqa: E402

OPTIONAL = {"FastARLoadModel": ["image_size", "compile", "weight_dtype", "aspect_ratio"],  # documented too
            "FastARTextConditioning": ["negative_prompt"]}


def test_every_node_and_input_is_documented():
    text = (ROOT / "docs" / "nodes.md").read_text()
    sections = node_docs.sections(text)
    assert sorted(sections) == sorted(NODES)
    shared = re.findall(r"^\| `(\w+)` \|", sections["FastARSamplerAR"], flags=re.M)
    for node, inputs in NODES.items():
        documented = set(re.findall(r"^\| `(\w+)` \|", sections[node], flags=re.M))
        if node.startswith("FastARSampler"):
            documented |= set(shared) | set(re.findall(r"^\| `(\w+)` \|", sections["FastARSamplerSJD"], flags=re.M))
        assert set(inputs) <= documented, (node, set(inputs) - documented)
    for node, optional in OPTIONAL.items():
        assert set(optional) <= set(re.findall(r"^\| `(\w+)` \|", sections[node], flags=re.M)), node
    assert (ROOT / "docs" / "comfyui_workflow.png").stat().st_size < 400_000  # small


def test_the_readme_lists_every_node_by_its_display_name():
    names = set()
    for source in (ROOT / "nodes").glob("*.py"):
        names |= set(re.findall(r'(?:display_name=|DISPLAY = )"(FastAR [^"]+)"', source.read_text()))
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("Nodes (every input"):readme.index("## Command line")]
    assert len(names) == len(NODES), names
    assert {name for name in names if name not in listed} == set()
    for name in sorted(names, key=len, reverse=True):
        listed = listed.replace(name, "")
    assert "FastAR " not in listed, f"a node that does not exist: {listed}"  # a renamed or removed one


def test_web_docs_match_docs_nodes_md():
    sections = node_docs.sections((ROOT / "docs" / "nodes.md").read_text())
    for node, body in sections.items():
        assert (ROOT / "web" / "docs" / f"{node}.md").read_text() == body, "run python tools/comfyui/node_docs.py"


def test_workflows_have_thumbnails_and_are_ui_format():
    import json

    assert len(WORKFLOWS) >= 4
    for path in WORKFLOWS:
        data = json.loads(path.read_text())
        assert {"nodes", "links", "version"} <= data.keys()
        assert path.with_suffix(".jpg").read_bytes()[:2] == b"\xff\xd8"


def test_pyproject_has_comfy_registry_metadata():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy = data["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"] and comfy["requires-comfyui"].startswith(">=0.3.75")
    assert "web" not in comfy  # WEB_DIRECTORY registers the scripts; both would load them twice
