"""What every conformance builder shares: the record of where a fixture came from (the official checkout's commit,
the packages it ran with, expected.json) and the torchvision stand-in official code needs where PyPI's torchvision
cannot load (its wheel wants CUDA's torch libraries; no generation path calls it)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

COMMITS: dict = {}  # checkout -> its commit, given on the command line where the checkout has no .git


def commit_of(checkout: Path) -> str:
    checkout = Path(checkout).resolve()
    if checkout in COMMITS:
        return COMMITS[checkout]
    found = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"{checkout} is no git work tree: give its commit on the command line")
    return found.stdout.strip()


def packages(*names) -> dict:
    """The versions of those of ``names`` that are installed."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def fixed_at_of(accepted: list[int], n: int) -> list[int]:
    """The iteration that fixed each of ``n`` codes in a speculative sampler (0: the prefill's first code; iteration
    i fixes its accepted drafts and the target's next code), from its accept lengths (LANTERN's evaluate_posterior),
    as FastAR's ``--stats-out`` reports ``fixed_at``."""
    at = [0]
    for iteration, a in enumerate(accepted, start=1):
        at += [iteration] * (a + 1)
    return at[:n]


def write_expected(folder: Path, source: dict, runs: list) -> None:
    (folder / "expected.json").write_text(json.dumps({"source": source, "runs": runs}, indent=1, ensure_ascii=False)
                                          + "\n")


def stub_torchvision() -> None:
    """Where torchvision cannot be imported, every ``torchvision.*`` module becomes a stand-in whose names are
    placeholders that raise when called (official code imports it for preprocessing or for writing PNGs, which the
    builders do themselves)."""
    try:
        import torchvision.utils  # noqa: F401 - the real one, where it loads
        return
    except (ImportError, OSError, RuntimeError):
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]

    class Placeholder(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Placeholder(name, (), {})

        def __call__(cls, *args, **kwargs):
            raise RuntimeError(f"torchvision stand-in: {cls.__name__} is not used by the builders")

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Placeholder(name, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname == "torchvision" or fullname.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = StandIn(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            module.__version__ = "0.0+stand-in"

    sys.meta_path.insert(0, Finder())
