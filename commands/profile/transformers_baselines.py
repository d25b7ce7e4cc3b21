"""transformers' own ``generate`` on the weights of the model being profiled (``profile --baselines``): the loop a
transformers user runs today for the same family.

- Janus shapes: ``JanusForConditionalGeneration.generate`` in image mode (its static cache, its CFG logits
  processor), which draws FastAR's ``ar`` tokens when decoding is greedy (tests/test_loop_baselines.py).
- Chameleon-family shapes (Anole, Lumina-mGPT): ``ChameleonForConditionalGeneration.generate`` with CFG as
  ``generate`` offers it (``guidance_scale`` and ``negative_prompt_ids``: a second forward per token for the
  unconditional rows, as Lumina-mGPT's own solver runs CFG) and ``prefix_allowed_tokens_fn`` keeping each step to
  the image tokens (the row-end token at row ends), as FastAR's sampler does; greedy, it draws FastAR's ``ar``
  tokens (tests/test_transformers_baselines.py).
"""
from __future__ import annotations

import re

import torch

from ...errors import FastARError
from ...model_loaders.chameleon.model import ChameleonGPT
from ...model_loaders.janus.model import JanusGPT
from ...model_loaders.shared.joined import parted_state_dict
from ...samplers.processing import SamplingSettings
from .common import ImageLoop, seed_global_generator


def generation_config(sampling: SamplingSettings, max_new_tokens: int, **tokens):
    """``sampling`` as transformers' GenerationConfig; ``tokens``: the family's special token ids."""
    from transformers import GenerationConfig

    sampled = sampling.temperature > 0
    # top_k=0: off, where transformers would add its default top-50 filter to a sampled generation
    return GenerationConfig(do_sample=sampled, temperature=sampling.temperature if sampled else None,
                            top_k=0 if sampled else None, guidance_scale=sampling.cfg_scale,
                            max_new_tokens=max_new_tokens, **tokens)


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


def janus_loop(model: JanusGPT) -> ImageLoop:
    """Janus's image loop: transformers' ``generate`` in image mode on ``model``'s weights."""
    reference = transformers_janus(model)

    @torch.no_grad()
    def loop(conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
        if sampling.top_k or sampling.top_p < 1.0 or not sampling.use_cfg:
            raise FastARError("the transformers baseline runs Janus's own setting: CFG on, no top-k or top-p")
        prompts = model.prompts.encode(conditioning)
        ids = torch.tensor(prompts, device=model.device)
        config = generation_config(sampling, model.grid[0] * model.grid[1], bos_token_id=model.cfg.bos,
                                   pad_token_id=model.cfg.pad, generation_kwargs={"boi_token_id": model.cfg.boi})
        seed_global_generator(generator)
        try:
            return reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      generation_mode="image")
        except TypeError as e:  # transformers 5.17's image mode calls its own cache setup with an argument short
            if "_prepare_static_cache" not in str(e):
                raise
            import transformers
            raise FastARError(f"transformers {transformers.__version__} cannot generate Janus images itself ({e}); "
                              "the baseline runs on transformers 5.23 or newer") from None

    return loop


def chameleon_weights(model: ChameleonGPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' Chameleon names (FastAR keeps HF's LLaMA names): q, k, v and gate, up
    apart (views, not copies), QK norms one row per head, the output head over the whole vocabulary."""
    weights = parted_state_dict(model)
    llm = model.decoder_cfg
    for name in [n for n in weights if re.search(r"\.[qk]_norm\.", n)]:  # a shard's row serves its consecutive heads
        heads = llm.n_head if ".q_norm." in name else llm.n_kv_head
        weights[name] = weights[name].repeat_interleave(heads // len(weights[name]), dim=0)
    if model.image_rows_only:  # the text rows were dropped: zeros stand in (never drawn; the whole head's matmul
        # costs what a transformers user's does)
        head = weights["lm_head.weight"].new_zeros(llm.vocab_size, llm.hidden_size)
        weights["lm_head.weight"] = head.index_copy_(0, model.image_ids, weights["lm_head.weight"])
    return weights


def transformers_chameleon(model: ChameleonGPT):
    """transformers' ChameleonForConditionalGeneration holding ``model``'s weights (shared where FastAR's layout is
    transformers': ``chameleon_weights``). Its VQ encoder, which image generation never runs, is kept tiny."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    cfg, llm = model.cfg, model.decoder_cfg
    config = ChameleonConfig(
        vocab_size=llm.vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.ffn_hidden,
        num_hidden_layers=llm.n_layer, num_attention_heads=llm.n_head, num_key_value_heads=llm.n_kv_head,
        rms_norm_eps=llm.rms_eps, rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta},
        swin_norm=llm.swin_norm, bos_token_id=cfg.bos, eos_token_id=cfg.eoi, pad_token_id=model.layout.filler,
        # no IMGIMG... entries: transformers' forward sets the logits of the tokens so named to the dtype's minimum
        # (its Chameleon writes text only); prefix_allowed_tokens_fn keeps image generation to the image tokens
        vocabulary_map={},
        vq_config=dict(embed_dim=32, num_embeddings=len(cfg.image_ids), latent_channels=32, base_channels=32,
                       channel_multiplier=[1], num_res_blocks=1, resolution=32))
    with torch.device(model.device):  # randomly initialised, then given the profiled model's tensors
        reference = ChameleonForConditionalGeneration._from_config(config, dtype=model.dtype)
    loaded = reference.load_state_dict(chameleon_weights(model), strict=False, assign=True)
    missing = [k for k in loaded.missing_keys if not k.startswith("model.vqmodel.")]
    assert not loaded.unexpected_keys and not missing, (loaded.unexpected_keys, missing)
    return reference.eval()


def left_padded(rows: list[list[int]], filler: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] of ``rows`` left-padded with ``filler`` (as FastAR's sessions pad), and their attention
    mask."""
    T = max(map(len, rows))
    ids = torch.tensor([[filler] * (T - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def chameleon_loop(model: ChameleonGPT) -> ImageLoop:
    """A Chameleon-family image loop: transformers' ``generate`` on ``model``'s weights, CFG against FastAR's
    unconditional rows, each step kept to what the layout allows there."""
    reference = transformers_chameleon(model)
    layout, width = model.layout, model.grid[1]
    steps = layout.region - (layout.row_end is not None)  # up to the last code: the last row end is never needed
    code_of = torch.full((model.decoder_cfg.vocab_size,), -1, device=model.device)  # vocabulary id -> code, or -1
    code_of[model.image_ids] = torch.arange(len(model.image_ids), device=model.device)
    # tensors on the model's device: a list would be copied there for every row at every step
    image_tokens = model.image_ids
    row_end = torch.tensor([layout.row_end], device=model.device) if layout.row_end is not None else None

    def allowed_tokens(prompt_len: int):
        def allowed(batch_id: int, ids: torch.Tensor) -> torch.Tensor:
            if row_end is not None and (len(ids) - prompt_len) % (width + 1) == width:
                return row_end
            return image_tokens
        return allowed

    @torch.no_grad()
    def loop(conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
        if sampling.top_k or sampling.top_p < 1.0:
            raise FastARError("the transformers baseline draws without top-k or top-p (FastAR's and transformers' "
                              "filters are not proven to keep the same codes)")
        prompts = model.encoded(conditioning)
        rows = model.prefixes(prompts, sampling.use_cfg)  # cond rows, then FastAR's uncond rows under CFG
        ids, mask = left_padded(rows[:len(prompts)], layout.filler, model.device)
        negative = {}
        if sampling.use_cfg:  # generate's CFG: a second forward per token, for these rows
            negative_ids, negative_mask = left_padded(rows[len(prompts):], layout.filler, model.device)
            negative = dict(negative_prompt_ids=negative_ids, negative_prompt_attention_mask=negative_mask)
        config = generation_config(sampling, steps, bos_token_id=model.cfg.bos, eos_token_id=model.cfg.eoi,
                                   pad_token_id=layout.filler)
        seed_global_generator(generator)
        out = reference.generate(ids, attention_mask=mask, generation_config=config,
                                 prefix_allowed_tokens_fn=allowed_tokens(ids.shape[1]), **negative)
        codes = code_of[out[:, ids.shape[1]:]]
        return codes[codes >= 0].view(len(prompts), -1)  # the row ends dropped

    return loop
