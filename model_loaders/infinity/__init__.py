"""Infinity (FoundationVision/Infinity): bitwise next-scale text-to-image transformers and their BSQ VAE."""
