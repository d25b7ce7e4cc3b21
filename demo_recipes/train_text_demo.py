"""Train the bundled text-to-image demo: a tiny Lumina-mGPT-format model with its own tokenizer, drawing the
procedural demo images from captions ("a red ring on a cyan background"), and its Chameleon-VQGAN-format decoder.

    python -m fastar.demo_recipes.train_text_demo [--steps N]      # demo/demo_text/ and demo/demo_vqgan.safetensors

- The decoder is the demo VQ converted (``convert_vq``): Chameleon's VQGAN has LlamaGen's decoder under LDM
  names and a codebook used as stored, so the converted file holds the L2-normalised codes; it decodes every
  code exactly as the demo VQ does (tests/test_text_demo.py). 8-pixel tokens: 16 x 16 per 128 px image,
  which config.json's ``vq_config`` says (``channel_multiplier`` of four levels).
- The tokenizer is word-level over the prompt template, the caption words, the image codes (``IMGIMG..Z``)
  and the Lumina-mGPT layout tokens, saved as ``tokenizer.json`` (``tokenizers`` library).
- The model is a Chameleon decoder (QK norm, 1-D RoPE) the size of the demo GPT, initialised from it (image
  code embeddings, output rows, blocks; the text embeddings start random), then trained with teacher
  forcing on Lumina-mGPT's layout: bos, the prompt template, the turn separator, boi, size tokens, rows
  ended by the row-end token, eoi. The loss is the cross-entropy over image codes at image positions (the
  sampler never draws a layout token). One caption in ten is dropped (the sequence starts at boi), which is
  the context of Lumina-mGPT's unconditional CFG pass.
"""
from __future__ import annotations

import argparse
import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..model_loaders import load_ar_model, load_image_decoder
from ..model_loaders.chameleon.loader import BOI, EOI, LUMINA_TEMPLATE, ROW_END, TURN_END, build_chameleon, size_token
from ..model_loaders.shared.demo import DEMO_AR, DEMO_TEXT, DEMO_VQ, DEMO_VQGAN
from ..model_loaders.shared.joined import parted_state_dict
from ..model_loaders.shared.protocol import PromptConditioning
from ..model_loaders.llamagen.vq import VQModel
from .demo_common import tokenised
from ..commands.training import Timer, adamw, cosine_lr, setup, train_step
from ..commands.bench.demo_data import CLASS_NAMES, COLOUR_NAMES, SIZE, TEXTURE_LEVELS, make_captioned_batch

IMAGE_SIZE = SIZE  # 128 px
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
DROP_CAPTION = 0.1


def code_name(k: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z"


# -- the image decoder -----------------------------------------------------------------------------


def convert_vq(vq: VQModel) -> dict[str, torch.Tensor]:
    """The demo VQ's decoder under Chameleon VQGAN (LDM) key names, the codebook stored normalised."""
    levels = len(vq.cfg.ch_mult)
    sd = {"quantize.embedding.weight": vq.quantize.codebook(), "post_quant_conv.weight": vq.post_quant_conv.weight,
          "post_quant_conv.bias": vq.post_quant_conv.bias}
    renames = {"mid.0.": "mid.block_1.", "mid.1.": "mid.attn_1.", "mid.2.": "mid.block_2."}
    for key, value in vq.decoder.state_dict().items():
        if key.startswith("conv_blocks."):  # LlamaGen: deepest first; LDM: up[i] at level i
            _, j, part, rest = key.split(".", 3)
            key = f"up.{levels - 1 - int(j)}.{'block' if part == 'res' else part}.{rest}"
        for old, new in renames.items():
            key = key.replace(old, new) if key.startswith(old) else key
        sd[f"decoder.{key}"] = value
    # fp16 as the demo VQ stores them (lossless); the normalised codebook stays fp32 (rounding it moves codes)
    return {k: v.detach().to(torch.float32 if k.startswith("quantize.") else torch.float16).contiguous()
            for k, v in sd.items()}


# -- the tokenizer ----------------------------------------------------------------------------------


def vocabulary(codes: int) -> dict[str, int]:
    words = LUMINA_TEMPLATE.format(w=IMAGE_SIZE, h=IMAGE_SIZE, prompt="").replace(":", " : ").split()
    words += ["a", "on", "background", *COLOUR_NAMES.values(), *CLASS_NAMES]
    names = [*SPECIALS, *(code_name(k) for k in range(codes)), BOI, EOI, TURN_END, ROW_END,
             size_token(IMAGE_SIZE // 32), *dict.fromkeys(words)]
    return {name: i for i, name in enumerate(names)}


def save_tokenizer(folder: Path, vocab: dict[str, int]) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in vocab if name.startswith("<")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "pad_token": "<pad>"}))


def hf_config(vocab: dict[str, int], vq: VQModel, dim: int, layers: int, heads: int, ffn: int) -> dict:
    """config.json as transformers' ChameleonConfig writes it, for Lumina-mGPT's class."""
    return {
        "architectures": ["ChameleonXLLMXForConditionalGeneration"], "model_type": "chameleon",
        "vocab_size": len(vocab), "hidden_size": dim, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 512,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "tie_word_embeddings": False, "swin_norm": False,
        "vocabulary_map": vocab, "image_size": IMAGE_SIZE,
        "vq_config": {"embed_dim": vq.cfg.embed_dim, "num_embeddings": vq.cfg.codebook_size,
                      "latent_channels": vq.cfg.z_channels, "base_channels": vq.cfg.ch,
                      "channel_multiplier": list(vq.cfg.ch_mult), "num_res_blocks": vq.cfg.num_res_blocks,
                      "resolution": IMAGE_SIZE},
    }


# -- data and model --------------------------------------------------------------------------------


def warm_start(model, gpt) -> None:
    """The demo GPT's weights where the shapes match: image code embeddings and output rows, the blocks
    (its wqkv as our qkv, its w1 and w3 as our gate and up), the norms. Text and layout embeddings keep their random
    init."""
    ids = model.image_ids
    with torch.no_grad():
        model.model.embed_tokens.weight[ids] = gpt.tok_embeddings.weight
        model.lm_head.weight[ids] = gpt.output.weight
        model.model.norm.weight.copy_(gpt.norm.weight)
        for ours, theirs in zip(model.model.layers, gpt.layers):
            attn = ours.self_attn  # q, k, v stacked in the same order as LlamaGen's wqkv
            for linear, weight in ((attn.qkv_proj, theirs.attention.wqkv.weight), (attn.o_proj, theirs.attention.wo.weight),
                                   (ours.mlp.gate_up_proj, theirs.feed_forward.w13.weight),
                                   (ours.mlp.down_proj, theirs.feed_forward.w2.weight)):
                linear.weight.copy_(weight)
            ours.input_layernorm.weight.copy_(theirs.attention_norm.weight)
            ours.post_attention_layernorm.weight.copy_(theirs.ffn_norm.weight)


def sequences(model, prompts: list[list[int]], codes: torch.Tensor):
    """Left-padded id rows of whole images and, per image code, its sequence position: (ids, valid, at)."""
    cfg, w = model.cfg, model.grid[1]
    image = model.image_ids[codes.long()]  # [B, N]
    rows = image.view(len(codes), model.grid[0], w)
    with_ends = torch.cat([rows, torch.full_like(rows[..., :1], cfg.row_end)], -1).flatten(1)
    body = torch.cat([with_ends, torch.full_like(with_ends[:, :1], cfg.eoi)], 1)
    prefixes = [p + cfg.image_prefix for p in prompts]
    width = max(map(len, prefixes)) + body.shape[1]
    ids = torch.full((len(codes), width), cfg.eoi, dtype=torch.long)
    valid = torch.zeros(len(codes), width, dtype=torch.bool)
    for b, prefix in enumerate(prefixes):
        start = width - body.shape[1] - len(prefix)
        ids[b, start: width - body.shape[1]] = torch.tensor(prefix)
        valid[b, start:] = True
    ids[:, width - body.shape[1]:] = body
    p = torch.arange(codes.shape[1])
    at = width - body.shape[1] + p + p // w  # each image code's slot
    return ids, valid, at


def loss_of(model, prompts, codes) -> torch.Tensor:
    """Cross-entropy over image codes of every image token, given what precedes it."""
    ids, valid, at = sequences(model, prompts, codes)
    hidden = model.backbone.teacher_forced(model.backbone.embed_tokens(ids), valid)
    logits = model.image_logits(hidden[:, at - 1])  # the slot before a token predicts it
    return F.cross_entropy(logits.flatten(0, 1), codes.long().flatten())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--images", type=int, default=8000)
    p.add_argument("--val-images", type=int, default=128)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texture", type=float, default=TEXTURE_LEVELS,
                   help="the images' texture, its largest excursion in 8-bit levels (0: flat colours)")
    p.add_argument("--vq", default=str(DEMO_VQ))
    p.add_argument("--start", default=str(DEMO_AR), help="the demo GPT to start from")
    p.add_argument("--out", default=str(DEMO_TEXT))
    p.add_argument("--vqgan-out", default=str(DEMO_VQGAN))
    args = p.parse_args(argv)

    gen = setup(args.seed)
    timer = Timer()
    vq = load_image_decoder(args.vq)
    save_file(convert_vq(vq), args.vqgan_out)
    draw, name = partial(make_captioned_batch, texture=args.texture / 255), f"text_t{args.texture:g}"
    codes, labels, captions = tokenised(name, args.vq, args.images, args.seed, draw)
    val_codes, _, val_captions = tokenised(name, args.vq, args.val_images, 10_000 + args.seed, draw)
    print(f"{len(codes)} captioned images tokenised [{timer}]")

    gpt = load_ar_model(args.start)
    out = Path(args.out)
    staging = out.with_name(out.name + ".partial")  # the folder appears whole or not at all
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    vocab = vocabulary(vq.cfg.codebook_size)
    save_tokenizer(staging, vocab)
    config = hf_config(vocab, vq, gpt.cfg.dim, gpt.cfg.n_layer, gpt.cfg.n_head, gpt.cfg.ffn_hidden)
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    model = build_chameleon(staging, config, staging.name)
    init_weights(model)
    warm_start(model, gpt)
    print(f"text demo {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, grid {model.grid} [{timer}]")

    prompts = model.prompts.encode(PromptConditioning(captions))
    val_prompts = model.prompts.encode(PromptConditioning(val_captions))
    opt = adamw(model, args.lr, weight_decay=0.05)
    model.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(codes), (args.batch,), generator=gen).tolist()
        dropped = (torch.rand(args.batch, generator=gen) < DROP_CAPTION).tolist()
        batch_prompts = [[] if drop else prompts[i] for i, drop in zip(idx, dropped)]
        loss = loss_of(model, batch_prompts, codes[idx])
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=min(100, args.steps // 10)), clip=1.0)
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}/{args.steps} train loss {loss.item():.4f} [{timer}]", flush=True)
        if (step + 1) % max(1, args.steps // 4) == 0 and step + 1 < args.steps:
            print(f"  val loss {val_loss(model, val_prompts, val_codes):.4f}", flush=True)

    model.eval()
    weights = {k: v.detach().half().contiguous() for k, v in parted_state_dict(model).items()}  # the release's names
    save_file(weights, str(staging / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    saved = load_ar_model(out)
    print(f"final val loss (fp16 weights, {len(val_codes)} held-out images): "
          f"{val_loss(saved, val_prompts, val_codes):.4f}; total {timer}")


def init_weights(model: nn.Module) -> None:
    """LlamaGen's init (normal 0.02) for what the warm start leaves: the text and layout embeddings."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)


@torch.no_grad()
def val_loss(model, prompts, codes) -> float:
    was = model.training
    model.eval()
    losses = [loss_of(model, prompts[i:i + 32], codes[i:i + 32]).item() for i in range(0, len(codes), 32)]
    model.train(was)
    return float(np.mean(losses))


if __name__ == "__main__":
    main()
