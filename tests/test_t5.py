"""The T5 caption encoder: official LlamaGen layout, offline loading, and its errors."""
import sys

import pytest
import torch
from torch.testing import assert_close

from fastar.errors import FastARError
from fastar.model_loaders.llamagen.t5 import captions_for, encode_captions, load_t5_encoder

WORDS = "a red cat sits on the green mat under blue sky with one two three dog".split()


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A tiny random T5 encoder and a word-level tokenizer that appends </s> like T5's, built offline."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder = tmp_path_factory.mktemp("tiny-t5")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    config = transformers.T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, num_heads=2, d_ff=32, num_layers=2,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.T5EncoderModel(config).save_pretrained(folder)
    return folder


def official_layout(features, mask):
    """LlamaGen's sample_t2i: roll each row by its valid count, flip the mask, zero the padding."""
    rows = [torch.cat([f[int(m.sum()):], f[: int(m.sum())]]) for f, m in zip(features, mask)]
    left_mask = torch.flip(mask, dims=[-1])
    return torch.stack(rows) * left_mask[..., None], left_mask.bool()


def test_captions_match_the_official_left_padded_layout(t5_folder):
    encoder = load_t5_encoder(t5_folder)
    prompts = ["a red cat", "the green dog sits on one blue mat"]
    conditioning = encode_captions(encoder, prompts)
    assert conditioning.embeddings.shape == (2, 120, 16) and conditioning.mask.dtype == torch.bool
    assert conditioning.mask.sum(1).tolist() == [4, 9]  # words + </s>
    assert not conditioning.mask[:, :100].any() and conditioning.mask[:, -4:].all()
    batch = encoder.tokenizer(prompts, max_length=120, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        right_padded = encoder.model(**batch).last_hidden_state
    expected, expected_mask = official_layout(right_padded, batch["attention_mask"])
    assert torch.equal(conditioning.mask, expected_mask)
    assert_close(conditioning.embeddings, expected)
    # the real tokens are those of the prompt encoded alone, padding is zero
    alone = encoder.model(**encoder.tokenizer(["a red cat"], return_tensors="pt")).last_hidden_state
    assert_close(conditioning.embeddings[0, -4:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.all(conditioning.embeddings[0, :-4] == 0)


def test_prompts_are_lower_cased_and_long_prompts_truncated(t5_folder):
    encoder = load_t5_encoder(t5_folder, dtype=torch.bfloat16)
    shouted, plain = encode_captions(encoder, ["  A Red   CAT ", "a red cat"]).embeddings
    assert shouted.dtype == torch.bfloat16 and torch.equal(shouted, plain)
    long = encode_captions(encoder, [" ".join(WORDS)], max_len=8)
    assert long.embeddings.shape == (1, 8, 16) and long.mask.all()


class Verbatim:  # what an Infinity model tells the encoding
    caption_padding, caption_tokens = "right", 512


def test_verbatim_captions_keep_the_prompt_and_put_real_tokens_first(t5_folder):
    """Infinity's layout: the prompt as typed (no lower-casing), </s> kept, real tokens first, as its
    ``encode_prompt`` slices them from the 512-token encoding."""
    encoder = load_t5_encoder(t5_folder)
    prompts = ["a red cat", "the green dog sits on one blue mat"]
    conditioning = captions_for(Verbatim(), encoder, prompts)
    assert conditioning.embeddings.shape == (2, 9, 16) and conditioning.mask.sum(1).tolist() == [4, 9]
    assert conditioning.mask[0, :4].all() and not conditioning.mask[0, 4:].any()
    batch = encoder.tokenizer(prompts, max_length=512, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        official = encoder.model(**batch).last_hidden_state
    assert_close(conditioning.embeddings[0, :4], official[0, :4])
    assert_close(conditioning.embeddings[1], official[1, :9])
    assert torch.all(conditioning.embeddings[0, 4:] == 0)
    shouted = captions_for(Verbatim(), encoder, ["a RED cat"]).embeddings
    assert not torch.allclose(shouted[0], conditioning.embeddings[0, :4])  # not normalised as LlamaGen's are
    llamagen = captions_for(object(), encoder, prompts)  # any other model: LlamaGen's layout
    assert llamagen.embeddings.shape == (2, 120, 16) and llamagen.mask[:, -4:].all()


def test_missing_or_incomplete_folder(tmp_path, t5_folder):
    with pytest.raises(FastARError, match="no T5 text encoder folder at .*flan-t5-xl"):
        load_t5_encoder(tmp_path / "absent")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_bytes((t5_folder / "config.json").read_bytes())
    with pytest.raises(FastARError, match="incomplete, it lacks a tokenizer .*; weights"):
        load_t5_encoder(incomplete)


def test_transformers_missing_is_explained(monkeypatch, tmp_path):
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(FastARError, match="optional `transformers` package.*pip install"):
        load_t5_encoder(tmp_path)
