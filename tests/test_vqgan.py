"""Chameleon's VQGAN: the encoder and quantiser equal transformers' ChameleonVQVAE (which has no decoder), Meta's
Lightning checkpoint layout loads (sizes from the shapes, training losses dropped) and decodes, and a converted
model folder whose VQ model lacks the decoder is refused with what to load instead."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_image_decoder
from fastar.model_loaders.chameleon.vqgan import VQGAN
from fastar.model_loaders.shared.ldm_blocks import VQGANConfig
from fastar.tests.tiny_chameleon import hf_model, write_folder


def transformers_vqvae(seed: int = 0):
    from transformers import ChameleonVQVAE, ChameleonVQVAEConfig

    torch.manual_seed(seed)
    config = ChameleonVQVAEConfig(embed_dim=8, num_embeddings=40, latent_channels=32, resolution=32, base_channels=32,
                                  channel_multiplier=[1, 2, 2], num_res_blocks=1, attn_resolutions=[])
    return ChameleonVQVAE(config).eval()


def meta_state_dict(reference) -> dict:
    """Meta's vqgan.ckpt layout: the encoder side from ``reference``, a decoder of the same sizes."""
    cfg = VQGANConfig(codebook_size=40, embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1)
    torch.manual_seed(1)
    sd = VQGAN(cfg).state_dict()
    sd.update(reference.state_dict())
    return sd


def test_codes_equal_transformers_encoder():
    reference = transformers_vqvae()
    ours = VQGAN(VQGANConfig.from_state_dict(meta_state_dict(reference), "test"))
    ours.load_state_dict(meta_state_dict(reference))
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(images).image_tokens.view(3, 8, 8)
        assert torch.equal(ours.eval().encode(images), expected)


def test_meta_checkpoint_loads_and_decodes(tmp_path):
    sd = meta_state_dict(transformers_vqvae())
    path = tmp_path / "vqgan.ckpt"
    torch.save({"state_dict": {**sd, "loss.discriminator.main.0.weight": torch.zeros(2)}, "epoch": 3}, path)
    vqgan = load_image_decoder(path)
    assert isinstance(vqgan, VQGAN) and vqgan.cfg.ch_mult == (1, 2, 2) and vqgan.cfg.z_channels == 32
    codes = torch.randint(0, 40, (2, 4, 5))
    with torch.no_grad():
        images = vqgan.decode(codes)
        assert images.shape == (2, 3, 16, 20)
        # the codebook is used as it is: decoding equals the decoder on the raw code vectors
        raw = vqgan.decoder(vqgan.post_quant_conv(sd["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)))
        assert torch.allclose(images, raw)


def test_a_folder_without_the_vq_decoder_says_what_to_load(tmp_path):
    folder = write_folder(tmp_path / "tiny-lumina-mgpt", hf_model())
    with pytest.raises(FastARError, match="without the decoder .* load Meta's vqgan.ckpt"):
        load_image_decoder(folder)
