"""The command line on the bundled demo models, run as a user runs it (a real subprocess)."""
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_DRAFTER, DEMO_MAR, DEMO_TEXT, DEMO_VAR, DEMO_VAR_DD, DEMO_VQ

needs_demo = pytest.mark.skipif(not (DEMO_AR.exists() and DEMO_VQ.exists() and DEMO_DRAFTER.exists()),
                                reason="demo weights not built")


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@needs_demo
def test_generate_writes_images_tokens_stats_and_maps(tmp_path):
    r = fastar("generate", "--classes", "0,3", "--decoder", "sjd", "--seed", 5, "--out", tmp_path / "img.png",
               "--tokens-out", tmp_path / "codes" / "t.json", "--stats-out", tmp_path / "runs" / "a" / "s.json",
               "--map-out", tmp_path / "map.png", cwd=tmp_path)  # folders that do not exist yet are made
    assert r.returncode == 0, r.stderr
    for said in (f"wrote {tmp_path / 'img_0.png'} ... {tmp_path / 'img_1.png'} (2 images)",  # the files, not img.png
                 f"wrote {tmp_path / 'codes' / 't.json'} (the image codes of 2 images, JSON)",
                 f"wrote {tmp_path / 'runs' / 'a' / 's.json'} (the decode statistics, JSON)",
                 f"wrote {tmp_path / 'map_0.png'} ... {tmp_path / 'map_1.png'} (2 acceptance maps)"):
        assert said in r.stdout.splitlines(), r.stdout
    for i in range(2):
        image = Image.open(tmp_path / f"img_{i}.png")
        assert image.size == (128, 128) and image.mode == "RGB"
        assert np.asarray(image).std() > 5  # a picture, not a flat field
        assert (tmp_path / f"map_{i}.png").exists()
    tokens = json.loads((tmp_path / "codes" / "t.json").read_text())
    assert tokens["grid"] == [16, 16] and len(tokens["tokens"]) == 2 and len(tokens["tokens"][0]) == 256
    stats = json.loads((tmp_path / "runs" / "a" / "s.json").read_text())
    assert stats["decoder"] == "sjd" and stats["tokens"] == 256 and stats["batch"] == 2
    assert stats["step_compression"] == pytest.approx(256 / stats["target_forwards"])
    assert stats["step_compression"] > 1.2  # the demo model is trained: Jacobi drafts get accepted
    assert len(stats["fixed_per_forward"]) == stats["target_forwards"] and stats["wall_time_s"] > 0


def test_an_output_folder_that_cannot_be_made_is_said_before_generating(tmp_path):
    (tmp_path / "taken").write_text("a file where the folder should be")
    r = fastar("generate", "--quiet", "--stats-out", tmp_path / "taken" / "s.json", "--model", "missing.safetensors",
               cwd=tmp_path)  # the folder is checked before the model is even looked for
    assert r.returncode == 2 and "--stats-out" in r.stderr and "its folder cannot be made" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@needs_demo
def test_without_a_vq_the_codes_are_kept_next_to_out_and_progress_counts_the_batch(tmp_path):
    model = tmp_path / "my_c2i.safetensors"  # not the bundled demo: no image decoder is known for it
    shutil.copy(DEMO_AR, model)
    r = fastar("generate", "--model", model, "--class", "4", "--batch", 2, "--decoder", "sjd",
               "--out", tmp_path / "pics" / "img.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    kept = tmp_path / "pics" / "img.tokens.json"
    note, progress = r.stderr.index("note: no images from this run"), r.stderr.index("256/256 tokens")
    assert note < progress, "said after the generation, not before"
    assert "no images written" in r.stderr and str(kept) in r.stderr and "--vq" in r.stderr
    assert len(json.loads(kept.read_text())["tokens"]) == 2 and not list(tmp_path.glob("pics/*.png"))
    assert "256/256 tokens (2 images)" in r.stderr  # and the tok/s beside it is of both images
    # stderr is a pipe here, as in a log: a plain line per tenth of the work, no carriage returns
    progress = [line for line in r.stderr.splitlines() if line.startswith("sjd, lossless [")]
    assert "\r" not in r.stderr and 2 <= len(progress) <= 10 and "256/256 tokens" in progress[-1]


@needs_demo
def test_same_seed_same_tokens_and_class_repeats_over_batch(tmp_path):
    runs = []
    for name in ("a", "b"):
        r = fastar("generate", "--class", "2", "--batch", 3, "--decoder", "gsd", "--seed", 11, "--quiet",
                   "--tokens-out", tmp_path / f"{name}.json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads((tmp_path / f"{name}.json").read_text())["tokens"])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 and runs[0][0] != runs[0][1]  # three independent rows of class 2


@needs_demo
def test_compile_gives_the_eager_tokens_and_says_what_compiling_cost(tmp_path):
    runs = {}
    for switch in ("off", "on"):
        # greedy: a sampled token may part on a last-bit logit difference where the demo model is unsure
        r = fastar("generate", "--classes", "1,5", "--decoder", "sjd", "--top-k", 1, "--compile", switch,
                   "--tokens-out", tmp_path / f"{switch}.json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        runs[switch] = (json.loads((tmp_path / f"{switch}.json").read_text())["tokens"], r.stdout)
    assert runs["on"][0] == runs["off"][0]
    assert "s of it compiling steps" in runs["on"][1] and "compiling" not in runs["off"][1]


@needs_demo
@pytest.mark.parametrize("args,message", [
    (["--class", "99"], "out of range"),
    (["--class", "not-a-class"], "unknown class"),
    (["--cfg", "-2"], "cfg scale"),
    (["--window", "1"], "window"),
    (["--model", "missing.safetensors"], "missing.safetensors"),
    (["--threads", "0"], "--threads 0: give at least 1"),
    (["--compile", "always"], "argument --compile: invalid choice: 'always'"),
    (["--device", "mps"], "sees no Apple GPU (MPS): use --device cpu"),
    (["--device", "cuda:3"], "sees no CUDA GPU: use --device cpu"),
    (["--device", "xpu"], "FastAR runs on cpu, cuda or cuda:N and mps"),
])
def test_bad_input_gives_a_clear_error_and_exit_code(tmp_path, args, message):
    r = fastar("generate", "--quiet", *args, cwd=tmp_path)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--window", "0"], "Jacobi window 0 is too small"),
    (["--gamma", "0"], "gamma 0 is too small"),
    (["--group", "0"], "GSD group size 0"),
    (["--lantern-delta", "2"], "LANTERN delta 2.0 is out of range"),
    (["--temperature", "-1"], "temperature"),
    (["--batch", "0"], "--batch 0: generate at least 1 image"),
    (["--prefill", "1.5"], "pre-fill 1.5"),
    (["--window", "1"], "for plain AR (one token per forward) use --decoder ar and leave --window out"),
])
def test_settings_are_checked_before_anything_loads(tmp_path, args, message):
    """A model that does not exist: the settings' error comes first, before the model is even looked for."""
    r = fastar("generate", "--quiet", "--model", "not-loaded.safetensors", *args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "not-loaded" not in r.stderr, r.stderr


@needs_demo
@pytest.mark.parametrize("model, extra", [
    (DEMO_MAR, ["--num-iter", "4", "--diffusion-steps", "5"]),
    (DEMO_VAR, []),
    (DEMO_DD, []),
    (DEMO_VAR_DD, []),
    (DEMO_TEXT, ["--prompt", "a red ring on a cyan background", "--window", "32"]),
], ids=lambda value: getattr(value, "name", ""))
def test_each_bundled_model_finds_its_image_decoder_and_writes_where_it_says(tmp_path, model, extra):
    r = fastar("generate", "--model", model, *extra, "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = list((tmp_path / "out").glob("*.png"))
    assert len(written) == 1 and written[0].name.startswith(f"{model.stem}_") and "_seed0" in written[0].name
    assert f"wrote {Path('out') / written[0].name} (1 image)" in r.stdout
    if model != DEMO_TEXT:  # a class-conditional model given no class says which it draws
        assert "warning: no --class given: drawing class 0 (circle); choose with --class" in r.stderr
    assert np.asarray(Image.open(written[0])).std() > 5


@needs_demo
def test_the_text_demo_names_the_words_it_does_not_know(tmp_path):
    r = fastar("generate", "--model", DEMO_TEXT, "--prompt", "a purple dog on a red background", "--window", "64",
               "--quiet", "--tokens-out", "t.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "does not know 'purple', 'dog'" in r.stderr and "'red'" not in r.stderr.split("does not know")[1]


def test_the_default_threads_leave_busy_cores_alone(monkeypatch):
    from fastar import cli

    monkeypatch.setattr(cli.os, "cpu_count", lambda: 8)
    for load, threads in ((0.1, 8), (3.0, 5), (7.6, 1), (20.0, 1)):
        monkeypatch.setattr(cli.os, "getloadavg", lambda load=load: (load, load, load))
        assert cli.free_cores() == threads
    monkeypatch.delattr(cli.os, "getloadavg")
    assert cli.free_cores() == 8


@needs_demo
def test_drafter_decoders_from_the_command_line(tmp_path):
    """spec and LANTERN (the demo drafter by default), LANTERN on Jacobi drafts (--drafter none)."""
    runs = {
        "spec": ["--decoder", "spec", "--gamma", 3],
        "lantern": ["--decoder", "lantern", "--drafter", "demo", "--lantern-k", 64, "--lantern-delta", 0.3],
        "lantern-jacobi": ["--decoder", "lantern", "--drafter", "none", "--lantern-delta", 0.3],
        "lantern-bundled": ["--decoder", "lantern", "--lantern-delta", 0.3],  # the demo's drafter, found for it
    }
    stats, stderr = {}, {}
    for name, args in runs.items():
        r = fastar("generate", "--class", "1", "--batch", 2, "--seed", 3, "--quiet", *args,
                   "--stats-out", tmp_path / f"{name}.json", "--out", tmp_path / f"{name}.png", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        stats[name], stderr[name] = json.loads((tmp_path / f"{name}.json").read_text()), r.stderr
        assert Image.open(tmp_path / f"{name}_1.png").size == (128, 128)
    assert stats["spec"]["settings"] == {"gamma": 3, "drafter": stats["spec"]["settings"]["drafter"], "rule": "exact"}
    assert stats["spec"]["drafter_forwards"] == 3 * stats["spec"]["target_forwards"]
    assert 1.2 < stats["spec"]["step_compression"] <= 4.0  # at most gamma + 1 tokens per forward
    assert stats["lantern"]["settings"]["rule"] == "lantern" and stats["lantern"]["drafter_forwards"] > 0
    assert stats["lantern-jacobi"]["drafter_forwards"] == 0 and stats["lantern-jacobi"]["settings"]["window"] == 16
    # LANTERN on Jacobi drafts degrades the image badly: said on the command line and kept in the stats
    assert "warning: LANTERN without a drafter" in stderr["lantern-jacobi"]
    assert stats["lantern-jacobi"]["warnings"] and not stats["lantern"]["warnings"] and not stats["spec"]["warnings"]
    assert "warning" not in stderr["lantern"] + stderr["spec"] + stderr["lantern-bundled"]
    assert stats["lantern-bundled"]["drafter_forwards"] > 0 and not stats["lantern-bundled"]["warnings"]


@needs_demo
@pytest.mark.parametrize("args,message", [
    (["--decoder", "spec", "--model", "copy_of_the_demo.safetensors"], "needs a drafter"),  # no bundled drafter
    (["--decoder", "sjd", "--drafter", "demo"], "does not use a drafter"),
    (["--decoder", "spec", "--gamma", "0"], "gamma"),
    (["--decoder", "lantern", "--lantern-delta", "1.5"], "delta"),
    (["--decoder", "lantern", "--lantern-k", "0"], "k 0"),
    (["--decoder", "spec", "--drafter", DEMO_VQ], "not a drafter"),
    (["--decoder", "sjd", "--drafts", "top"], "give sjd a drafter (--drafter"),
])
def test_bad_drafter_settings_give_a_clear_error(tmp_path, args, message):
    shutil.copy(DEMO_AR, tmp_path / "copy_of_the_demo.safetensors")  # not the bundled file: its drafter is not found
    r = fastar("generate", "--quiet", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_bench_names_its_top_drafted_rows_instead_of_taking_drafts(tmp_path):
    r = fastar("bench", "--drafts", "top", "--decoders", "ar,spec", "--samples", 2, cwd=tmp_path)
    assert r.returncode != 0 and "spec,spec-top" in r.stderr and "Traceback" not in r.stderr


@needs_demo
def test_bench_smoke_writes_json_and_markdown(tmp_path):
    """A smoke run: fewest samples, no sweeps (the statistics live in the exactness tests), 8-bit weights."""
    r = fastar("bench", "--decoders", "ar,sjd,spec,spec-top,lantern-jacobi,zipar-sjd", "--samples", 2, "--timing-runs", 1,
               "--no-pareto", "--toy-rows", 500, "--threads", 1, "--weights", "int8", "--out", tmp_path / "b",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert set(report["results"]) == {"ar", "sjd", "spec", "spec-top", "lantern-jacobi", "zipar-sjd"} and "pareto" not in report
    assert (report["results"]["spec"]["spec"]["drafts"], report["results"]["spec-top"]["spec"]["drafts"]) == ("sampled", "top")
    assert report["machine"].endswith(", 1 threads")  # --threads reaches PyTorch
    for result in report["results"].values():
        for key in ("step_compression", "latency_ratio", "class_accuracy", "frechet", "drafter_time_share"):
            assert np.isfinite(result[key])
    assert report["results"]["spec"]["drafter_forwards_per_image"] > 0 < report["results"]["spec"]["drafter_time_share"]
    assert report["results"]["lantern-jacobi"]["drafter_forwards_per_image"] == 0
    assert report["toy_tv"]["rows"] == 500 and set(report["toy_tv"]["gsd_by_group"]) == {"1", "3", "5"}
    assert set(report["toy_tv"]["zipar_by_lead"]) == {"1", "2", "3"}
    assert report["results"]["zipar-sjd"]["step_compression"] > 2  # rows run side by side (lead 4: 3.4x without drafts)
    assert "| zipar-sjd | no | - |" in (tmp_path / "b" / "bench.md").read_text()
    assert report["results"]["ar"]["step_compression"] == pytest.approx(256 / 255)
    assert report["results"]["ar"]["latency_ratio"] == pytest.approx(1.0)
    assert report["results"]["sjd"]["step_compression"] > 1.2
    assert report["results"]["ar"]["first_draft_acceptance"] == 0 < report["results"]["spec"]["first_draft_acceptance"]
    assert 0 < report["ambiguity"]["top1_probability"] < 1 and report["ambiguity"]["entropy_nats"] > 0
    assert report["ambiguity"]["samples"] == 2
    assert (tmp_path / "b" / "bench.md").read_text().startswith("# FastAR benchmark")
    assert report["weights"] == "int8" and "int8 weights" in (tmp_path / "b" / "bench.md").read_text().splitlines()[0]
    assert "mean top-1 probability" in (tmp_path / "b" / "bench.md").read_text()
    assert not (tmp_path / "b" / "pareto.png").exists()


@needs_demo
def test_bench_sweeps_every_slider_and_plots_the_pareto_front(tmp_path, monkeypatch, capsys):
    from fastar.pipeline import load_models
    from fastar.samplers.decoders import DecoderSpec
    from fastar.samplers.processing import SamplingSettings
    from fastar.commands.bench import decoders as bench
    from fastar.commands.bench.classifier import classify, load_classifier
    from fastar.commands.bench.demo_data import make_batch

    for name, values in (("SWEEP_GROUPS", (1, 10)), ("SWEEP_WINDOWS", (4,)), ("SWEEP_DELTAS", (0.0, 0.4)),
                         ("SWEEP_KS", (1,))):
        monkeypatch.setattr(bench, name, values)
    models = load_models(None, None, "cpu", drafter_path="demo")
    judge = load_classifier()
    reference = classify(judge, make_batch(np.random.default_rng(0), 16)[0])[1]
    configs = bench.sweep_configs(DecoderSpec(), bench_entries("ar", "gsd", "sjd", "lantern"), drafted=True)
    points = bench.sweep(models, judge, SamplingSettings(), configs, [0, 1], 0, reference)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[bench] sweep")]
    assert len(progress) == 7 and progress[-1].startswith("[bench] sweep 7/7 LANTERN (k, delta=0.2) with the drafter")
    assert {(p["series"], p["value"]) for p in points} == {
        ("GSD (group size)", 1), ("GSD (group size)", 10), ("SJD independent (window)", 4),
        ("SJD maximal (window)", 4), ("LANTERN (delta)", 0.0), ("LANTERN (delta)", 0.4),
        ("LANTERN (k, delta=0.2)", 1)}
    assert all(p["drafter"] for p in points if p["series"].startswith("LANTERN"))
    results = {"ar": {"step_compression": 1.0, "class_accuracy": 1.0, "frechet": 1.0}}
    bench.plot_pareto(points, results, tmp_path / "pareto.png")
    assert Image.open(tmp_path / "pareto.png").size[0] > 400


def test_bench_sweeps_only_the_decoders_asked_for():
    from fastar.samplers.decoders import DecoderSpec
    from fastar.commands.bench import decoders as bench

    def series(decoders, drafted=False):
        return {config[0] for config in bench.sweep_configs(DecoderSpec(), bench_entries(*decoders), drafted)}

    assert series({"ar"}) == set() and series({"ar", "spec"}) == set()
    assert series({"ar", "sjd"}) == {"SJD independent (window)", "SJD maximal (window)"}
    assert series({"sjd-pac"}) == {"SJD-PAC independent, 2 branches (window)", "SJD-PAC maximal, 2 branches (window)",
                                   "SJD-PAC maximal, window 32 (branches)"}
    for *_, spec, _ in bench.sweep_configs(DecoderSpec(), bench_entries("sjd-pac"), False):
        spec.validate()  # every point's tree fits its window
    assert series({"gsd"}) == {"GSD (group size)"}
    assert series({"sjd-entropy"}) == {"SJD entropy-aware, independent, window 16 (strength)"}
    assert series({"lantern"}) == {"LANTERN (delta)", "LANTERN (k, delta=0.2)"}
    configs = bench.sweep_configs(DecoderSpec(), bench_entries("lantern"), drafted=False)
    assert not any(with_drafter for *_, with_drafter in configs)
    assert series({"spec-top-tree", "lantern++"}, drafted=True) == {
        "LANTERN (delta)", "LANTERN (k, delta=0.2)", "LANTERN++ (lambda)", "spec, top-drafted dynamic tree (nodes)"}


def bench_entries(*labels):
    """The bench's rows of ``labels``, as --decoders names them."""
    from argparse import Namespace

    from fastar.cli import build_parser
    from fastar.commands.bench import decoders as bench

    args = build_parser().parse_args(["bench"])
    return bench.parse_entries(",".join(labels), Namespace(**vars(args)))


def test_bench_without_matplotlib_says_what_to_install(monkeypatch):
    from fastar.errors import FastARError
    from fastar.commands.bench import common

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(FastARError, match="pip install matplotlib, or run the benchmark with --no-pareto"):
        common.require_matplotlib()


def test_text_to_image_from_an_official_pickle_and_a_local_t5_folder(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "comfyui"))
    import standins

    standins.write_llamagen(tmp_path)
    r = fastar("generate", "--model", standins.LLAMAGEN_T2I, "--vq", standins.LLAMAGEN_VQ_T2I,
               "--prompt", "a red apple on a wooden table", "--prompt", "a blue cube", "--t5", standins.FLAN_T5,
               "--decoder", "sjd", "--quiet", "--out", "t2i.png", "--tokens-out", "t.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(json.loads((tmp_path / "t.json").read_text())["tokens"]) == 2
    assert Image.open(tmp_path / "t2i_1.png").size == (128, 128)
    r = fastar("generate", "--model", standins.LLAMAGEN_T2I, "--class", "3", "--quiet", cwd=tmp_path)
    assert r.returncode == 2 and "--prompt" in r.stderr


def test_profile_on_a_device_this_machine_lacks_says_so(tmp_path):
    r = fastar("profile", "--shape", "tiny", "--device", "mps", cwd=tmp_path)
    assert r.returncode == 2 and "sees no Apple GPU (MPS)" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,error,nearest,help_of", [
    (["genrate"], "argument COMMAND: invalid choice: 'genrate'", "did you mean 'generate'?", "python -m fastar"),
    (["generate", "--decoder", "lanter"], "argument --decoder: invalid choice: 'lanter'", "did you mean 'lantern'?",
     "python -m fastar generate"),
    (["generate", "--compile", "always"], "argument --compile: invalid choice: 'always'", None,
     "python -m fastar generate"),
    (["generate", "--seed", "abc"], "argument --seed: invalid int value: 'abc'", None, "python -m fastar generate"),
    (["generate", "--sed", "3"], "unrecognized arguments: --sed 3", None, "python -m fastar generate"),
    (["profile", "--dtype", "bf1"], "argument --dtype: invalid choice: 'bf1'", "did you mean 'bf16'?",
     "python -m fastar profile"),
])
def test_a_mistyped_argument_is_one_error_line_and_where_help_is(tmp_path, args, error, nearest, help_of):
    r = fastar(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    said, pointer = r.stderr.splitlines()  # no usage dump before the error
    assert said.startswith(f"{help_of}: error: {error}") and pointer.startswith(f"{help_of} --help lists the ")
    assert (nearest in said) if nearest else "did you mean" not in said


def test_fastar_alone_lists_the_commands_one_line_each(tmp_path):
    from fastar.cli import build_parser

    r = fastar(cwd=tmp_path)
    assert r.returncode == 0 and not r.stderr, r.stderr
    commands = build_parser().commands
    listed = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("  ")}
    assert list(listed) == list(commands) and "generate images with one decoder" in listed["generate"]
    assert "python -m fastar COMMAND --help lists a command's options" in r.stdout


def test_help_shows_the_seed_and_class_defaults(tmp_path):
    r = fastar("generate", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # the help is wrapped to the terminal's width
    assert "the same seed, settings and device give the same image (default: 0)" in text  # 0 is no missing default
    assert "--class CLASS class index or name, repeated over --batch (default: 0, the model's first class)" in text


@needs_demo
def test_progress_on_a_terminal_redraws_one_line(tmp_path):
    pty = pytest.importorskip("pty")  # POSIX: a pseudo-terminal as stderr, as a user's shell gives it
    terminal, stderr = pty.openpty()
    run = subprocess.Popen([sys.executable, "-m", "fastar", "generate", "--class", "1", "--decoder", "ar",
                            "--tokens-out", "t.json"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr)
    os.close(stderr)
    shown = b""
    while chunk := read_terminal(terminal):
        shown += chunk
    assert run.wait(timeout=600) == 0, shown
    shown = shown.decode()
    assert "\rar, lossless [" in shown  # redrawn in place (the terminal writes its newlines as \r\n)
    assert shown.count("256/256 tokens") == 1 and shown.endswith("tok/s\r\n")  # the last drawing ends the line


def read_terminal(terminal: int) -> bytes:
    """What the program wrote to the terminal since the last read; b"" once it closed it (Linux raises EIO)."""
    try:
        return os.read(terminal, 4096)
    except OSError:
        return b""


def test_profile_memory_estimates_in_a_gpus_bf16_by_default(tmp_path):
    r = fastar("profile", "--shape", "llamagen-xl", "--memory", "--batches", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(bf16, as a GPU runs it: --dtype for another;" in r.stdout
    assert "weights 1.55 GB" in r.stdout and "total batch 1: 1.65 GB" in r.stdout  # README's table, bf16 column
    r = fastar("profile", "--shape", "llamagen-xl", "--memory", "--batches", "1", "--dtype", "fp32", cwd=tmp_path)
    assert "(fp32; weights auto): weights 3.10 GB" in r.stdout, r.stdout


def test_half_precision_on_a_cpu_without_its_instructions_is_said_to_be_emulated(monkeypatch):
    import torch

    from fastar import pipeline
    from fastar.errors import FastARError, FastARWarning

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.warns(FastARWarning, match="--dtype bf16 on this CPU is emulated .*leave --dtype out for fp32"):
        with pytest.raises(FastARError):  # the warning comes before the model is looked for
            pipeline.load_models("missing.safetensors", None, "cpu", "bf16")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # AMX: bf16 can be the faster choice
    for dtype, device in ((torch.bfloat16, "cpu"), (torch.float32, "cpu"), (torch.float16, "cuda")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipeline.warn_if_emulated(dtype, torch.device(device))


def test_bench_rows_name_trees_and_lantern_plus_plus():
    rows = bench_entries("spec-tree", "spec-top-tree", "lantern-top-tree", "lantern++")
    assert (rows["spec-tree"].spec.tree, rows["spec-tree"].spec.drafts) == ("static", "sampled")
    assert (rows["spec-top-tree"].spec.tree, rows["spec-top-tree"].spec.drafts) == ("static", "top")
    assert rows["lantern-top-tree"].drafted and rows["lantern-top-tree"].spec.decoder == "lantern"
    assert (rows["lantern++"].spec.tree, rows["lantern++"].spec.lantern_lambda) == ("static", 3.0)
    from fastar.errors import FastARError

    with pytest.raises(FastARError, match="spec-top-tree"):
        bench_entries("spec-jacobi-tree")
