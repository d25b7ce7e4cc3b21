"""Loading MAR checkpoints (official ``mar_base/large/huge`` files and FastAR's) and their KL autoencoder.

MAR's config comes from FastAR's ``fastar_config`` metadata when present, otherwise from the weight shapes
plus the training ``args`` saved in official checkpoints. Shapes give every width, depth, the token size,
the grid (square, from the position embeddings), the class-embedding buffer and the class count; the
attention heads come from the args/config (``num_heads``), else the official size table. The KL
autoencoder's sizes all come from its shapes (``KLConfig.from_state_dict``); LDM training files carry a
``loss.*`` sub-module (the discriminator), which decoding drops.
"""
from __future__ import annotations

import math
import re

import torch

from ...errors import FastARError
from ..shared.checkpoint import AR_MODEL, FAMILY_WHAT, IMAGE_DECODER, CheckpointInfo, detect_family, read_state_dict, require_family
from .kl_vae import KLAutoencoder
from ..shared.ldm_blocks import KLConfig
from ..shared.quantized import is_codes, quantised_state, stored_format_loading
from ..shared.building import build_and_load, checkpoint_of, config_from_metadata, first_setting, official_heads, weight_shape, where_config_goes
from .model import MAR, MARConfig

# The official mar_* sizes: name -> (width, depth, heads), the same for encoder and decoder.
OFFICIAL_SIZES = {"mar_base": (768, 12, 12), "mar_large": (1024, 16, 16), "mar_huge": (1280, 20, 16)}


def load_mar(path_or_state_dict, *, device="cpu", dtype=torch.float32, info: CheckpointInfo | None = None,
             image_size: int | None = None) -> MAR:
    """A MAR model in eval mode. The diffusion head stays in fp32 whatever ``dtype`` says: its first
    reverse step amplifies rounding errors about 300x."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    require_family(sd, info.source, AR_MODEL)
    if image_size is not None:
        raise FastARError(f"{info.source} is a MAR model: it generates at the size it was trained at (its position "
                          "embeddings fix the grid), so leave the image size on auto")
    model = build_and_load(MAR, mar_config(sd, info), sd, info.source, device, dtype)
    # the head's weights straight from the file in fp32: a round trip through fp16/bf16 would round them
    head = {k.removeprefix("diffloss."): v if is_codes(v) else v.float() for k, v in sd.items()
            if k.startswith("diffloss.")}  # a pre-quantised file's codes as they are
    model.diffloss.float().load_state_dict(quantised_state(model.diffloss, head, torch.float32))
    return model


def load_mar_draft(path, target: MAR, *, device=None, dtype=None, weights: str = "auto") -> MAR:
    """A smaller MAR to draft for ``target`` (CSpD), checked to work on the same latents; ``weights``: its 8-bit
    format (quantized.py), or ``auto``: as the checkpoint holds them."""
    sd, info = read_state_dict(path)
    family = detect_family(sd)
    if family != "mar":
        what = f"{FAMILY_WHAT[family]} ({family})" if family else "no model FastAR knows"
        raise FastARError(f"{info.source} is {what}, not a MAR draft model: CSpD drafts with a smaller MAR trained on "
                          "the same VAE latents as the target (e.g. mar_base for mar_huge)")
    dtype = target.z_proj.weight.dtype if dtype is None else dtype
    with stored_format_loading(info.metadata, weights, info.source, dtype):
        draft = load_mar(sd, info=info, device=target.device if device is None else device, dtype=dtype)
    check_mar_draft(target, draft, info.source)
    return draft


def check_mar_draft(target, draft, source: str = "the draft") -> None:
    """A draft must be a MAR on the target's latent space, grid and classes."""
    if getattr(draft, "kind", None) != "masked-ar":
        what = getattr(draft, "what", None) or getattr(draft, "name", None) or type(draft).__name__
        raise FastARError(f"CSpD drafts with a smaller MAR model; the drafter given is {what}. Load a MAR model "
                          "trained on the same VAE latents (e.g. mar_base for mar_huge)")
    for name, what in (("token_dim", "latent channels"), ("grid", "token grid"), ("num_classes", "classes")):
        mine, theirs = getattr(target.cfg, name), getattr(draft.cfg, name)
        if mine != theirs:
            raise FastARError(f"{source}: the draft MAR has {theirs} {what} but the target has {mine}: a draft must "
                              "work on the same VAE latents at the same size (pick the draft trained with the "
                              "target's VAE)")


def load_kl_vae(path_or_state_dict, *, device="cpu", dtype=torch.float32, info: CheckpointInfo | None = None
                ) -> KLAutoencoder:
    """An LDM KL autoencoder in eval mode (decoder, plus the encoder when the file has it)."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    require_family(sd, info.source, IMAGE_DECODER)
    sd = {k: v for k, v in sd.items() if not k.startswith("loss.")}
    saved = info.fastar_config()
    cfg = config_from_metadata(KLConfig, saved, info.source) if saved else KLConfig.from_state_dict(sd, info.source)
    if saved:
        cfg.with_encoder = "encoder.conv_in.weight" in sd
    return build_and_load(KLAutoencoder, cfg, sd, info.source, device, dtype)


def mar_config(sd, info: CheckpointInfo) -> MARConfig:
    saved = info.fastar_config()
    if saved is not None:
        return config_from_metadata(MARConfig, saved, info.source)
    settings, source = info.settings(), info.source
    if int(settings.get("patch_size", 1)) != 1:
        raise FastARError(f"{source}: trained with patch size {settings['patch_size']}; FastAR runs MAR models with "
                          "one VAE latent per token (patch size 1), as every released MAR is")
    dim, token_dim = weight_shape(sd, "z_proj.weight", source)
    decoder_dim = weight_shape(sd, "decoder_embed.weight", source)[0]
    num_tokens = weight_shape(sd, "diffusion_pos_embed_learned", source)[1]
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise FastARError(f"{source}: {num_tokens} token positions are not a square grid; FastAR runs square MAR models")
    encoder_depth, decoder_depth = block_count(sd, "encoder_blocks"), block_count(sd, "decoder_blocks")
    return MARConfig(
        dim=dim, encoder_depth=encoder_depth, encoder_heads=heads(dim, encoder_depth, settings, source),
        decoder_dim=decoder_dim, decoder_depth=decoder_depth, decoder_heads=heads(decoder_dim, decoder_depth, settings, source),
        head_width=weight_shape(sd, "diffloss.net.input_proj.weight", source)[0],
        head_depth=block_count(sd, "diffloss.net.res_blocks"), token_dim=token_dim, grid=(side, side),
        buffer=weight_shape(sd, "encoder_pos_embed_learned", source)[1] - num_tokens,
        num_classes=weight_shape(sd, "class_emb.weight", source)[0],
        mlp_ratio=weight_shape(sd, "encoder_blocks.0.mlp.fc1.weight", source)[0] / dim,
    )


def block_count(sd, prefix: str) -> int:
    pattern = re.compile(rf"{re.escape(prefix)}\.(\d+)\.")
    indices = {int(m.group(1)) for k in sd if (m := pattern.match(k))}
    return 1 + max(indices) if indices else 0


def heads(width: int, depth: int, settings: dict, source: str) -> int:
    """Attention heads: from the args/config, else the official table (by the args' model name, else by size)."""
    said = first_setting(settings, ("num_heads", "encoder_num_heads"), None)
    if said is not None:
        return int(said)
    count = official_heads(OFFICIAL_SIZES, settings.get("model"), (width, depth))
    if count is not None:
        return count
    raise FastARError(
        f"{source}: cannot tell the attention heads of a {depth}-block, {width}-wide MAR transformer: it is none "
        f"of the official sizes ({', '.join(OFFICIAL_SIZES)}) and no config says. "
        f'{where_config_goes(source)}: {{"num_heads": N}}'
    )
