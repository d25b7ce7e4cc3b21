"""``profile --kernels``: where one forward's time goes, from torch.profiler. On CUDA: the device time of each
kernel (inside CUDA graph replays too), grouped into matrix products, attention, copies and fused elementwise
work, against the forward's wall time (the rest is the GPU waiting for launches). On the CPU: each operator's
own time, grouped the same way. On both, the host time a compiled step spends in dynamo before its graph runs:
checking guards, and gathering the graph's inputs from the session and the model."""
from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# the first group whose pattern a kernel's or operator's name matches (case-insensitive); inductor names its
# GEMM templates triton_tem_*, its fused pointwise and reduction kernels triton_poi_* / triton_red_* / triton_per_*
# (a dtype cast in them reads "_to_copy": not a copy); cuBLAS's Hopper GEMMs are nvjet_*
GROUPS = (("attention", r"flash|fmha|attention|sdpa|cudnn"),  # before matmul: CUTLASS attention kernels say cutlass
          ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|matmul|aten::(mm|bmm|addmm|linear)\b|triton_tem|_w8_|splitk"),
          ("copy", r"memcpy|memset|index_put|scatter|gather|aten::(copy_|cat|index|fill_)\b"),
          ("elementwise", r"triton_|elementwise|reduce|aten::"))
TOP = 12
DYNAMO_HOST = {"TorchDynamo Cache Lookup": "guards", "Pregraph bytecode": "inputs"}  # profiler event -> what it is


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_breakdown(step, device: torch.device, repeats: int = 5) -> dict:
    """``step()`` (one forward) ``repeats`` times under the profiler, after a warm-up: ms per forward of each
    group of kernels (CUDA) or operators (CPU), the busiest names, and the wall time."""
    step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / repeats
    busy, calls, host = defaultdict(float), defaultdict(int), dict.fromkeys(DYNAMO_HOST.values(), 0.0)
    for event in prof.events():
        if event.name in DYNAMO_HOST:
            host[DYNAMO_HOST[event.name]] += event.cpu_time_total / 1e3 / repeats
        if cuda and event.device_type == DeviceType.CUDA:
            busy[event.name] += event.time_range.elapsed_us() / 1e3
        elif not cuda and event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            busy[event.name] += event.self_cpu_time_total / 1e3
        else:
            continue
        calls[event.name] += 1
    groups = defaultdict(float)
    for name, ms in busy.items():
        groups[group_of(name)] += ms / repeats
    total = sum(groups.values())
    top = sorted(busy, key=busy.get, reverse=True)[:TOP]
    return {"wall_ms": wall_ms, "busy_ms": total, "busy_share": total / wall_ms,
            "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])), "dynamo_host_ms": host,
            "top": [{"name": name[:160], "group": group_of(name), "ms": busy[name] / repeats,
                     "calls": calls[name] / repeats} for name in top]}


def print_breakdown(label: str, breakdown: dict) -> None:
    print(f"[profile]   {label}: {breakdown['wall_ms']:.2f} ms wall, {breakdown['busy_ms']:.2f} ms busy "
          f"({breakdown['busy_share']:.0%}): " + ", ".join(f"{group} {ms:.2f}" for group, ms
                                                           in breakdown["groups_ms"].items()), flush=True)
    host = breakdown["dynamo_host_ms"]
    if any(host.values()):
        print(f"[profile]     host, dynamo: guards {host['guards']:.3f} ms, gathering inputs {host['inputs']:.3f} ms",
              flush=True)
    for kernel in breakdown["top"][:5]:
        print(f"[profile]     {kernel['ms']:.3f} ms x{kernel['calls']:.0f} [{kernel['group']}] {kernel['name'][:90]}",
              flush=True)
