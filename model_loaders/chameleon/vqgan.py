"""Chameleon's VQGAN (Meta's ``vqgan.ckpt``; Lumina-mGPT and Anole decode with it), in the image-decoder slot.

Taming's VQModel with LDM key names (``decoder.up.{level}.block.{i}``, ``decoder.mid.attn_1``), the blocks of
the KL autoencoder: an 8192 x 256 codebook used as it is (not normalised), ``post_quant_conv`` from the code
width to the decoder's latent width. Sizes are read off the weights (``vqgan.yaml`` beside the checkpoint is
not needed). The encoder is optional: decoding needs only the decoder; the text demo's training encodes.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import FastARError
from ..shared.codebook import nearest_codes
from ..shared.ldm_blocks import Decoder, Encoder, VQGANConfig


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
