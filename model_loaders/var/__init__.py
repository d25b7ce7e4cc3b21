"""VAR (next-scale prediction): the model, its multi-scale VQVAE, the VAR-DD student and their readers."""
