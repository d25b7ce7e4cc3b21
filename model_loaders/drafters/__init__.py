"""Drafters for speculative decoding: EAGLE heads (LANTERN's format), smaller same-family models, and the
loader that checks a drafter against its target."""
