"""Builds the Infinity transformer conformance fixtures (fixtures/infinity_2b/, fixtures/infinity_8b/) with the
official code (run by hand, never by the tests).

    git -C MIRROR archive HEAD | tar -x -C Infinity      # a checkout of FoundationVision/Infinity
    pip install --target DEPS einops pytz                 # the imports FastAR's venv lacks
    PYTHONPATH=DEPS python tests/conformance/build/infinity.py --infinity Infinity --commit SHA

Tiny random transformers of the official ``Infinity`` class, built with tools/run_infinity.py's ``load_infinity``
arguments (shared AdaLN, fused norm, pad_to_multiplier 128, lvl_embed before the first block, bit labels, RoPE in
every self-attention normalised by the 1M grid, text_maxlen 512) and ``load_transformer``'s block chunks:
- ``infinity_2b``: the 2B's layout (no patchify, 32 bits a token against fixtures/infinity_vae/vae_d32.pth), saved
  as ``infinity_2b_reg.pth`` is (``torch.save(state_dict)``), read back by ``load_infinity(checkpoint_type="torch")``;
- ``infinity_8b``: the 8B's (apply_spatial_patchify 1: 56 bits a token, 2 x 2 cells of the d14 VAE
  fixtures/infinity_vae/vae_d14_patchify.pth), saved as shards with ``model.safetensors.index.json`` and read back by
  transformers' ``load_sharded_checkpoint`` as ``load_infinity(checkpoint_type="torch_shard")`` does;
- ``t5/`` (in infinity_2b, shared): a tiny T5EncoderModel folder with a word-level tokenizer appending ``</s>``.
Each prompt is encoded as ``encode_prompt`` does (max_length 512, padding to it, its valid tokens), the official
``autoregressive_infer_cfg`` runs greedily (top_k 1, cfg on the logits: cfg_insertion_layer [0], one cfg and tau for
every scale, B 1 per prompt as gen_one_img), recording each scale's bits where the loop samples them and where it
hands them to the VAE; the image is the official VAE's decode of the summed codes. FastAR's model, loaded from the
saved file, is run teacher-forced on the official bits in the builder: its guided logits' largest difference from
the official ones and the smallest official margin are recorded, and the fixture is refused if a margin is not
ten times that difference (a greedy bit must not rest on float order). The official scale schedules and template
choices are recorded for tests/conformance/test_infinity.py.

Departures, each recorded in expected.json: tiny sizes; every weight redrawn and rounded to fp16 (saved so); fp32
on the CPU (the release: CUDA autocast in bf16), its cross-attention's cast to bf16 for flash-attn left out
(``Bf16AsFp32``); flash_attn stood in for by per-sequence SDPA in fp32 (varlen over
cu_seqlens); timm, torchvision stood in for; torch.compile off (TORCHDYNAMO_DISABLE: the fused norm runs eagerly);
T5 in fp32 (the release loads it in fp16 on CUDA); transformers 5's ``load_sharded_checkpoint`` (moved to
trainer_utils).
"""
from __future__ import annotations

import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the release's fused norm is torch.compile'd: run it as written

import argparse  # noqa: E402
import importlib.machinery  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import FIXTURES, save_image  # noqa: E402
from provenance import commit_of, packages, stub_torchvision  # noqa: E402

import infinity_vae as vae_builder  # noqa: E402  (the VAE fixture's cases and its tiny vae_model)

DEPTH, CHUNKS, WIDTH, HEADS, TEXT = 4, 2, 64, 2, 128
PROMPTS = ["a red cat sits on the green mat", "one blue dog under the sky"]
T5_WORDS = "a red cat sits on the green mat under blue sky with one two three dog".split()
CASES = {
    "infinity_2b": dict(vae="d32", patchify=False, runs=[("1:1", 3.0, 0.5), ("3:4", 4.0, 1.0)]),
    "infinity_8b": dict(vae="d14_patchify", patchify=True, runs=[("1:1", 3.0, 1.0)]),
}
RATIOS = ["1:1", "16:9", "9:16", "4:3", "3:4", "3:2", "2:3", "21:9", "5:4", "7:4", "2:1", "1:2", "5:2", "3:1", "1:3",
          "10:11", "13:10"]
MARGIN = 10  # the smallest official margin must be this many times FastAR's largest logit difference


def varlen_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, **_):
    """flash_attn's varlen attention: each sequence's queries over its own keys, computed in fp32, returned in the
    inputs' dtype (as flash-attn's kernel accumulates and returns)."""
    out = []
    for i in range(len(cu_seqlens_q) - 1):
        qi = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].transpose(0, 1).float()
        k, v = kv[cu_seqlens_k[i]:cu_seqlens_k[i + 1]].float().unbind(1)
        o = F.scaled_dot_product_attention(qi, k.transpose(0, 1), v.transpose(0, 1), scale=softmax_scale)
        out.append(o.transpose(0, 1).to(q.dtype))
    return torch.cat(out)


def not_called(*_, **__):
    raise AssertionError("flash_attn_func is only called with customized_flash_attn, which load_infinity turns off")


def import_official(checkout: Path):
    sys.path[:] = [str(checkout)] + [p for p in sys.path if Path(p).resolve() != HERE]  # this file is infinity.py
    stub_torchvision()
    timm = types.ModuleType("timm")
    models, layers, loss = (types.ModuleType(n) for n in ("timm.models", "timm.models.layers", "timm.loss"))
    models.register_model = lambda f: f
    layers.DropPath, layers.drop_path = torch.nn.Identity, None
    loss.SoftTargetCrossEntropy = torch.nn.CrossEntropyLoss
    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func, flash.flash_attn_varlen_kvpacked_func = not_called, varlen_kvpacked
    stand_ins = {"timm": timm, "timm.models": models, "timm.models.layers": layers, "timm.loss": loss,
                 "flash_attn": flash, "imageio": types.ModuleType("imageio")}
    for module_name, module in stand_ins.items():  # a spec, so that transformers' package probes pass over them
        module.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
    sys.modules.update(stand_ins)
    from infinity.models import basic
    from infinity.models import infinity as official
    from infinity.models.bsq_vae import vae as official_vae
    from infinity.utils import dynamic_resolution

    basic.torch = Bf16AsFp32()
    return official, official_vae, dynamic_resolution


class Bf16AsFp32(types.SimpleNamespace):
    """torch, as infinity/models/basic.py sees it, with ``torch.bfloat16`` read as fp32: its CrossAttention casts
    fp32 queries, keys and values to bf16 for flash-attn, which FastAR in fp32 does not (that cast alone moves the
    tiny model's guided bit logits by up to 0.1, more than many greedy margins); basic.py names bfloat16 nowhere
    else."""

    def __getattr__(self, name):
        return torch.float32 if name == "bfloat16" else getattr(torch, name)


def make_t5_folder(folder: Path) -> None:
    """A tiny T5 encoder folder as transformers saves one, laid out like google/flan-t5-xl's."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(["<pad>", "</s>", "<unk>", *T5_WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    config = transformers.T5Config(vocab_size=len(vocab), d_model=TEXT, d_kv=32, num_heads=2, d_ff=64, num_layers=1,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save_pretrained(folder)


def encode_prompt(folder: Path, prompt: str):
    """tools/run_infinity.py's encode_prompt (without .cuda()): padded to 512, the valid tokens' features."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, legacy=True)
    encoder = transformers.T5EncoderModel.from_pretrained(folder).eval()
    tokens = tokenizer(text=[prompt], max_length=512, padding="max_length", truncation=True, return_tensors="pt")
    mask = tokens.attention_mask
    with torch.no_grad():
        features = encoder(input_ids=tokens.input_ids, attention_mask=mask)["last_hidden_state"].float()
    lens = mask.sum(dim=-1).tolist()
    cu_seqlens_k = F.pad(mask.sum(dim=-1).to(dtype=torch.int32).cumsum_(0), (1, 0))
    return torch.cat([f[:n] for n, f in zip(lens, features)]), lens, cu_seqlens_k, max(lens)


def official_transformer(official, vae, patchify: bool, pn: str):
    """``Infinity`` as load_infinity builds it, at tiny sizes."""
    torch.manual_seed(0)
    return official.Infinity(
        vae_local=vae, text_channels=TEXT, text_maxlen=512, shared_aln=True, raw_scale_schedule=None,
        checkpointing="full-block", customized_flash_attn=False, fused_norm=True, pad_to_multiplier=128,
        use_flex_attn=False, add_lvl_embeding_only_first_block=1, use_bit_label=1, rope2d_each_sa_layer=1,
        rope2d_normalized_by_hw=2, pn=pn, apply_spatial_patchify=int(patchify), inference_mode=True,
        train_h_div_w_list=[1.0], depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS, drop_path_rate=0.1, mlp_ratio=4,
        block_chunks=CHUNKS).eval()


@torch.no_grad()
def redraw(model, seed: int) -> None:
    """Every weight redrawn at about unit gain (the official init makes a tiny model's bits flat), then rounded to
    fp16."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith("scale_mul_1H11"):
            p.copy_(torch.log(torch.full_like(p, 4.0)) + r * 0.5)
        elif name.endswith(("text_norm.weight", "ca_norm.weight")):
            p.copy_(1 + r * 0.2)
        elif name.endswith("bias"):
            p.copy_(r * 0.1)
        elif name.endswith(".weight") and p.dim() == 2 and "embed" not in name.split(".")[0]:
            gain = 3.0 if name == "head.weight" else 0.5 if "ada_lin" in name else 1.0
            p.copy_(r * gain * p.shape[1] ** -0.5)
        elif name.endswith("ada_gss"):
            p.copy_(r * 0.3)
        else:  # pos_start, lvl_embed, word_embed (unit entries), cfg_uncond, the pool's query
            p.copy_(r)
        p.copy_(p.half().float())


class BitRecorder:
    """Wraps the loop's sampler: each scale's sampled bits ``[B, l*bits]`` and its inputs' smallest margin (the two
    logits of a bit, already guided and divided by tau)."""

    def __init__(self, official):
        self.official, self.original = official, official.sample_with_top_k_top_p_also_inplace_modifying_logits_
        self.bits, self.margins, self.logits = [], [], []

    def __enter__(self):
        def sample(logits, *args, **kwargs):
            self.logits.append(logits.clone())
            self.margins.append((logits[..., 1] - logits[..., 0]).abs().min().item())
            out = self.original(logits, *args, **kwargs)
            self.bits.append(out[:, :, 0].clone())
            return out
        self.official.sample_with_top_k_top_p_also_inplace_modifying_logits_ = sample
        return self

    def __exit__(self, *exc):
        self.official.sample_with_top_k_top_p_also_inplace_modifying_logits_ = self.original


class VAERecorder:
    """The VAE as the loop sees it: records the VAE-grid bits it hands to ``indices_to_codes`` and decode's output."""

    def __init__(self, vae):
        self.vae, self.bits = vae, []
        self.quantizer = types.SimpleNamespace(z_interplote_up=vae.quantizer.z_interplote_up,
                                               lfq=types.SimpleNamespace(indices_to_codes=self.indices_to_codes))

    def indices_to_codes(self, idx, label_type):
        self.bits.append(idx.squeeze(1).clone())  # [B, H, W, d]
        return self.vae.quantizer.lfq.indices_to_codes(idx, label_type=label_type)

    def decode(self, z):
        self.decoded = self.vae.decode(z)
        return self.decoded


def official_run(official, model, vae, schedule, text, cfg: float, tau: float):
    S = len(schedule)
    recorder, vae_side = BitRecorder(official), VAERecorder(vae)
    with recorder:
        model.autoregressive_infer_cfg(
            vae=vae_side, scale_schedule=[(1, h, w) for h, w in schedule], label_B_or_BLT=text, g_seed=0, B=1,
            negative_label_B_or_BLT=None, cfg_list=[cfg] * S, tau_list=[tau] * S, top_k=1, top_p=0.0,
            returns_vemb=1, cfg_insertion_layer=[0], vae_type=vae.quantizer.lfq.mask.numel(), ret_img=True,
            inference_mode=True, sampling_per_bits=1)
    decoded = vae_side.decoded
    if isinstance(decoded, (tuple, list)):
        decoded = decoded[0]
    return recorder, vae_side.bits, decoded[0].squeeze()


def labels(bits: torch.Tensor, mask: torch.Tensor) -> list:
    """A scale's VAE-grid bits ``[H, W, d]`` as the release's integer labels (its lfq mask: bit 0 the most
    significant), raster order."""
    return (bits.long() * mask.long()).sum(-1).flatten().tolist()


def fastar_margins(fastar_model, recorders, text_features, vae_bits, cfg, tau):
    """FastAR's model teacher-forced on the official bits of each prompt: its guided logits' largest difference
    from the official ones."""
    from fastar.model_loaders.shared.protocol import CaptionConditioning

    worst = 0.0
    for (features, *_), recorder, bits in zip(text_features, recorders, vae_bits):
        cond = CaptionConditioning(features[None], torch.ones(1, features.shape[0], dtype=torch.bool))
        session = fastar_model.start(cond, cfg=cfg != 1)
        f_hat, inputs = torch.zeros(1, *fastar_model.f_hat_shape), None
        for scale, (h, w) in enumerate(fastar_model.scale_shapes):
            out = session.forward(scale, inputs)
            guided = (out.uncond + cfg * (out.cond - out.uncond)) / tau
            official = recorder.logits[scale].view_as(guided)
            worst = max(worst, (guided - official).abs().max().item())
            token_bits = recorder.bits[scale].view(1, h, w, -1)
            f_hat, inputs = fastar_model.next_input(VAE_FOR_FASTAR, f_hat, token_bits, scale)
            assert torch.equal(fastar_model.to_vae_grid(token_bits), bits[scale][:1].long().view_as(
                fastar_model.to_vae_grid(token_bits))), "FastAR's VAE-grid bits differ from the loop's"
    return worst


VAE_FOR_FASTAR = None  # FastAR's VAE of the case, for fastar_margins


def save_release(model, folder: Path, patchify: bool) -> Path:
    sd = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    if not patchify:
        path = folder / "infinity_2b_tiny.pth"
        torch.save(sd, path)  # infinity_2b_reg.pth: a raw state dict
        return path
    from safetensors.torch import save_file

    path = folder / "infinity_8b_tiny"
    path.mkdir(exist_ok=True)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: sd[k].contiguous() for k in part}, path / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": {k: name for name, part in shards.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return path


def load_release(official, vae, path: Path, patchify: bool, pn: str):
    """The saved file read back into a fresh official model as load_infinity reads it."""
    model = official_transformer(official, vae, patchify, pn)
    if patchify:
        from transformers.trainer_utils import load_sharded_checkpoint

        result = load_sharded_checkpoint(model, str(path), strict=False)
    else:
        result = model.load_state_dict(torch.load(path, map_location="cpu"))
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


def schedules_record(dynamic_resolution) -> dict:
    table = dynamic_resolution.dynamic_resolution_h_w
    templates = [float(t) for t in dynamic_resolution.h_div_w_templates]
    chosen = {}
    for ratio in RATIOS:
        w, h = (int(x) for x in ratio.split(":"))
        chosen[ratio] = templates[int(abs(dynamic_resolution.h_div_w_templates - h / w).argmin())]
    sizes = ("0.06M", "0.25M", "0.60M", "1M")
    return {"templates": templates, "chosen": chosen,
            "scales": {str(t): {pn: [list(s[1:]) for s in table[t][pn]["scales"]] for pn in sizes} for t in table}}


def build_case(name: str, case: dict, official, official_vae, dynamic_resolution, t5: Path) -> list:
    from fastar.model_loaders import load_ar_model, load_image_decoder
    from fastar.model_loaders.infinity.schedules import scale_schedule

    global VAE_FOR_FASTAR
    folder = FIXTURES / name
    folder.mkdir(parents=True, exist_ok=True)
    vae_case = next(c for c in vae_builder.CASES if c["name"] == case["vae"])
    vae_file = FIXTURES / "infinity_vae" / vae_case["file"]
    vae = vae_builder.tiny_vae(official_vae, str(vae_file), vae_case).eval()
    VAE_FOR_FASTAR = load_image_decoder(vae_file)
    texts = [encode_prompt(t5, p) for p in PROMPTS]
    for seed in range(30):
        model = official_transformer(official, vae, case["patchify"], "0.06M")
        redraw(model, seed)
        path = save_release(model, folder, case["patchify"])
        model = load_release(official, vae, path, case["patchify"], "0.06M")
        runs, problems = [], []
        for ratio, cfg, tau in case["runs"]:
            w, h = (int(x) for x in ratio.split(":"))
            template = dynamic_resolution.h_div_w_templates[abs(dynamic_resolution.h_div_w_templates - h / w).argmin()]
            schedule = [tuple(s[1:]) for s in dynamic_resolution.dynamic_resolution_h_w[template]["0.06M"]["scales"]]
            assert list(scale_schedule(256, ratio)[0]) == schedule, "FastAR's schedule is not the release's"
            outs = [official_run(official, model, vae, schedule, text, cfg, tau) for text in texts]
            fastar_model = load_ar_model(path, image_size=256, aspect_ratio=ratio)
            worst = fastar_margins(fastar_model, [o[0] for o in outs], texts, [o[1] for o in outs], cfg, tau)
            margin = min(min(o[0].margins) for o in outs)
            ones = torch.cat([torch.cat([b.flatten().float() for b in o[0].bits]) for o in outs]).mean().item()
            print(f"{name} seed {seed} {ratio}: smallest margin {margin:.2e}, FastAR's largest difference {worst:.2e}, "
                  f"ones {ones:.2f}")
            if margin < MARGIN * worst or not 0.2 < ones < 0.8:
                problems.append(ratio)
            tag = f"{ratio.replace(':', 'x')}"
            images = []
            for i, (_, _, decoded) in enumerate(outs):
                images.append(f"{tag}_{i}.png")
                save_image(decoded.clamp(-1, 1).numpy(), folder / images[-1])
            mask = vae.quantizer.lfq.mask
            codes = [[labels(b[0], mask) for b in o[1]] for o in outs]
            vae_grid = [list(b.shape[1:3]) for b in outs[0][1]]
            runs.append({"name": f"greedy {ratio} cfg {cfg} tau {tau}", "aspect_ratio": ratio,
                         "template": float(template),
                         "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg", cfg, "--temperature", tau,
                                  "--top-k", 1, "--image-size", 256, "--aspect-ratio", ratio, "--decoder", "ar"],
                         "scales": [list(s) for s in schedule], "vae_grid": vae_grid, "codes": codes,
                         "images": images, "smallest_margin": margin, "fastar_largest_logit_difference": worst})
        if not problems:
            return runs, path, seed
    raise SystemExit(f"{name}: no seed gave clear margins")


def build(checkout: Path, commit: str) -> None:
    official, official_vae, dynamic_resolution = import_official(checkout)
    t5 = FIXTURES / "infinity_2b" / "t5"
    t5.mkdir(parents=True, exist_ok=True)
    make_t5_folder(t5)
    for name, case in CASES.items():
        runs, path, seed = build_case(name, case, official, official_vae, dynamic_resolution, t5)
        vae_file = next(c["file"] for c in vae_builder.CASES if c["name"] == case["vae"])
        files = {"model": path.name, "vae": f"../infinity_vae/{vae_file}", "t5": "../infinity_2b/t5"}
        layout = ("apply_spatial_patchify 1, saved as two safetensors shards with model.safetensors.index.json, read "
                  "back by load_sharded_checkpoint" if case["patchify"] else
                  "saved as torch.save(state_dict), read back by Infinity.load_state_dict")
        source = {
            "repository": "FoundationVision/Infinity", "commit": commit,
            "packages": packages("torch", "transformers", "tokenizers", "einops", "safetensors"),
            "builder": "tests/conformance/build/infinity.py", "files": files, "weight_seed": seed,
            "made_with": (f"infinity.models.infinity.Infinity(depth={DEPTH}, embed_dim={WIDTH}, num_heads={HEADS}, "
                          f"block_chunks={CHUNKS}, text_channels={TEXT}, text_maxlen=512, load_infinity's other "
                          f"arguments), {layout}; prompts encoded as encode_prompt does; "
                          "autoregressive_infer_cfg(top_k=1, cfg_insertion_layer=[0], B=1 per prompt, g_seed=0); "
                          "codes: the VAE-grid bits the loop hands to indices_to_codes as the lfq mask's integer "
                          "labels; images: the official VAE's decode of the summed codes, clamped"),
            "departures": [f"tiny sizes (depth {DEPTH}, width {WIDTH}, {HEADS} heads, T5 width {TEXT}, 1 layer)",
                           "weights redrawn at unit gain and rounded to fp16 (stored in fp16)",
                           "fp32 on the CPU (the release: CUDA autocast bf16)",
                           "the cross-attention's cast to bf16 for flash-attn (CrossAttention.forward, fp32 inputs) "
                           "left out: infinity.models.basic sees torch.bfloat16 as torch.float32 (Bf16AsFp32)",
                           "flash_attn stood in for: varlen attention per sequence by SDPA in fp32",
                           "timm, torchvision and imageio stood in for; TORCHDYNAMO_DISABLE (the fused norm eager)",
                           "T5 in fp32 (the release: fp16 on CUDA)",
                           "transformers 5's trainer_utils.load_sharded_checkpoint (the release imports it from "
                           "modeling_utils)"]}
        expected = {"source": source, "runs": runs}
        if name == "infinity_2b":
            expected["schedules"] = schedules_record(dynamic_resolution)
        (FIXTURES / name / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        print(f"wrote {FIXTURES / name} (weight seed {seed})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--infinity", type=Path, required=True, help="a checkout of FoundationVision/Infinity")
    parser.add_argument("--commit", help="its commit, where the checkout has no .git")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build(args.infinity.resolve(), args.commit or commit_of(args.infinity))
