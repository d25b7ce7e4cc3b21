"""Start-up shim for the test ComfyUI's virtual environment (installed there by setup.sh, never imported
by the pack).

PyPI's torchvision is a CUDA build: on the CPU build of torch its compiled extension does not load, and
``import torchvision`` then fails in ``torchvision._meta_registrations`` because the ops
``torchvision::nms`` and ``torchvision::qnms`` are undefined. Just before that module is imported, this
hook defines the two op schemas if (and only if) they are missing, so the pure-Python parts of
torchvision import; nothing else changes. It costs nothing until torchvision is imported.
"""
import importlib.abc
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries = []  # a torch.library.Library drops its definitions when it is garbage-collected


def define_missing_ops() -> None:
    import torch

    missing = [name for name in _SCHEMAS if not hasattr(torch.ops.torchvision, name)]
    if missing:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            library.define(_SCHEMAS[name])
        _libraries.append(library)


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            define_missing_ops()
        return None  # the ordinary finders import the module


if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeMetaRegistrations())
