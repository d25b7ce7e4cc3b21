"""Janus-Pro: the model adapter over the shared LLaMA-family decoder and the folder reader (both released
layouts)."""
