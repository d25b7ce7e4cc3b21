"""Emu3 (BAAI): the text-to-image transformer over the shared LLaMA-family decoder, its folder readers (transformers'
layout and BAAI's original) with their tokenizers, and its image decoder."""
