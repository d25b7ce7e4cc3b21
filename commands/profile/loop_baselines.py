"""The usual loops FastAR's ``ar`` is timed against (``python -m fastar profile --baselines``), each on the very
weights of the model being profiled, so that one run puts them side by side:

- ``plain-loop`` (LlamaGen class-to-image shapes): LlamaGen's loop semantics without a static cache or graphs —
  one token per forward, cond and uncond rows in one batch, each layer's keys and values grown by
  concatenation, ``torch.multinomial`` per step.
- ``transformers-generate`` (Janus shapes): transformers' ``JanusForConditionalGeneration.generate`` in image
  mode, its weights taken from the profiled model (its own loop, static cache, CFG logits processor).

Both draw the same tokens as FastAR's ``ar`` when decoding is greedy (tests/test_loop_baselines.py), so the
times compare the same work.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from ...errors import FastARError
from ...model_loaders.janus.model import JanusGPT
from ...model_loaders.llamagen.model import LlamaGenGPT, rope_2d_table
from ...model_loaders.shared.joined import parted_state_dict
from ...model_loaders.shared.protocol import ModelOutput
from ...samplers.processing import SamplingSettings, probabilities

# an image loop: (conditioning, sampling, generator) -> codes [B, N]
ImageLoop = Callable[..., torch.Tensor]


class GrowingCache:
    """A layer's keys and values, concatenated step by step (the cache of a loop without preallocation)."""

    def __init__(self):
        self.k = self.v = None

    def write(self, k, v, slots, keys=None):  # every key so far, whatever ``keys`` asks
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@torch.no_grad()
def plain_loop(model: LlamaGenGPT, conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
    """Codes ``[B, N]`` of a class-to-image LlamaGen, one token per forward with a growing cache."""
    cfg = sampling.use_cfg
    h, _ = model.embed_conditioning(conditioning, cfg)
    rows, cond_len = h.shape[:2]
    table = rope_2d_table(model.grid, model.cfg.head_dim, cond_len, 0, model.cfg.rope_base).to(model.device)
    caches = [GrowingCache() for _ in model.layers]
    hidden = model.run_layers(h, table[None, :cond_len].expand(rows, -1, -1, -1), None, caches)
    codes = []
    for i in range(model.cfg.num_tokens):
        logits = model.output(hidden[:, -1:]).float()
        out = ModelOutput(logits[: len(logits) // 2], logits[len(logits) // 2:]) if cfg else ModelOutput(logits)
        token = torch.multinomial(probabilities(out, sampling)[:, 0], 1, generator=generator)
        codes.append(token)
        fed = torch.cat([token, token]) if cfg else token
        hidden = model.run_layers(model.tok_embeddings(fed), table[cond_len + i].expand(rows, 1, -1, -1), None, caches)
    return torch.cat(codes, dim=1)


# FastAR's internal Janus names -> transformers' (the inverse of the loader's renaming of a converted folder)
TO_TRANSFORMERS = ((r"^language_model\.", "model.language_model."), (r"^gen_embed\.", "model.generation_embeddings."),
                   (r"^gen_aligner\.", "model.generation_aligner."), (r"^gen_head\.", "model.generation_head."))


def transformers_janus(model: JanusGPT):
    """transformers' JanusForConditionalGeneration holding ``model``'s weights (shared, not copied). The parts
    image generation never runs (the understanding encoder, the VQ decoder) are kept tiny."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    cfg, llm = model.cfg, model.cfg.decoder
    if cfg.head_width != llm.hidden_size:
        raise FastARError("transformers' Janus ties the generation head's width to the LLM's; this shape does not")
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
                         intermediate_size=llm.ffn_hidden, num_hidden_layers=llm.n_layer,
                         num_attention_heads=llm.n_head, num_key_value_heads=llm.n_kv_head, rms_norm_eps=llm.rms_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta},
                         pad_token_id=cfg.pad, bos_token_id=cfg.bos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16, num_image_tokens=cfg.grid[0] * cfg.grid[1],
                           projection_dim=llm.hidden_size),
        vq_config=dict(embed_dim=cfg.code_width, num_embeddings=cfg.codes, latent_channels=32, base_channels=32,
                       channel_multiplier=[1], num_res_blocks=1, projection_dim=llm.hidden_size,
                       image_token_embed_dim=llm.hidden_size, num_hidden_layers=cfg.aligner_layers))
    with torch.device(model.device):  # randomly initialised, then given the profiled model's tensors
        reference = JanusForConditionalGeneration._from_config(config, dtype=model.dtype)
    weights = {}
    for name, tensor in parted_state_dict(model).items():  # q, k, v apart: views of the joined weights, not copies
        for pattern, new in TO_TRANSFORMERS:
            name = re.sub(pattern, new, name)
        weights[name] = tensor
    unexpected = reference.load_state_dict(weights, strict=False, assign=True).unexpected_keys
    assert not unexpected, unexpected
    return reference.eval()


def transformers_loop(model: JanusGPT) -> ImageLoop:
    from transformers import GenerationConfig

    reference = transformers_janus(model)

    @torch.no_grad()
    def loop(conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
        if sampling.top_k or sampling.top_p < 1.0 or not sampling.use_cfg:
            raise FastARError("the transformers baseline runs Janus's own setting: CFG on, no top-k or top-p")
        prompts = model.prompts.encode(conditioning)
        ids = torch.tensor(prompts, device=model.device)
        config = GenerationConfig(do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
                                  guidance_scale=sampling.cfg_scale, bos_token_id=model.cfg.bos,
                                  pad_token_id=model.cfg.pad, generation_kwargs={"boi_token_id": model.cfg.boi},
                                  max_new_tokens=model.grid[0] * model.grid[1])
        torch.manual_seed(generator.initial_seed())  # transformers samples from the global generator
        return reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  generation_mode="image")

    return loop


def baseline_for(model) -> tuple[str, ImageLoop] | None:
    """The usual loop for ``model``'s family, on its weights; None where FastAR has none to compare with."""
    if isinstance(model, LlamaGenGPT) and model.cfg.model_type == "c2i":
        return "plain-loop", lambda conditioning, sampling, generator: plain_loop(model, conditioning, sampling,
                                                                                 generator)
    if isinstance(model, JanusGPT):
        return "transformers-generate", transformers_loop(model)
    return None
