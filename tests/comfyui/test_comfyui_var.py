"""VAR in the real ComfyUI: Load AR Model and Load Image Decoder list a VAR model and its multi-scale VQVAE (the
release's .pth layouts), the AR sampler runs the release's scale-by-scale sampler through the VQVAE (one forward
per scale), Decode Image turns f_hat into the image, the seed repeats it; mix-ups give FastAR's messages."""
import numpy as np
from test_comfyui_runs import failed, images_of

import harness

VAR_MODEL, VAR_VQVAE = "var_tiny.pth", "vae_var_tiny.pth"


def var_prompt(sampler="FastARSamplerAR", vqvae=VAR_VQVAE, decode_with=VAR_VQVAE, seed=4, connect_vqvae=True) -> dict:
    widgets = {"seed": seed, "cfg": 1.5, "temperature": 1.0, "top_k": 8, "top_p": 0.96, "batch": 2}
    if sampler == "FastARSamplerSJD":
        widgets |= {"window": 16, "init": "random", "coupling": "independent"}
    sockets = {"model": ["1", 0], "conditioning": ["3", 0]} | ({"preview_vq": ["2", 0]} if connect_vqvae else {})
    return {
        "1": {"class_type": "FastARLoadModel", "inputs": {"model_name": VAR_MODEL, "dtype": "auto"}},
        "2": {"class_type": "FastARLoadVQ", "inputs": {"vq_name": vqvae, "dtype": "auto"}},
        "3": {"class_type": "FastARClassLabel", "inputs": {"model": ["1", 0], "class_name": "(use index)", "index": 3}},
        "4": {"class_type": sampler, "inputs": {**sockets, **widgets}},
        "5": {"class_type": "FastARLoadVQ", "inputs": {"vq_name": decode_with, "dtype": "auto"}},
        "6": {"class_type": "FastARVQDecode", "inputs": {"vq": ["5", 0], "tokens": ["4", 0]}},
        "7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}},
        "8": {"class_type": "FastARStats", "inputs": {"stats": ["4", 1]}},
    }


def test_loaders_list_the_var_model_and_its_vqvae(object_info, comfy):
    models = object_info["FastARLoadModel"]["input"]["required"]["model_name"][1]["options"]
    decoders = object_info["FastARLoadVQ"]["input"]["required"]["vq_name"][1]["options"]
    assert VAR_MODEL in models and VAR_VQVAE in decoders  # pickles: listed in both, told apart when loaded


def test_var_samples_scale_by_scale_and_repeats_by_seed(comfy):
    entry = comfy.run(var_prompt())
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    text = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert text.startswith("VAR (one forward per scale: 4 scales of 1x1, 2x2, 3x3, 4x4)")
    assert text.splitlines()[1] == "2 images of 30 tokens in 4 forwards"  # VAR's own sampler: no steps saved
    assert "speed-up vs VAR: not measured" in text
    first = images_of(comfy, entry)
    assert len(first) == 2 and first[0].shape == (16, 16, 3)  # 4x4 tokens, VQVAE downsampling 4
    assert not np.array_equal(first[0], first[1])
    again = images_of(comfy, comfy.run(var_prompt(seed=5)))
    assert not np.array_equal(first[0], again[0])
    same = images_of(comfy, comfy.run(var_prompt(seed=4)))
    assert all(np.array_equal(a, b) for a, b in zip(first, same))


def test_var_compiled_draws_the_eager_images_and_says_when_it_compiles(comfy):
    """Load AR Model's compile switch on a VAR: each scale's forward compiled (off under auto for now), the very
    images of eager steps, and the run that compiles says so on the Stats node."""
    prompt = var_prompt(seed=97)
    eager = images_of(comfy, comfy.run(prompt))
    prompt["1"]["inputs"]["compile"] = "on"
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    compiled = images_of(comfy, entry)
    assert len(compiled) == len(eager) == 2 and all(np.array_equal(a, b) for a, b in zip(compiled, eager))
    texts = [out["text"][0] for out in entry["outputs"].values() if "text" in out]
    assert any("compiling steps:" in text for text in texts), texts


def test_var_mix_ups_give_fastar_messages(comfy):
    error = failed(comfy, var_prompt(sampler="FastARSamplerSJD"))
    assert "sjd needs a token model (LlamaGen); this is a VAR model (next-scale prediction): use one of ar" \
        in error["exception_message"]
    error = failed(comfy, var_prompt(connect_vqvae=False))
    assert "it samples through its multi-scale VQVAE" in error["exception_message"]
    error = failed(comfy, var_prompt(decode_with="demo_vq.safetensors"))
    assert error["node_type"] == "FastARVQDecode" and "pick the multi-scale VQVAE" in error["exception_message"]


def test_var_dd_student_runs_in_the_dd_sampler_and_decodes_through_the_vqvae(comfy):
    prompt = var_prompt()
    prompt["1"]["inputs"]["model_name"] = "var-dd-tiny.pth"
    prompt["4"] = {"class_type": "FastARSamplerDD", "inputs": {"model": ["1", 0], "conditioning": ["3", 0], "vq": ["2", 0],
                                                              "seed": 2, "batch": 2, "steps": 2, "t2": 0, "split": -1}}
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    text = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert "DD steps: 2 (t2 5, split 5)" in text and "in 2 forwards; its teacher's VAR takes 4: 2.00x fewer steps" in text
    assert "speed-up vs VAR: not measured" in text
    images = images_of(comfy, entry)
    assert len(images) == 2 and images[0].shape == (16, 16, 3)
    prompt["2"]["inputs"]["vq_name"] = "demo_vq.safetensors"
    error = failed(comfy, prompt)
    assert "writes the token maps of its scales: its image decoder is its multi-scale VQVAE" in error["exception_message"]


def test_var_takes_fastvar_and_skipvar_from_the_ar_samplers_last_widgets(comfy):
    """fastvar_ratios, skip_scales and uncond_scales (appended, optional): the Stats node shows the tokens each
    scale forwarded; a wrong ratio stops the run with FastAR's message."""
    prompt = var_prompt()
    prompt["4"]["inputs"] |= {"fastvar_ratios": "0.5", "skip_scales": 1, "uncond_scales": 1}
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    text = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert "scale acceleration: tokens forwarded per scale 1/4/2.5/0 (plain 1/4/9/16)" in text  # 5 of 9, cond rows
    assert len(images_of(comfy, entry)) == 2
    prompt["4"]["inputs"]["fastvar_ratios"] = "1.5"
    assert "not in [0, 1)" in failed(comfy, prompt)["exception_message"]
