"""From tokens and statistics to what artists look at: VQ Decode, Acceptance Map, Stats."""
from __future__ import annotations

import numpy as np
from comfy_api.latest import io

from ..errors import FastARError
from ..pipeline import decode_images
from ..samplers.decoders import LOSSLESS
from ..samplers.stats import DecodeStats, acceptance_heatmap
from . import comfy_glue as glue
from .loader_nodes import FastARVQ
from .sampler_nodes import FastARStats, FastARTokens
from .values import ModelHandle, Tokens


class VQDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARVQDecode",
            display_name="FastAR VQ Decode",
            category="FastAR/image",
            description="Turns image tokens into pixels with the VQ decoder the AR model was trained with.",
            inputs=[
                FastARVQ.Input("vq", tooltip="The VQ decoder (FastAR Load VQ Decoder) matching the AR model."),
                FastARTokens.Input("tokens", tooltip="Image tokens from a FastAR sampler."),
            ],
            outputs=[io.Image.Output("image", display_name="image",
                                     tooltip="The decoded images (one per batch row).")],
        )

    @classmethod
    def execute(cls, vq: ModelHandle, tokens: Tokens) -> io.NodeOutput:
        model = vq.module
        if model.cfg.codebook_size != tokens.vocab_size:
            raise FastARError(f"the VQ decoder {vq.name} has {model.cfg.codebook_size} codes but the tokens come from "
                              f"a model with {tokens.vocab_size}: pick the VQ the AR model was trained with")
        h, w = tokens.grid
        side = model.cfg.downsample
        pixels = tokens.codes.shape[0] * h * w * side * side
        glue.load_for_inference([vq.patcher], memory_required=pixels * model.cfg.ch * 4 * 8)
        images = decode_images(model, tokens.codes.view(-1, h, w))
        glue.free_cache()
        return io.NodeOutput(glue.to_image_tensor(images))


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


def summary(stats: DecodeStats, baseline: DecodeStats | None = None) -> str:
    """The text shown on the Stats node."""
    tokens = stats.num_tokens * stats.batch
    ar_forwards = stats.num_tokens - 1  # plain AR: one forward per token after the first
    kind = "lossless" if LOSSLESS.get(stats.decoder, False) else "relaxed: trades fidelity for speed"
    lines = [
        f"{stats.decoder.upper()} ({kind})",
        f"tokens: {stats.batch} x {stats.num_tokens} ({stats.grid[0]}x{stats.grid[1]})",
        f"model forwards: {stats.target_forwards} (AR needs {ar_forwards})",
        f"step compression: {stats.step_compression:.2f} tokens/forward",
        f"mean accepted per iteration: {stats.mean_accepted:.2f}",
        f"wall time: {stats.wall_time_s:.2f} s, {tokens / max(stats.wall_time_s, 1e-9):.0f} tokens/s",
    ]
    if stats.drafter_forwards:
        drafter = stats.settings.get("drafter_file") or stats.settings.get("drafter", "drafter")
        lines.append(f"drafter {drafter}: {stats.drafter_forwards} forwards, {stats.drafter_time_s:.2f} s"
                     + (f", gamma {stats.settings['gamma']}" if "gamma" in stats.settings else ""))
    if baseline is not None and baseline.wall_time_s > 0 and stats.wall_time_s > 0:
        per_token = baseline.wall_time_s / (baseline.num_tokens * baseline.batch)
        lines.append(f"speed-up vs AR (measured): {per_token * tokens / stats.wall_time_s:.2f}x")
    else:
        unpriced = ", drafter not counted" if stats.drafter_forwards else ""  # only a measured baseline prices it
        lines.append(f"speed-up vs AR (estimate, forwards{unpriced}): "
                     f"{ar_forwards / max(stats.target_forwards, 1):.2f}x")
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
