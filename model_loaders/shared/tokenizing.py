"""Prompt text -> token ids with a model's own tokenizer, saying which words it does not know (a word-level
tokenizer, like the text demo's, reads them as its unknown token: they do not steer the image)."""
from __future__ import annotations

import warnings

from ...errors import FastARWarning


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
