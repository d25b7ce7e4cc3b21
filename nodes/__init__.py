"""FastAR's ComfyUI nodes (V3 schema). Imported only inside ComfyUI, through the package's lazy
``comfy_entrypoint`` (see the package ``__init__``); never imported by the CLI or the tests of the engine."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .files import register_model_folders
from .loader_nodes import ClassLabel, LoadARModel, LoadDrafter, LoadVQ, TextConditioning, check_class_labels
from .output_nodes import AcceptanceMap, Stats, VQDecode
from .sampler_nodes import (
    SamplerAR,
    SamplerCSpD,
    SamplerDD,
    SamplerDial,
    SamplerGSD,
    SamplerLazyMAR,
    SamplerLantern,
    SamplerSJD,
    SamplerSJDEntropy,
    SamplerSpeculative,
    SamplerZipAR,
)

NODES = [LoadARModel, LoadVQ, LoadDrafter, ClassLabel, TextConditioning, SamplerDial, SamplerAR, SamplerSJD, SamplerGSD,
         SamplerSJDEntropy, SamplerSpeculative, SamplerLantern, SamplerZipAR, SamplerCSpD, SamplerLazyMAR, SamplerDD,
         VQDecode, AcceptanceMap, Stats]


class FastARExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


def register_prompt_checks() -> None:
    """Cross-node checks before validation (a class against the linked model's classes)."""
    try:
        from server import PromptServer
        add = getattr(PromptServer.instance, "add_on_prompt_handler", None)
    except (ImportError, AttributeError):
        return
    if add is not None:
        add(check_class_labels)


async def comfy_entrypoint() -> FastARExtension:
    register_model_folders()
    register_prompt_checks()
    return FastARExtension()
