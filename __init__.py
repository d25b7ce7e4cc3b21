"""FastAR: fast autoregressive image generation (ComfyUI pack and the Python package ``fastar``).

Imported two ways: by ComfyUI as a custom-node folder, and as the ``fastar`` package. Nothing here
may import ComfyUI unconditionally or do heavy work at import time.
"""

__version__ = "0.1.0"
