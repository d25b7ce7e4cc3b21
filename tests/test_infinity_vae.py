"""Infinity's BSQ VAE: detection, the release's two key layouts, wrong and damaged files, bit order, the scale chain's
shapes, batches and half precision on the CPU. Its numbers against the official code: conformance/test_infinity_vae.py.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_image_decoder
from fastar.model_loaders.infinity.vae import InfinityVAEConfig, check_image_decoder, infinity_norm, load_infinity_vae
from fastar.model_loaders.shared.checkpoint import (FAMILY_KIND, IMAGE_DECODER, CheckpointInfo, detect_family,
                                                    read_state_dict, require_family)
from fastar.memory import decode_bytes_per_image
from fastar.pipeline import decode_images
from fastar.tests.conformance.common import FIXTURES

D32, D14 = FIXTURES / "infinity_vae" / "vae_d32.pth", FIXTURES / "infinity_vae" / "vae_d14_patchify.pth"
SHAPES = [(1, 1), (2, 3), (3, 5), (5, 7)]  # not square, not integer ratios


def load(state: dict, source: str = "vae.pth"):
    return load_infinity_vae(state, info=CheckpointInfo(source=source))


def random_bits(batch: int, d: int, shapes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2, (batch, h, w, d), generator=g) for h, w in shapes]


def f_hat_of(vae, bits, shapes) -> torch.Tensor:
    f_hat = torch.zeros(len(bits[0]), vae.cfg.codebook_dim, *shapes[-1])
    for scale, b in enumerate(bits):
        f_hat, inputs = vae.next_input(f_hat, b, scale, shapes)
        assert inputs is None if scale + 1 == len(shapes) else inputs.shape == (*f_hat.shape[:2], *shapes[scale + 1])
    return f_hat


@pytest.fixture(scope="module")
def d32():
    return load_image_decoder(D32)


def test_both_release_files_are_detected_and_sized_from_their_weights():
    for path, d, patch in ((D32, 32, 16), (D14, 14, 8)):
        sd, _ = read_state_dict(path)  # {"vae": sd}: unwrapped by the checkpoint reader
        assert detect_family(sd) == "infinity-vae" and require_family(sd, path.name, IMAGE_DECODER) == "infinity-vae"
        vae = load_image_decoder(path)
        assert (vae.cfg.codebook_dim, vae.cfg.patch_size, vae.input_kind) == (d, patch, "multi-scale-bits")
        assert vae.codebook() is None and vae.dtype == torch.float32


def test_wrapped_and_plain_key_names_load_the_same_weights(d32):
    sd, _ = read_state_dict(D32)
    assert "decoder.conv_in.conv.weight" in sd  # the module's own names
    plain = {k.replace(".conv.weight", ".weight").replace(".conv.bias", ".bias").replace(".norm.weight", ".weight")
             .replace(".norm.bias", ".bias"): v for k, v in sd.items()}
    other = load(plain)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in d32.state_dict().items())


def test_bit_j_is_channel_j_at_plus_or_minus_one_over_sqrt_d(d32):
    d = d32.cfg.codebook_dim
    bits = torch.zeros(1, 1, 2, d, dtype=torch.long)
    bits[0, 0, 1, 3] = 1  # cell (0, 1), bit 3
    codes = d32.codes_of_bits(bits)
    assert codes.shape == (1, d, 1, 2) and codes.dtype == torch.float32
    expected = torch.full((d,), -1 / math.sqrt(d))
    assert torch.allclose(codes[0, :, 0, 0], expected)
    expected[3] = 1 / math.sqrt(d)
    assert torch.allclose(codes[0, :, 0, 1], expected)


def test_batches_and_non_square_scales_decode_each_image_as_alone(d32):
    bits = random_bits(3, 32, SHAPES)
    f_hat = f_hat_of(d32, bits, SHAPES)
    with torch.no_grad():
        images = d32.decode(f_hat)
        alone = d32.decode(f_hat_of(d32, [b[1:2] for b in bits], SHAPES))
    assert images.shape == (3, 3, 5 * 16, 7 * 16)
    assert (images[1:2] - alone).abs().max() < 1e-4  # float order only (batched convolutions)
    assert decode_images(d32, f_hat).shape == (3, 80, 112, 3)
    assert decode_bytes_per_image(d32, SHAPES[-1]) > 0  # how the pipeline sizes its chunks on a GPU


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_on_the_cpu(dtype):
    full, half = load_image_decoder(D14), load_image_decoder(D14, dtype=dtype)
    bits = random_bits(2, 14, SHAPES, seed=1)
    f_hat = f_hat_of(half, bits, SHAPES)  # the accumulation stays fp32 whatever the decoder's dtype
    assert f_hat.dtype == torch.float32 and torch.equal(f_hat, f_hat_of(full, bits, SHAPES))
    with torch.no_grad():
        out, ref = half.decode(f_hat), full.decode(f_hat)
    assert out.dtype == dtype and out.shape == (2, 3, 40, 56)
    assert torch.isfinite(out).all() and (out.float() - ref).abs().max() < 0.1
    assert decode_images(half, f_hat).shape == (2, 40, 56, 3)


def test_an_infinity_model_refuses_another_decoder_naming_its_own(d32):
    with pytest.raises(FastARError, match=r"infinity_vae_d56_f8_14_patchify\.pth.*this VAE is infinity_vae_d32reg"):
        check_image_decoder(d32, 14, 8, "Infinity-8B")  # the 2B's VAE (d 32, 16 pixels) for the 8B
    var = SimpleNamespace(input_kind="multi-scale", what="a multi-scale VQVAE (VAR)")
    with pytest.raises(FastARError, match=r"infinity_vae_d32reg\.pth.*not a multi-scale VQVAE \(VAR\)"):
        check_image_decoder(var, 32, 16, "Infinity-2B")
    check_image_decoder(d32, 32, 16, "Infinity-2B")


@pytest.mark.skipif("infinity" not in FAMILY_KIND, reason="the Infinity transformer's family is not registered yet")
def test_a_transformer_file_given_as_the_image_decoder_says_what_to_do():
    with pytest.raises(FastARError, match="load it as the AR model"):
        require_family({"word_embed.weight": torch.zeros(1), "text_proj_for_sos.ca.mat_q": torch.zeros(1)}, "x.pth",
                       IMAGE_DECODER)


def test_damaged_files_are_refused_in_words(tmp_path):
    data = D32.read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(FastARError, match="truncated or corrupt"):
        load_image_decoder(tmp_path / "cut.pth")
    sd, _ = read_state_dict(D32)
    without = {k: v for k, v in sd.items() if not k.startswith("decoder.conv_out.")}
    with pytest.raises(FastARError, match="lacks decoder.conv_out.weight: the file is incomplete"):
        load(without)
    without = {k: v for k, v in sd.items() if not k.startswith("decoder.up.2.block.1.norm2.")}
    with pytest.raises(FastARError, match="missing decoder.up.2.block.1.norm2"):
        load(without)
    attends = {**sd, "decoder.mid.attn_1.q.conv.weight": torch.zeros(1)}
    with pytest.raises(FastARError, match="attention in the middle.*not the layout"):
        load(attends)


def test_wrong_shapes_are_refused_in_words(d32):
    with pytest.raises(FastARError, match="reads 32 bits per cell"):
        d32.codes_of_bits(torch.zeros(1, 2, 2, 14, dtype=torch.long))
    bits = random_bits(1, 32, SHAPES)
    with pytest.raises(FastARError, match="do not fit the scales"):
        d32.next_input(torch.zeros(1, 32, *SHAPES[-1]), bits[2], 1, SHAPES)


def test_groups_of_32_else_24_as_infinity_normalises():
    assert (infinity_norm(64).num_groups, infinity_norm(48).num_groups, infinity_norm(96).num_groups) == (32, 24, 32)
    with pytest.raises(FastARError, match="groups of 32 or 24"):
        InfinityVAEConfig(ch=20, ch_mult=(1, 2))
