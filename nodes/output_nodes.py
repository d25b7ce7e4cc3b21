"""From sampler outputs and statistics to what artists look at: Decode Image, Acceptance Map, Stats."""
from __future__ import annotations

import numpy as np
from comfy_api.latest import io

from ..errors import FastARError
from ..memory import DECODE_CHUNK, decode_bytes_per_image
from ..pipeline import decode_images
from ..samplers.decoders import LOSSLESS, NEXT_SCALE
from ..samplers.stats import DecodeStats, acceptance_heatmap
from . import comfy_glue as glue
from .loader_nodes import FastARVQ
from .sampler_nodes import FastARStats, FastARTokens
from .values import Latents, ModelHandle, Tokens


class VQDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARVQDecode",
            display_name="FastAR Decode Image (VQ / KL)",
            category="FastAR/image",
            description="Turns a sampler's output into pixels with the image decoder the model was trained with: "
                        "image codes through a VQ decoder (LlamaGen), MAR latents through a KL autoencoder.",
            inputs=[
                FastARVQ.Input("vq", tooltip="The image decoder (FastAR Load Image Decoder) matching the model: its "
                                             "VQ tokenizer, or for MAR its KL autoencoder."),
                FastARTokens.Input("tokens", tooltip="Image codes or MAR latents from a FastAR sampler."),
            ],
            outputs=[io.Image.Output("image", display_name="image",
                                     tooltip="The decoded images (one per batch row).")],
        )

    @classmethod
    def execute(cls, vq: ModelHandle, tokens: Tokens | Latents) -> io.NodeOutput:
        decoder = vq.module
        inputs = decoder_inputs(decoder, vq.name, tokens)
        at_once = min(len(inputs), DECODE_CHUNK)  # decode_images fits its chunks to the room there is
        glue.load_for_inference([vq.patcher], at_once * decode_bytes_per_image(decoder, tuple(inputs.shape[-2:])))
        images = decode_images(decoder, inputs)
        glue.free_cache()
        return io.NodeOutput(glue.to_image_tensor(images))


def decoder_inputs(decoder, name: str, output: Tokens | Latents):
    """What ``decoder`` reads from a sampler's output (codes ``[B, h, w]`` or latents), or a FastARError
    that says which decoder to pick."""
    if isinstance(output, Latents) and output.source == "dd":
        if decoder.input_kind != "codes" or decoder.cfg.embed_dim != output.latents.shape[1]:
            raise FastARError(f"these are a Distilled Decoding student's {output.latents.shape[1]}-wide code vectors, "
                              f"but {name} is {decoder.what} of {decoder.cfg.embed_dim}-wide ones: pick the VQ "
                              "decoder of the student's teacher (vq_ds16_c2i.pt for the released LlamaGen-DD)")
        return output.latents
    if isinstance(output, Latents) and output.source == "infinity":
        if decoder.input_kind != "multi-scale-bits" or decoder.cfg.codebook_dim != output.latents.shape[1]:
            raise FastARError(f"these are an Infinity model's f_hat latents ({output.latents.shape[1]} bits per cell), "
                              f"but {name} is {decoder.what}: pick the BSQ VAE the model was trained with "
                              "(infinity_vae_d32reg.pth for Infinity-2B, infinity_vae_d56_f8_14_patchify.pth for the 8B)")
        return output.latents
    if isinstance(output, Latents) and output.source == "var":
        if decoder.input_kind != "multi-scale" or decoder.cfg.z_channels != output.latents.shape[1]:
            raise FastARError(f"these are a VAR model's f_hat latents ({output.latents.shape[1]} channels), but {name} "
                              f"is {decoder.what}: pick the multi-scale VQVAE the VAR model was trained with "
                              "(vae_ch160v4096z32.pth for the release)")
        return output.latents
    if isinstance(output, Latents):
        if decoder.input_kind != "latents":
            raise FastARError(f"these are a MAR model's latents, but {name} is {decoder.what}: pick the KL autoencoder "
                              "the MAR model was trained with (kl16.ckpt for the official MAR models)")
        if decoder.cfg.embed_dim != output.latents.shape[1]:
            raise FastARError(f"the KL autoencoder {name} has {decoder.cfg.embed_dim} latent channels but the latents "
                              f"have {output.latents.shape[1]}: pick the autoencoder the MAR model was trained with")
        return output.latents
    if decoder.input_kind != "codes":
        raise FastARError(f"these are image codes of a token model, but {name} is {decoder.what}: pick the VQ "
                          "decoder the model was trained with")
    if decoder.cfg.codebook_size != output.vocab_size:
        raise FastARError(f"the VQ decoder {name} has {decoder.cfg.codebook_size} codes but the tokens come from "
                          f"a model with {output.vocab_size}: pick the VQ the AR model was trained with")
    return output.codes.view(-1, *output.grid)


class AcceptanceMap(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARAcceptanceMap",
            display_name="FastAR Acceptance Map",
            category="FastAR/stats",
            description="A heatmap of the decoding iteration at which each token was fixed (dark blue = early, "
                        "yellow = late). Large same-colour runs show where many tokens were accepted in one forward.",
            inputs=[
                FastARStats.Input("stats", tooltip="Statistics from a FastAR sampler."),
                io.Int.Input("scale", default=16, min=1, max=64,
                             tooltip="Pixels per token in the heatmap (16 matches a VQ-16 image)."),
            ],
            outputs=[io.Image.Output("image", display_name="image",
                                     tooltip="One heatmap per batch row.")],
        )

    @classmethod
    def execute(cls, stats: DecodeStats, scale) -> io.NodeOutput:
        maps = np.stack([acceptance_heatmap(row, tuple(stats.grid), scale=scale) for row in stats.fixed_at])
        return io.NodeOutput(glue.to_image_tensor(maps))


def drafted_shape(settings: dict) -> str:
    """What a drafter drafted per forward, as the Stats node says it."""
    if "gamma" in settings:
        return f", gamma {settings['gamma']}"
    if settings.get("tree") == "dynamic":
        return (f", dynamic tree of {settings['tree_nodes']} drafts (depth {settings['tree_depth']}, top-k "
                f"{settings['tree_topk']})")
    return f", tree {settings['tree']}" if "tree" in settings else ""


def baseline_name(stats: DecodeStats) -> str:
    """The sampler a speed-up is measured against: VAR's own for VAR and its students, plain AR otherwise."""
    var = stats.settings.get("model_kind") == NEXT_SCALE or stats.settings.get("teacher_sampler", [""])[0] == "VAR"
    return "VAR" if var else "AR"


def heading(stats: DecodeStats) -> str:
    if stats.settings.get("model_kind") == NEXT_SCALE and "patch_nums" not in stats.settings:  # Infinity's (h, w)
        shapes = stats.settings["scales"]
        return (f"next-scale ({'flow map, ' if stats.decoder == 'fm' else ''}one forward per scale: {len(shapes)} "
                f"scales of {', '.join(f'{h}x{w}' for h, w in shapes)})")
    if stats.settings.get("model_kind") == NEXT_SCALE:
        scales = stats.settings["patch_nums"]
        return f"VAR ({'flow map, ' if stats.decoder == 'fm' else ''}one forward per scale: {len(scales)} scales of " \
               f"{', '.join(f'{p}x{p}' for p in scales)})"
    kind = "lossless" if LOSSLESS.get(stats.decoder, False) else "relaxed: trades fidelity for speed"
    return f"{stats.decoder.upper()} ({kind})"


def summary(stats: DecodeStats, baseline: DecodeStats | None = None) -> str:
    """The text shown on the Stats node (the fields as docs/statistics.md defines them)."""
    tokens = stats.tokens * stats.batch
    lines = [
        heading(stats),
        stats.steps_summary(),
        f"step compression: {stats.step_compression:.2f} tokens per forward",
        f"wall time: {stats.wall_time_s:.2f} s, {tokens / max(stats.decode_time_s, 1e-9):.0f} tokens/s",
    ]
    if "weights" in stats.settings:
        lines[0] += f", {stats.settings['weights']} weights"
    if stats.compile_time_s > 0:  # the first run of a shape with compiled steps: said, and left out of the speeds
        lines[-1] += f" (compiling steps: {stats.compile_time_s:.1f} s, once per shape; not in the speeds)"
    if stats.decoder == "dd":
        dd = stats.settings
        lines.insert(3, f"DD steps: {dd['steps']} (t2 {dd['t2']}, split {dd['split']})" if dd["regenerate"] is None else
                     f"DD steps: 2 + {dd['teacher_forwards']} teacher forwards (the teacher resampled tokens "
                     f"{dd['regenerate']}..{dd['t2'] - 1})")
    if stats.reuse_note:
        lines.append(stats.reuse_note)
    if stats.drafter_forwards:
        drafter = stats.settings.get("drafter_file") or stats.settings.get("drafter", "drafter")
        lines.append(f"drafter {drafter}: {stats.drafter_forwards} forwards, {stats.drafter_time_s:.2f} s"
                     + drafted_shape(stats.settings))
    if stats.acceptance_rate is not None:
        lines.append(f"drafts: {stats.accepted_tokens} of {stats.drafted_tokens} judged were kept "
                     f"({stats.acceptance_rate:.1%})")
    if stats.resample_tries:
        lines.append(f"{stats.resample_tries} residual redraws, {stats.resample_fallbacks} plain model samples after "
                     f"{stats.settings.get('max_tries')} refused redraws")
    if baseline is not None and baseline.decode_time_s > 0 and stats.decode_time_s > 0:
        per_token = baseline.decode_time_s / (baseline.tokens * baseline.batch)
        lines.append(f"speed-up vs {baseline_name(stats)} (measured): {per_token * tokens / stats.decode_time_s:.2f}x")
    else:
        unpriced = ", and the drafter's forwards are not in the steps" if stats.drafter_forwards else ""
        lines.append(f"speed-up vs {baseline_name(stats)}: not measured (fewer steps is not the same: a step's cost "
                     f"depends on the decoder and the device{unpriced}; connect a plain run as ar_baseline to measure)")
    dial = stats.settings.get("dial")
    if dial:
        lines.insert(1, f"speed dial, {dial['speed']}: {dial['why']}")
    conditioning = stats.settings.get("conditioning")
    if conditioning:
        lines.append(f"{conditioning}, seed {stats.settings.get('seed')}")
    lines += [f"WARNING: {warning}" for warning in stats.warnings]
    return "\n".join(lines)


class Stats(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARStats",
            display_name="FastAR Stats",
            category="FastAR/stats",
            description="Shows how fast a decode was: model forwards, step compression (tokens per forward), "
                        "tokens/s, drafter forwards and time (when a drafter was used) and the speed-up over plain "
                        "AR sampling.",
            inputs=[
                FastARStats.Input("stats", tooltip="Statistics from a FastAR sampler."),
                FastARStats.Input("ar_baseline", optional=True,
                                  tooltip="Optional: stats of a FastAR Sampler (AR baseline) run, for a measured "
                                          "speed-up; without it the speed-up is estimated from the forward counts."),
            ],
            outputs=[io.String.Output("text", display_name="text",
                                      tooltip="The summary as text."),
                     io.String.Output("json", display_name="json",
                                      tooltip="All statistics as JSON (as the CLI's --stats-out).")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, stats: DecodeStats, ar_baseline: DecodeStats | None = None) -> io.NodeOutput:
        import json

        text = summary(stats, ar_baseline)
        data = stats.to_json()
        return io.NodeOutput(text, json.dumps(data), ui={"text": [text], "fastar_stats": [data]})
