"""Builds the Chameleon-family conformance fixtures with the official code (run by hand, never by the tests).

    python tests/conformance/build/chameleon.py --lantern CHECKOUT_OF_jadohu/LANTERN \
        --lumina CHECKOUT_OF_Alpha-VLLM/Lumina-mGPT [--out tests/conformance/fixtures]
(in a venv with transformers 4.45.2, the version LANTERN pins; Lumina-mGPT asks for >= 4.43.3)
    python tests/conformance/build/chameleon.py --lantern CHECKOUT_OF_jadohu/LANTERN --only anole_lantern
    python tests/conformance/build/chameleon.py --lantern CHECKOUT_OF_jadohu/LANTERN --only anole_lantern_trees
    python tests/conformance/build/chameleon.py --lumina CHECKOUT_OF_Alpha-VLLM/Lumina-mGPT --only lumina_mgpt_shapes
(from the committed fixtures: LANTERN's Anole drafter; its static and dynamic trees, anole_lantern/expected_trees.json,
with the checks of build/trees.py)

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
  ``chameleon_vae_ori`` ImageTokenizer's. lumina_mgpt/expected_shapes.json: the same solver on that folder at
  non-square shapes of its ``generate_crop_size_list`` (``{w}x{h}`` in the prompt, the size tokens height first).

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
from provenance import commit_of, fixed_at_of, packages, write_expected  # noqa: E402
import trees  # noqa: E402 - build/trees.py: LANTERN's trees and the checks of a tree fixture

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


def anole_scratch(vocab: dict[str, int], vqgan: Path) -> Path:
    """A scratch working folder holding the files LANTERN's Anole classes open at hard-coded relative paths."""
    scratch = Path(tempfile.mkdtemp())
    files = scratch / "ckpts/anole/chameleon/tokenizer"  # where the class looks, relative to the working folder
    files.mkdir(parents=True)
    write_tokenizer(files, vocab).rename(files / "text_tokenizer.json")
    for name in ("vqgan.ckpt", "vqgan.yaml"):
        (files / name).write_bytes((vqgan / name).read_bytes())
    return scratch


def use_cpu_token_manager() -> None:
    """LANTERN's Anole class builds Meta's TokenManager on a hard-coded 'cuda': here it is built on the CPU."""
    from models.base_models.anole.chameleon import chameleon as token_manager_module
    from models.kv_variants import modeling_anole_kv

    official = token_manager_module.TokenManager

    def cpu_token_manager(*args, device=None, **kwargs):
        return official(*args, device="cpu", **kwargs)

    modeling_anole_kv.TokenManager = cpu_token_manager


def build_anole(lantern: Path, out: Path, vocab: dict[str, int], vqgan: Path) -> dict:
    sys.path.insert(0, str(lantern))
    from models.configs.configuration_anole import ChameleonConfig
    from models.kv_variants import modeling_anole_kv

    use_cpu_token_manager()
    folder = out / "anole"
    folder.mkdir(parents=True, exist_ok=True)
    scratch = anole_scratch(vocab, vqgan)
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
    from model.chameleon import ChameleonForConditionalGeneration
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
    runs = lumina_runs(model, tokenizer, vocab, vqgan, folder, LUMINA_SIZE, LUMINA_SIZE, "lumina_0.png")
    return {"name": "lumina-mgpt cfg 4 greedy", "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg",
                                                          str(LUMINA_CFG), "--top-k", "1", "--image-size",
                                                          str(LUMINA_SIZE)], **runs}


def lumina_runs(model, tokenizer, vocab: dict[str, int], vqgan: Path, folder: Path, height: int, width: int,
                image_name: str) -> dict:
    """The official solver's greedy codes for PROMPTS at ``height`` x ``width`` px (the prompt's ``{w}x{h}``, then
    boi and the size tokens height first, as its item processor writes them and its layout processor reads them),
    and its ImageTokenizer's image of the first (``image_name`` in ``folder``)."""
    from transformers import GenerationConfig, LogitsProcessorList

    import inference_solver
    from data.convertsation import Conversation
    from model.chameleon_vae_ori.image_tokenizer import ImageTokenizer

    image_start = [vocab["<racm3:break>"]] + [vocab[f"<reserved{8800 + side // 32:05d}>"] for side in (height, width)]
    rows_n, cols_n = height // 16, width // 16  # image tokens per column and per row (16-pixel tokens)
    runs = {"codes": [], "images": []}
    image_tokenizer = ImageTokenizer(cfg_path=str(vqgan / "vqgan.yaml"), ckpt_path=str(vqgan / "vqgan.ckpt"),
                                     device="cpu")
    for i, prompt in enumerate(PROMPTS):
        conversation = Conversation()
        conversation.load_qas([[f"Generate an image of {width}x{height} according to the following "
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
        generation = GenerationConfig(max_new_tokens=rows_n * (cols_n + 1) + 1, max_length=256, temperature=1.0,
                                      top_k=None, do_sample=True, eos_token_id=[8710])
        with torch.no_grad():
            written = model.generate(torch.tensor([ids]), generation, logits_processor=LogitsProcessorList(processors))
        written = written[0, len(ids):].tolist()
        assert written[-1] == vocab["<eoss>"] and len(written) == rows_n * (cols_n + 1) + 1, written
        rows = [written[r * (cols_n + 1): (r + 1) * (cols_n + 1)] for r in range(rows_n)]
        assert all(row[-1] == vocab["<reserved08799>"] for row in rows)
        codes = [t - 4 for row in rows for t in row[:-1]]  # ids 4..8195 are codes 0..8191 in this vocabulary
        assert all(code_name(c) in vocab and vocab[code_name(c)] == c + 4 for c in codes)
        runs["codes"].append(codes)
        if i == 0:
            image = image_tokenizer.pil_from_img_toks(torch.tensor(codes), rows_n, cols_n)
            assert image.size == (width, height), image.size
            image.save(folder / image_name)
            runs["images"].append(image_name)
    for codes in runs["codes"]:
        assert len(set(codes)) > 10, "degenerate greedy codes: re-draw the weights"
    return runs


# (width, height) px at --image-size 128, whose release size list is 256x64 (4:1) ... 128x96 (4:3), 128x128,
# 96x128 (3:4) ... 64x256 (1:4): one wide and one tall shape, each side a different number of 32-pixel units
LUMINA_SHAPES = [("4:3", 128, 96), ("2:5", 64, 160)]


def build_lumina_shapes(lumina: Path, out: Path, vocab: dict[str, int]) -> list:
    """Non-square runs on the committed lumina_mgpt/ folder (lumina_mgpt/expected_shapes.json): the official solver
    at each of LUMINA_SHAPES, with the size the release's ``generate_crop_size_list`` offers for that ratio."""
    sys.path[:0] = [str(lumina / "lumina_mgpt"), str(lumina)]  # its modules import both ways
    from data.item_processor import generate_crop_size_list
    from model.chameleon import ChameleonForConditionalGeneration

    folder = out / "lumina_mgpt"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab() == vocab, "the committed tokenizer is not this builder's vocabulary"
    offered = generate_crop_size_list((LUMINA_SIZE // 32) ** 2, 32)
    model = ChameleonForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    runs = []
    for ratio, width, height in LUMINA_SHAPES:
        assert (width, height) in offered, (ratio, offered)
        name = f"lumina_{width}x{height}_0.png"
        codes = lumina_runs(model, tokenizer, vocab, out / "chameleon_vqgan", folder, height, width, name)
        runs.append({"name": f"lumina-mgpt {width}x{height} ({ratio}) cfg 4 greedy", "height": height, "width": width,
                     "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg", str(LUMINA_CFG), "--top-k", "1",
                              "--image-size", str(LUMINA_SIZE), "--aspect-ratio", ratio], **codes})
    return runs


LUMINA_SHAPES_MADE_WITH = (
    "model/chameleon ChameleonForConditionalGeneration (from_pretrained of the committed lumina_mgpt/ folder, "
    "generate, as the solver loads it); inference_solver.py FlexARInferenceSolver.create_logits_processor (its layout processor "
    "reads the grid from the two size tokens after the image start, height first); data/item_processor.py "
    "generate_crop_size_list (the shapes its demo offers, scaled to 128 px: (128 // 32) ** 2 units); "
    "data/convertsation.py Conversation; model/chameleon_vae_ori ImageTokenizer on the committed chameleon_vqgan/. "
    "The tiny word-level tokenizer has no word for the shapes' '{w}x{h}', which both sides encode as <unk>")


ANOLE_GAMMA = 4  # drafts per target forward: Model(top_k=1, depth=GAMMA - 1, total_tokens=GAMMA + 1) drafts a chain


def anole_drafter_config(target_config) -> dict:
    """data/configs/anole_config.json (the released drafter's config: the target's Chameleon config with one layer)
    at the tiny target's sizes."""
    config = json.loads((Path(target_config) / "config.json").read_text())
    keep = ["architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act",
            "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias",
            "model_parallel_size", "model_type", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_scaling", "rope_theta", "swin_norm", "tie_word_embeddings", "vocab_size"]
    drafter = {k: config[k] for k in keep if k in config}
    drafter.update({"num_hidden_layers": 1, "boi_token_id": 8197, "eoi_token_id": 8196, "image_token_id": 8711,
                    "torch_dtype": "float16", "use_cache": True})
    return drafter


class Recorder:
    """Wraps a callable (the official evaluate_posterior), keeping what each call returned."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.calls.append(out)
        return out


def anole_rows(tokenizer, prompt: str, image_ids: list[int]):
    """EaModel.generate's two rows for one prompt (cond ``[0] + prompt + [8710, 8197]``, uncond
    ``[1] * (L - 2) + [0, 8197]``), each followed by ``image_ids``; its mask (ids != 1 over the prompt, then
    ones) and its target positions (cond 0.., uncond 0 over padding and bos, 1 at boi, image k at k + 2, as its
    tree_decoding shifts them by ``input_position_diff = L - 2``)."""
    cond = [0] + tokenizer.tokenize_text(prompt) + [8710, 8197]
    L = len(cond)
    uncond = [1] * (L - 2) + [0, 8197]
    ids = torch.tensor([cond + image_ids, uncond + image_ids])
    prompt_mask = torch.tensor([cond, uncond]) != 1
    mask = torch.cat([prompt_mask, torch.ones(2, len(image_ids), dtype=torch.bool)], 1)
    cond_pos = torch.arange(ids.shape[1])
    uncond_pos = (cond_pos - (L - 2)).clamp(min=0)  # 0 over padding and bos, 1 at boi, k + 2 at image k
    return ids, prompt_mask, mask, torch.stack([cond_pos, uncond_pos]), L


def official_cfg_logits(head, features, non_image, cfg=ANOLE_CFG):
    from models.drafters.cnets_anole import cfg_logit_process

    logits = cfg_logit_process(head(features), cfg)
    logits[..., non_image] = torch.finfo(logits.dtype).min
    return logits


def anole_teacher_forced(drafter, base, tokenizer, prompt: str, codes: list[int], non_image):
    """The official drafter over one prompt's whole sequence, as Model.topK_genrate computes its prefill rows
    (Model.forward(hidden, input_ids[:, 1:], attention_mask=the prompt mask, position_ids cond 0.., uncond
    shifted by L - 2 and clamped at 0)): the target's final-norm hidden states of slots 0..T-1 (its forward with
    EaModel's mask and positions) paired with the tokens of slots 1..T. Returns (hidden [2, T, D], target-input
    ids [2, T + 1], prompt mask, positions, L, CFG-combined image-masked draft logits [T, V])."""
    image_ids = [c + 4 for c in codes]
    ids, prompt_mask, mask, positions, L = anole_rows(tokenizer, prompt, image_ids)
    base.model.tree_mask = None
    hidden = base.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                        use_cache=False, return_dict=True).last_hidden_state
    T = hidden.shape[1]
    drafter_pos = torch.arange(T)[None]
    drafter_pos = torch.cat([drafter_pos, (drafter_pos - (L - 2)).clamp(min=0)])
    drafter.reset()
    features, _ = drafter(hidden, input_ids=ids[:, 1:], attention_mask=prompt_mask, position_ids=drafter_pos,
                          use_cache=True)
    return hidden, ids, prompt_mask, drafter_pos, L, official_cfg_logits(base.lm_head, features, non_image)[0]


def train_anole_drafter(drafter, rows, base, steps=150):
    """Weights for the tiny drafter: regress the target's next hidden state and its greedy code (EAGLE's
    objective), so the chains get accepted and the spec run drafts past the first token."""
    image_head = base.lm_head.weight[4:8196].detach()  # the image ids' rows (the others are blanked anyway)
    drafter.train()
    drafter.gradient_checkpointing = False
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(params, lr=3e-3)
    with torch.enable_grad():
        for step in range(steps):
            loss = 0
            for hidden, ids, prompt_mask, positions, L, codes in rows:
                drafter.reset()
                out = drafter(hidden[:, :-1], input_ids=ids[:, 1:-1], attention_mask=prompt_mask,
                              position_ids=positions[:, :-1], use_cache=False)
                cond, uncond = (out[:, L - 1:] @ image_head.T).unbind(0)  # image rows: row k drafts code k+1
                loss = loss + (out - hidden[:, 1:]).square().mean() + torch.nn.functional.cross_entropy(
                    uncond + (cond - uncond) * ANOLE_CFG, torch.tensor(codes[1:]))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            if step % 50 == 0:
                print(f"step {step}: loss {loss.item():.3f}", flush=True)
    drafter.eval()
    print(f"drafter loss {loss.item():.3f}")


def build_anole_lantern(lantern: Path, out: Path, vocab: dict[str, int], vqgan: Path) -> dict:
    """LANTERN's Anole drafter (fixtures/anole_lantern/drafter) for the committed anole/ target."""
    sys.path.insert(0, str(lantern))
    import numpy as np

    from models import ea_model_anole
    from models.configs.configs import EConfigAnole
    from models.drafters import cnets_anole
    from models.kv_variants import modeling_anole_kv

    use_cpu_token_manager()
    target_folder = out / "anole"
    target_run = json.loads((target_folder / "expected.json").read_text())["runs"][0]
    folder = out / "anole_lantern"
    (folder / "drafter").mkdir(parents=True, exist_ok=True)
    scratch = anole_scratch(vocab, vqgan)
    distances = scratch / "ckpts/anole/vq_distances"  # EaModel loads it; only its relaxed (lantern) test reads it
    distances.mkdir(parents=True)
    np.save(distances / "top_8191_indices.npy", np.tile(np.arange(CODES, dtype=np.int64), (CODES, 1))[:, :2])
    non_image = torch.tensor([*range(4), *range(8196, len(vocab))])  # the class's 0..3 + 8196..65535, cut

    with working_directory(scratch):
        base = modeling_anole_kv.ChameleonForConditionalGeneration.from_pretrained(
            target_folder.resolve(), torch_dtype=torch.float32, attn_implementation="eager").eval()
        tokenizer = base.tokenizer
        config = anole_drafter_config(target_folder)
        torch.manual_seed(0)
        drafter = cnets_anole.Model(EConfigAnole(**config), bias=True, total_tokens=ANOLE_GAMMA + 1,
                                    depth=ANOLE_GAMMA - 1, top_k=1).eval()
        drafter.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight.data)  # the target's, frozen
        reinitialise(drafter.layers, seed=5)  # norms away from 1 (a misplaced one shows), unit-scale weights
        drafter.non_image_tokens = non_image
        rows = []
        with torch.no_grad():
            for prompt, codes in zip(PROMPTS, target_run["codes"]):
                hidden, ids, prompt_mask, positions, L, _ = anole_teacher_forced(drafter, base, tokenizer, prompt,
                                                                                 codes, non_image)
                rows.append((hidden, ids, prompt_mask, positions, L, codes))
        train_anole_drafter(drafter, rows, base)
        (folder / "drafter" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        torch.save({k: v.half() for k, v in drafter.state_dict().items()}, folder / "drafter" / "pytorch_model.bin")

        # the official sampler: EaModel.from_pretrained on the two folders, greedy (temperature 0: no logits
        # processor), the target's own greedy codes for comparison
        model = ea_model_anole.EaModel.from_pretrained(
            base_model_path=str(target_folder.resolve()), ea_model_path=str((folder / "drafter").resolve()),
            total_token=ANOLE_GAMMA + 1, depth=ANOLE_GAMMA - 1, top_k=1, torch_dtype=torch.float32,
            attn_implementation="eager").eval()
        for owner in (model, model.ea_layer, model.base_model):
            owner.non_image_tokens = non_image
        posterior = Recorder(model.evaluate_posterior)
        model.evaluate_posterior = posterior
        run = {"codes": [], "fixed_at": [], "drafts": [], "drafter_logit_rows": None}
        sampled = None
        logits_out = []
        for prompt, target_codes in zip(PROMPTS, target_run["codes"]):
            posterior.calls.clear()
            with torch.no_grad():
                ids, mean_accept, _ = model.generate(prompt=[prompt], max_length=1024, temperature=0.0, top_k=1,
                                                     top_p=1.0, cfg=ANOLE_CFG, lantern=False, static_tree=False)
            codes = tokenizer.translation.convert_bpe2img(ids[0].flatten()).tolist()
            assert codes == target_codes, "greedy speculative decoding left the target's greedy codes"
            accepted = [int(call[1]) for call in posterior.calls]
            run["codes"].append(codes)
            run["fixed_at"].append(fixed_at_of(accepted, len(codes)))
            print(f"{prompt!r}: {len(accepted)} target forwards after the prefill, mean accept {mean_accept:.2f}")
            # the drafter's own outputs: its teacher-forced rows, reloaded as EaModel holds it
            with torch.no_grad():
                _, _, _, _, L, logits = anole_teacher_forced(model.ea_layer, model.base_model, tokenizer, prompt,
                                                             codes, non_image)
            image = logits[L - 1: L - 1 + len(codes) - 1, 4:8196]  # row k (boi's slot + k) drafts code k + 1
            top = image.topk(2, dim=-1).values
            gap = (top[:, 0] - top[:, 1]).min().item()
            assert gap > 1e-3, f"near tie in the teacher-forced drafts ({gap:.1e})"
            run["drafts"].append(image.argmax(-1).tolist())
            sampled = list(range(0, image.shape[0], 124))
            logits_out.append(image[sampled].numpy())
        run["drafter_logit_rows"] = sampled
        np.save(folder / "drafter_logits.npy", np.stack(logits_out).astype(np.float32))
    assert sum(max(a) for a in run["fixed_at"]) < 0.8 * sum(len(c) - 1 for c in run["codes"]), \
        "the drafter's chains are hardly accepted"
    return {"name": f"anole spec gamma {ANOLE_GAMMA} cfg {ANOLE_CFG} greedy",
            "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg", str(ANOLE_CFG), "--top-k", "1",
                     "--decoder", "spec", "--gamma", str(ANOLE_GAMMA)], **run}


ANOLE_LANTERN_MADE_WITH = (
    "drafter/: models/drafters/cnets_anole.Model(EConfigAnole(config.json), bias=True, top_k=1, depth=3, "
    "total_tokens=5) (config.json: data/configs/anole_config.json's keys at anole/'s sizes, one layer) with "
    "anole/'s token embeddings, its layer re-initialised (norms away from 1) and trained briefly (next hidden "
    "state + CE on the target's greedy codes, EAGLE's objective) so chains get accepted; saved as the release "
    "(config.json + pytorch_model.bin of its state_dict, fp16). codes/fixed_at: models/ea_model_anole.py "
    "EaModel.from_pretrained(anole/, drafter/, total_token=5, depth=3, top_k=1).generate(prompt=[p], "
    "max_length=1024, temperature=0 (greedy: no logits processor), cfg=3, lantern=False, static_tree=False), "
    "one prompt per call as it allows; fixed_at from its evaluate_posterior accept lengths (iteration i fixes "
    "its accepted drafts and the target's next code; 0 = the prefill's first code). drafts/drafter_logits.npy: "
    "the EaModel's drafter (Model.forward) teacher-forced over each prompt's whole sequence with the arguments "
    "topK_genrate builds at its prefill (target final-norm hidden of slots 0..T-1 from its forward with "
    "EaModel.generate's mask and positions, tokens of slots 1..T, the prompt mask, positions cond 0.., uncond "
    "shifted by L-2 and clamped at 0), then cfg_logit_process(lm_head(.), 3) with non-image ids blanked; row k "
    "(boi's slot + k) drafts code k+1; logits at image ids 4..8195 of rows 0::124. Departures forced by the tiny "
    "CPU model: TokenManager on 'cpu'; the non-image id list (0..3, 8196..65535) cut at the tiny vocabulary's end "
    "in the EaModel, its drafter and its target; ckpts/anole/vq_distances/top_8191_indices.npy, which EaModel "
    "loads but only its relaxed (lantern=True) acceptance reads, is a placeholder in the scratch folder")


def build_anole_lantern_trees(lantern: Path, out: Path, vocab: dict[str, int]) -> list:
    """anole_lantern/expected_trees.json's runs: the committed anole/ target and anole_lantern/drafter/ in LANTERN's
    own sampler at its tree defaults (static naive_extend_57 and dynamic), greedy, one prompt per call."""
    sys.path.insert(0, str(lantern))
    import numpy as np

    from models import ea_model_anole
    from models.drafters import choices, cnets_anole

    use_cpu_token_manager()
    target_folder, folder = (out / "anole").resolve(), (out / "anole_lantern").resolve()
    chain_run = json.loads((folder / "expected.json").read_text())["runs"][0]
    scratch = anole_scratch(vocab, out / "chameleon_vqgan")
    distances = scratch / "ckpts/anole/vq_distances"  # EaModel loads it; only its relaxed (lantern) test reads it
    distances.mkdir(parents=True)
    np.save(distances / "top_8191_indices.npy", np.tile(np.arange(CODES, dtype=np.int64), (CODES, 1))[:, :2])
    non_image = torch.tensor([*range(4), *range(8196, len(vocab))])  # the class's 0..3 + 8196..65535, cut

    runs = []
    with working_directory(scratch):
        model = ea_model_anole.EaModel.from_pretrained(
            base_model_path=str(target_folder), ea_model_path=str(folder / "drafter"), total_token=trees.TOTAL_TOKEN,
            depth=trees.DEPTH, top_k=trees.TOP_K, torch_dtype=torch.float32, attn_implementation="eager").eval()
        for owner in (model, model.ea_layer, model.base_model):
            owner.non_image_tokens = non_image
        tokenizer = model.base_model.tokenizer
        for kind in ("static", "dynamic"):
            margins, gaps = trees.PathMargins(), trees.BoundaryGaps()
            run = {"codes": [], "fixed_at": [], "target_forwards": []}
            for b, prompt in enumerate(PROMPTS):
                def generate(static_tree, prompt=prompt):
                    return model.generate(prompt=[prompt], max_length=1024, temperature=0.0, top_k=1, top_p=1.0,
                                          cfg=ANOLE_CFG, lantern=False, static_tree=static_tree)[0]

                target = chain_run["codes"][b]  # the target's greedy codes (checked by the anole_lantern case)
                ids, accepts = trees.ea_model_run(model, cnets_anole, generate, kind, [c + 4 for c in target],
                                                  choices.naive_extend_57, margins, gaps, tag=f"prompt {b}")
                codes = tokenizer.translation.convert_bpe2img(ids[0].flatten()).tolist()
                assert codes == target, f"{kind}: greedy speculative decoding left the target's greedy codes"
                for seed in range(trees.SHAKES):
                    _, shaken = trees.ea_model_run(model, cnets_anole, generate, kind, [c + 4 for c in target],
                                                   choices.naive_extend_57, shake=seed)
                    assert shaken == accepts, f"{kind}: the accept lengths move when the drafter's logits are shaken"
                run["codes"].append(codes)
                run["fixed_at"].append(fixed_at_of(accepts, len(codes)))
                run["target_forwards"].append(max(run["fixed_at"][-1]))
            print(f"{kind}: target forwards per image {run['target_forwards']}", end="; ")
            runs.append({"name": f"anole spec {kind} tree cfg {ANOLE_CFG} greedy",
                         "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg", str(ANOLE_CFG), "--top-k",
                                  "1", "--decoder", "spec", *map(str, trees.fastar_args(kind))],
                         **run, **trees.summary(margins, gaps)})
    return runs


ANOLE_LANTERN_TREES_MADE_WITH = (
    "models/ea_model_anole.py EaModel.from_pretrained(anole/, anole_lantern/drafter/, total_token=59, depth=4, "
    "top_k=10: its defaults, torch_dtype fp32, eager attention).generate(prompt=[p], max_length=1024, temperature=0 "
    "(greedy: no logits processor), cfg=3, lantern=False, static_tree=True (tree_choices naive_extend_57: "
    "topK_genrate_v1, evaluate_posterior_v1) or False (topK_genrate, evaluate_posterior)), one prompt per call as it "
    "allows, with the anole_lantern case's set-up (TokenManager on 'cpu', the non-image id list cut at the tiny "
    "vocabulary's end in the EaModel, its drafter and its target, the vq_distances placeholder); codes (BPE ids "
    "through the tokenizer's convert_bpe2img) asserted equal to expected.json's (the target's greedy codes); "
    "fixed_at from the evaluate_posterior(_v1) accept lengths; target_forwards: the iterations that fixed the 1024 "
    "codes (its loop runs on until new_token > max_length). " + trees.CHECKS)


def write_lumina_shapes(args, vocab: dict[str, int]) -> None:
    runs = build_lumina_shapes(args.lumina, args.out, vocab)
    (args.out / "lumina_mgpt" / "expected_shapes.json").write_text(json.dumps({"source": {
        "repository": "Alpha-VLLM/Lumina-mGPT", "commit": args.lumina_commit or commit_of(args.lumina),
        "packages": packages("torch", "transformers"), "builder": "tests/conformance/build/chameleon.py "
        "--only lumina_mgpt_shapes", "model": "fixtures/lumina_mgpt", "made_with": LUMINA_SHAPES_MADE_WITH},
        "runs": runs}, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lantern", type=Path, help="a checkout of jadohu/LANTERN (not for --only lumina_mgpt_shapes)")
    parser.add_argument("--lumina", type=Path, help="a checkout of Alpha-VLLM/Lumina-mGPT (only for a full build and "
                        "--only lumina_mgpt_shapes)")
    parser.add_argument("--only", choices=["anole_lantern", "anole_lantern_trees", "lumina_mgpt_shapes"],
                        help="build only this case from the committed fixtures (anole_lantern: LANTERN's Anole drafter "
                        "for anole/; anole_lantern_trees: its static and dynamic trees, expected_trees.json; "
                        "lumina_mgpt_shapes: Lumina-mGPT's non-square runs, lumina_mgpt/expected_shapes.json)")
    parser.add_argument("--commit", help="LANTERN's commit, when the checkout is an export without .git")
    parser.add_argument("--lumina-commit", help="Lumina-mGPT's commit, likewise")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "fixtures")
    args = parser.parse_args()
    import transformers

    vocab = vocabulary()
    if args.only == "lumina_mgpt_shapes":
        if args.lumina is None:
            parser.error("--only lumina_mgpt_shapes needs --lumina")
        write_lumina_shapes(args, vocab)
        return
    if args.lantern is None:
        parser.error("--lantern is needed for every case but lumina_mgpt_shapes")
    if args.only == "anole_lantern_trees":
        runs = build_anole_lantern_trees(args.lantern, args.out, vocab)
        (args.out / "anole_lantern" / "expected_trees.json").write_text(json.dumps({"source": {
            "repository": "jadohu/LANTERN", "commit": args.commit or commit_of(args.lantern),
            "packages": packages("torch", "transformers", "numpy"), "builder": "tests/conformance/build/chameleon.py "
            "--only anole_lantern_trees", "target": "fixtures/anole", "drafter": "fixtures/anole_lantern/drafter",
            "made_with": ANOLE_LANTERN_TREES_MADE_WITH}, "runs": runs}, indent=1, ensure_ascii=False) + "\n")
        return
    if args.only == "anole_lantern":
        run = build_anole_lantern(args.lantern, args.out, vocab, args.out / "chameleon_vqgan")
        write_expected(args.out / "anole_lantern", {
            "repository": "jadohu/LANTERN", "commit": args.commit or commit_of(args.lantern),
            "packages": packages("torch", "transformers", "numpy"), "builder": "tests/conformance/build/chameleon.py "
            "--only anole_lantern", "target": "fixtures/anole (made by this builder's anole case)",
            "made_with": ANOLE_LANTERN_MADE_WITH}, [run])
        return
    if args.lumina is None:
        parser.error("--lumina is needed to build every case")
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
    write_lumina_shapes(args, vocab)
    (vqgan / "SOURCE.json").write_text(json.dumps({**source, "made_with": "models/base_models/anole/chameleon/vqgan.py "
                                                   "VQModel, saved as Meta's Lightning checkpoint"}))


if __name__ == "__main__":
    main()
