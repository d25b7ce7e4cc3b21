"""Runs through the real ComfyUI's HTTP API: every example workflow, same seed twice, progress with live
previews, cancel, and errors (rejected at validation, or an execution error carrying FastAR's message)."""
import io
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from comfyui_helpers import WORKFLOWS, node_of, workflow_prompt
from PIL import Image

import harness


def images_of(comfy, entry) -> list[np.ndarray]:
    return [np.asarray(Image.open(io.BytesIO(comfy.fetch(image))).convert("RGB")) for image in
            harness.output_images(entry)]


@pytest.mark.parametrize("workflow", [p.stem for p in WORKFLOWS])
def test_example_workflow_runs_and_makes_images(workflow, comfy, object_info):
    entry = comfy.run(workflow_prompt(workflow, object_info))
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    images = images_of(comfy, entry)
    assert images and all(image.ndim == 3 and image.shape[2] == 3 for image in images)
    assert all(image.std() > 1 for image in images)  # pictures, not flat fields
    texts = [out["text"][0] for out in entry["outputs"].values() if "text" in out]
    assert texts and all("step compression" in text and "tokens/s" in text for text in texts)


def test_hf_style_model_folder_is_listed_and_runs(comfy, object_info):
    from standins import HF_FOLDER

    options = object_info["FastARLoadModel"]["input"]["required"]["model_name"][1]["options"]
    assert f"{HF_FOLDER}/" in options
    prompt = workflow_prompt("fastar_llamagen_c2i", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = f"{HF_FOLDER}/"
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert images_of(comfy, entry)


def test_folder_with_a_pt_of_any_name_is_listed_and_runs_at_the_chosen_image_size(comfy, object_info):
    from standins import PT_FOLDER

    loader = object_info["FastARLoadModel"]["input"]
    assert f"{PT_FOLDER}/" in loader["required"]["model_name"][1]["options"]
    assert not any(name.startswith(f"{PT_FOLDER}/c2i_tiny") for name in loader["required"]["model_name"][1]["options"])
    assert loader["optional"]["image_size"][1]["options"] == ["auto", "128", "256", "384", "512", "768", "1024"]
    prompt = workflow_prompt("fastar_llamagen_c2i", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"].update(model_name=f"{PT_FOLDER}/", image_size="256")
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    assert [image.shape for image in images_of(comfy, entry)] == [(256, 256, 3)]


def test_compare_workflow_measures_speedup_against_ar(comfy, object_info):
    entry = comfy.run(workflow_prompt("fastar_demo_compare_ar_sjd_gsd", object_info))
    texts = sorted(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert [t.split(" ")[0] for t in texts] == ["AR", "GSD", "SJD"]
    assert "of 256 tokens in 255 forwards" in texts[0]
    assert all("speed-up vs AR (measured)" in t for t in texts[1:])


def test_zipar_workflow_runs_rows_side_by_side(comfy, object_info):
    entry = comfy.run(workflow_prompt("fastar_demo_zipar_compare", object_info))
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    texts = sorted(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert [t.split(" ")[0] for t in texts] == ["AR", "ZIPAR", "ZIPAR-SJD"]
    assert "in 87 forwards; plain AR takes 255: 2.93x fewer steps" in texts[1]  # at lead 4: 2 x 16 - 1 + 14 x 4
    assert all("speed-up vs AR (measured)" in t for t in texts[1:])


def fresh_entry(comfy, prompt) -> dict:
    comfy.free_memory()  # the sampler runs again, on a model loaded again
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)
    cached = [d for kind, d in harness.status_messages(entry) if kind == "execution_cached"]
    sampler = next(k for k, n in prompt.items() if n["class_type"].startswith("FastARSampler"))
    assert not cached or sampler not in cached[0]["nodes"]
    return entry


def fresh_run(comfy, prompt):
    return images_of(comfy, fresh_entry(comfy, prompt))


def test_same_seed_same_image_and_another_seed_another(comfy, object_info):
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    first, again = fresh_run(comfy, prompt), fresh_run(comfy, prompt)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    node_of(prompt, "FastARSamplerSJD")["inputs"]["seed"] = 12345
    other = fresh_run(comfy, prompt)
    assert not np.array_equal(first[0], other[0])


def test_compiled_steps_draw_the_eager_images_and_say_when_they_compile(comfy, object_info):
    """The loader's compile switch in the real ComfyUI: compiled and eager steps give the same greedy images (a
    sampled token may part on a last-bit logit difference where the demo model is unsure: the proof is greedy, as
    on the GPU); the run that compiles a new shape says so on the Stats node, the next one does not."""
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    node_of(prompt, "FastARSamplerSJD")["inputs"].update(batch=3, window=5, seed=321, top_k=1)  # a shape no other test runs
    stats_texts = lambda entry: [out["text"][0] for out in entry["outputs"].values() if "text" in out]  # noqa: E731
    node_of(prompt, "FastARLoadModel")["inputs"]["compile"] = "off"
    eager = fresh_run(comfy, prompt)
    node_of(prompt, "FastARLoadModel")["inputs"]["compile"] = "on"
    first = comfy.run(prompt)
    assert first["status"]["status_str"] == "success", harness.execution_error(first)
    compiled = images_of(comfy, first)  # the 3 images and their acceptance maps
    assert len(compiled) == len(eager) == 6 and all(np.array_equal(a, b) for a, b in zip(compiled, eager))
    assert any("compiling steps:" in text for text in stats_texts(first))
    again = fresh_entry(comfy, prompt)  # the model loads again too
    assert not any("compiling steps:" in text for text in stats_texts(again))


def saved_images(comfy, entry) -> np.ndarray:
    """The Save Image node's pictures [B, H, W, 3] (the previews beside them are acceptance maps)."""
    return np.stack([np.asarray(Image.open(io.BytesIO(comfy.fetch(image))).convert("RGB"))
                     for image in harness.output_images(entry) if image["type"] == "output"])


def test_8_bit_weights_draw_the_prompted_class(comfy, object_info):
    """Load AR Model's weight_dtype in the real ComfyUI: int8 and fp8 blocks run the demo workflow (the Stats node
    says which) and draw what full precision draws, the prompted shape, as the demo classifier judges. Not the
    same pictures: a sampled token parts from full precision's early on (test_quantized.py measures how close
    the 8-bit model's predictions are). Class 4: one the demo model draws in 16 of 16 samples in full precision."""
    from fastar.commands.bench.classifier import classify, load_classifier

    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    assert object_info["FastARLoadModel"]["input"]["optional"]["weight_dtype"][1]["options"] == ["auto", "int8", "fp8"]
    node_of(prompt, "FastARClassLabel")["inputs"].update(class_name="(use index)", index=4)
    node_of(prompt, "FastARSamplerSJD")["inputs"].update(seed=2024, batch=6)
    judge = load_classifier()
    drawn = {}
    for weights in ("auto", "int8", "fp8"):
        node_of(prompt, "FastARLoadModel")["inputs"]["weight_dtype"] = weights
        entry = fresh_entry(comfy, prompt)
        stats = [out["text"][0].splitlines()[0] for out in entry["outputs"].values() if "text" in out]
        said = f"{weights} weights" if weights != "auto" else "weights"
        assert stats and all((said in line) == (weights != "auto") for line in stats), stats
        drawn[weights] = saved_images(comfy, entry)
        assert drawn[weights].shape[0] == 6 and all(image.std() > 5 for image in drawn[weights])
        labels = classify(judge, drawn[weights])[0].tolist()
        assert labels.count(4) >= 4, (weights, labels)
    assert not np.array_equal(drawn["int8"], drawn["auto"]) and not np.array_equal(drawn["fp8"], drawn["auto"])


def test_an_8_bit_copy_loads_in_its_format_and_draws_what_quantising_at_load_draws(comfy, object_info, models):
    """A copy from ``python -m fastar quantize`` in ComfyUI's model folder: Load AR Model lists it, loads it in int8
    with weight_dtype auto (the Stats node says so), and the same seed draws the very images weight_dtype int8 draws
    from the full-precision file (the same codes); asking for fp8 stops with what to do."""
    from fastar.commands.quantize import write_quantised
    from fastar.model_loaders.shared.demo import DEMO_AR

    copy = write_quantised(DEMO_AR, "int8", models / "demo_c2i-int8.safetensors").name
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    node_of(prompt, "FastARSamplerSJD")["inputs"].update(seed=4242, batch=2)
    node_of(prompt, "FastARLoadModel")["inputs"]["weight_dtype"] = "int8"
    at_load = saved_images(comfy, fresh_entry(comfy, prompt))
    node_of(prompt, "FastARLoadModel")["inputs"].update(model_name=copy, weight_dtype="auto")
    entry = fresh_entry(comfy, prompt)
    stats = [out["text"][0].splitlines()[0] for out in entry["outputs"].values() if "text" in out]
    assert stats and all("int8 weights" in line for line in stats), stats
    assert np.array_equal(saved_images(comfy, entry), at_load)
    node_of(prompt, "FastARLoadModel")["inputs"]["weight_dtype"] = "fp8"
    comfy.free_memory()
    refused = comfy.run(prompt)
    assert refused["status"]["status_str"] == "error"
    assert "holds int8 weights" in harness.execution_error(refused)["exception_message"]


def test_progress_and_live_previews_arrive_while_decoding(comfy, object_info, events):
    prompt = workflow_prompt("fastar_demo_compare_ar_sjd_gsd", object_info)
    node_of(prompt, "FastARSamplerAR")["inputs"]["seed"] = 99  # not cached
    answer = comfy.queue(prompt)
    entry = comfy.wait(answer["prompt_id"])
    assert entry["status"]["status_str"] == "success"
    time.sleep(0.5)
    progress = [d for _, d in events.of("progress", answer["prompt_id"])]
    ar_node = next(k for k, n in prompt.items() if n["class_type"] == "FastARSamplerAR")
    ar_progress = [d for d in progress if d["node"] == ar_node]
    assert ar_progress and ar_progress[-1]["value"] == ar_progress[-1]["max"] == 256
    assert len(ar_progress) < 255  # throttled, not one message per token
    assert events.of("preview"), "no live preview image was sent"


SLOW = {
    "1": {"class_type": "FastARLoadModel", "inputs": {"model_name": "slow_c2i.safetensors", "dtype": "fp32"}},
    "2": {"class_type": "FastARClassLabel", "inputs": {"model": ["1", 0], "class_name": "(use index)", "index": 3}},
    "3": {"class_type": "FastARSamplerAR", "inputs": {"model": ["1", 0], "conditioning": ["2", 0], "seed": 1,
                                                       "cfg": 4.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                       "batch": 16}},
    "4": {"class_type": "FastARStats", "inputs": {"stats": ["3", 1]}},
}


def test_interrupt_stops_a_long_decode_promptly_and_the_next_run_works(comfy, object_info, events):
    answer = comfy.queue(SLOW)
    assert not answer.get("node_errors"), answer
    prompt_id = answer["prompt_id"]
    events.wait_for("progress", prompt_id, timeout=120)  # the decode is under way
    time.sleep(0.5)
    asked = time.monotonic()
    comfy.interrupt()
    stopped, _ = events.wait_for("execution_interrupted", prompt_id, timeout=60)
    assert stopped - asked < 3.0, f"cancel took {stopped - asked:.1f} s"
    progress = [d for _, d in events.of("progress", prompt_id)]
    assert progress[-1]["value"] < progress[-1]["max"]  # it really stopped mid-decode
    entry = comfy.run(workflow_prompt("fastar_demo_sjd", object_info))
    assert entry["status"]["status_str"] == "success"


def test_interrupt_during_a_first_compile_stops_promptly_and_the_next_run_works(comfy, object_info, events):
    """Cancel while the first run of a new shape compiles its steps (seconds on a CPU, with no iteration to
    stop at): the run ends at once, the compilation finishes in the background, and the same prompt then runs."""
    prompt = workflow_prompt("fastar_demo_sjd", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["compile"] = "on"
    # a shape no other test (or earlier run of this one) compiled, so that compiling really takes a while
    node_of(prompt, "FastARSamplerSJD")["inputs"].update(batch=2, window=random.randint(9, 15), seed=5)
    sampler = next(k for k, n in prompt.items() if n["class_type"] == "FastARSamplerSJD")
    answer = comfy.queue(prompt)
    prompt_id = answer["prompt_id"]
    deadline = time.monotonic() + 120
    while not any(isinstance(d, dict) and d.get("node") == sampler for _, d in events.of("executing", prompt_id)):
        assert time.monotonic() < deadline, "the sampler never started"
        time.sleep(0.05)
    time.sleep(0.5)
    asked = time.monotonic()
    comfy.interrupt()
    stopped, _ = events.wait_for("execution_interrupted", prompt_id, timeout=60)
    assert not events.of("progress", prompt_id), "decoding had begun: the cancel did not land in the compilation"
    assert stopped - asked < 3.0, f"cancel took {stopped - asked:.1f} s"
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", harness.execution_error(entry)


# -- errors ----------------------------------------------------------------------------------------


def errors_of(answer: dict) -> list[tuple[str, str, str]]:
    """(node type, input, message) of every error in ComfyUI's answer to a prompt."""
    return [(node["class_type"], e["extra_info"].get("input_name"), f"{e['message']}: {e['details']}")
            for node in answer["node_errors"].values() for e in node["errors"]]


def rejection(comfy, prompt) -> list[tuple[str, str, str]]:
    answer = comfy.queue(prompt)
    assert "prompt_id" not in answer, "the prompt was accepted"
    return errors_of(answer)


def rejected(comfy, prompt) -> str:
    return " | ".join(message for _, _, message in rejection(comfy, prompt))


def rejected_on(comfy, prompt, node: str, field: str) -> str:
    """The message of a prompt refused before the run, with one error only, on ``field`` of the ``node`` type."""
    errors = rejection(comfy, prompt)
    assert [(kind, name) for kind, name, _ in errors] == [(node, field)], errors
    return errors[0][2]


def demo(object_info):
    return workflow_prompt("fastar_demo_sjd", object_info)


@pytest.mark.parametrize("node,field,value,message", [
    ("FastARSamplerSJD", "top_p", 0.0, "top-p 0.0 is out of range"),
    ("FastARSamplerSJD", "cfg", -1.0, "Value -1.0 smaller than min of 0.0"),  # ComfyUI's own range check
    ("FastARSamplerSJD", "cfg", "strong", "Failed to convert an input value to a FLOAT value"),
    ("FastARSamplerSJD", "top_p", "most", "Failed to convert an input value to a FLOAT value"),
    ("FastARSamplerSJD", "window", 1, "smaller than min of 2"),
    ("FastARSamplerSJD", "batch", 0, "smaller than min of 1"),
    ("FastARLoadModel", "model_name", "demo_vq.safetensors", "is an image decoder (load it with FastAR Load Image Decoder)"),
    ("FastARLoadModel", "model_name", "missing.safetensors", "put it in ComfyUI's models/fastar folder"),
    ("FastARLoadVQ", "vq_name", "demo_c2i.safetensors", "is an AR model"),
])
def test_bad_widget_values_are_rejected_before_the_run_once_on_their_input(comfy, object_info, node, field, value,
                                                                           message):
    prompt = demo(object_info)
    node_of(prompt, node)["inputs"][field] = value
    assert message in rejected_on(comfy, prompt, node, field)


@pytest.mark.parametrize("field,value,message", [
    ("class_name", "unicorn", "unknown class 'unicorn'"),
    ("class_name", "(use index)", "give an index of 0 or more"),
    ("index", 5, "both a class"),
])
def test_bad_class_label_is_rejected_before_the_run(comfy, object_info, field, value, message):
    prompt = demo(object_info)
    node_of(prompt, "FastARClassLabel")["inputs"][field] = value
    assert message in rejected(comfy, prompt)


def assert_refused_choice(comfy, prompt, node: str, field: str, message: str) -> None:
    """A value outside an input's list: ComfyUI versions that check V3 lists refuse it before the run, on that
    input alone; ComfyUI 0.3.75 checks none, and the node refuses it with FastAR's message when it runs."""
    answer = comfy.queue(prompt)
    if "prompt_id" not in answer:
        assert {(kind, name) for kind, name, _ in errors_of(answer)} == {(node, field)}, answer
        return
    error = harness.execution_error(comfy.wait(answer["prompt_id"]))
    assert error is not None, "the run did not fail"
    assert error["node_type"] == node and message in error["exception_message"], error


@pytest.mark.parametrize("node,field,value,message", [
    ("FastARLoadModel", "image_size", "1000", "unknown image size '1000'"),
    ("FastARLoadModel", "compile", "always", "unknown compile setting 'always': choose one of auto, on, off"),
    ("FastARLoadModel", "weight_dtype", "nf4", "unknown weight_dtype 'nf4': choose one of auto, int8, fp8"),
    ("FastARLoadModel", "dtype", "fp8", "unknown dtype 'fp8'"),
    ("FastARSamplerSJD", "init", "diagonal", "unknown initialisation 'diagonal'"),
    ("FastARSamplerSJD", "coupling", "none", "unknown coupling 'none'"),
])
def test_a_value_outside_a_list_is_refused_on_its_input_or_when_its_node_runs(comfy, object_info, node, field,
                                                                              value, message):
    prompt = demo(object_info)
    node_of(prompt, node)["inputs"][field] = value
    assert_refused_choice(comfy, prompt, node, field, message)


@pytest.fixture
def elsewhere(tmp_path, models) -> Path:
    """A real model folder and file outside the model folders, where a shared workflow could point."""
    from standins import HF_FOLDER

    shutil.copytree(models / HF_FOLDER, tmp_path / "model")
    shutil.copy(models / HF_FOLDER / "model.safetensors", tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("entry", ["model/", "model.safetensors"])
@pytest.mark.parametrize("absolute", [False, True], ids=["dot-dot", "absolute"])
def test_a_model_name_that_leaves_the_model_folders_is_refused_on_its_input(comfy, object_info, models, elsewhere,
                                                                           entry, absolute):
    target = elsewhere / entry
    name = (str(target) if absolute else os.path.relpath(target, models)) + ("/" if entry.endswith("/") else "")
    prompt = demo(object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = name
    assert (f"model_name '{name}' leaves ComfyUI's model folders, and FastAR reads models only from them: pick an "
            "entry of the list, or put it in ComfyUI's models/fastar folder") in \
        rejected_on(comfy, prompt, "FastARLoadModel", "model_name")


def failed(comfy, prompt) -> dict:
    answer = comfy.queue(prompt)
    assert "prompt_id" in answer and not answer["node_errors"], answer
    entry = comfy.wait(answer["prompt_id"])
    error = harness.execution_error(entry)
    assert error is not None, "the run did not fail"
    return error


def test_corrupt_checkpoint_gives_fastar_message(comfy, object_info):
    prompt = demo(object_info)
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = "corrupt_c2i.pt"
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARLoadModel"
    assert "corrupt_c2i.pt" in error["exception_message"] and "corrupt" in error["exception_message"]
    assert error["exception_type"].endswith("FastARError")


def test_class_out_of_range_for_the_linked_model_is_rejected_before_the_run(comfy, object_info):
    prompt = demo(object_info)
    label = node_of(prompt, "FastARClassLabel")["inputs"]
    label["class_name"], label["index"] = "(use index)", 12
    assert "class 12 is out of range: this model has classes 0..7" in rejected(comfy, prompt)


def test_imagenet_class_on_the_demo_model_is_rejected_before_the_run(comfy, object_info):
    prompt = demo(object_info)
    node_of(prompt, "FastARClassLabel")["inputs"]["class_name"] = "golden retriever (207)"
    message = rejected(comfy, prompt)
    assert "ImageNet class" in message and "8 classes" in message and "circle" in message


def test_class_out_of_range_for_a_pickled_model_gives_fastar_message_at_run(comfy, object_info):
    prompt = workflow_prompt("fastar_llamagen_c2i", object_info)  # a .pt: its classes show when it is loaded
    label = node_of(prompt, "FastARClassLabel")["inputs"]
    label["class_name"], label["index"] = "(use index)", 1500
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARClassLabel"
    assert "class 1500 is out of range: this model has classes 0..999" in error["exception_message"]


def test_text_conditioning_on_a_class_model_gives_fastar_message(comfy, object_info):
    prompt = workflow_prompt("fastar_llamagen_t2i", object_info)
    node_of(prompt, "FastARTextConditioning")["inputs"]["prompt"] = "a blue ball"
    node_of(prompt, "FastARLoadModel")["inputs"]["model_name"] = "demo_c2i.safetensors"
    error = failed(comfy, prompt)
    assert "class-to-image model: use FastAR Class Label" in error["exception_message"]


@pytest.mark.parametrize("folder,message", [
    ("flan-t5-missing/", "no FLAN-T5 folder named 'flan-t5-missing/' in the model folders: put it in ComfyUI's "
                         "models/fastar or models/text_encoders folder (or a fastar: or text_encoders: path"),
    ("demo_text/", "demo_text is no FLAN-T5 folder"),
    ("../flan-t5-xl/", "t5_folder '../flan-t5-xl/' leaves ComfyUI's model folders"),
])
def test_t5_folder_that_is_missing_or_not_t5_is_rejected_before_the_run_on_its_input(comfy, object_info, folder,
                                                                                     message):
    prompt = workflow_prompt("fastar_llamagen_t2i", object_info)
    node_of(prompt, "FastARTextConditioning")["inputs"]["t5_folder"] = folder
    assert message in rejected_on(comfy, prompt, "FastARTextConditioning", "t5_folder")


def test_an_empty_prompt_stops_the_run_with_fastar_message(comfy, object_info):
    prompt = workflow_prompt("fastar_llamagen_t2i", object_info)
    node_of(prompt, "FastARTextConditioning")["inputs"]["prompt"] = "  "
    error = failed(comfy, prompt)
    assert error["node_type"] == "FastARTextConditioning"
    assert "the prompt is empty: describe the image to draw" in error["exception_message"]


def test_label_made_for_another_model_gives_fastar_message(comfy, object_info):
    prompt = demo(object_info)  # the sampler uses the demo model (8 classes) ...
    prompt["90"] = {"class_type": "FastARLoadModel", "inputs": {"model_name": "c2i_L_256.pt", "dtype": "auto"}}
    label = node_of(prompt, "FastARClassLabel")["inputs"]  # ... the label is an ImageNet class of another model
    label["model"], label["class_name"] = ["90", 0], "golden retriever (207)"
    error = failed(comfy, prompt)
    assert error["node_type"].startswith("FastARSampler")
    assert "class 207 is out of range: this model has classes 0..7" in error["exception_message"]
