"""Loading VAR models (``var_d{16,20,24,30}.pth``: raw state dicts) and VAR's multi-scale VQVAE
(``vae_ch160v4096z32.pth``), and the files FastAR writes in the same layouts (plus its ``fastar_config``).

Sizes come from the weights: width and code width from ``word_embed``, depth from the blocks, heads from
``scale_mul_1H11``, classes from ``class_emb`` (minus the null class). The scales (``patch_nums``) are the
release's 256 px ones when the sequence has their 680 slots; other files need them in ``fastar_config`` or in
``NAME.json`` beside ``NAME.pth`` (config.json in a model folder): ``{"patch_nums": [...]}``, and the VQVAE its own
NAME.json with the same scales (its weights do not show them). A VAR-DD student of a depth the release does not
have takes its ``split_t`` (scales given as data at step 2) from NAME.json, or the DD run's t2 and split. The
block-causal mask and level ids are rebuilt when a file lacks them (they follow from the scales).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import FastARError
from ..shared.checkpoint import CheckpointInfo, has_prefix
from ..shared.building import build_and_load, checkpoint_of, config_from_metadata, first_setting, weight_shape
from .dd_student import OFFICIAL_SCALES, VARDDConfig, VARDDStudent, dd_mask
from .model import VAR, VARConfig, additive_mask, block_causal_mask, level_ids
from .vqvae import VAR_PATCH_NUMS, MultiScaleVQVAE, VQVAEConfig, split_fused_attention

TRAINING_STATE = ("quantize.ema_vocab_hit_SV",)  # the VQVAE's codebook-usage statistics: training only


def load_var(path_or_state_dict, *, device="cpu", dtype=torch.float32, info: CheckpointInfo | None = None,
             image_size: int | None = None) -> VAR:
    """A VAR model in eval mode without gradients."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    if image_size is not None:
        raise FastARError("a VAR model's image size follows its scales (patch_nums): leave the image size unset")
    cfg = var_config(sd, info)
    return build_and_load(VAR, cfg, {**rebuilt_buffers(cfg), **sd}, info.source, device, dtype)


def load_var_dd(path_or_state_dict, *, device="cpu", dtype=torch.float32, info: CheckpointInfo | None = None,
                image_size: int | None = None) -> VARDDStudent:
    """A VAR-DD student (the release's ``var-d{16,20,24}.pth``, or one distill-dd wrote) in eval mode."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    if image_size is not None:
        raise FastARError("a VAR-DD student's image size follows its scales (patch_nums): leave the image size unset")
    cfg = var_dd_config(sd, info)
    buffers = rebuilt_buffers(cfg.student(), dd_mask((1, *cfg.patch_nums)))
    return build_and_load(VARDDStudent, cfg, {**buffers, **sd}, info.source, device, dtype)


def var_dd_config(sd, info: CheckpointInfo) -> VARDDConfig:
    saved = info.fastar_config()
    if saved is not None:
        return config_from_metadata(VARDDConfig, saved, info.source)
    shared = var_config(sd, info, extra_scale=1)
    scales = OFFICIAL_SCALES.get(shared.depth)
    said = first_setting(info.settings(), ("split_t", "loss_split_t"), scales)
    if said is None:  # none of the released depths and no split_t: the DD run must give t2 and split
        return VARDDConfig(**vars(shared), t2=None, split=None,
                           unknown_split=(f"{info.source} is a depth-{shared.depth} VAR-DD student, none of the "
                                          f"released sizes (16, 20, 24), and {config_file_hint(info)} gives no "
                                          "split_t"))
    data = sum(p * p for p in shared.patch_nums[: int(said)])
    return VARDDConfig(**vars(shared), t2=data, split=data)


def config_file_hint(info: CheckpointInfo) -> str:
    """Where a file's settings go: NAME.json beside NAME.pth, or a model folder's config.json."""
    if info.folder is not None:
        return f"its config.json ({info.folder.name}/config.json)"
    return f"{Path(info.source).stem}.json beside it"


def var_config(sd, info: CheckpointInfo, extra_scale: int = 0) -> VARConfig:
    """The config of a VAR (``extra_scale`` 1: a VAR-DD student, whose sequence has a leading extra scale of one
    token; the config keeps the teacher's scales)."""
    saved = info.fastar_config()
    if saved is not None:
        return config_from_metadata(VARConfig, saved, info.source)
    source = info.source
    if "shared_ada_lin.1.weight" in sd:
        raise FastARError(f"{source} uses shared AdaLN (VAR-d36, 512 px), which FastAR does not run yet: use "
                          "var_d16/d20/d24/d30")
    dim, channels = weight_shape(sd, "word_embed.weight", source)
    seq_len = weight_shape(sd, "pos_1LC", source)[1]
    scales = weight_shape(sd, "lvl_embed.weight", source)[0]
    return VARConfig(
        depth=1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks.")),
        dim=dim, n_head=weight_shape(sd, "blocks.0.attn.scale_mul_1H11", source)[1],
        mlp_ratio=weight_shape(sd, "blocks.0.ffn.fc1.weight", source)[0] / dim,
        vocab_size=weight_shape(sd, "head.weight", source)[0], channels=channels,
        num_classes=weight_shape(sd, "class_emb.weight", source)[0] - 1,
        patch_nums=patch_nums_of(info.settings(), seq_len - extra_scale, scales - extra_scale, source,
                                 config_file_hint(info)),
    )


def patch_nums_of(settings: dict, seq_len: int, scales: int, source: str, hint: str = "NAME.json beside it") \
        -> tuple[int, ...]:
    said = first_setting(settings, ("patch_nums", "pn"), None)
    if said is None and seq_len == sum(p * p for p in VAR_PATCH_NUMS) and scales == len(VAR_PATCH_NUMS):
        said = VAR_PATCH_NUMS
    if said is None:
        raise FastARError(f"{source}: a VAR model of {scales} scales and {seq_len} tokens is not the release's 256 px "
                          f"layout; put its patch_nums in {hint} (e.g. {{\"patch_nums\": [1, 2, 3, 4]}}), and the "
                          "same in its VQVAE's NAME.json")
    patch_nums = tuple(int(p) for p in said)
    if len(patch_nums) != scales or sum(p * p for p in patch_nums) != seq_len:
        raise FastARError(f"{source}: patch_nums {list(patch_nums)} give {len(patch_nums)} scales and "
                          f"{sum(p * p for p in patch_nums)} tokens but the weights have {scales} and {seq_len}")
    return patch_nums


def rebuilt_buffers(cfg: VARConfig, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The buffers that follow from the config (``mask``: the attention mask, block-causal by default), for
    files that do not carry them."""
    mask = block_causal_mask(cfg.patch_nums) if mask is None else mask
    buffers = {"lvl_1L": level_ids(cfg.patch_nums).view(1, cfg.seq_len), "attn_bias_for_masking": additive_mask(mask)}
    buffers.update({f"blocks.{i}.attn.zero_k_bias": torch.zeros(cfg.dim) for i in range(cfg.depth)})
    return buffers


def load_var_vqvae(sd, *, info: CheckpointInfo, device="cpu", dtype=torch.float32) -> MultiScaleVQVAE:
    """VAR's VQVAE in eval mode (decoder and quantiser, plus the encoder when the file has it)."""
    sd = split_fused_attention({k: v for k, v in sd.items() if k not in TRAINING_STATE})
    saved = info.fastar_config()
    cfg = config_from_metadata(VQVAEConfig, saved, info.source) if saved else VQVAEConfig.from_state_dict(sd, info.source)
    cfg.with_encoder = has_prefix(sd, "encoder.")
    if not saved:
        cfg.patch_nums = tuple(first_setting(info.settings(), ("patch_nums", "v_patch_nums"), VAR_PATCH_NUMS))
    return build_and_load(MultiScaleVQVAE, cfg, sd, info.source, device, dtype)
