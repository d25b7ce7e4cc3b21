"""Drafters in the real ComfyUI: the Load Drafter, Speculative and LANTERN nodes as /object_info shows them,
the drafter workflows run through /prompt (the t2i one with LANTERN's released drafter layout, as stand-ins),
LANTERN with delta 0 giving exactly the Speculative sampler's image, and what a wrong drafter or a bad
widget value gives: a validation refusal, or an execution error carrying FastAR's message."""
import io

import numpy as np
import pytest
from comfyui_helpers import node_of, workflow_prompt
from PIL import Image
from standins import OTHER_VOCAB_DRAFTER
from test_comfyui_nodes import inputs_of
from test_comfyui_runs import assert_refused_choice, failed, rejected, rejected_on

import harness
from workflows import DEMO_DRAFTER, LANTERN_DRAFTER_T2I, LLAMAGEN_VQ_T2I

COMPARE = "fastar_demo_lantern_compare"
T2I = "fastar_llamagen_t2i_lantern"


def options_of(object_info, node, name):
    return inputs_of(object_info[node])[name][1]


def test_drafter_list_comes_from_the_drafter_folders(object_info):
    drafters = options_of(object_info, "FastARLoadDrafter", "drafter_name")
    names = drafters["options"]
    assert {LANTERN_DRAFTER_T2I, OTHER_VOCAB_DRAFTER} <= set(names)  # fastar_drafters: in extra_model_paths.yaml
    assert DEMO_DRAFTER in names and drafters["default"] == DEMO_DRAFTER  # the bundled (or stand-in) demo drafter
    assert not any(name.endswith((".pt", "vq.safetensors")) for name in names)  # models and VQs stay in their lists
    models = options_of(object_info, "FastARLoadModel", "model_name")["options"]
    assert DEMO_DRAFTER not in models  # a drafter folder is no AR model
    assert inputs_of(object_info["FastARLoadDrafter"])["model"][0] == "FASTAR_MODEL"
    assert object_info["FastARLoadDrafter"]["output"] == ["FASTAR_DRAFTER"]


def test_lantern_sliders_and_drafter_sockets(object_info):
    k = options_of(object_info, "FastARSamplerLANTERN", "lantern_k")
    assert (k["min"], k["max"], k["default"], k["display"]) == (1, 16384, 1000, "slider")
    delta = options_of(object_info, "FastARSamplerLANTERN", "lantern_delta")
    assert (delta["min"], delta["max"], delta["step"], delta["default"], delta["display"]) == (0.0, 1.0, 0.01, 0.1,
                                                                                               "slider")
    assert "0 = exact" in delta["tooltip"]
    assert object_info["FastARSamplerLANTERN"]["input"]["required"]["vq"][0] == "FASTAR_VQ"  # the codebook
    assert object_info["FastARSamplerLANTERN"]["input"]["optional"]["drafter"][0] == "FASTAR_DRAFTER"
    assert object_info["FastARSamplerSpeculative"]["input"]["required"]["drafter"][0] == "FASTAR_DRAFTER"
    gsd = object_info["FastARSamplerGSD"]
    assert gsd["input"]["optional"]["drafter"][0] == "FASTAR_DRAFTER"
    # widgets added after a release come last, in the order they arrived: saved workflows keep their values
    assert gsd["input_order"]["optional"][-2:] == ["gamma", "prob_filter"]


def test_descriptions_say_lossless_or_relaxed(object_info):
    spec, lantern = (object_info[n]["description"] for n in ("FastARSamplerSpeculative", "FastARSamplerLANTERN"))
    assert "Lossless" in spec and "different image" in spec
    assert "Relaxed" in lantern and "trades fidelity for speed" in lantern and "different image" in lantern
    assert "delta 0 is exact" in lantern


def texts_by_decoder(entry) -> dict[str, str]:
    texts = [out["text"][0] for out in entry["outputs"].values() if "text" in out]
    return {text.split(" ")[0]: text for text in texts}


def images_by_title(comfy, prompt, entry) -> dict[str, np.ndarray]:
    return {prompt[node]["_meta"]["title"]: np.asarray(Image.open(io.BytesIO(comfy.fetch(out["images"][0]))))
            for node, out in entry["outputs"].items() if out.get("images")}


def test_compare_workflow_runs_every_drafter_decoder(comfy, object_info):
    prompt = workflow_prompt(COMPARE, object_info)
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    texts = texts_by_decoder(entry)
    assert sorted(texts) == ["AR", "GSD", "LANTERN", "SPEC"]
    assert "SPEC (lossless)" in texts["SPEC"] and "LANTERN (relaxed" in texts["LANTERN"]
    for decoder in ("SPEC", "LANTERN", "GSD"):
        assert f"drafter {DEMO_DRAFTER}:" in texts[decoder] and "speed-up vs AR (measured)" in texts[decoder]
    assert "drafter" not in texts["AR"] and not any("WARNING" in text for text in texts.values())
    images = images_by_title(comfy, prompt, entry)
    assert len(images) == 4 and all(image.std() > 1 for image in images.values())


def test_lantern_without_a_drafter_on_the_demo_model_drafts_with_its_bundled_drafter(comfy, object_info):
    """Nothing connected to LANTERN's drafter input: the bundled demo model's own drafter drafts (LANTERN on Jacobi
    drafts would ruin the image), and the Stats node names it."""
    prompt = workflow_prompt(COMPARE, object_info)
    del node_of(prompt, "FastARSamplerLANTERN")["inputs"]["drafter"]
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    texts = texts_by_decoder(entry)
    assert "drafter demo_drafter/" in texts["LANTERN"] and "WARNING" not in texts["LANTERN"], texts["LANTERN"]


def test_t2i_workflow_with_lanterns_drafter_folder(comfy, object_info):
    entry = comfy.run(workflow_prompt(T2I, object_info))
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert harness.output_images(entry)
    text = texts_by_decoder(entry)["LANTERN"]
    assert f"drafter {LANTERN_DRAFTER_T2I}:" in text
    assert "the drafter's forwards are not in the steps" in text  # no AR baseline: the drafter's cost is unpriced


def test_lantern_with_delta_zero_gives_the_speculative_image(comfy, object_info):
    prompt = workflow_prompt(COMPARE, object_info)
    spec, lantern = node_of(prompt, "FastARSamplerSpeculative"), node_of(prompt, "FastARSamplerLANTERN")
    for sampler in (spec, lantern):
        sampler["inputs"]["seed"] = 2024
    lantern["inputs"]["lantern_delta"] = 0.0
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    images = images_by_title(comfy, prompt, entry)
    assert np.array_equal(images["Image: Speculative (lossless)"], images["Image: LANTERN (relaxed)"])
    texts = texts_by_decoder(entry)
    forwards = [line for line in texts["SPEC"].splitlines() if " forwards; plain AR takes " in line]
    assert forwards and forwards[0] in texts["LANTERN"]


def test_top_drafts_run_on_both_drafter_samplers(comfy, object_info):
    # optional and last, each after those before it: saved workflows keep their values
    for node, newest in (("FastARSamplerSpeculative", ["drafts", "tree"]),
                         ("FastARSamplerLANTERN", ["drafts", "tree", "lambda"])):
        drafts = options_of(object_info, node, "drafts")
        assert drafts["options"] == ["sampled", "top"] and drafts["default"] == "sampled"
        assert object_info[node]["input_order"]["optional"][-len(newest):] == newest
    prompt = workflow_prompt(COMPARE, object_info)
    for node in ("FastARSamplerSpeculative", "FastARSamplerLANTERN"):
        node_of(prompt, node)["inputs"]["drafts"] = "top"
        for newer in ("tree", "lambda"):  # as a workflow saved before trees existed
            node_of(prompt, node)["inputs"].pop(newer, None)
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert all(image.std() > 1 for image in images_by_title(comfy, prompt, entry).values())
    del node_of(prompt, "FastARSamplerLANTERN")["inputs"]["drafter"]  # the demo model's own drafter drafts then
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert "drafter demo_drafter/" in texts_by_decoder(entry)["LANTERN"]


def test_trees_run_on_both_drafter_samplers(comfy, object_info):
    for node in ("FastARSamplerSpeculative", "FastARSamplerLANTERN"):
        assert options_of(object_info, node, "tree")["options"] == ["chain", "lantern++57", "dynamic"]
    prompt = workflow_prompt(COMPARE, object_info)
    node_of(prompt, "FastARSamplerSpeculative")["inputs"]["tree"] = "lantern++57"
    node_of(prompt, "FastARSamplerLANTERN")["inputs"].update({"tree": "dynamic", "lambda": 2.0})
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert all(image.std() > 1 for image in images_by_title(comfy, prompt, entry).values())
    texts = texts_by_decoder(entry)
    assert "tree lantern++57" in texts["SPEC"] and "dynamic tree of 58 drafts" in texts["LANTERN"], texts


def test_old_gsd_widgets_without_gamma_still_run(comfy, object_info):
    prompt = workflow_prompt("fastar_demo_compare_ar_sjd_gsd", object_info)
    del node_of(prompt, "FastARSamplerGSD")["inputs"]["gamma"]  # as a workflow saved before gamma existed
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)


@pytest.mark.parametrize("drafter,message", [
    (OTHER_VOCAB_DRAFTER, "drafts over 1024 codes but the target model has 512"),
    (LLAMAGEN_VQ_T2I, f"{LLAMAGEN_VQ_T2I} is a VQ tokenizer"),
])
def test_mismatched_drafter_gives_fastar_message(comfy, object_info, drafter, message):
    prompt = workflow_prompt(T2I, object_info)
    node_of(prompt, "FastARLoadDrafter")["inputs"]["drafter_name"] = drafter
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARLoadDrafter"
    assert message in error["exception_message"] and error["exception_type"].endswith("FastARError")


def test_drafter_loaded_for_another_model_gives_fastar_message(comfy, object_info):
    prompt = workflow_prompt(COMPARE, object_info)
    prompt["90"] = {"class_type": "FastARLoadModel", "inputs": {"model_name": "demo_c2i.safetensors", "dtype": "fp16"}}
    node_of(prompt, "FastARLoadDrafter")["inputs"]["model"] = ["90", 0]
    error = failed(comfy, prompt)
    assert error["node_type"].startswith("FastARSampler")
    assert "was loaded for another model" in error["exception_message"]


@pytest.mark.parametrize("node,field,value,message", [
    ("FastARSamplerLANTERN", "lantern_k", 0, "smaller than min of 1"),
    ("FastARSamplerLANTERN", "lantern_k", 20000, "bigger than max of 16384"),
    ("FastARSamplerLANTERN", "lantern_delta", 1.5, "bigger than max of 1.0"),
    ("FastARSamplerLANTERN", "gamma", 0, "smaller than min of 1"),
    ("FastARSamplerSpeculative", "gamma", 0, "smaller than min of 1"),
    ("FastARSamplerSpeculative", "top_p", 0.0, "top-p 0.0 is out of range"),
    ("FastARSamplerGSD", "gamma", 100, "bigger than max of 64"),
    ("FastARLoadDrafter", "drafter_name", "missing_drafter/", "put it in ComfyUI's models/fastar_drafters folder"),
    ("FastARLoadDrafter", "drafter_name", "demo_vq.safetensors", "is an image decoder (load it with FastAR Load "
                                                                 "Image Decoder), not a drafter"),
    ("FastARLoadDrafter", "drafter_name", "../missing_drafter/", "drafter_name '../missing_drafter/' leaves "
                                                                 "ComfyUI's model folders"),
    ("FastARLoadModel", "model_name", DEMO_DRAFTER, "is a drafter (load it with FastAR Load Drafter)"),
])
def test_bad_widget_values_are_rejected_before_the_run_once_on_their_input(comfy, object_info, node, field, value,
                                                                           message):
    prompt = workflow_prompt(COMPARE, object_info)
    node_of(prompt, node)["inputs"][field] = value
    assert message in rejected_on(comfy, branch(prompt, node), node, field)


@pytest.mark.parametrize("node,field,value,message", [
    ("FastARSamplerGSD", "prob_filter", "ratio", "unknown GSD probability filter 'ratio'"),
    ("FastARLoadDrafter", "dtype", "fp8", "unknown dtype 'fp8'"),
])
def test_a_value_outside_a_list_is_refused_on_its_input_or_when_its_node_runs(comfy, object_info, node, field,
                                                                              value, message):
    prompt = workflow_prompt(COMPARE, object_info)
    node_of(prompt, node)["inputs"][field] = value
    assert_refused_choice(comfy, branch(prompt, node), node, field, message)


def test_speculative_sampler_without_a_drafter_is_rejected(comfy, object_info):
    prompt = workflow_prompt(COMPARE, object_info)
    del node_of(prompt, "FastARSamplerSpeculative")["inputs"]["drafter"]
    assert "Required input is missing: drafter" in rejected(comfy, branch(prompt, "FastARSamplerSpeculative"))


def branch(prompt: dict, class_type: str) -> dict:
    """The prompt without the output nodes that do not depend on the ``class_type`` node: ComfyUI still
    queues a prompt whose errors leave some outputs reachable, and runs those."""
    node = next(k for k, n in prompt.items() if n["class_type"] == class_type)

    def depends(key: str) -> bool:
        links = [v[0] for v in prompt[key]["inputs"].values() if isinstance(v, list) and len(v) == 2]
        return node in links or any(depends(link) for link in links)

    return {k: n for k, n in prompt.items()
            if n["class_type"] not in ("PreviewImage", "SaveImage", "FastARStats") or depends(k)}
