"""Emu3's vision tokenizer decoder beyond the conformance images (tests/conformance/test_emu3_vq.py): half precision,
codes out of range, the key layouts and what a wrong folder is told; on the conformance fixture's tiny folders."""
import json
import shutil

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.emu3.vqvae import RELEASED_MEAN, RELEASED_STD, load_emu3_vq
from fastar.model_loaders.shared.checkpoint import read_state_dict
from fastar.tests.conformance.common import expected, fixture

HF, BAAI = "Emu3-Gen-hf", "Emu3-VisionTokenizer"


def folder_weights(layout: str, folder=None):
    sd, info = read_state_dict(folder or fixture("emu3_vq") / layout)
    return {k: sd[k] for k in sd}, info


def load(layout: str, **kw):
    sd, info = folder_weights(layout)
    return load_emu3_vq(sd, info=info, **kw)


def codes():
    return torch.tensor(expected("emu3_vq")["runs"][0]["codes"])


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_half_precision_decodes_close_to_fp32(dtype, tolerance):
    with torch.no_grad():
        reference = load(BAAI).decode(codes())
        half = load(BAAI, dtype=dtype)
        assert half.codebook().dtype == dtype and half.decoder.time_res_stack[0].norm1.running_var.dtype == dtype
        images = half.decode(codes())
    assert images.dtype == dtype and torch.isfinite(images).all()
    assert (images.float() - reference).abs().max() < tolerance
    assert (images.float() - reference).abs().mean() < tolerance / 5


@pytest.mark.parametrize("bad", [-1, 64])
def test_a_code_out_of_range_is_refused_by_name(bad):
    decoder = load(BAAI)
    wrong = codes()
    wrong[1, 2, 3] = bad
    with pytest.raises(FastARError, match=r"codes outside 0\.\.63"):
        decoder.decode(wrong)
    with pytest.raises(FastARError, match="integer codes"):
        decoder.decode(codes().float())


def test_transformers_module_path_loads_as_its_saved_folder():
    """``model.vqmodel.*`` (transformers' module names, as FastAR's folder reader may hand them over) and ``vqmodel.*``
    (what save_pretrained writes) give the same decoder; the text model beside it is left alone."""
    sd, info = folder_weights(HF)
    assert any(k.startswith("text_model.") for k in sd) and any(k.startswith("vqmodel.encoder.") for k in sd)
    renamed = {("model." + k if k.startswith("vqmodel.") else k): v for k, v in sd.items()}
    a, b = load_emu3_vq(sd, info=info).state_dict(), load_emu3_vq(renamed, info=info).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    bare = {k[len("vqmodel."):]: v for k, v in sd.items() if k.startswith("vqmodel.")}  # Emu3VQVAE.save_pretrained's
    assert all(torch.equal(a[k], v) for k, v in load_emu3_vq(bare, info=info).state_dict().items())


@pytest.mark.parametrize("layout", [HF, BAAI])
def test_missing_and_stray_decoder_weights_name_the_folder(layout):
    sd, info = folder_weights(layout)
    conv_in = next(k for k in sd if k.endswith("decoder.conv_in.weight"))
    with pytest.raises(FastARError, match=rf"{layout} does not fit .*missing decoder\.conv_in\.weight"):
        load_emu3_vq({k: v for k, v in sd.items() if k != conv_in}, info=info)
    stray = conv_in.replace("conv_in", "conv_extra")
    with pytest.raises(FastARError, match=rf"{layout} does not fit .*unexpected decoder\.conv_extra\.weight"):
        load_emu3_vq({**sd, stray: sd[conv_in]}, info=info)


def test_a_folder_without_the_vq_model_or_its_config_says_what_to_pick(tmp_path):
    sd, info = folder_weights(HF)
    with pytest.raises(FastARError, match="holds no Emu3 vision tokenizer decoder.*Emu3-VisionTokenizer folder"):
        load_emu3_vq({k: v for k, v in sd.items() if k.startswith("text_model.")}, info=info)
    single, single_info = read_state_dict(fixture("emu3_vq") / BAAI / "model.safetensors")
    with pytest.raises(FastARError, match="read from its folder .* not a single file"):
        load_emu3_vq(single, info=single_info)
    config = json.loads((fixture("emu3_vq") / HF / "config.json").read_text())
    config["vq_config"]["num_attention_heads"] = 2
    info.config = config
    with pytest.raises(FastARError, match="one attention head"):
        load_emu3_vq(sd, info=info)
    config["vq_config"].update(num_attention_heads=1, embed_dim=8)
    with pytest.raises(FastARError, match="must be equal"):
        load_emu3_vq(sd, info=info)


def test_mean_and_std_come_from_the_folder_else_the_release(tmp_path):
    loaded = load(BAAI)
    assert loaded.cfg.image_mean == tuple(expected("emu3_vq")["source"]["image_mean"])
    assert loaded.cfg.image_std == tuple(expected("emu3_vq")["source"]["image_std"])
    bare = shutil.copytree(fixture("emu3_vq") / BAAI, tmp_path / BAAI)
    (bare / "preprocessor_config.json").unlink()
    sd, info = folder_weights(BAAI, bare)
    decoder = load_emu3_vq(sd, info=info)
    assert (decoder.cfg.image_mean, decoder.cfg.image_std) == (RELEASED_MEAN, RELEASED_STD)
    with torch.no_grad():  # 0.5 and 0.5: FastAR's -1..1 is the decoder's own output
        assert torch.allclose(decoder.decode(codes()), decoder.frames(codes(), every_frame=False)[:, 0], atol=1e-6)
