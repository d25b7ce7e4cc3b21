"""Distilled Decoding in the real ComfyUI: Load AR Model loads a student in the released layout, the DD
sampler makes the image in one or two forwards with the teacher's VQ, Decode Image takes its code vectors,
Stats says how many forwards AR would need, the same seed repeats the image; mix-ups give FastAR's messages."""
import harness
import numpy as np
from test_comfyui_runs import failed, images_of

from workflows import LLAMAGEN_DD_B, LLAMAGEN_VQ_C2I

DEMO_VQ, DEMO_KL = "demo_vq.safetensors", "demo_kl_vae.safetensors"


def dd_prompt(steps=2, seed=5, batch=2, vq=LLAMAGEN_VQ_C2I, model=LLAMAGEN_DD_B, sampler="FastARSamplerDD") -> dict:
    """A DD run: by default the release's student stand-in with the stand-in release VQ it decodes with."""
    widgets = ({"seed": seed, "batch": batch, "steps": steps, "t2": 0, "split": -1} if sampler == "FastARSamplerDD"
               else {"seed": seed, "cfg": 1.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "batch": batch})
    sockets = {"model": ["1", 0], "conditioning": ["3", 0]} | ({"vq": ["2", 0]} if sampler == "FastARSamplerDD" else {})
    return {
        "1": {"class_type": "FastARLoadModel", "inputs": {"model_name": model, "dtype": "auto"}},
        "2": {"class_type": "FastARLoadVQ", "inputs": {"vq_name": vq, "dtype": "auto"}},
        "3": {"class_type": "FastARClassLabel", "inputs": {"model": ["1", 0], "class_name": "(use index)", "index": 3}},
        "4": {"class_type": sampler, "inputs": {**sockets, **widgets}},
        "5": {"class_type": "FastARVQDecode", "inputs": {"vq": ["2", 0], "tokens": ["4", 0]}},
        "6": {"class_type": "PreviewImage", "inputs": {"images": ["5", 0]}},
        "7": {"class_type": "FastARStats", "inputs": {"stats": ["4", 1]}},
    }


def executed(comfy, prompt) -> tuple[list, str]:
    """The images and the Stats text of a run in which the sampler ran (was not served from the cache)."""
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    cached = [d for kind, d in harness.status_messages(entry) if kind == "execution_cached"]
    assert not cached or "4" not in cached[0]["nodes"]
    text = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    return images_of(comfy, entry), text


def test_dd_student_runs_in_two_forwards_and_repeats_by_seed(comfy):
    prompt = dd_prompt()
    first, text = executed(comfy, prompt)
    assert text.startswith("DD (relaxed") and "in 2 forwards; its teacher's AR takes 255: 127.50x fewer steps" in text
    assert len(first) == 2 and first[0].shape == (128, 128, 3)  # 16x16 codes through the stand-in VQ (8 px each)
    assert not np.array_equal(first[0], first[1])  # each row its own noise
    prompt["4"]["inputs"]["steps"] = 1  # ComfyUI keeps the last run's outputs only: the next run samples again
    one_step, text = executed(comfy, prompt)
    assert "in 1 forward; its teacher's AR takes 255" in text and not np.array_equal(first[0], one_step[0])
    prompt["4"]["inputs"]["steps"] = 2
    again, _ = executed(comfy, prompt)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_dd_mix_ups_give_fastar_messages(comfy):
    error = failed(comfy, dd_prompt(model="demo_c2i.safetensors", vq=DEMO_VQ))
    assert "dd needs a Distilled Decoding student; this is a LlamaGen GPT" in error["exception_message"]
    error = failed(comfy, dd_prompt(sampler="FastARSamplerAR"))
    assert "ar needs a token model (LlamaGen) or a MAR model or a next-scale model (VAR, Infinity); this is a " \
        "Distilled Decoding student (LlamaGen-DD): use one of dd" \
        in error["exception_message"]
    prompt = dd_prompt(seed=11)  # a seed of its own: the sampler's result must not be cached for the other tests
    prompt["8"] = {"class_type": "FastARLoadVQ", "inputs": {"vq_name": DEMO_KL, "dtype": "auto"}}
    prompt["5"]["inputs"]["vq"] = ["8", 0]
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARVQDecode"
    assert "Distilled Decoding student's 8-wide code vectors, but demo_kl_vae.safetensors is a KL autoencoder" in \
        error["exception_message"]


def hybrid_prompt(teacher="demo_c2i.safetensors", steps=2, regenerate=40) -> dict:
    """The bundled demo student with its teacher resampling tokens between the two steps."""
    prompt = dd_prompt(model="demo_dd.safetensors", vq=DEMO_VQ, batch=1, steps=steps)
    prompt["8"] = {"class_type": "FastARLoadModel", "inputs": {"model_name": teacher, "dtype": "auto"}}
    prompt["4"]["inputs"] |= {"teacher": ["8", 0], "regenerate": regenerate, "teacher_cfg": 2.0, "teacher_top_k": 8}
    return prompt


def test_dd_hybrid_lets_the_teacher_resample_between_the_steps(comfy):
    plain, _ = executed(comfy, dd_prompt(model="demo_dd.safetensors", vq=DEMO_VQ, batch=1))
    hybrid, text = executed(comfy, hybrid_prompt())
    assert "DD steps: 2 + 40 teacher forwards (the teacher resampled tokens 40..79)" in text
    assert "in 42 forwards; its teacher's AR takes 255" in text
    assert not np.array_equal(plain[0], hybrid[0])  # the teacher's tokens 40..79 change the image
    error = failed(comfy, hybrid_prompt(steps=1))
    assert "set steps to 2, or disconnect the teacher" in error["exception_message"]
    error = failed(comfy, hybrid_prompt(regenerate=80))
    assert "give 2 steps and s in 0..79" in error["exception_message"]
    error = failed(comfy, hybrid_prompt(teacher="demo_text/"))
    assert "this teacher is not the student's" in error["exception_message"]
    error = failed(comfy, hybrid_prompt(teacher="demo_mar.safetensors"))
    assert "the teacher regenerates tokens: it must be a token model" in error["exception_message"]
