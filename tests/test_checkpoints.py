"""Checkpoint formats, family detection, config inference and every user-facing load error."""
import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastar.errors import FastARError, FastARWarning
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.checkpoint import CheckpointInfo, detect_family, read_state_dict
from fastar.model_loaders.shared.joined import parted_state_dict
from fastar.model_loaders.llamagen.loader import llamagen_config, load_llamagen, load_vq
from fastar.model_loaders.llamagen.model import LlamaGenGPT, find_multiple
from fastar.model_loaders.llamagen.vq import VQConfig, VQModel
from tiny_llamagen import tiny_conditioning, tiny_model, tiny_tokens

TINY_ARGS = argparse.Namespace(n_head=4, image_size=64, downsample_size=16, gpt_model="custom")


def official_sd(model_type="c2i", **overrides):
    return {k: v.clone() for k, v in parted_state_dict(tiny_model(model_type, **overrides)).items()}


def save_safetensors(path, sd, config=None):
    metadata = {"fastar_config": json.dumps(dataclasses.asdict(config))} if config else None
    save_file(sd, str(path), metadata=metadata)
    return path


def assert_same_weights(model_or_sd, expected):
    actual = parted_state_dict(model_or_sd) if hasattr(model_or_sd, "state_dict") else model_or_sd
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


def same_logits(a: LlamaGenGPT, b: LlamaGenGPT) -> bool:
    conditioning, tokens = tiny_conditioning(a), tiny_tokens(a)
    return torch.equal(a.training_logits(conditioning, tokens), b.training_logits(conditioning, tokens))


# -- formats ---------------------------------------------------------------------------------------


def test_safetensors_with_fastar_config(tmp_path):
    model = tiny_model("t2i")
    path = save_safetensors(tmp_path / "m.safetensors", official_sd("t2i"), model.cfg)
    loaded = load_llamagen(path)
    assert loaded.cfg == model.cfg
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert same_logits(model, loaded)
    assert load_llamagen(path, image_size=32).cfg.grid == (2, 2)  # an explicit image size wins


def test_pt_with_model_and_namespace_args(tmp_path):
    sd = official_sd()
    torch.save({"model": sd, "args": TINY_ARGS, "steps": 10}, tmp_path / "ddp.pt")
    tensors, info = read_state_dict(tmp_path / "ddp.pt")
    assert info.args["image_size"] == 64
    assert_same_weights(tensors, sd)
    model = load_llamagen(tmp_path / "ddp.pt", dtype=torch.float64)
    assert model.cfg.grid == (4, 4) and model.cfg.n_head == 4 and model.cfg.ffn_hidden == 48
    assert model.cfg.num_classes == 10 and model.dtype == torch.float64


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_raw_state_dict_in_every_pickle_suffix(tmp_path, suffix):
    sd = official_sd()
    torch.save(sd, tmp_path / f"raw{suffix}")
    tensors, info = read_state_dict(tmp_path / f"raw{suffix}")
    assert_same_weights(tensors, sd)
    assert info.args is None and info.metadata == {}


def test_legacy_non_zip_pickle(tmp_path):
    sd = official_sd()
    torch.save({"model": sd}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert_same_weights(read_state_dict(tmp_path / "old.pt")[0], sd)


@pytest.mark.parametrize("wrap", [
    lambda sd, other: {"ema": sd, "model": other},  # EMA weights preferred
    lambda sd, other: {"model_ema": sd, "model": other, "args": TINY_ARGS},
    lambda sd, other: {"module": sd},
    lambda sd, other: {"state_dict": sd, "epoch": 3},
    lambda sd, other: {"trainer": {"ema_parameters": sd, "step": 1}},
    lambda sd, other: {"state_dict": {"model": sd}},
    lambda sd, other: {"model": {f"module.{k}": v for k, v in sd.items()}},
])
def test_wrappers_and_prefix_are_unwrapped(tmp_path, wrap):
    sd, other = official_sd(seed=0), official_sd(seed=1)
    torch.save(wrap(sd, other), tmp_path / "wrapped.pt")
    assert_same_weights(read_state_dict(tmp_path / "wrapped.pt")[0], sd)


def test_cache_buffers_are_ignored(tmp_path):
    sd = official_sd()
    with_caches = {**sd, "freqs_cis": torch.zeros(20, 4, 2), "causal_mask": torch.ones(4, 4, dtype=torch.bool),
                   "layers.0.attention.kv_cache.k_cache": torch.zeros(1, 4, 8, 8),
                   "layers.1.attention.kv_cache.v_cache": torch.zeros(1, 4, 8, 8)}
    torch.save({"model": with_caches, "args": TINY_ARGS}, tmp_path / "cached.pt")
    assert_same_weights(load_llamagen(tmp_path / "cached.pt"), sd)


def to_hf_names(sd, cfg):
    """LANTERN's HF naming of a LlamaGen state dict, written out independently of the loader."""
    layer_names = {"attention.wo.weight": "self_attn.o_proj.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
                   "feed_forward.w3.weight": "mlp.up_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
                   "attention_norm.weight": "input_layernorm.weight",
                   "ffn_norm.weight": "post_attention_layernorm.weight"}
    top_names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
    hd = cfg.dim // cfg.n_head
    hf = {}
    for key, tensor in sd.items():
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if layer is None:
            hf[top_names.get(key, f"model.{key}")] = tensor
        elif layer.group(2) == "attention.wqkv.weight":
            q, k, v = tensor.split([cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd])
            for name, part in zip("qkv", (q, k, v)):
                hf[f"model.layers.{layer.group(1)}.self_attn.{name}_proj.weight"] = part.clone()
        else:
            hf[f"model.layers.{layer.group(1)}.{layer_names[layer.group(2)]}"] = tensor
    return hf


def hf_config(cfg):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": cfg.dim, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head, "num_hidden_layers": cfg.n_layer, "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.ffn_hidden, "rms_norm_eps": cfg.norm_eps, "rope_base": cfg.rope_base,
            "block_size": cfg.num_tokens, "cls_token_num": cfg.cls_token_num, "caption_dim": cfg.caption_dim,
            "input_type": cfg.model_type}


def save_hf_folder(folder: Path, sd, cfg, shards=2):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(cfg)))
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_hf_sharded_folder_with_renamed_keys_gives_identical_logits(tmp_path):
    model = tiny_model("t2i", n_kv_head=2)
    hf = to_hf_names(parted_state_dict(model), model.cfg)
    assert detect_family(hf) == "llamagen-gpt-hf"
    folder = save_hf_folder(tmp_path / "LlamaGen-T2I", hf, model.cfg)
    loaded = load_ar_model(folder)
    assert loaded.cfg == model.cfg
    assert same_logits(model, loaded)


def test_hf_folder_with_pytorch_model_bin(tmp_path):
    model = tiny_model("c2i")
    folder = tmp_path / "hf-bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(model.cfg)))
    torch.save(to_hf_names(parted_state_dict(model), model.cfg), folder / "pytorch_model.bin")
    assert same_logits(model, load_llamagen(folder))


def test_front_doors_dispatch_on_family(tmp_path):
    model = tiny_model()
    ar = save_safetensors(tmp_path / "ar.safetensors", official_sd(), model.cfg)
    vq = save_tiny_vq(tmp_path / "vq.safetensors")
    assert isinstance(load_ar_model(ar), LlamaGenGPT)
    assert isinstance(load_image_decoder(vq), VQModel)


# -- VQ --------------------------------------------------------------------------------------------

TINY_VQ = VQConfig(codebook_size=16, embed_dim=4, z_channels=32, ch=32, ch_mult=(1, 2), num_res_blocks=1)


def tiny_vq_sd(with_encoder: bool):
    vq = VQModel(dataclasses.replace(TINY_VQ, with_encoder=with_encoder))
    generator = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=generator) * 0.2 for k, v in vq.state_dict().items()}


def save_tiny_vq(path, with_encoder=False):
    return save_safetensors(path, tiny_vq_sd(with_encoder), dataclasses.replace(TINY_VQ, with_encoder=True))


def test_vq_decoder_only_from_metadata(tmp_path):
    vq = load_vq(save_tiny_vq(tmp_path / "vq.safetensors"))
    assert not hasattr(vq, "encoder") and vq.cfg.ch_mult == (1, 2)
    image = vq.decode_codes(torch.tensor([[[0, 5], [9, 15]]]))
    assert image.shape == (1, 3, 4, 4) and torch.isfinite(image).all()


def test_vq_from_official_pt_with_encoder_and_codebook_usage(tmp_path):
    sd = tiny_vq_sd(with_encoder=True)
    torch.save({"model": {**sd, "quantize.codebook_used": torch.zeros(16)}}, tmp_path / "vq_ds16.pt")
    vq = load_image_decoder(tmp_path / "vq_ds16.pt")
    assert vq.cfg == dataclasses.replace(TINY_VQ, with_encoder=True)
    assert_same_weights(vq, sd)


# -- config inference from shapes (meta tensors: official sizes without the memory) -----------------


def meta_sd(n_layer, dim, n_head, n_kv_head=None, vocab=16384, caption=None):
    n_kv_head = n_kv_head or n_head
    hd = dim // n_head
    ffn = find_multiple(int(8 * dim / 3), 256)
    sd = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,), "output.weight": (vocab, dim)}
    for i in range(n_layer):
        sd[f"layers.{i}.attention.wqkv.weight"] = ((n_head + 2 * n_kv_head) * hd, dim)
        sd[f"layers.{i}.feed_forward.w1.weight"] = (ffn, dim)
    if caption:
        sd["cls_embedding.cap_proj.fc1.weight"] = (dim, caption[1])
        sd["cls_embedding.uncond_embedding"] = caption
    else:
        sd["cls_embedding.embedding_table.weight"] = (1001, dim)
    return {k: torch.empty(shape, device="meta") for k, shape in sd.items()}


@pytest.mark.parametrize("n_layer,dim,n_head", [(12, 768, 12), (24, 1024, 16), (36, 1280, 20), (48, 1536, 24),
                                                (24, 3200, 32)])
def test_official_sizes_give_heads_and_default_grid(n_layer, dim, n_head):
    with pytest.warns(FastARWarning, match="raw.pt: nothing says its image size"):
        cfg = llamagen_config(meta_sd(n_layer, dim, n_head), CheckpointInfo("raw.pt"))
    assert (cfg.n_head, cfg.n_kv_head, cfg.grid, cfg.num_classes) == (n_head, n_head, (16, 16), 1000)


def test_gqa_kv_heads_come_from_the_wqkv_shape():
    cfg = llamagen_config(meta_sd(24, 1024, 16, n_kv_head=4), CheckpointInfo("gqa_256.pt"))
    assert (cfg.n_head, cfg.n_kv_head) == (16, 4)


def test_t2i_caption_layout_and_grid_from_args():
    info = CheckpointInfo("t2i.pt", args={"gpt_model": "GPT-XL", "image_size": 512, "downsample_size": 16})
    cfg = llamagen_config(meta_sd(36, 1280, 20, caption=(120, 2048)), info)
    assert (cfg.model_type, cfg.cls_token_num, cfg.caption_dim, cfg.grid) == ("t2i", 120, 2048, (32, 32))


def test_grid_is_the_square_root_of_the_block_size():
    cfg = llamagen_config(meta_sd(12, 768, 12), CheckpointInfo("c", config={"block_size": 576}))
    assert cfg.grid == (24, 24)
    with pytest.raises(FastARError, match=r"block size in its config \(200 tokens\) is not a square grid"):
        llamagen_config(meta_sd(12, 768, 12), CheckpointInfo("c", config={"block_size": 200}))


# -- image size: official releases carry no grid ----------------------------------------------------


def release_standin(folder: Path, name: str, n_layer: int, dim: int, n_head: int, wrapped: bool) -> Path:
    """A file shaped like an official release (names, layout, shapes) at almost no size: every tensor is
    one zero expanded to its shape, which torch.save stores as one element plus strides."""
    sd = {k: torch.zeros(()).expand(v.shape) for k, v in meta_sd(n_layer, dim, n_head).items()}
    torch.save({"model": sd} if wrapped else sd, folder / name)  # XXL and 3B are raw FSDP state dicts
    return folder / name


RELEASES = [  # file name, (layers, width, heads), wrapped in {"model": ...}, tokens per side
    ("c2i_B_256.pt", (12, 768, 12), True, 16), ("c2i_B_384.pt", (12, 768, 12), True, 24),
    ("c2i_L_256.pt", (24, 1024, 16), True, 16), ("c2i_L_384.pt", (24, 1024, 16), True, 24),
    ("c2i_XL_384.pt", (36, 1280, 20), True, 24), ("c2i_XXL_384.pt", (48, 1536, 24), False, 24),
    ("c2i_3B_384.pt", (24, 3200, 32), False, 24),
]


@pytest.mark.parametrize("name,size,wrapped,side", RELEASES)
def test_official_releases_get_the_grid_their_name_says(tmp_path, recwarn, name, size, wrapped, side):
    sd, info = read_state_dict(release_standin(tmp_path, name, *size, wrapped))
    cfg = llamagen_config(sd, info)
    assert (cfg.n_layer, cfg.dim, cfg.n_head, cfg.grid) == (*size, (side, side))
    assert llamagen_config(sd, info, image_size=512).grid == (32, 32)  # the user's choice wins
    assert not [w for w in recwarn if issubclass(w.category, FastARWarning)]


def test_image_size_order_explicit_args_config_name_default(tmp_path):
    sd = meta_sd(12, 768, 12)
    args = {"image_size": 384, "downsample_size": 16}
    assert llamagen_config(sd, CheckpointInfo("c2i_B_256.pt", args=args)).grid == (24, 24)  # args beat the name
    assert llamagen_config(sd, CheckpointInfo("c2i_B_256.pt", config={"image_size": 512})).grid == (32, 32)
    assert llamagen_config(sd, CheckpointInfo("c2i_B_256.pt", args=args), image_size=256).grid == (16, 16)
    with pytest.warns(FastARWarning, match=r"using 256 px \(16x16 tokens\).*--image-size"):
        assert llamagen_config(sd, CheckpointInfo("my_gpt.pt")).grid == (16, 16)
    with pytest.raises(FastARError, match="image size 300 px is not a positive multiple of the model's 16-pixel"):
        llamagen_config(sd, CheckpointInfo("c2i_B_256.pt"), image_size=300)


def test_following_the_size_warning_loads_at_the_chosen_size_without_warning(tmp_path, recwarn):
    path = tmp_path / "mine.pt"
    torch.save(official_sd(), path)
    (tmp_path / "mine.json").write_text(json.dumps({"n_head": 4}))
    with pytest.warns(FastARWarning, match="choose the image size"):
        assert load_ar_model(path).cfg.grid == (16, 16)
    recwarn.clear()
    assert load_ar_model(path, image_size=64).cfg.grid == (4, 4)
    assert not [w for w in recwarn if issubclass(w.category, FastARWarning)]


# -- size metadata beside the weights: every error's advice works ------------------------------------


def advice(error: pytest.ExceptionInfo) -> str:
    return str(error.value)


def test_unofficial_size_advice_name_json_next_to_the_file_works(tmp_path):
    torch.save({"model": official_sd(), "args": {"image_size": 64}}, tmp_path / "custom.pt")
    with pytest.raises(FastARError) as error:
        load_ar_model(tmp_path / "custom.pt")
    said = re.search(r'Write (\S+) next to custom.pt with: (\{.*\})', advice(error))
    assert said, advice(error)
    (tmp_path / said.group(1)).write_text(said.group(2).replace("N", "4"))
    model = load_ar_model(tmp_path / "custom.pt")
    assert model.cfg.n_head == 4 and model.cfg.grid == (4, 4)
    assert_same_weights(model, official_sd())


def test_unofficial_size_advice_in_a_folder_works(tmp_path):
    folder = tmp_path / "my_gpt"
    folder.mkdir()
    torch.save(official_sd(), folder / "my_gpt_step_20000.pt")  # any weights name, not only the HF ones
    with pytest.raises(FastARError) as error:
        load_ar_model(folder)
    said = re.search(r"Write the folder's config.json with: (\{.*\})", advice(error))
    assert said, advice(error)
    (folder / "config.json").write_text(said.group(1).replace("N", "4")[:-1] + ', "image_size": 64}')
    model = load_ar_model(folder)
    assert (model.cfg.n_head, model.cfg.grid) == (4, (4, 4))


def test_folder_with_several_weights_files_says_keep_one_and_then_loads(tmp_path):
    folder = tmp_path / "gpt"
    folder.mkdir()
    torch.save(official_sd(), folder / "last.pt")
    torch.save(official_sd(), folder / "best.ckpt")
    (folder / "config.json").write_text(json.dumps({"n_head": 4, "image_size": 64}))
    with pytest.raises(FastARError, match="several weights files .*best.ckpt, last.pt.*keep one"):
        load_ar_model(folder)
    (folder / "best.ckpt").unlink()
    assert load_ar_model(folder).cfg.grid == (4, 4)


def test_folder_without_weights_advice_works(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"n_head": 4, "image_size": 64}))
    with pytest.raises(FastARError, match=r"holds no weights: put the model's weights file \(.safetensors, .pt"):
        load_ar_model(folder)
    torch.save(official_sd(), folder / "weights.pth")
    assert load_ar_model(folder).cfg.n_head == 4


# -- errors ----------------------------------------------------------------------------------------


def test_missing_file_names_path_and_models_folder(tmp_path):
    with pytest.raises(FastARError, match=r"no checkpoint at .*nothing\.safetensors.*models/fastar"):
        read_state_dict(tmp_path / "nothing.safetensors")


def test_index_with_missing_shard(tmp_path):
    model = tiny_model()
    folder = save_hf_folder(tmp_path / "hf", to_hf_names(parted_state_dict(model), model.cfg), model.cfg)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FastARError, match=r"shards that are missing \(model-00002-of-00002.safetensors\)"):
        load_ar_model(folder)


def test_unknown_file_type(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(FastARError, match="unknown checkpoint type '.gguf'.*safetensors"):
        read_state_dict(tmp_path / "model.gguf")


def truncated(path: Path, save) -> Path:
    save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def filled(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


CORRUPT_FILES = {
    "truncated-safetensors": lambda d: truncated(d / "t.safetensors", lambda p: save_safetensors(p, official_sd())),
    "truncated-pt": lambda d: truncated(d / "t.pt", lambda p: torch.save({"model": official_sd()}, p)),
    "truncated-legacy-pt": lambda d: truncated(
        d / "t.pt", lambda p: torch.save({"model": official_sd()}, p, _use_new_zipfile_serialization=False)),
    "empty-safetensors": lambda d: filled(d / "e.safetensors", b""),
    "truncated-header-safetensors": lambda d: filled(d / "h.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a"),
}


@pytest.mark.parametrize("kind", CORRUPT_FILES)
def test_corrupt_files_ask_for_a_redownload(tmp_path, kind):
    with pytest.raises(FastARError, match="truncated or corrupt: re-download it"):
        read_state_dict(CORRUPT_FILES[kind](tmp_path))


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
@pytest.mark.parametrize("content", [b"hello", b"h", b"}", b"(", b"<!DOCTYPE html><html>Not Found</html>",
                                     b"0123456789", bytes(range(256)) * 4])
def test_a_file_that_is_no_weights_file_says_so(tmp_path, name, content):
    """What a failed download leaves (an HTML page, a stray text file named like weights, other bytes) is not
    called damaged: re-downloading the same link would give the same page."""
    kind = "safetensors" if name.endswith(".safetensors") else "PyTorch checkpoint"
    with pytest.raises(FastARError, match=f"{name} is not a {kind} file at all .*download the weights file itself"):
        read_state_dict(filled(tmp_path / name, content))


def test_a_git_lfs_pointer_says_how_to_fetch_the_weights(tmp_path):
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n"
    with pytest.raises(FastARError, match="is a Git LFS pointer, not the weights: fetch the file itself"):
        read_state_dict(filled(tmp_path / "model.safetensors", pointer))


def test_reader_fuzzed_with_short_random_files_only_raises_clear_errors(tmp_path):
    """Any damaged pickle stream must end in a FastARError that says what to do, never in a traceback."""
    generator = torch.Generator().manual_seed(0)
    clear = re.compile("truncated or corrupt: re-download it|refused for safety|holds no weights|is empty|"
                       "is not a PyTorch checkpoint file at all")
    for i in range(300):
        size = int(torch.randint(0, 48, (), generator=generator))
        data = bytes(torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8).tolist())
        if i % 3 == 0:  # the pickle protocol header, so the unpickler runs further into the noise
            data = b"\x80\x02" + data
        with pytest.raises(FastARError) as error:
            read_state_dict(filled(tmp_path / f"fuzz{i}.pt", data))
        assert clear.search(str(error.value)), (data, str(error.value))


class CreatesFileWhenUnpickled:
    marker: Path

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_pickle_with_disallowed_global_is_refused_and_never_runs(tmp_path):
    payload = CreatesFileWhenUnpickled()
    payload.marker = tmp_path / "code-ran"
    torch.save({"model": official_sd(), "hook": payload}, tmp_path / "evil.pt")
    with pytest.raises(FastARError, match=r"refused for safety.*\.safetensors"):
        read_state_dict(tmp_path / "evil.pt")
    assert not payload.marker.exists()


def test_empty_state_dict(tmp_path):
    torch.save({"model": {}, "args": TINY_ARGS}, tmp_path / "empty.pt")
    with pytest.raises(FastARError, match="holds no weights"):
        read_state_dict(tmp_path / "empty.pt")


def test_unrecognised_keys_are_named_with_the_supported_families(tmp_path):
    save_file({"encoder.conv.weight": torch.zeros(2), "head.bias": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(FastARError, match=r"encoder.conv.weight, head.bias.*var, llamagen-dd, llamagen-gpt, llamagen-gpt-hf, "
                                          r"janus, emu3, chameleon, mar, var-vqvae, llamagen-vq"):
        load_ar_model(tmp_path / "x.safetensors")


def test_vq_given_as_ar_model_and_vice_versa(tmp_path):
    vq = save_tiny_vq(tmp_path / "vq.safetensors")
    ar = save_safetensors(tmp_path / "ar.safetensors", official_sd(), tiny_model().cfg)
    for load, path in [(load_ar_model, vq), (load_llamagen, vq)]:
        with pytest.raises(FastARError, match="is a VQ tokenizer .*not an AR model: load it as the image decoder"):
            load(path)
    for load, path in [(load_image_decoder, ar), (load_vq, ar)]:
        with pytest.raises(FastARError, match="is a LlamaGen GPT .*not an image decoder: load it as the AR model"):
            load(path)


def test_strict_loading_names_missing_unexpected_and_misshaped_keys(tmp_path):
    model = tiny_model()
    sd = official_sd()
    del sd["norm.weight"]
    with pytest.raises(FastARError, match="missing norm.weight"):
        load_llamagen({"model": sd, "args": TINY_ARGS})
    bundled = official_sd() | tiny_vq_sd(with_encoder=False)
    with pytest.raises(FastARError, match=r"unexpected .*decoder\..*look like a VQ tokenizer, load it as the image decoder"):
        load_llamagen({"model": bundled, "args": TINY_ARGS})
    wrong = dataclasses.replace(model.cfg, ffn_hidden=64)
    with pytest.raises(FastARError, match=r"wrong shapes layers\.0\.feed_forward\.w1\.weight \(48, 32\) vs "
                                          r"\(64, 32\)"):
        load_llamagen(save_safetensors(tmp_path / "wrong.safetensors", official_sd(), wrong))


def test_hf_names_with_a_missing_projection(tmp_path):
    model = tiny_model()
    hf = to_hf_names(parted_state_dict(model), model.cfg)
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(FastARError, match="layer 1 has no k projection"):
        load_llamagen(hf)
