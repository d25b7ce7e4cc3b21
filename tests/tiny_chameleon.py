"""Tiny Chameleon-family folders for tests: a random transformers ChameleonForConditionalGeneration saved as a
Hugging Face folder (config.json with its vocabulary map, safetensors, a word-level tokenizer made with the
``tokenizers`` library), in the Lumina-mGPT layout or Anole's; and an EAGLE drafter folder for it in LANTERN's
Anole drafter layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CODES = 24  # image codes
WORDS = ["a", "red", "blue", "green", "ring", "circle", "square", "on", "background", "Generate", "an", "image",
         "of", "according", "to", "the", "following", "prompt", ":", "x"]


def code_name(k: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z"


def vocabulary() -> dict[str, int]:
    """Specials first (bos 0), then the image codes in a scrambled order (the mapping must be read, not
    assumed), the layout tokens, the size tokens and the words."""
    names = ["<s>", "<pad>", "</s>", "<unk>"]
    scrambled = [(7 * k) % CODES for k in range(CODES)]  # 7 is coprime with 24: a permutation
    names += [code_name(k) for k in scrambled]
    names += ["<eoss>", "<racm3:break>", "<reserved08706>", "<reserved08799>"]
    names += [f"<reserved{8800 + n:05d}>" for n in range(1, 9)]
    names += WORDS
    return {name: i for i, name in enumerate(names)}


def save_tokenizer(folder: Path, vocab: dict[str, int], bos: str = "<s>", eos: str = "</s>", pad: str | None = None):
    """A word-level tokenizer (specials: the entries in angle brackets) and its tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tokenizer.add_special_tokens([AddedToken(n, special=True) for n in vocab if n.startswith("<")])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": bos, "eos_token": eos, **({"pad_token": pad} if pad else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def randomise_norms(model, seed: int) -> None:
    """Norm weights and biases away from their neutral init, so that a misplaced norm shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=generator))


def hf_model(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 4):
    """A random transformers Chameleon model over ``vocabulary()``, its norms and biases randomised too."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    vocab = vocabulary()
    config = ChameleonConfig(
        vocab_size=len(vocab) + 4, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocabulary_map=vocab, bos_token_id=0,
        vq_config=dict(embed_dim=8, num_embeddings=CODES, latent_channels=8, resolution=32, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[]))  # 16-px tokens
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(config).eval()
    randomise_norms(model, seed)  # per-head QK norms and RMSNorms
    return model


def write_folder(folder: Path, model, *, lumina: bool = True, image_size: int | None = 128) -> Path:
    """The HF folder of ``model`` (its VQ encoder weights included, as converted releases have them)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = ["ChameleonXLLMXForConditionalGeneration" if lumina else "ChameleonForConditionalGeneration"]
    if image_size is not None:
        config["image_size"] = image_size
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    save_tokenizer(folder, vocabulary())
    return folder


def write_anole_drafter(folder: Path, reference, seed: int):
    """A LANTERN-layout Anole drafter folder for ``reference``'s sizes: its Chameleon config of one layer and
    ``embed_tokens``, ``fc`` (with bias), ``layers.0.*`` (a transformers ChameleonDecoderLayer, norms
    randomised). Returns (weights, the layer, its rotary embedding) for reference computations."""
    from transformers import ChameleonConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonDecoderLayer, ChameleonRotaryEmbedding

    config = ChameleonConfig(**{**reference.config.to_dict(), "num_hidden_layers": 1})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = ChameleonDecoderLayer(config, 0).eval()
    randomise_norms(layer, seed)  # input norm, per-head QK norms: a misplaced one shows
    D, V = config.hidden_size, config.vocab_size
    generator = torch.Generator().manual_seed(seed + 1)
    weights = {"embed_tokens.weight": torch.randn(V, D, generator=generator),
               "fc.weight": torch.randn(D, 2 * D, generator=generator) / (2 * D) ** 0.5,
               "fc.bias": 0.1 * torch.randn(D, generator=generator),
               **{f"layers.0.{k}": v for k, v in layer.state_dict().items()}}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return weights, layer, ChameleonRotaryEmbedding(config)

