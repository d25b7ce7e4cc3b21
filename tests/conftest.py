"""The suite split between processes (pytest-xdist with ``--dist loadfile``, as tools/run_tests.sh runs it): each
test file stays in one worker, so its module fixtures (a trained demo loaded, its decoders run) are built once; a
worker that runs ComfyUI tests starts its own ComfyUI server. The workers share the cores, so each gets its share
of threads: torch's default, a thread per core in every worker, oversubscribes them and slows all."""
from __future__ import annotations

import os

import torch


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the commands and servers the tests start
        torch.set_num_threads(threads)
