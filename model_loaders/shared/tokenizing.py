"""A text model's own tokenizer: read from its folder (``tokenizer.json``, or a tiktoken rank file made into an
equivalent ``tokenizers`` BPE), a named token's id, and prompt text -> token ids, saying which words it does not know
(a word-level tokenizer, like the text demo's, reads them as its unknown token: they do not steer the image)."""
from __future__ import annotations

import warnings
from pathlib import Path

from ...errors import FastARError, FastARWarning


def encode_text(tokenizer, text: str) -> list[int]:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) ids of ``text``, warning once per prompt of unknown words."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    unknown_token = getattr(tokenizer.model, "unk_token", None)
    unknown_id = tokenizer.token_to_id(unknown_token) if unknown_token else None
    if unknown_id is not None:
        words = list(dict.fromkeys(text[start:end] for i, (start, end) in zip(encoding.ids, encoding.offsets)
                                   if i == unknown_id))
        if words:
            warnings.warn(f"the model's tokenizer does not know {', '.join(repr(w) for w in words)}: they reach the "
                          f"model as {unknown_token} and do not steer the image; use words it was trained on",
                          FastARWarning, stacklevel=3)
    return encoding.ids


def load_tokenizer(folder: Path, source: str):
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FastARError(f"{source} has no tokenizer.json: copy the model's tokenizer files (tokenizer.json, "
                          "tokenizer_config.json) from its release into the folder; nothing is downloaded (FastAR's "
                          "docs/models.md lists each release's files)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions for bad files
        raise FastARError(f"{source}/tokenizer.json cannot be read ({e}): re-download it") from e


def token_id(tokenizer, name: str, source: str) -> int:
    found = tokenizer.token_to_id(name)
    if found is None:
        raise FastARError(f"{source}: its tokenizer has no {name} token, which the image layout needs: this "
                          "tokenizer belongs to another model")
    return found


def byte_level_names() -> dict[int, str]:
    """The character a byte-level BPE (GPT-2's, the ``tokenizers`` ByteLevel pre-tokenizer's) writes for each byte:
    printable Latin-1 bytes stand for themselves, every other byte for the next code point from 256 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    names, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def read_tiktoken_ranks(path: Path, source: str) -> dict[bytes, int]:
    """A tiktoken rank file (each line: a token's bytes in base64, its rank), which must rank 0..N-1."""
    import base64
    import binascii

    ranks = {}
    try:
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error) as e:
        raise FastARError(f"{source}/{path.name} line {number} is not a token and its rank ({e}): re-download it") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FastARError(f"{source}/{path.name} does not rank its tokens 0..{len(ranks) - 1}: re-download it")
    return ranks


def tiktoken_tokenizer(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]):
    """A ``tokenizers.Tokenizer`` that encodes as tiktoken does with these ranks, split pattern and special tokens
    (recognised anywhere in the text), after NFC normalisation: tiktoken merges the adjacent pair whose joined bytes
    rank lowest, which is byte-level BPE with one merge per way of splitting each token into two ranked tokens, in the
    order of the joined token's rank; a piece that is a token as a whole is taken as it is (``ignore_merges``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    names = byte_level_names()

    def text(token: bytes) -> str:
        return "".join(names[b] for b in token)

    merges = sorted(((rank, ranks[token[:i]], ranks[token[i:]], text(token[:i]), text(token[i:]))
                     for token, rank in ranks.items() for i in range(1, len(token))
                     if token[:i] in ranks and token[i:] in ranks))
    vocab = {text(token): rank for token, rank in ranks.items()} | specials
    tokenizer = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return tokenizer
