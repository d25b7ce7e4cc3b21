"""Builds the Chameleon-family conformance fixtures with the official code (run by hand, never by the tests).

    python tests/conformance/build/chameleon.py --lantern CHECKOUT_OF_jadohu/LANTERN \
        --lumina CHECKOUT_OF_Alpha-VLLM/Lumina-mGPT [--out tests/conformance/fixtures]
(in a venv with transformers 4.45.2, the version LANTERN pins; Lumina-mGPT asks for >= 4.43.3)

- chameleon_vqgan/: Meta's VQGAN (``vqgan.ckpt`` Lightning checkpoint + ``vqgan.yaml``) made by the taming
  ``VQModel`` class that Anole's TokenManager loads; 8192 codes as in the release, tiny channels.
- anole/: an Anole HF folder saved by LANTERN's Anole class (``modeling_anole_kv.ChameleonForConditionalGeneration``,
  ``save_pretrained``) with the real Chameleon ids of the tokens the official code hard-codes (bos 0, pad 1,
  codes at 4..8195 in code order, eoi 8196, boi 8197, ``<reserved08706>`` 8710); the expected codes are that
  class's own ``generate`` (LANTERN's Anole sampler: ``[0] + prompt + [8710, 8197]``, the CFG row ``[0, 8197]``,
  non-image logits blanked) with top_k 1, one prompt per call as it allows, and the images its ``decode_ids``
  (Meta's TokenManager + VQGAN) draws.

- lumina_mgpt/: a Lumina-mGPT folder saved by its own ``ChameleonXLLMXForConditionalGeneration`` with
  ``model_parallel_size`` 1, so its QK norms are stored as ``[1, head_dim]`` as in the released 7B folders; the
  expected codes are ``generate`` of the class its inference solver loads the folder with with the processors of ``FlexARInferenceSolver.create_logits_processor`` (the CFG
  pass from the image start, the layout processor that writes the row ends and the end of image, image top-k 1),
  the prompt built by its ``Conversation`` (prompt, ``<reserved08706>``) after bos; the image is its
  ``chameleon_vae_ori`` ImageTokenizer's.

Departures from a release run, each forced by a tiny CPU model: the TokenManager's hard-coded paths are filled in
a scratch folder and its hard-coded device 'cuda' becomes 'cpu'; the vocabulary stops after the tokens used, so the
class's list of non-image ids (0..3 and 8196..65535) is cut at the vocabulary's end; Lumina-mGPT's processors make
their id tensors on 'cuda' (made on the CPU here); the random Lumina-mGPT model cannot write the image start and
the size tokens itself, so they end its prompt (boi, then 128 px = 4 units twice, which the layout processor reads);
weights are re-initialised
(larger than transformers' 0.02, norms away from 1) and stored in fp16, which the sampler reads back in fp32.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import commit_of  # noqa: E402

CODES = 8192
WORDS = ["a", "red", "blue", "green", "ring", "circle", "square", "on", "background", "small", "large", "the",
         "Generate", "an", "image", "of", "according", "to", "following", "prompt", ":", "x", "768x768", "128x128"]
PROMPTS = ["a red ring on a blue background", "a small green square"]
ANOLE_CFG = 3.0


def code_name(k: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z"


def vocabulary() -> dict[str, int]:
    """Chameleon's ids for everything the official samplers hard-code; the words after them."""
    names = ["<s>", "<pad>", "</s>", "<unk>"] + [code_name(k) for k in range(CODES)] + ["<eoss>", "<racm3:break>"]
    names += [f"<reserved{n:05d}>" for n in range(8194, 8800 + 1024 // 32 + 1)]  # id = n + 4: 08706 is 8710
    names += WORDS
    vocab = {name: i for i, name in enumerate(names)}
    assert vocab["<reserved08706>"] == 8710 and vocab["<reserved08799>"] == 8803 and vocab["<racm3:break>"] == 8197
    return vocab


def write_tokenizer(folder: Path, vocab: dict[str, int]) -> Path:
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(n, special=True) for n in vocab if n.startswith("<")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "pad_token": "<pad>"}))
    return folder / "tokenizer.json"


VQGAN_PARAMS = {"embed_dim": 4, "n_embed": CODES, "ddconfig": {
    "double_z": False, "z_channels": 4, "resolution": 512, "in_channels": 3, "out_ch": 3, "ch": 32,
    "ch_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}}


# transformers-style vq_config for config.json (the folder's own VQ encoder, as converted releases carry one)
VQ_CONFIG = {"embed_dim": 4, "num_embeddings": CODES, "latent_channels": 4, "resolution": 512, "in_channels": 3,
             "base_channels": 32, "channel_multiplier": [1, 1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": []}


def build_vqgan(vqgan_module, folder: Path, seed: int) -> None:
    """Meta's VQGAN files, made by the official VQModel; weights re-drawn so the decoder's output has contrast."""
    torch.manual_seed(seed)
    model = vqgan_module.VQModel(**VQGAN_PARAMS).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("quantize."):
                p.normal_(0, 1.0)
            elif "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0, 1.5 / p[0].numel() ** 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {k: v.half() for k, v in model.state_dict().items()}}, folder / "vqgan.ckpt")
    (folder / "vqgan.yaml").write_text(yaml.safe_dump({"model": {"target": "chameleon.vqgan.VQModel",
                                                                 "params": VQGAN_PARAMS}}))


def reinitialise(model, seed: int) -> None:
    """Weights of unit-scale activations (logits far from ties) and norms away from their neutral init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


@contextlib.contextmanager
def working_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def build_anole(lantern: Path, out: Path, vocab: dict[str, int], vqgan: Path) -> dict:
    sys.path.insert(0, str(lantern))
    from models.base_models.anole.chameleon import chameleon as token_manager_module
    from models.configs.configuration_anole import ChameleonConfig
    from models.kv_variants import modeling_anole_kv

    official_token_manager = token_manager_module.TokenManager

    def cpu_token_manager(*args, device=None, **kwargs):
        return official_token_manager(*args, device="cpu", **kwargs)

    modeling_anole_kv.TokenManager = cpu_token_manager
    folder = out / "anole"
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp())
    files = scratch / "ckpts/anole/chameleon/tokenizer"  # where the class looks, relative to the working folder
    files.mkdir(parents=True)
    write_tokenizer(files, vocab).rename(files / "text_tokenizer.json")
    for name in ("vqgan.ckpt", "vqgan.yaml"):
        (files / name).write_bytes((vqgan / name).read_bytes())
    write_tokenizer(folder, vocab)

    config = ChameleonConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1100,
                             vocabulary_map=vocab, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                             vq_config=VQ_CONFIG)
    config._attn_implementation = "eager"
    with working_directory(scratch):
        torch.manual_seed(0)
        model = modeling_anole_kv.ChameleonForConditionalGeneration(config).eval()
        reinitialise(model, seed=1)
        model.half().save_pretrained(folder, safe_serialization=True)
        model = modeling_anole_kv.ChameleonForConditionalGeneration.from_pretrained(
            folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
        # the class lists ids 0..3 and 8196..65535 as non-image; the tiny vocabulary ends earlier
        model.non_image_tokens = torch.tensor([*range(4), *range(8196, len(vocab))])
        runs = {"codes": [], "images": []}
        with torch.no_grad():
            for i, prompt in enumerate(PROMPTS):
                ids, _, _ = model.generate(prompt=[prompt], max_length=1024, temperature=1.0, top_k=1, top_p=1.0,
                                           cfg=ANOLE_CFG)
                runs["codes"].append(model.tokenizer.translation.convert_bpe2img(ids[0].flatten()).tolist())
                if i == 0:  # one image keeps the fixture small; both prompts' codes are compared
                    _, images = model.decode_ids(ids)
                    images[0].save(folder / "anole_0.png")
                    runs["images"].append("anole_0.png")
    for codes in runs["codes"]:
        assert len(set(codes)) > 20, "degenerate greedy codes: re-draw the weights"
    return {"name": "anole cfg 3 greedy", "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg",
                                                    str(ANOLE_CFG), "--top-k", "1"], **runs}


LUMINA_SIZE = 128
LUMINA_CFG = 4.0


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """Lumina-mGPT's layout processor makes its tensors with device="cuda": make them on the CPU."""
    originals = {name: getattr(torch, name) for name in ("tensor", "arange")}

    def on_cpu(make):
        return lambda *args, device=None, **kwargs: make(*args, **kwargs)

    for name, make in originals.items():
        setattr(torch, name, on_cpu(make))
    try:
        yield
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)


def build_lumina(lumina: Path, out: Path, vocab: dict[str, int], vqgan: Path) -> dict:
    sys.path[:0] = [str(lumina / "lumina_mgpt"), str(lumina)]  # its modules import both ways
    from transformers import GenerationConfig, LogitsProcessorList

    import inference_solver
    from data.convertsation import Conversation
    from model.chameleon import ChameleonForConditionalGeneration
    from model.chameleon_vae_ori.image_tokenizer import ImageTokenizer
    from model.configuration_xllmx_chameleon import ChameleonXLLMXConfig
    from model.modeling_xllmx_chameleon import ChameleonXLLMXForConditionalGeneration

    folder = out / "lumina_mgpt"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(write_tokenizer(folder, vocab)))
    config = ChameleonXLLMXConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                  model_parallel_size=1, mask_image_logits=False, vocabulary_map=vocab,
                                  bos_token_id=0, pad_token_id=1, eos_token_id=2, vq_config=VQ_CONFIG)
    torch.manual_seed(0)
    model = ChameleonXLLMXForConditionalGeneration(config).eval()
    reinitialise(model, seed=3)
    norm = model.model.layers[0].self_attn.q_norm.weight
    assert tuple(norm.shape) == (1, 8), f"expected the release's [model_parallel_size, head_dim] layout, got {norm.shape}"
    model.half().save_pretrained(folder, safe_serialization=True)
    model = ChameleonForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()  # as the solver

    units = LUMINA_SIZE // 32
    image_start = [vocab["<racm3:break>"]] + [vocab[f"<reserved{8800 + units:05d}>"]] * 2  # height, width
    side = units * 2  # image tokens per side (16-pixel tokens)
    runs = {"codes": [], "images": []}
    image_tokenizer = ImageTokenizer(cfg_path=str(vqgan / "vqgan.yaml"), ckpt_path=str(vqgan / "vqgan.ckpt"),
                                     device="cpu")
    for i, prompt in enumerate(PROMPTS):
        conversation = Conversation()
        conversation.load_qas([[f"Generate an image of {LUMINA_SIZE}x{LUMINA_SIZE} according to the following "
                                f"prompt:\n{prompt}", None]])
        text = conversation.process()["conv"]
        ids = [vocab["<s>"]] + tokenizer.encode(text, add_special_tokens=False).ids + image_start
        solver = inference_solver.FlexARInferenceSolver.__new__(inference_solver.FlexARInferenceSolver)
        solver.model = model
        solver.item_processor = type("Ids", (), {
            "image_start_token": "<racm3:break>", "image_end_token": "<eoss>", "new_line_token": "<reserved08799>",
            "token2id": staticmethod(lambda token: vocab[token])})()
        with cuda_tensors_on_cpu():
            processors = solver.create_logits_processor(cfg=LUMINA_CFG, image_top_k=1)
        generation = GenerationConfig(max_new_tokens=side * (side + 1) + 1, max_length=256, temperature=1.0,
                                      top_k=None, do_sample=True, eos_token_id=[8710])
        with torch.no_grad():
            written = model.generate(torch.tensor([ids]), generation, logits_processor=LogitsProcessorList(processors))
        written = written[0, len(ids):].tolist()
        assert written[-1] == vocab["<eoss>"] and len(written) == side * (side + 1) + 1, written
        rows = [written[r * (side + 1): (r + 1) * (side + 1)] for r in range(side)]
        assert all(row[-1] == vocab["<reserved08799>"] for row in rows)
        codes = [t - 4 for row in rows for t in row[:-1]]  # ids 4..8195 are codes 0..8191 in this vocabulary
        assert all(code_name(c) in vocab and vocab[code_name(c)] == c + 4 for c in codes)
        runs["codes"].append(codes)
        if i == 0:
            image = image_tokenizer.pil_from_img_toks(torch.tensor(codes), side, side)
            image.save(folder / "lumina_0.png")
            runs["images"].append("lumina_0.png")
    for codes in runs["codes"]:
        assert len(set(codes)) > 10, "degenerate greedy codes: re-draw the weights"
    return {"name": "lumina-mgpt cfg 4 greedy", "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg",
                                                          str(LUMINA_CFG), "--top-k", "1", "--image-size",
                                                          str(LUMINA_SIZE)], **runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lantern", required=True, type=Path, help="a checkout of jadohu/LANTERN")
    parser.add_argument("--lumina", required=True, type=Path, help="a checkout of Alpha-VLLM/Lumina-mGPT")
    parser.add_argument("--commit", help="LANTERN's commit, when the checkout is an export without .git")
    parser.add_argument("--lumina-commit", help="Lumina-mGPT's commit, likewise")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "fixtures")
    args = parser.parse_args()
    import transformers

    vocab = vocabulary()
    sys.path.insert(0, str(args.lantern))
    from models.base_models.anole.chameleon import vqgan as vqgan_module

    vqgan = args.out / "chameleon_vqgan"
    build_vqgan(vqgan_module, vqgan, seed=2)
    run = build_anole(args.lantern, args.out, vocab, vqgan)
    source = {"repository": "jadohu/LANTERN", "commit": args.commit or commit_of(args.lantern),
              "packages": {"torch": torch.__version__, "transformers": transformers.__version__},
              "builder": "tests/conformance/build/chameleon.py",
              "made_with": "models/kv_variants/modeling_anole_kv.py ChameleonForConditionalGeneration (save_pretrained, "
                           "generate, decode_ids); models/base_models/anole/chameleon (TokenManager, VQModel)"}
    (args.out / "anole" / "expected.json").write_text(json.dumps({"source": source, "runs": [run]}))
    lumina_run = build_lumina(args.lumina, args.out, vocab, vqgan)
    lumina_source = {**source, "repository": "Alpha-VLLM/Lumina-mGPT",
                     "commit": args.lumina_commit or commit_of(args.lumina),
                     "made_with": "lumina_mgpt/model/modeling_xllmx_chameleon.py ChameleonXLLMXForConditionalGeneration "
                                  "(model_parallel_size 1, save_pretrained); model/chameleon ChameleonForConditionalGeneration "
                                  "(from_pretrained, generate, as the solver loads it); inference_solver.py "
                                  "FlexARInferenceSolver.create_logits_processor; data/convertsation.py Conversation; "
                                  "model/chameleon_vae_ori ImageTokenizer"}
    (args.out / "lumina_mgpt" / "expected.json").write_text(json.dumps({"source": lumina_source,
                                                                          "runs": [lumina_run]}))
    (vqgan / "SOURCE.json").write_text(json.dumps({**source, "made_with": "models/base_models/anole/chameleon/vqgan.py "
                                                   "VQModel, saved as Meta's Lightning checkpoint"}))


if __name__ == "__main__":
    main()
