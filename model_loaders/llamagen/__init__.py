"""LlamaGen: the GPT (class- and text-to-image), its checkpoint reader, the VQ-16 tokenizer and the T5
text encoder of its text-to-image models."""
