"""``python -m fastar generate``: one decoder on one model, from the flags (settings.py) to the images, codes,
latents, statistics and maps it writes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import FastARError
from ..samplers.decoders import DRAFTED_BY_DEFAULT, LOSSLESS, check_decoder
from ..samplers.few_step_loops.distilled import DDSettings
from ..samplers.few_step_loops.next_scale import VAR_SAMPLING
from ..speed_dial import check_auto, choose, window_note
from ..settings import (SAMPLING_DEFAULTS, acceleration_from, check_arguments, cspd_from, masked_settings_from,
                        sampling_from, spec_from, top_k_of, top_p_of)


def drafter_choice(args, decoder: str) -> str | None:
    """The drafter path for ``decoder``: --drafter, or a bundled model's bundled drafter for a decoder that drafts
    with one by default (spec, lantern, cspd) or for the speed dial to weigh; None (Jacobi drafts, or none) otherwise."""
    from ..model_loaders.shared.demo import DEMO_AR, demo_drafter

    if args.drafter:
        return None if args.drafter == "none" else args.drafter
    wanted = decoder in DRAFTED_BY_DEFAULT or decoder in (None, "auto")  # the dial weighs what is connected
    bundled = wanted and demo_drafter(args.model or DEMO_AR) is not None
    return "demo" if bundled else None


class ProgressLine:
    """Progress on stderr. ``done`` counts the tokens of the slowest row; the rate is of the whole batch. A
    terminal gets one line, redrawn at most ten times a second; a log (stderr redirected) a plain line per tenth
    of the work and the last one, since carriage returns pile every redraw into one line of a file."""

    def __init__(self, label: str, enabled: bool, batch: int = 1):
        self.label, self.enabled, self.batch = label, enabled, batch
        self.redraw = sys.stderr.isatty()
        self.start, self.last, self.tenths = time.perf_counter(), 0.0, 0

    def __call__(self, done: int, total: int, _tokens) -> None:
        now = time.perf_counter()
        if not self.enabled or not self.due(now, done, total):
            return
        self.last, self.tenths = now, 10 * done // total
        rate = self.batch * done / max(now - self.start, 1e-9)
        bar = "#" * int(30 * done / total)
        rows = f" ({self.batch} images)" if self.batch > 1 else ""
        line = f"{self.label} [{bar:<30}] {done}/{total} tokens{rows}  {rate:.0f} tok/s"
        if self.redraw:
            print(f"\r{line}", end="\n" if done >= total else "", file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def due(self, now: float, done: int, total: int) -> bool:
        """A terminal's redraw at most ten times a second and at the end; a log's line once per tenth of the work."""
        if self.redraw:
            return now - self.last >= 0.1 or done >= total
        return 10 * done // total > self.tenths


def numbered_paths(path: Path, count: int) -> list[Path]:
    """Where ``count`` files of one output go: ``path`` itself for one, PATH_0, PATH_1, ... for more."""
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{index}{path.suffix}") for index in range(count)]


def say_written(paths: list[Path], what: str) -> None:
    """One line naming the files an output wrote (the first and the last of several), so they can be found."""
    names = str(paths[0]) if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
    print(f"wrote {names} ({what})")


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


OUTPUTS = ("out", "tokens_out", "latents_out", "stats_out", "map_out", "noise_out")
DEFAULT_OUT = Path("out")  # generate's images when no output is given: out/MODEL_DECODER_seedS.png


def make_output_folders(args) -> None:
    """Every output's folder, before the models load: a missing one is made, and one that cannot be (a file in the
    way, no permission) is said now, not after the generation."""
    for name in OUTPUTS:
        path = getattr(args, name, None)
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise FastARError(f"--{name.replace('_', '-')} {path}: its folder cannot be made ({error.strerror})")


def command_generate(args) -> int:
    from ..pipeline import conditioning_for, load_models

    check_auto(args.decoder, args.speed)
    check_arguments(args)
    make_output_folders(args)
    models = load_models(args.model, args.vq, args.device, args.dtype, drafter_path=drafter_choice(args, args.decoder),
                         image_size=args.image_size, compile_switch=args.compile, gpu_weights=args.gpu_weights,
                         weights=args.weights, aspect_ratio=args.aspect_ratio)
    if acceleration_from(args) and models.ar.kind != "next-scale":
        raise FastARError(f"--fastvar, --skip-scales and --uncond-scales act on a VAR model's scales; "
                          f"{args.model or 'the demo model'} is {models.ar.what}: leave them out")
    if args.reuse and models.ar.kind != "masked-ar":
        raise FastARError(f"--reuse reuses a MAR model's features between its steps; {args.model or 'the demo model'} "
                          f"is {models.ar.what}: leave --reuse out")
    classes = args.classes.split(",") if args.classes else [args.class_] if args.class_ else None
    conditioning = conditioning_for(models.ar, classes=classes, batch=args.batch, prompts=args.prompt,
                                    t5_folder=args.t5, negative_prompts=args.negative_prompt)
    if args.reuse and args.decoder in (None, "auto"):  # --reuse is a pick: MAR's sampler with feature reuse
        args.decoder = "ar"
    choice = dial(args, models) if args.decoder in (None, "auto") else None
    if not any(getattr(args, name, None) for name in OUTPUTS):  # said where when written
        args.out = str(DEFAULT_OUT / f"{Path(args.model or 'demo').stem}_{args.decoder}_seed{args.seed}.png")
    kept = kept_output(args, models)
    if kept:  # said now, not after a long generation
        print(f"note: no images from this run: {missing_decoder(args, models)}. The model's output goes to {kept}",
              file=sys.stderr)
    lossless = LOSSLESS[args.decoder] and not (getattr(args, "reuse", False) or acceleration_from(args)) and (
        choice is None or
        choice.candidate.lossless)
    kind = "lossless" if lossless else "relaxed: trades fidelity for speed"
    progress = ProgressLine(f"{args.decoder}, {kind}", enabled=not args.quiet, batch=conditioning.batch)
    token_maps = None
    if models.ar.kind == "masked-ar":
        outputs, stats = generate_masked(args, models, conditioning, progress, choice)
    elif models.ar.kind == "few-step":
        outputs, stats = generate_distilled(args, models, conditioning, progress, choice)
    elif models.ar.kind == "next-scale":
        outputs, stats, token_maps = generate_next_scale(args, models, conditioning, progress)
    else:
        outputs, stats = generate_tokens(args, models, conditioning, progress, choice)
    if choice is not None:
        stats.settings["dial"] = choice.summary()
    write_outputs(args, models, outputs, stats, token_maps)
    return 0


def dial(args, models):
    """--decoder auto: the speed dial's pick for this model, drafter and device (speed_dial.py), said in one line;
    a drafter it does not use is let go. Steps given (--num-iter) are kept."""
    choice = choose(models.ar, args.speed or "balanced", models.drafter, codebook=models.vq is not None,
                    keep_steps=args.num_iter is not None)
    args.decoder = choice.decoder
    if not choice.candidate.drafter:
        models.drafter = None
    print(f"speed dial, {choice.speed}: {choice.why}")
    return choice


def generate_tokens(args, models, conditioning, progress, choice=None):
    from ..pipeline import check_token_room
    from ..samplers.decoders import decode

    spec = choice.spec() if choice else spec_from(args, args.decoder)
    sampling = sampling_from(args, models.ar)
    check_token_room(models.ar, conditioning, sampling, spec, drafted=models.drafter is not None)
    codes, stats = decode(models.ar, conditioning, sampling, spec, seed=args.seed, on_iteration=progress,
                          drafter=models.drafter, codebook=models.codebook())
    print(summary_line(stats))
    note = None if choice else window_note(models.ar, spec, stats, conditioning)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return codes, stats


def summary_line(stats) -> str:
    """What a run did, in one line: its forwards against the plain sampler's (steps, not a speed-up), its drafts
    and drafter, its time (docs/statistics.md defines each number)."""
    line = f"{stats.decoder}: {stats.steps_summary()}"
    if stats.acceptance_rate is not None:
        line += f"; {stats.accepted_tokens} of {stats.drafted_tokens} drafts kept ({stats.acceptance_rate:.1%})"
    if stats.drafter_forwards:
        line += f"; {stats.drafter_forwards} drafter forwards ({stats.drafter_time_s:.2f} s)"
    if stats.resample_tries:
        line += f", {stats.resample_tries} residual proposals ({stats.resample_fallbacks} fell back)"
    if stats.reuse_note:
        line += f"; {stats.reuse_note}"
    return f"{line}; {seconds(stats)}"


def seconds(stats) -> str:
    """A run's wall time, and how much of it compiled steps."""
    return f"{stats.wall_time_s:.2f} s" + (f" ({stats.compile_time_s:.1f} s of it compiling steps)"
                                          if stats.compile_time_s else "")


def generate_masked(args, models, conditioning, progress, choice=None):
    from ..samplers.decoders import decode_masked

    if args.tokens_out:
        raise FastARError("--tokens-out is for token models; a MAR model writes continuous latents: use --latents-out")
    settings = masked_settings_from(args, models.ar)
    tokens, stats = decode_masked(models.ar, conditioning, choice.masked(settings) if choice else settings,
                                  args.decoder, seed=args.seed,
                                  cspd=cspd_from(args, args.decoder), drafter=models.drafter, on_iteration=progress)
    print(summary_line(stats))
    return tokens, stats


def generate_next_scale(args, models, conditioning, progress):
    from ..samplers.decoders import decode_next_scale
    from ..samplers.few_step_loops.next_scale import constant_guidance

    check_decoder(args.decoder, models.ar, None)
    sampling = sampling_from(args, models.ar, VAR_SAMPLING)
    token_maps = []
    f_hat, stats = decode_next_scale(models.ar, conditioning, sampling, seed=args.seed, vqvae=models.vq,
                                     decoder=args.decoder, on_iteration=progress, flow_steps=args.flow_steps,
                                     scale_codes=token_maps, acceleration=acceleration_from(args))
    guidance = "at every scale" if constant_guidance(models.ar) else "ramped over the scales"
    print(f"{summary_line(stats)} (cfg {sampling.cfg_scale} {guidance}, temperature {sampling.temperature:g}, "
          f"top-k {sampling.top_k}, top-p {sampling.top_p})")
    return f_hat, stats, token_maps


def generate_distilled(args, models, conditioning, progress, choice=None):
    import numpy as np
    import torch

    from ..samplers.decoders import decode_distilled, make_generator
    from ..samplers.few_step_loops.flow_map import token_noise

    if (args.teacher is None) != (args.dd_regenerate is None):
        raise FastARError("the DD hybrid needs both --teacher (the student's teacher) and --dd-regenerate S")
    tuned = (args.cfg not in (None, 1.0) or args.temperature not in (None, SAMPLING_DEFAULTS.temperature)
             or top_k_of(args) or top_p_of(args) < 1)
    if tuned and args.teacher is None:
        raise FastARError("a Distilled Decoding student maps noise to an image deterministically: --cfg, "
                          "--temperature, --top-k and --top-p do not apply (its teacher's settings are baked in); "
                          "vary the image with --seed or --noise-in")
    student = models.ar
    teacher = None
    if args.teacher:
        from ..model_loaders import load_ar_model

        teacher = load_ar_model(args.teacher, device=student.device, dtype=student.dtype)
    if args.noise_in:
        try:
            noise = torch.from_numpy(np.load(args.noise_in)).float()
        except (OSError, ValueError) as e:
            raise FastARError(f"{args.noise_in} is not a .npy array ({e}): give a file --noise-out wrote") from e
    else:
        noise = token_noise(conditioning.batch, student.num_tokens, student.cfg.channels,
                            make_generator(args.seed, student.device))
    if args.noise_out:
        np.save(args.noise_out, noise.cpu().numpy())
        say_written([Path(args.noise_out)], f"the noise {list(noise.shape)}")
    steps = args.dd_steps or (choice.dd_steps if choice else DDSettings.steps)  # given steps win over the dial's
    settings = DDSettings(steps=steps, t2=args.dd_t2, split=args.dd_split, regenerate=args.dd_regenerate)
    latents, stats = decode_distilled(student, conditioning, settings, seed=args.seed, codebook=models.codebook(),
                                      noise=noise, on_iteration=progress, teacher=teacher, sampling=sampling_from(args))
    teacher_part = stats.settings["teacher_forwards"]
    print(summary_line(stats) + (f" ({teacher_part} of the forwards by the teacher)" if teacher_part else ""))
    return latents, stats


def kept_output(args, models) -> str | None:
    """Where the model's output goes when images were asked for (--out) but cannot be made (no image decoder) and
    no other output keeps it: beside --out. None when there is nothing to keep."""
    if not args.out or models.vq is not None or args.tokens_out or args.latents_out:
        return None
    suffix = ".latents.npy" if models.ar.kind in ("masked-ar", "next-scale") else ".tokens.json"
    return str(Path(args.out).with_suffix(suffix))


def missing_decoder(args, models) -> str:
    if getattr(models.ar, "holds_image_decoder", False):
        return f"{args.model} holds its own image decoder: give the same folder as --vq"
    return "give the model's image decoder with --vq"


def write_outputs(args, models, outputs, stats, token_maps=None) -> None:
    from PIL import Image

    from ..pipeline import outputs_to_images
    from ..samplers.stats import acceptance_heatmap

    grid = models.ar.grid
    tokens_out, latents_out = args.tokens_out, args.latents_out
    kept = kept_output(args, models)
    if kept:
        Path(kept).parent.mkdir(parents=True, exist_ok=True)
        latents_out, tokens_out = (kept, None) if kept.endswith(".npy") else (None, kept)
    if tokens_out:
        Path(tokens_out).write_text(json.dumps(tokens_json(models, outputs, token_maps)))
        say_written([Path(tokens_out)], f"the image codes of {counted(len(outputs), 'image')}, JSON")
    if latents_out:
        import numpy as np

        latents = latents_of(models, outputs).float().cpu().numpy()
        np.save(latents_out, latents)
        say_written([Path(latents_out)], f"latents {list(latents.shape)}, float32")
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(stats.to_json(), indent=1))
        say_written([Path(args.stats_out)], "the decode statistics, JSON")
    if args.map_out:
        maps = numbered_paths(Path(args.map_out), stats.batch)
        for row, path in zip(stats.fixed_at, maps):
            Image.fromarray(acceptance_heatmap(row, grid)).save(path)
        say_written(maps, counted(len(maps), "acceptance map"))
    if args.out:
        if models.vq is None:
            print(f"no images written ({missing_decoder(args, models)}); the model's output is in "
                  f"{tokens_out or latents_out}", file=sys.stderr)
        else:
            save_images(outputs_to_images(models.vq, models.ar, outputs), Path(args.out))


def tokens_json(models, outputs, token_maps=None) -> dict:
    """What --tokens-out writes. Raster models: ``{"tokens": [image][h*w], "grid": [h, w]}``. VAR and VAR-DD: every
    scale's token map, ``{"scales": [[pn, pn], ...], "tokens": [image][scale][pn*pn], "grid": [h, w]}`` (VAR: the
    codes it drew, ``token_maps`` [B, pn, pn] per scale; a VAR-DD student: the nearest code of each vector, its
    greedy codes before the split)."""
    grid = list(models.ar.grid)
    if getattr(models.ar, "decoder_kind", "codes") == "multi-scale-bits":
        return bit_labels_json(models.ar, token_maps)
    if getattr(models.ar, "decoder_kind", "codes") != "multi-scale":
        return {"tokens": codes_of(models, outputs).tolist(), "grid": grid}
    patch_nums = models.ar.cfg.patch_nums
    if token_maps is None:
        token_maps = codes_of(models, outputs).split([p * p for p in patch_nums], dim=1)
    tokens = [[m[row].flatten().tolist() for m in token_maps] for row in range(outputs.shape[0])]
    return {"scales": [[p, p] for p in patch_nums[: len(token_maps)]], "tokens": tokens, "grid": grid}  # skipped: fewer


def bit_labels_json(model, token_maps) -> dict:
    """Infinity: every scale's bits at the VAE's grid as the release's integer labels (bit 0 the most significant),
    ``{"scales": [[h, w], ...], "tokens": [image][scale][h*w], "grid": [h, w], "bits": d}``."""
    from ..model_loaders.infinity.labels import labels_of

    maps = [labels_of(model.to_vae_grid(bits)) for bits in token_maps]
    shapes = [list(s) for s in model.vae_shapes()]  # skipped scales (FastVAR, SkipVAR): fewer than the grid's
    return {"scales": shapes[: len(maps)], "grid": shapes[-1], "bits": model.vae_bits,
            "tokens": [[m[row].flatten().tolist() for m in maps] for row in range(maps[0].shape[0])]}


def codes_of(models, outputs):
    """Image codes ``[B, h*w]``: a token model's own, or the nearest code of each of a DD student's vectors."""
    if models.ar.kind != "few-step":
        return outputs
    from ..samplers.few_step_loops.flow_map import nearest_code

    return nearest_code(outputs.flatten(0, 1), models.codebook().to(outputs.device)).view(outputs.shape[:2])


def latents_of(models, outputs):
    """The image decoder's input as latents ``[B, C, h, w]``; a token model's codes as their code vectors."""
    if getattr(models.ar, "decoder_kind", "codes") == "multi-scale" and outputs.dim() == 3:
        if models.vq is None:
            raise FastARError("--latents-out of a VAR-DD student writes f_hat, which its VQVAE accumulates: give --vq")
        return models.vq.sequence_to_f_hat(outputs.to(models.vq.device).float())  # a VAR-DD student's scales
    if models.ar.kind != "token-ar":
        return models.ar.decoder_input(outputs)
    if models.vq is None:
        raise FastARError("--latents-out of a token model writes its code vectors: give the VQ decoder (--vq)")
    codes = models.ar.decoder_input(outputs).to(models.vq.device)  # [B, h, w]
    return models.codebook()[codes].permute(0, 3, 1, 2)  # every VQ decoder's codebook (LlamaGen's, a VQGAN's)


def save_images(images, out: Path) -> None:
    from PIL import Image

    out.parent.mkdir(parents=True, exist_ok=True)
    paths = numbered_paths(out, len(images))
    for image, path in zip(images, paths):
        Image.fromarray(image).save(path)
    say_written(paths, counted(len(paths), "image"))
