"""What the training commands (train-drafter, distill-dd) and the demo recipes share: seeding, the learning-rate
schedule, the optimiser step, LlamaGen's initialisation, fp16 saving, the timer and the cache folder."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from ..model_loaders.shared.joined import parted_state_dict

DATA_DIR = Path(__file__).resolve().parent.parent / ".data"  # git-ignored caches


def setup(seed: int) -> torch.Generator:
    """Two CPU threads (the machine is shared), global seeds for module init, a generator for the rest."""
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)  # cheap insurance: denormal floats are very slow on CPUs
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def save_fp16(module: torch.nn.Module, cfg, path, keep_fp32: tuple[str, ...] = (), drop: tuple[str, ...] = (),
              defaults: dict | None = None) -> None:
    """State dict in fp16 (official key names; keys starting with ``keep_fp32`` stay fp32, keys starting with
    ``drop`` are left out) with the config as JSON under ``fastar_config`` and the model's best measured sampling
    settings under ``fastar_defaults`` (the command line's names: what it and the speed dial use unless told)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.half() if v.is_floating_point() and not k.startswith(keep_fp32) else v).detach().contiguous()
          for k, v in parted_state_dict(module).items() if not (drop and k.startswith(drop))}
    metadata = {"fastar_config": json.dumps(asdict(cfg) if not isinstance(cfg, dict) else cfg)}
    if defaults:
        metadata["fastar_defaults"] = json.dumps(defaults)
    write_whole(path, lambda file: save_file(sd, str(file), metadata=metadata))
    print(f"saved {path.name}: {path.stat().st_size / 1e6:.2f} MB")


def write_whole(path: Path, write) -> None:
    """``write(file)`` to a file beside ``path`` named for this process, then renamed to ``path``: an interrupted
    write never leaves half a file, and two processes caching the same data at once each rename a whole one."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def save_whole(data, path: Path) -> None:
    write_whole(path, lambda file: torch.save(data, file))


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * min(t, 1.0))))


def adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW that decays the weight matrices only (norms, biases and gains keep their values), as LlamaGen and
    MAR train."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)


def train_step(opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, clip: float | None = None,
               clip_value: float | None = None) -> None:
    """One optimiser step at learning rate ``lr`` on the gradients of ``loss``: their norm clipped to ``clip``,
    or each one to +-``clip_value`` (LANTERN's drafter), or neither."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    if clip is not None:
        nn.utils.clip_grad_norm_(params, clip)
    if clip_value is not None:
        nn.utils.clip_grad_value_(params, clip_value)
    opt.step()


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """``ema`` <- ``decay`` * ``ema`` + (1 - ``decay``) * ``model``, parameter by parameter."""
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1 - decay)


def init_weights(model: nn.Module) -> None:
    """LlamaGen's init: normal(0, 0.02) for Linear/Embedding, zero output head (seeded by the caller)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
    nn.init.zeros_(model.output.weight)


class Timer:
    def __init__(self):
        self.start = time.time()

    def __str__(self):
        return f"{time.time() - self.start:.0f}s"


class Checkpoints:
    """A long training's state (its modules, by name: the model, its EMA...; the optimiser, generator, step) saved
    every ``every`` steps to one file, so that a run cut short (a session ends, the machine restarts) continues where
    it stopped and ends as an uncut run would. The file is written whole or not at all, and removed when the run
    finishes."""

    def __init__(self, path, every: int, modules: dict[str, nn.Module], opt: torch.optim.Optimizer,
                 gen: torch.Generator):
        self.path, self.every, self.modules, self.opt, self.gen = Path(path), every, modules, opt, gen

    def resume(self) -> int:
        """The step to start from: 0, or the saved run's next step (its state restored)."""
        if not self.path.exists():
            return 0
        state = torch.load(self.path, weights_only=False)
        for name, module in self.modules.items():
            module.load_state_dict(state[name])
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])
        print(f"resumed from {self.path.name} at step {state['step']}", flush=True)
        return state["step"]

    def after(self, step: int) -> None:
        """Call after step ``step`` (counted from 0) is done."""
        if (step + 1) % self.every:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        modules = {name: module.state_dict() for name, module in self.modules.items()}
        save_whole(modules | {"opt": self.opt.state_dict(), "gen": self.gen.get_state(), "step": step + 1}, self.path)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)
