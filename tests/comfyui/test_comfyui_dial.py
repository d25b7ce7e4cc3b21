"""FastAR Sampler, the speed dial, in a real ComfyUI on the bundled demo models: every family runs from the one node,
the Stats node says what was picked and why, and the same seed and speed give the same image."""
import numpy as np
import pytest
from comfyui_helpers import REAL_DEMO, harness
from test_comfyui_runs import images_of

pytestmark = pytest.mark.skipif(not REAL_DEMO, reason="needs the bundled demo models")


def dial_prompt(model: str, vq: str, speed: str, seed: int = 3, index: int = 5) -> dict:
    return {
        "1": {"class_type": "FastARLoadModel", "inputs": {"model_name": model, "dtype": "auto"}},
        "2": {"class_type": "FastARLoadVQ", "inputs": {"vq_name": vq, "dtype": "auto"}},
        "3": {"class_type": "FastARClassLabel", "inputs": {"model": ["1", 0], "class_name": "(use index)",
                                                           "index": index}},
        "4": {"class_type": "FastARSampler", "inputs": {"model": ["1", 0], "conditioning": ["3", 0], "vq": ["2", 0],
                                                        "seed": seed, "speed": speed, "batch": 1}},
        "5": {"class_type": "FastARVQDecode", "inputs": {"vq": ["2", 0], "tokens": ["4", 0]}},
        "6": {"class_type": "PreviewImage", "inputs": {"images": ["5", 0]}},
        "7": {"class_type": "FastARStats", "inputs": {"stats": ["4", 1]}},
    }


def run(comfy, prompt) -> tuple[np.ndarray, str, dict]:
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    stats_out = next(out for out in entry["outputs"].values() if "text" in out)
    return images_of(comfy, entry)[0], stats_out["text"][0], stats_out["fastar_stats"][0]


@pytest.mark.parametrize("model, vq, speed, decoders", [
    ("demo_c2i.safetensors", "demo_vq.safetensors", "lossless", ("ar",)),  # a CPU: a window costs more than it saves
    ("demo_c2i.safetensors", "demo_vq.safetensors", "fast", ("zipar", "zipar-sjd")),
    ("demo_mar.safetensors", "demo_kl_vae.safetensors", "balanced", ("ar+reuse",)),
    ("demo_var.safetensors", "demo_var_vqvae.safetensors", "balanced", ("ar",)),
    ("demo_dd.safetensors", "demo_vq.safetensors", "fast", ("dd",)),
])
def test_every_family_runs_from_the_one_node(comfy, model, vq, speed, decoders):
    image, text, stats = run(comfy, dial_prompt(model, vq, speed))
    assert image.shape == (128, 128, 3) and image.std() > 5  # a picture, not a flat field
    dial = stats["settings"]["dial"]
    assert dial["speed"] == speed and f"speed dial, {speed}: {dial['why']}" in text
    assert stats["decoder"] in decoders
    if speed == "fast" and model == "demo_c2i.safetensors":
        assert stats["step_compression"] > 2  # fast skips most steps
    if model == "demo_mar.safetensors":  # the demo MAR's own 32 steps, halved, with its own cfg 3
        assert stats["target_forwards"] == 16 and stats["settings"]["cfg"] == 3.0


def test_the_same_seed_and_speed_give_the_same_image(comfy):
    first, _, _ = run(comfy, dial_prompt("demo_c2i.safetensors", "demo_vq.safetensors", "balanced", seed=11))
    other, _, _ = run(comfy, dial_prompt("demo_c2i.safetensors", "demo_vq.safetensors", "balanced", seed=12))
    again, _, _ = run(comfy, dial_prompt("demo_c2i.safetensors", "demo_vq.safetensors", "balanced", seed=11, index=4))
    assert not np.array_equal(first, other)
    assert not np.array_equal(first, again)  # another class
    repeat, _, _ = run(comfy, dial_prompt("demo_c2i.safetensors", "demo_vq.safetensors", "balanced", seed=11))
    assert np.array_equal(first, repeat)  # sampled again: ComfyUI kept only the last run's outputs
