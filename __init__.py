"""FastAR: fast autoregressive image generation (ComfyUI pack and the Python package ``fastar``).

Imported two ways: by ComfyUI as a custom-node folder, and as the ``fastar`` package. Nothing here
may import ComfyUI unconditionally or do heavy work at import time: ComfyUI's loader asks for
``comfy_entrypoint``, which imports the nodes (and with them torch and ComfyUI) only then.
"""

__version__ = "0.1.0"

# ComfyUI serves this folder's .js files to the web UI (the stats display on the FastAR Stats node).
WEB_DIRECTORY = "./web"


def __getattr__(name):
    if name == "comfy_entrypoint":
        from .nodes import comfy_entrypoint

        return comfy_entrypoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
