"""What a real ComfyUI shows of the pack: every node in /object_info with the expected inputs, tooltips,
sliders, seeds and custom types; model lists from the fastar folders (extra_model_paths.yaml honoured,
demo model listed); the example workflows in the template browser; the stats display script."""
import json
import re

import pytest
from comfyui_helpers import WORKFLOWS, harness, workflow_prompt
from workflows import TITLE_HEIGHT, node_height, widget_slots

NODES = {
    "FastARLoadModel": ["model_name", "dtype"],
    "FastARLoadVQ": ["vq_name", "dtype"],
    "FastARLoadDrafter": ["model", "drafter_name", "dtype"],
    "FastARClassLabel": ["model", "class_name", "index"],
    "FastARTextConditioning": ["model", "prompt", "t5_folder"],
    "FastARSampler": ["model", "conditioning", "seed", "speed", "batch"],
    "FastARSamplerAR": ["model", "conditioning", "seed", "cfg", "temperature", "top_k", "top_p", "batch"],
    "FastARSamplerSJD": ["model", "conditioning", "seed", "cfg", "temperature", "top_k", "top_p", "batch",
                         "window", "init", "coupling"],
    "FastARSamplerGSD": ["model", "conditioning", "seed", "cfg", "temperature", "top_k", "top_p", "batch",
                         "window", "init", "coupling", "group", "prob_threshold", "distance_threshold"],
    "FastARSamplerSJDEntropy": ["model", "conditioning", "seed", "cfg", "temperature", "top_k", "top_p", "batch",
                                "window", "init", "coupling", "strength"],
    "FastARSamplerSpeculative": ["model", "conditioning", "drafter", "seed", "cfg", "temperature", "top_k", "top_p",
                                 "batch", "gamma"],
    "FastARSamplerLANTERN": ["model", "conditioning", "vq", "seed", "cfg", "temperature", "top_k", "top_p", "batch",
                             "lantern_k", "lantern_delta", "gamma", "window", "init", "coupling"],
    "FastARSamplerZipAR": ["model", "conditioning", "seed", "cfg", "temperature", "top_k", "top_p", "batch", "lead",
                           "row_window"],
    "FastARSamplerCSpD": ["model", "conditioning", "drafter", "seed", "cfg", "temperature", "batch", "gamma", "prefill",
                          "verify", "num_iter", "diffusion_steps", "cfg_schedule"],
    "FastARSamplerLazyMAR": ["model", "conditioning", "seed", "cfg", "temperature", "batch", "num_iter",
                             "diffusion_steps", "cfg_schedule", "start_percent", "end_percent", "refresh_every",
                             "token_reuse", "head_refresh_every"],
    "FastARSamplerDD": ["model", "conditioning", "vq", "seed", "batch", "steps", "t2", "split"],
    "FastARVQDecode": ["vq", "tokens"],
    "FastARAcceptanceMap": ["stats", "scale"],
    "FastARStats": ["stats"],
}
OUTPUTS = {
    "FastARLoadModel": ["FASTAR_MODEL"], "FastARLoadVQ": ["FASTAR_VQ"], "FastARLoadDrafter": ["FASTAR_DRAFTER"],
    "FastARClassLabel": ["FASTAR_CONDITIONING"],
    "FastARTextConditioning": ["FASTAR_CONDITIONING"], "FastARSamplerAR": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSampler": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerSJD": ["FASTAR_TOKENS", "FASTAR_STATS"], "FastARSamplerGSD": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerSJDEntropy": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerSpeculative": ["FASTAR_TOKENS", "FASTAR_STATS"], "FastARSamplerLANTERN": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerZipAR": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerCSpD": ["FASTAR_TOKENS", "FASTAR_STATS"], "FastARSamplerDD": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARSamplerLazyMAR": ["FASTAR_TOKENS", "FASTAR_STATS"],
    "FastARVQDecode": ["IMAGE"], "FastARAcceptanceMap": ["IMAGE"], "FastARStats": ["STRING", "STRING"],
}


def inputs_of(info: dict) -> dict:
    return {**info["input"].get("required", {}), **info["input"].get("optional", {})}


def test_every_node_is_registered_with_its_inputs_in_order(object_info, comfy):
    fastar = sorted(k for k in object_info if k.startswith("FastAR"))
    assert fastar == sorted(NODES)
    for node, expected in NODES.items():
        info = object_info[node]
        assert info["input_order"]["required"] == expected, node  # widget order is part of saved workflows
        assert info["output"] == OUTPUTS[node], node
        assert info["category"].startswith("FastAR/") and info["description"]
    assert "IMPORT FAILED" not in comfy.log()


def test_every_input_has_a_tooltip_floats_are_sliders_seeds_advance(object_info):
    for node in NODES:
        for name, spec in inputs_of(object_info[node]).items():
            options = spec[1] if len(spec) > 1 else {}
            assert options.get("tooltip"), f"{node}.{name} has no tooltip"
            if spec[0] == "FLOAT":
                assert options.get("display") == "slider" and "min" in options and "max" in options, (node, name)
            if name == "seed":
                assert options.get("control_after_generate") is True
    for sampler in ("FastARSamplerAR", "FastARSamplerSJD", "FastARSamplerGSD"):
        assert inputs_of(object_info[sampler])["preview_vq"][0] == "FASTAR_VQ"


def test_no_tokens_disguised_as_latents(object_info):
    for node in NODES:
        info = object_info[node]
        assert "LATENT" not in info["output"]
        assert all(spec[0] != "LATENT" for spec in inputs_of(info).values())


def test_tooltips_say_which_decoders_are_lossless(object_info):
    sjd, gsd = object_info["FastARSamplerSJD"]["description"], object_info["FastARSamplerGSD"]["description"]
    assert "Lossless" in sjd and "different image" in sjd
    assert "Relaxed" in gsd and "trades fidelity for speed" in gsd
    assert "lossless" in inputs_of(object_info["FastARSamplerGSD"])["group"][1]["tooltip"]
    entropy = object_info["FastARSamplerSJDEntropy"]
    assert "Relaxed" in entropy["description"] and "lossless" in inputs_of(entropy)["strength"][1]["tooltip"]


def test_model_lists_come_from_the_fastar_folders(object_info):
    models = inputs_of(object_info["FastARLoadModel"])["model_name"][1]["options"]
    vqs = inputs_of(object_info["FastARLoadVQ"])["vq_name"][1]["options"]
    assert "demo_c2i.safetensors" in models and "demo_vq.safetensors" not in models
    assert "demo_vq.safetensors" in vqs and "demo_c2i.safetensors" not in vqs
    assert "c2i_L_256.pt" in models and "t2i_XL_stage1_256.pt" in models  # from extra_model_paths.yaml
    assert not any(name.startswith("flan-t5-xl") for name in models)  # a T5 folder is no AR model
    t5 = inputs_of(object_info["FastARTextConditioning"])["t5_folder"][1]["options"]
    assert t5 == ["flan-t5-xl/", "(none: the model reads the prompt itself)"]  # the default is the T5 folder


def test_class_list_has_demo_and_imagenet_names(object_info):
    options = inputs_of(object_info["FastARClassLabel"])["class_name"][1]["options"]
    assert options[0] == "(use index)"
    assert "circle (demo 0)" in options and "blob (demo 7)" in options
    assert "tench (0)" in options and "golden retriever (207)" in options and "toilet tissue (999)" in options
    assert len(options) == 1 + 8 + 1000


def test_example_workflows_are_in_the_template_browser(comfy):
    templates = comfy.get("/workflow_templates")
    assert sorted(templates["FastAR"]) == sorted(p.stem for p in WORKFLOWS)
    for path in WORKFLOWS:
        assert path.with_suffix(".jpg").exists(), f"{path.name} has no thumbnail"
        served = comfy.get(f"/api/workflow_templates/FastAR/{path.name}")
        assert served["nodes"]


def test_stats_display_script_is_served(comfy):
    extensions = comfy.get("/extensions")
    script = next(e for e in extensions if re.search(r"/FastAR/.*fastar_stats\.js$", e))
    import urllib.request

    with urllib.request.urlopen(comfy.url + script) as response:
        assert b"FastARStats" in response.read()
    for node in NODES:  # the per-node help the UI's node library shows
        with urllib.request.urlopen(f"{comfy.url}/extensions/FastAR/docs/{node}.md") as response:
            assert response.read().startswith(f"# {node}".encode())


@pytest.mark.parametrize("workflow", [p.stem for p in WORKFLOWS])
def test_workflows_are_ui_format_with_fastar_nodes(workflow, object_info):
    prompt = workflow_prompt(workflow, object_info)
    kinds = {n["class_type"] for n in prompt.values()}
    assert "FastARVQDecode" in kinds and kinds & {"SaveImage", "PreviewImage"}


@pytest.mark.parametrize("workflow", [p.stem for p in WORKFLOWS])
def test_workflows_open_fitted_to_a_laptop_canvas(workflow):
    """ComfyUI opens a workflow at its saved view (extra.ds): every node (title bar included) and group lies
    inside a 1440 x 780 browser, clear of the side bar (80 px) and the menu and tabs (110 px) lying over the
    canvas, and the view is not shrunk more than it needs to be."""
    data = json.loads(next(p for p in WORKFLOWS if p.stem == workflow).read_text())
    scale, (ox, oy) = data["extra"]["ds"]["scale"], data["extra"]["ds"]["offset"]
    boxes = [(n["pos"][0], n["pos"][1] - 30, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in data["nodes"]]
    boxes += [(x, y, x + w, y + h) for x, y, w, h in (g["bounding"] for g in data["groups"])]
    left, top = min(b[0] for b in boxes), min(b[1] for b in boxes)
    right, bottom = max(b[2] for b in boxes), max(b[3] for b in boxes)
    assert (left + ox) * scale >= 79.9 and (top + oy) * scale >= 109.9
    assert (right + ox) * scale <= 1440 and (bottom + oy) * scale <= 780
    assert scale == 1.0 or max((right - left) * scale / 1440, (bottom - top) * scale / 780) > 0.8


@pytest.mark.parametrize("workflow", [p.stem for p in WORKFLOWS])
def test_workflows_save_every_widget_at_a_height_that_shows_it(workflow, object_info):
    """Each node saves a value for every widget the frontend gives it (a seed's control_after_generate too) and is
    at least as tall as the frontend makes a node with its sockets and widgets."""
    for node in json.loads(next(p for p in WORKFLOWS if p.stem == workflow).read_text())["nodes"]:
        if node["type"] in harness.FRONTEND_ONLY:
            continue
        info = object_info[node["type"]]
        assert len(node["widgets_values"]) == len(widget_slots(info)), (node["type"], node["widgets_values"])
        assert node["size"][1] >= node_height(info), (node["type"], node["size"], node_height(info))


@pytest.mark.parametrize("workflow", [p.stem for p in WORKFLOWS])
def test_workflow_nodes_do_not_overlap(workflow):
    """No node (title bar included) lies over another and hides its widgets."""
    nodes = json.loads(next(p for p in WORKFLOWS if p.stem == workflow).read_text())["nodes"]
    boxes = [(n["pos"][0], n["pos"][1] - TITLE_HEIGHT, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in nodes]
    overlapping = [(a["type"], b["type"]) for i, (a, box_a) in enumerate(zip(nodes, boxes))
                   for b, box_b in zip(nodes[i + 1:], boxes[i + 1:])
                   if box_a[0] < box_b[2] and box_b[0] < box_a[2] and box_a[1] < box_b[3] and box_b[1] < box_a[3]]
    assert not overlapping
