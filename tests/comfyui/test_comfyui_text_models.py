"""Lumina-mGPT, Anole and Janus-Pro in the real ComfyUI (tiny stand-ins in their release layouts): Load AR Model lists
the folders, Load Image Decoder lists Meta's VQGAN file and the Janus folder (its VQ inside), Text Conditioning
reads the prompt with the model's own tokenizer (no T5), the token samplers run, and the mix-ups say what to
do (a class label for a prompt model, no T5 for LlamaGen t2i); Anole drafts with LANTERN's Anole drafter."""
from comfyui_helpers import node_of, workflow_prompt
from fastar.demo_recipes.check_demo import colour_pair
from standins import CHAMELEON_VQGAN, JANUS_PRO_7B, LANTERN_DRAFTER_ANOLE, LUMINA_768
from test_comfyui_mar import options, succeeded
from test_comfyui_runs import images_of

import harness

NO_T5 = "(none: the model reads the prompt itself)"


def text_prompt(object_info, model: str, decoder: str, sampler: str = "FastARSamplerSJD") -> dict:
    prompt = workflow_prompt("fastar_llamagen_t2i", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = model
    node_of(prompt, "FastARLoadVQ")["inputs"]["vq_name"] = decoder
    node_of(prompt, "FastARTextConditioning")["inputs"].update(prompt="a red ring on a blue background", t5_folder=NO_T5)
    if sampler != "FastARSamplerSJD":
        node_of(prompt, "FastARSamplerSJD")["class_type"] = sampler
    node_of(prompt, sampler)["inputs"].update(cfg=3.0, batch=2)
    return prompt


def test_loaders_list_the_text_model_folders_and_their_decoders(object_info):
    models = options(object_info, "FastARLoadModel", "model_name")["options"]
    decoders = options(object_info, "FastARLoadVQ", "vq_name")["options"]
    assert {LUMINA_768, JANUS_PRO_7B} <= set(models)
    assert {CHAMELEON_VQGAN, JANUS_PRO_7B} <= set(decoders) and LUMINA_768 not in decoders


def test_lumina_mgpt_draws_from_a_prompt_with_sjd(comfy, object_info):
    entry = comfy.run(text_prompt(object_info, LUMINA_768, CHAMELEON_VQGAN))
    succeeded(entry)
    images = images_of(comfy, entry)
    assert len(images) == 2 and all(image.shape == (32, 32, 3) for image in images)  # 8 x 8 codes, VQGAN stride 4
    stats = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert "text: a red ring on a blue background" in stats and "2 images of 64 tokens in" in stats


def test_janus_pro_draws_with_the_vq_inside_its_folder(comfy, object_info):
    entry = comfy.run(text_prompt(object_info, JANUS_PRO_7B, JANUS_PRO_7B, "FastARSamplerAR"))
    succeeded(entry)
    assert [image.shape for image in images_of(comfy, entry)] == [(12, 12, 3)] * 2  # 6 x 6 codes, VQ stride 2


def test_mix_ups_say_what_to_do(comfy, object_info):
    prompt = text_prompt(object_info, LUMINA_768, CHAMELEON_VQGAN)
    conditioning = next(k for k, n in prompt.items() if n["class_type"] == "FastARTextConditioning")
    model = next(k for k, n in prompt.items() if n["class_type"] == "FastARLoadModel")
    prompt[conditioning] = {"class_type": "FastARClassLabel",
                            "inputs": {"model": [model, 0], "class_name": "(use index)", "index": 3}}
    error = harness.execution_error(comfy.run(prompt))
    assert "text-to-image model: use FastAR Text Conditioning" in error["exception_message"]
    llamagen = workflow_prompt("fastar_llamagen_t2i", object_info)
    node_of(llamagen, "FastARTextConditioning")["inputs"]["t5_folder"] = NO_T5
    error = harness.execution_error(comfy.run(llamagen))
    assert "reads the prompt through FLAN-T5-XL: download google/flan-t5-xl" in error["exception_message"]


def test_anole_workflow_drafts_with_lanterns_anole_drafter(comfy, object_info):
    entry = comfy.run(workflow_prompt("fastar_lantern_anole", object_info))
    succeeded(entry)
    assert [image.shape for image in images_of(comfy, entry)] == [(128, 128, 3)]  # 32 x 32 codes, VQGAN stride 4
    stats = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert f"drafter {LANTERN_DRAFTER_ANOLE}:" in stats and "1 image of 1024 tokens in" in stats


def test_the_anole_drafter_on_lumina_mgpt_says_what_to_do(comfy, object_info):
    prompt = workflow_prompt("fastar_lantern_anole", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = LUMINA_768
    error = harness.execution_error(comfy.run(prompt))
    message = error["exception_message"]
    assert "trained for a layout without row-end tokens" in message and "python -m fastar train-drafter" in message


def test_the_bundled_text_demo_workflow_follows_its_prompt(comfy, object_info):
    """AR, SJD and GSD on the bundled text demo: each image shows the prompt's colours (a red ring on cyan)."""
    entry = comfy.run(workflow_prompt("fastar_demo_text_compare", object_info))
    succeeded(entry)
    images = images_of(comfy, entry)
    assert len(images) == 3 and all(image.shape == (128, 128, 3) for image in images)
    assert all(colour_pair(image) == {(1, 0, 0), (0, 1, 1)} for image in images)
