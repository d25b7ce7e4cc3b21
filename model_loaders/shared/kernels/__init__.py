"""Triton kernels for GPUs: the fused 8-bit matmul and a decoder layer's fused products."""
