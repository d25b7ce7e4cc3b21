"""Emu3's vision tokenizer decoder (BAAI's ``Emu3-VisionTokenizer`` folder; ``vqmodel.*`` inside transformers' Emu3
folders), in the image-decoder slot.

A video VQ model (MoVQGAN-style): a 32768 x 4 codebook used as it is, 8 pixels per code. Decoding, as BAAI's
``Emu3VisionVQModel.decode`` and transformers' ``Emu3VQVAE.decode`` do it: an image is a video of one latent frame;
its code vectors go through ``post_quant_conv``, and then the latent and the code vectors alike through the temporal
stack (residual blocks of BatchNorm with running statistics and causal 3-D convolutions, then x2 temporal
upsamplings: ``temporal_downsample_factor`` frames); each frame goes through LDM's 2-D decoder (shared/ldm_blocks.py)
whose every norm is a spatial norm conditioned on that frame's code vectors (GroupNorm, then scaled and shifted by
1x1 convolutions of the code vectors, resized to the features). The image is the first frame.

Every temporal convolution is causal (the past padded with zero frames), so frame 0 of each depends on frame 0 of its
input alone: ``decode`` computes the first frame by itself (the upsamplings, which repeat frames, are skipped; the
other frames are never made), ``frames`` all of them as the official decode does.

Both key layouts load into one module (``vq_names``): BAAI's (LDM names: ``decoder.mid.attn_1.{norm,q,k,v,proj_out}``,
``decoder.up.{i}.attn.{j}``, attention projections as 1x1 convolutions), used here, and transformers' (its
conversion script's renames: ``decoder.middle_block.attn_norm``, ``decoder.up_block.up.{i}.attn_norms.{j}``,
``q_proj``/``k_proj``/``v_proj``/``out_proj`` as linear layers), bare or under ``vqmodel.`` (as transformers saves
an Emu3 folder) or ``model.vqmodel.`` (its module names). The encoder's weights are left out: decoding needs none.

The decoder writes normalised pixels; the folder's ``preprocessor_config.json`` says how they map to pixel values
(``x * image_std + image_mean`` in 0..1; the released files say 0.5 and 0.5, which BAAI's processor class also
defaults to, where transformers' ``Emu3ImageProcessor`` defaults to CLIP's), which ``decode`` turns into FastAR's -1..1.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..shared.checkpoint import CheckpointInfo, load_weights, read_json, sample_keys
from ..shared.ldm_blocks import Decoder, ResnetBlock, VQGANConfig, group_norm

RELEASED_MEAN = RELEASED_STD = (0.5, 0.5, 0.5)  # BAAI/Emu3-VisionTokenizer's preprocessor_config.json
VQ_PREFIXES = ("model.vqmodel.", "vqmodel.")  # transformers' module path, and its saved Emu3 folders
ENCODER_SIDE = ("encoder.", "quant_conv.")  # what only encoding needs
# transformers' names -> BAAI's, in this order (the reverse of transformers' convert_emu3_weights_to_hf.py)
TRANSFORMERS_NAMES = (
    (r"^decoder\.middle_block\.attn_norm\.", "decoder.mid.attn_1.norm."),
    (r"^decoder\.middle_block\.", "decoder.mid."),
    (r"^decoder\.up_block\.up\.(\d+)\.attn_norms\.(\d+)\.", r"decoder.up.\1.attn.\2.norm."),
    (r"^decoder\.up_block\.up\.", "decoder.up."),
    (r"\.q_proj\.", ".q."), (r"\.k_proj\.", ".k."), (r"\.v_proj\.", ".v."), (r"\.out_proj\.", ".proj_out."),
)
LINEAR_ATTENTION = re.compile(r"\.(q_proj|k_proj|v_proj|out_proj)\.weight$")  # [C, C] here, [C, C, 1, 1] in BAAI's


@dataclass
class Emu3VQConfig(VQGANConfig):
    """The VQGAN's layout (the release's sizes by default; no encoder) plus the frames and the folder's pixel
    normalisation."""

    codebook_size: int = 32768
    embed_dim: int = 4  # code width
    z_channels: int = 4  # the decoder's latent width
    ch: int = 256
    ch_mult: tuple[int, ...] = (1, 2, 2, 4)
    decoder_attn_levels: tuple[int, ...] = (3,)
    with_encoder: bool = False
    temporal_downsample_factor: int = 4  # frames per latent frame
    image_mean: tuple[float, ...] = RELEASED_MEAN
    image_std: tuple[float, ...] = RELEASED_STD

    def __post_init__(self):
        super().__post_init__()
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)

    @property
    def frames(self) -> int:
        return self.temporal_downsample_factor

    @classmethod
    def from_config(cls, config: dict, source: str, preprocessor: dict | None = None) -> "Emu3VQConfig":
        """From an Emu3 model's config.json (transformers: the ``vq_config`` inside), transformers' ``Emu3VQVAEConfig``
        or BAAI's ``Emu3VisionVQConfig`` (config.json of the VisionTokenizer folder), and the folder's
        preprocessor_config.json (None: the released mean and std)."""
        vq = config.get("vq_config", config)
        baai = "ch" in vq or vq.get("model_type") == "Emu3VisionVQ"
        names = {"ch": "ch", "ch_mult": "ch_mult", "z_channels": "z_channels"} if baai else \
            {"ch": "base_channels", "ch_mult": "channel_multiplier", "z_channels": "latent_channels"}
        defaults = cls()
        values = {ours: vq.get(theirs, getattr(defaults, ours)) for ours, theirs in names.items()}
        heads = vq.get("num_attention_heads", 1)
        if vq.get("out_channels", 3) != 3 or heads != 1:
            raise FastARError(f"{source}: its VQ config (out_channels {vq.get('out_channels')}, num_attention_heads "
                              f"{heads}) is not Emu3's vision tokenizer, which draws 3 channels with one attention head")
        width = vq.get("embed_dim", defaults.embed_dim)
        if width != values["z_channels"]:
            raise FastARError(f"{source}: its VQ config has codes {width} wide and a latent {values['z_channels']} wide; "
                              "Emu3's decoder runs both through one temporal stack, so they must be equal")
        mean, std = RELEASED_MEAN, RELEASED_STD
        if preprocessor is not None:
            mean, std = (per_channel(preprocessor.get(key, default), key, source)
                         for key, default in (("image_mean", RELEASED_MEAN), ("image_std", RELEASED_STD)))
        return cls(codebook_size=vq.get("codebook_size", defaults.codebook_size),
                   embed_dim=width,
                   num_res_blocks=vq.get("num_res_blocks", defaults.num_res_blocks),
                   decoder_attn_levels=vq.get("attn_resolutions", defaults.decoder_attn_levels),
                   temporal_downsample_factor=vq.get("temporal_downsample_factor", defaults.frames),
                   image_mean=mean, image_std=std, **values)


def per_channel(value, key: str, source: str) -> tuple[float, ...]:
    values = (value,) * 3 if isinstance(value, (int, float)) else tuple(value)
    if len(values) != 3:
        raise FastARError(f"{source}: preprocessor_config.json's {key} has {len(values)} values, not one per RGB "
                          "channel: the file is damaged, re-download it")
    return tuple(float(v) for v in values)


class SpatialNorm(nn.Module):
    """GroupNorm of the features, scaled and shifted by 1x1 convolutions of the code vectors (nearest-resized)."""

    def __init__(self, code_channels: int, channels: int):
        super().__init__()
        self.norm_layer = group_norm(channels)
        self.conv_y = nn.Conv2d(code_channels, channels, 1)
        self.conv_b = nn.Conv2d(code_channels, channels, 1)

    def forward(self, x, codes):
        codes = F.interpolate(codes, size=x.shape[-2:], mode="nearest")
        return self.norm_layer(x) * self.conv_y(codes) + self.conv_b(codes)


class CausalConv3d(nn.Module):
    """A 3-D convolution over ``[B, C, T, H, W]`` that sees the current and earlier frames (the past padded with
    zero frames) and keeps the spatial size."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int] = (3, 3, 3)):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, kernel)
        t, h, w = kernel
        self.padding = (w // 2, w // 2, h // 2, h // 2, t - 1, 0)

    def forward(self, x):
        return self.conv(F.pad(x, self.padding))


class RunningBatchNorm(nn.Module):
    """BatchNorm3d as the released decoder runs it (in eval mode): its running statistics, never the batch's."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class TemporalUpsample(nn.Module):
    """Frames repeated (nearest x2 in time), then a causal 3-D convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = CausalConv3d(channels, channels)

    def forward(self, x, every_frame: bool = True):
        # frame 0 of the convolution reads frame 0 alone, which the repeat leaves where it was
        return self.conv(x.repeat_interleave(2, dim=2) if every_frame else x)


class Emu3Decoder(Decoder):
    """The temporal stack, then LDM's 2-D decoder with spatial norms, frame by frame."""

    def __init__(self, cfg: Emu3VQConfig):
        super().__init__(cfg.blocks(), norm=partial(SpatialNorm, cfg.embed_dim))
        z = cfg.z_channels
        self.time_res_stack = nn.ModuleList(ResnetBlock(z, z, norm=RunningBatchNorm, conv=CausalConv3d)
                                            for _ in range(cfg.num_res_blocks))
        self.time_conv = nn.ModuleList(TemporalUpsample(z) for _ in range(int(math.log2(cfg.frames))))

    def forward(self, latent, codes, every_frame: bool = True):
        """``latent`` and ``codes`` ``[B, C, 1, h, w]`` -> ``[B, T, 3, H, W]`` (T: the frames, or 1: the first)."""
        both = torch.cat((latent, codes))  # the temporal stack treats the latent and the code vectors alike
        for block in self.time_res_stack:
            both = block(both)
        for upsample in self.time_conv:
            both = F.silu(upsample(both, every_frame))
        latent, codes = both.transpose(1, 2).chunk(2)  # [B, T, C, h, w] each
        frames = super().forward(latent.flatten(0, 1), codes.flatten(0, 1))
        return frames.view(*latent.shape[:2], *frames.shape[1:])


class Emu3VQDecoder(nn.Module):
    """Codes ``[B, h, w]`` -> images ``[B, 3, 8h, 8w]`` in [-1, 1] (the release's sizes)."""

    input_kind = "codes"
    what = "Emu3's vision tokenizer"

    def __init__(self, cfg: Emu3VQConfig):
        super().__init__()
        self.cfg = cfg
        self.quantize = nn.ModuleDict({"embedding": nn.Embedding(cfg.codebook_size, cfg.embed_dim)})
        self.post_quant_conv = CausalConv3d(cfg.embed_dim, cfg.z_channels, (3, 1, 1))
        self.decoder = Emu3Decoder(cfg)

    @property
    def device(self) -> torch.device:
        return self.quantize.embedding.weight.device

    def codebook(self) -> torch.Tensor:
        """The code vectors as the decoder uses them (raw: Emu3 does not normalise them)."""
        return self.quantize.embedding.weight

    def frames(self, codes: torch.Tensor, every_frame: bool = True) -> torch.Tensor:
        """The official decode's output: codes ``[B, h, w]`` -> normalised frames ``[B, T, 3, H, W]`` (T = 1 with
        ``every_frame`` False: the first frame alone)."""
        self.check_codes(codes)
        vectors = self.quantize.embedding(codes.long()).permute(0, 3, 1, 2).unsqueeze(2)  # [B, C, 1, h, w]
        return self.decoder(self.post_quant_conv(vectors), vectors, every_frame)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: codes ``[B, h, w]`` -> images in [-1, 1] (not clamped): the first frame, mapped
        to pixel values by the folder's mean and std."""
        image = self.frames(codes, every_frame=False)[:, 0]
        mean, std = (torch.tensor(v, device=image.device, dtype=image.dtype).view(3, 1, 1)
                     for v in (self.cfg.image_mean, self.cfg.image_std))
        return (image * std + mean) * 2 - 1

    def check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.is_floating_point():
            raise FastARError(f"{self.what} decodes integer codes [batch, rows, columns], not a {codes.dtype} tensor of "
                              f"shape {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.cfg.codebook_size):
            raise FastARError(f"codes outside 0..{self.cfg.codebook_size - 1}: {self.what} has "
                              f"{self.cfg.codebook_size} codes; pick the VQ the model was trained with")


# -- loading ---------------------------------------------------------------------------------------------------------


def vq_names(keys, source: str) -> dict[str, str]:
    """``{name here: stored name}`` of a VQ model's decoder weights, from BAAI's layout or transformers' (bare, under
    ``vqmodel.`` or ``model.vqmodel.``); in a whole model folder the VQ model's keys alone. The encoder side and
    BatchNorm's batch counters are left out on purpose."""
    keys = list(keys)
    prefix = next((p for p in VQ_PREFIXES if any(k.startswith(p) for k in keys)), "")
    names = {}
    for stored in keys:
        if not stored.startswith(prefix):
            continue  # beside the VQ model: the text model
        name = stored[len(prefix):]
        if name.startswith(ENCODER_SIDE) or name.endswith(".num_batches_tracked"):
            continue
        for pattern, replacement in TRANSFORMERS_NAMES:
            name = re.sub(pattern, replacement, name)
        names[name] = stored
    if "quantize.embedding.weight" not in names or not any(n.startswith("decoder.time_res_stack.") for n in names):
        raise FastARError(f"{source} holds no Emu3 vision tokenizer decoder (its keys: {sample_keys(keys)}): pick "
                          "BAAI's Emu3-VisionTokenizer folder, or a transformers Emu3 folder (Emu3-Gen-hf), which "
                          "carries it under vqmodel.")
    return names


def vq_weights(sd, source: str) -> dict[str, torch.Tensor]:
    """The decoder's weights under the names here, transformers' linear attention projections as 1x1 convolutions."""
    weights = {}
    for name, stored in vq_names(sd, source).items():
        tensor = sd[stored]
        weights[name] = tensor[..., None, None] if LINEAR_ATTENTION.search(stored) and tensor.dim() == 2 else tensor
    return weights


def image_processor_settings(folder) -> dict | None:
    """The image processor's settings (its mean and std): preprocessor_config.json (the releases', an image processor's
    save_pretrained), else the ``image_processor`` inside processor_config.json (transformers 5's
    ``ProcessorMixin.save_pretrained`` writes them there); None: neither file (the released values)."""
    preprocessor = read_json(folder / "preprocessor_config.json")
    if preprocessor is not None:
        return preprocessor
    inside = (read_json(folder / "processor_config.json") or {}).get("image_processor")
    return inside if isinstance(inside, dict) else None


def load_emu3_vq(sd, *, info: CheckpointInfo, device="cpu", dtype=torch.float32) -> Emu3VQDecoder:
    """Emu3's image decoder in eval mode, from BAAI's Emu3-VisionTokenizer folder or an Emu3 model folder in
    transformers' layout: sizes from config.json, mean and std from preprocessor_config.json."""
    if info.folder is None or not info.config:
        raise FastARError(f"{info.source}: Emu3's vision tokenizer is read from its folder (config.json, "
                          "model.safetensors, preprocessor_config.json): pick BAAI's Emu3-VisionTokenizer folder or "
                          "the Emu3 model folder, not a single file")
    cfg = Emu3VQConfig.from_config(info.config, info.source, image_processor_settings(info.folder))
    weights = vq_weights(sd, info.source)
    with torch.device("meta"):
        model = Emu3VQDecoder(cfg)
    load_weights(model, weights, info.source)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
