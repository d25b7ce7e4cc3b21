"""Masked and continuous loops: MAR's masked sampler with its diffusion head's reverse steps, continuous
speculative decoding (CSpD) with its density-ratio rule, and LazyMAR-style feature reuse."""
