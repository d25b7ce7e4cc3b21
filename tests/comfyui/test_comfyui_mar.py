"""MAR in the real ComfyUI: the loaders list MAR models, KL autoencoders and MAR drafts; the AR sampler runs
MAR's own sampler and the CSpD sampler speculates with a draft MAR (both verify modes), with progress and
live previews; Decode Image takes latents; Stats counts draft calls and acceptance; and every mix-up (a VQ
for latents, a KL for codes, a token decoder on MAR, CSpD on a token model, an EAGLE drafter for a MAR,
top-k on MAR, too many steps) is refused with FastAR's message. The LazyMAR sampler reuses features and says how
much of the transformer's work it did."""
import time

import numpy as np
import pytest
from comfyui_helpers import node_of, workflow_prompt
from test_comfyui_nodes import inputs_of
from test_comfyui_runs import assert_refused_choice, failed, fresh_run, images_of, rejected

import harness
from workflows import DEMO_KL, DEMO_MAR, DEMO_MAR_DRAFT, MAR_BASE, MAR_HUGE, MAR_KL16

DEMO = "fastar_demo_mar_cspd"
OFFICIAL = "fastar_mar_cspd"


def succeeded(entry) -> None:
    error = harness.execution_error(entry)
    assert error is None, f"{error['node_type']}: {error['exception_message']}\n{''.join(error.get('traceback', []))}"


def options(object_info, node, name):
    return inputs_of(object_info[node])[name][1]


def test_loaders_list_mar_models_kl_autoencoders_and_mar_drafts(object_info):
    models = options(object_info, "FastARLoadModel", "model_name")["options"]
    decoders = options(object_info, "FastARLoadVQ", "vq_name")["options"]
    drafters = options(object_info, "FastARLoadDrafter", "drafter_name")["options"]
    assert {DEMO_MAR, MAR_HUGE} <= set(models) and DEMO_KL not in models
    assert {DEMO_KL, MAR_KL16, "demo_vq.safetensors"} <= set(decoders) and DEMO_MAR not in decoders
    assert {DEMO_MAR_DRAFT, MAR_BASE} <= set(drafters)
    assert object_info["FastARLoadVQ"]["display_name"] == "FastAR Load Image Decoder (VQ / KL)"


def test_cspd_sampler_widgets_and_the_ar_samplers_mar_widgets(object_info):
    cspd = inputs_of(object_info["FastARSamplerCSpD"])
    assert cspd["drafter"][0] == "FASTAR_DRAFTER" and "drafter" in object_info["FastARSamplerCSpD"]["input"]["required"]
    assert (cspd["gamma"][1]["default"], cspd["prefill"][1]["default"]) == (8, 0.05)
    assert cspd["verify"][1]["options"] == ["steps", "merged"] and cspd["verify"][1]["default"] == "steps"
    assert cspd["num_iter"][1]["default"] == 64 and cspd["diffusion_steps"][1]["default"] == 100
    assert cspd["cfg_schedule"][1]["options"] == ["linear", "constant"]
    assert "top_k" not in cspd and "top_p" not in cspd  # MAR samples continuous tokens
    assert "lossless" in object_info["FastARSamplerCSpD"]["description"].lower()
    optional = object_info["FastARSamplerAR"]["input"]["optional"]
    assert {"num_iter", "diffusion_steps", "cfg_schedule"} <= set(optional)  # old AR prompts stay valid


def stats_texts(entry) -> dict[str, str]:
    return {out["text"][0].split(" ")[0]: out["text"][0] for out in entry["outputs"].values() if "text" in out}


def test_demo_workflow_compares_mar_with_both_cspd_modes(comfy, object_info):
    prompt = workflow_prompt(DEMO, object_info)
    entry = comfy.run(prompt)
    succeeded(entry)
    images = images_of(comfy, entry)
    assert len(images) == 3 and all(image.shape == (128, 128, 3) and image.std() > 1 for image in images)
    texts = [out["text"][0] for out in entry["outputs"].values() if "text" in out]
    mar = next(t for t in texts if t.startswith("AR"))
    assert mar.splitlines()[1] == "1 image of 64 tokens in 32 forwards"  # plain MAR is its own baseline
    cspd = [t for t in texts if t.startswith("CSPD")]
    assert len(cspd) == 2 and all("drafts:" in t and "speed-up vs AR (measured)" in t for t in cspd)
    assert all("drafter demo_mar_draft.safetensors" in t for t in cspd)


def test_official_mar_workflow_runs_with_the_release_files(comfy, object_info):
    entry = comfy.run(workflow_prompt(OFFICIAL, object_info))
    succeeded(entry)
    assert [image.shape for image in images_of(comfy, entry)] == [(16, 16, 3)]  # the 8x8 stand-in, KL stride 2


def without(prompt: dict, class_type: str) -> dict:
    """``prompt`` with the nodes of ``class_type`` and everything downstream of them removed."""
    gone = {k for k, n in prompt.items() if n["class_type"] == class_type}
    while True:
        fed = {k for k, n in prompt.items() if k not in gone
               and any(isinstance(v, list) and v[0] in gone for v in n["inputs"].values())}
        if not fed:
            return {k: n for k, n in prompt.items() if k not in gone}
        gone |= fed


def ar_mar(object_info):
    """The demo workflow's MAR baseline alone."""
    return without(workflow_prompt(DEMO, object_info), "FastARSamplerCSpD")


def test_mar_same_seed_same_image_and_another_seed_another(comfy, object_info):
    prompt = ar_mar(object_info)
    first, again = fresh_run(comfy, prompt), fresh_run(comfy, prompt)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    node_of(prompt, "FastARSamplerAR")["inputs"]["seed"] = 4321
    assert not np.array_equal(first[0], fresh_run(comfy, prompt)[0])


def test_mars_head_compiled_draws_the_eager_images_and_says_when_it_compiles(comfy, object_info):
    """Load AR Model's compile switch on a MAR: its transformer call and diffusion head's reverse steps compiled (off under auto for
    now), images as eager's to the rounding of fused kernels, and the run that compiles says so on the Stats node."""
    prompt = ar_mar(object_info)
    node_of(prompt, "FastARSamplerAR")["inputs"]["seed"] = 2468
    eager = fresh_run(comfy, prompt)  # the workflow's auto: the head eager
    node_of(prompt, "FastARLoadModel")["inputs"]["compile"] = "on"
    entry = comfy.run(prompt)
    succeeded(entry)
    compiled = images_of(comfy, entry)
    assert len(compiled) == len(eager) and all(np.abs(a.astype(float) - b).mean() < 1.0 for a, b in zip(compiled, eager))
    texts = [out["text"][0] for out in entry["outputs"].values() if "text" in out]
    assert any("compiling steps:" in text for text in texts), texts


def test_mar_progress_and_live_previews(comfy, object_info, events):
    prompt = ar_mar(object_info)
    node_of(prompt, "FastARSamplerAR")["inputs"]["seed"] = 77
    answer = comfy.queue(prompt)
    entry = comfy.wait(answer["prompt_id"])
    succeeded(entry)
    time.sleep(0.5)
    sampler = next(k for k, n in prompt.items() if n["class_type"] == "FastARSamplerAR")
    progress = [d for _, d in events.of("progress", answer["prompt_id"]) if d["node"] == sampler]
    assert progress and progress[-1]["value"] == progress[-1]["max"] == 64  # tokens fixed of the 8 x 8 latents
    assert events.of("preview"), "no live preview image was sent"


@pytest.mark.parametrize("change, node, message", [
    (lambda p: node_of(p, "FastARLoadVQ")["inputs"].update(vq_name="demo_vq.safetensors"), "FastARVQDecode",
     "these are a MAR model's latents, but demo_vq.safetensors is a VQ tokenizer"),
    (lambda p: node_of(p, "FastARSamplerAR")["inputs"].update(top_k=100), "FastARSamplerAR",
     "is a MAR model, which samples continuous tokens"),
    (lambda p: node_of(p, "FastARSamplerAR")["inputs"].update(num_iter=300), "FastARSamplerAR",
     "num_iter 300: MAR fixes at least one token per step, so choose 1 to 64 steps for this model's 64 tokens"),
    (lambda p: node_of(p, "FastARLoadDrafter")["inputs"].update(drafter_name="demo_drafter/"), "FastARLoadDrafter",
     "demo_drafter"),
])
def test_mix_ups_on_mar_give_fastar_messages(comfy, object_info, change, node, message):
    prompt = workflow_prompt(DEMO, object_info)
    change(prompt)
    error = failed(comfy, prompt)
    assert error["node_type"] == node and message in error["exception_message"], error
    assert error["exception_type"].endswith("FastARError")


def test_token_samplers_refuse_a_mar_and_cspd_refuses_a_token_model(comfy, object_info):
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = DEMO_MAR
    node_of(prompt, "FastARLoadVQ")["inputs"]["vq_name"] = DEMO_KL
    error = failed(comfy, prompt)
    assert "sjd needs a token model (LlamaGen); this is a MAR model: use one of ar, cspd" in error["exception_message"]

    prompt = workflow_prompt(DEMO, object_info)
    for loader, name in (("FastARLoadModel", "demo_c2i.safetensors"), ("FastARLoadVQ", "demo_vq.safetensors")):
        node_of(prompt, loader)["inputs"]["model_name" if loader == "FastARLoadModel" else "vq_name"] = name
    node_of(prompt, "FastARLoadDrafter")["inputs"]["drafter_name"] = "demo_drafter/"
    error = failed(comfy, prompt)
    assert "cspd needs a MAR model" in error["exception_message"]


def test_kl_autoencoder_refuses_token_codes(comfy, object_info):
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    decoders = [k for k, n in prompt.items() if n["class_type"] == "FastARLoadVQ"]
    prompt["91"] = {"class_type": "FastARLoadVQ", "inputs": {"vq_name": DEMO_KL, "dtype": "auto"}}
    node_of(prompt, "FastARVQDecode")["inputs"]["vq"] = ["91", 0]
    assert decoders
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARVQDecode"
    assert "these are image codes of a token model, but demo_kl_vae.safetensors is a KL autoencoder" in \
        error["exception_message"]


def cspd_columns(object_info, field: str, value) -> dict:
    prompt = without(workflow_prompt(DEMO, object_info), "FastARSamplerAR")  # only CSpD columns left
    for node in prompt.values():
        if node["class_type"] == "FastARSamplerCSpD":
            node["inputs"][field] = value
    return prompt


@pytest.mark.parametrize("field, value, message", [
    ("gamma", 0, "smaller than min of 1"),
    ("prefill", 0.99, "bigger than max of 0.95"),
])
def test_bad_cspd_widgets_are_rejected_before_the_run(comfy, object_info, field, value, message):
    assert message in rejected(comfy, cspd_columns(object_info, field, value))


@pytest.mark.parametrize("field, value, message", [
    ("verify", "joint", "unknown CSpD verify mode 'joint'"),
    ("cfg_schedule", "cosine", "unknown CFG schedule 'cosine'"),
])
def test_a_cspd_value_outside_a_list_is_refused_on_its_input_or_when_its_node_runs(comfy, object_info, field, value,
                                                                                   message):
    assert_refused_choice(comfy, cspd_columns(object_info, field, value), "FastARSamplerCSpD", field, message)


def test_lazymar_reuses_features_says_how_much_and_refuses_a_token_model(comfy, object_info):
    entry = comfy.run(workflow_prompt("fastar_demo_mar_lazy", object_info))
    succeeded(entry)
    texts = sorted(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert [t.split(" ")[0] for t in texts] == ["AR", "AR+REUSE"] and "relaxed" in texts[1].split("\n")[0]
    assert "feature reuse:" in texts[1] and "of plain MAR's transformer work done" in texts[1]
    assert "speed-up vs AR (measured)" in texts[1]

    prompt = without(workflow_prompt("fastar_demo_mar_lazy", object_info), "FastARSamplerAR")
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = "demo_c2i.safetensors"
    node_of(prompt, "FastARLoadVQ")["inputs"]["vq_name"] = "demo_vq.safetensors"
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARSamplerLazyMAR"
    assert "reuses the features of a MAR model between its steps" in error["exception_message"]

    prompt = without(workflow_prompt("fastar_demo_mar_lazy", object_info), "FastARSamplerAR")
    node_of(prompt, "FastARSamplerLazyMAR")["inputs"].update(start_percent=0.9, end_percent=0.5)
    error = failed(comfy, prompt)
    assert "give 0 <= start percent < end percent <= 1" in error["exception_message"]
