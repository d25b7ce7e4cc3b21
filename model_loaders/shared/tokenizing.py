"""A text model's own tokenizer: read from its folder (``tokenizer.json``), a named token's id, and prompt text ->
token ids, saying which words it does not know (a word-level tokenizer, like the text demo's, reads them as its
unknown token: they do not steer the image)."""
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
