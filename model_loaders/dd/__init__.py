"""Distilled Decoding students of LlamaGen: the one/two-step student and its reader."""
