"""Chameleon's VQGAN (Meta's ``vqgan.ckpt``; Lumina-mGPT and Anole decode with it), in the image-decoder slot.

Taming's VQModel with LDM key names (``decoder.up.{level}.block.{i}``, ``decoder.mid.attn_1``), the blocks of
the KL autoencoder: an 8192 x 256 codebook used as it is (not normalised), ``post_quant_conv`` from the code
width to the decoder's latent width. Sizes are read off the weights (``vqgan.yaml`` beside the checkpoint is
not needed). The encoder is optional: decoding needs only the decoder; the text demo's training encodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import FastARError
from ..mar.kl_vae import Decoder, Encoder, KLConfig


@dataclass
class VQGANConfig:
    codebook_size: int = 8192
    embed_dim: int = 256  # code width
    z_channels: int = 256  # the decoder's latent width
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_levels: tuple[int, ...] = ()
    decoder_attn_levels: tuple[int, ...] = ()
    with_encoder: bool = True

    def __post_init__(self):
        for name in ("ch_mult", "encoder_attn_levels", "decoder_attn_levels"):
            setattr(self, name, tuple(getattr(self, name)))

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def blocks(self) -> KLConfig:
        """The encoder/decoder layout in the KL autoencoder's terms (its latent = the VQGAN's z)."""
        return KLConfig(embed_dim=self.z_channels, ch=self.ch, ch_mult=self.ch_mult, num_res_blocks=self.num_res_blocks,
                        encoder_attn_levels=self.encoder_attn_levels, decoder_attn_levels=self.decoder_attn_levels,
                        with_encoder=self.with_encoder)

    @classmethod
    def from_state_dict(cls, sd: dict, source: str, what: str = "a VQGAN", **extra) -> "VQGANConfig":
        try:
            kl = KLConfig.from_state_dict(sd, source)  # its "embed_dim" is the decoder's latent width
            codebook = sd["quantize.embedding.weight"]
        except KeyError as e:
            raise FastARError(f"{source} looks like {what} but lacks {e.args[0]}: the file is incomplete, "
                              "re-download it") from None
        return cls(codebook_size=codebook.shape[0], embed_dim=codebook.shape[1], z_channels=kl.embed_dim, ch=kl.ch,
                   ch_mult=kl.ch_mult, num_res_blocks=kl.num_res_blocks, encoder_attn_levels=kl.encoder_attn_levels,
                   decoder_attn_levels=kl.decoder_attn_levels, with_encoder=kl.with_encoder, **extra)


class Quantize(nn.Module):
    def __init__(self, codes: int, width: int):
        super().__init__()
        self.embedding = nn.Embedding(codes, width)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, h, w]`` of latents ``[B, C, h, w]``."""
        return nearest_codes(z, self.embedding.weight)


class VQGAN(nn.Module):
    """Codes ``[B, h, w]`` <-> images ``[B, 3, h*ds, w*ds]`` in [-1, 1]."""

    input_kind = "codes"
    what = "a Chameleon VQGAN"

    def __init__(self, cfg: VQGANConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.with_encoder:
            self.encoder = Encoder(cfg.blocks(), cfg.z_channels)
            self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.quantize = Quantize(cfg.codebook_size, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = Decoder(cfg.blocks())

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def codebook(self) -> torch.Tensor:
        """The code vectors as the decoder uses them (raw: Chameleon does not normalise them)."""
        return self.quantize.embedding.weight

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] -> codes ``[B, h, w]``."""
        if not self.cfg.with_encoder:
            raise FastARError("this VQGAN file has no encoder weights: it can only decode")
        return self.quantize.nearest(self.quant_conv(self.encoder(images)))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: codes ``[B, h, w]`` -> images in [-1, 1] (not clamped)."""
        vectors = self.quantize.embedding(codes.long()).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(vectors))
