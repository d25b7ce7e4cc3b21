"""Builds the MAR + KL-16 conformance fixtures with the official code of LTH14/mar (run by hand, never by the tests).

    VENV/bin/python tests/conformance/build/mar.py --official /path/to/mar

needs torch, timm, scipy, numpy (no GPU: ``Tensor.cuda`` is made a no-op while the official code runs).

mar_tiny: a tiny ``models.mar.MAR`` built with the keyword arguments ``main_mar.py`` gives its ``mar_*`` factory (the
training args come from ``main_mar.get_args_parser`` at tiny sizes), zero-initialised heads re-initialised, EMA
weights that differ from the live ones, saved by ``util.misc.save_model`` ({"model", "model_ema", "optimizer",
"epoch", "scaler", "args"}: checkpoint-last.pth). ``sample_tokens`` (CFG 3, linear schedule, 4 steps, 10 diffusion
steps) runs on the EMA weights as ``engine_mar.evaluate`` switches to them. Its randomness is recorded as it is
drawn: the generation orders (``sample_orders``), the masks (``mask_by_order``), and every ``torch.randn`` /
``torch.randn_like`` (x_T and each reverse step's noise) of ``DiffLoss.sample``; expected.json keeps them per token
position so that FastAR's sampler can be handed the same ones.

mar_kl16: a tiny ``models.vae.AutoencoderKL`` (its Encoder/Decoder at ch 32; the class's own always builds the
256-px KL-16) saved as {"model": state_dict} (kl16.ckpt), and its ``decode`` of the official MAR output / 0.2325
(``engine_mar.evaluate``'s call) for the images.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE.parent))  # common.save_image
from common import save_image  # noqa: E402
from provenance import packages, stub_torchvision  # noqa: E402

SIZE = dict(img_size=64, vae_stride=16, patch_size=1, class_num=10, buffer_size=4, diffloss_d=1, diffloss_w=32,
            num_sampling_steps="10", diffusion_batch_mul=1)  # 4 x 4 tokens of 16 channels
WIDTH = dict(encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2, decoder_embed_dim=32, decoder_depth=1,
             decoder_num_heads=2, mlp_ratio=4)
SAMPLING = dict(num_iter=4, cfg=3.0, cfg_schedule="linear", temperature=1.0)
LABELS = [1, 7]
TINY_KL = dict(ch=32, ch_mult=(1, 1), num_res_blocks=0, z_channels=16, resolution=8, attn_resolutions=())


def function_from(path: Path, name: str, namespace: dict):
    """One top-level function of an official script, compiled from the file (its other top-level code not run)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def randomise(module: nn.Module, seed: int, scale: float = 0.2) -> None:
    """Norms away from their neutral init, zero-initialised tensors (adaLN gates, the head's output layer) random."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * noise)
            elif p.abs().max() == 0:
                p.copy_(scale * noise)


@contextlib.contextmanager
def recorded_randomness(log: list):
    """Tensor.cuda a no-op; every torch.randn / torch.randn_like drawn is appended to ``log`` (in order)."""
    randn, randn_like, cuda = torch.randn, torch.randn_like, torch.Tensor.cuda

    def recording(function):
        def draw(*args, **kwargs):
            value = function(*args, **kwargs)
            log.append(value.clone())
            return value
        return draw

    torch.randn, torch.randn_like, torch.Tensor.cuda = recording(randn), recording(randn_like), lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.randn, torch.randn_like, torch.Tensor.cuda = randn, randn_like, cuda


def build(out: Path, seed: int, official: Path) -> None:
    sys.path.insert(0, str(official))
    stub_torchvision()
    import util.misc as misc
    from models import mar as mar_module
    from models import vae as vae_module

    # the training args as main_mar.py parses them, at the tiny sizes
    parser = function_from(official / "main_mar.py", "get_args_parser", {"argparse": argparse})()
    with tempfile.TemporaryDirectory() as scratch:
        argv = ["--model", "mar_tiny", "--output_dir", scratch, "--lr", "1e-4", "--cfg", str(SAMPLING["cfg"]),
                "--num_iter", str(SAMPLING["num_iter"]), "--temperature", str(SAMPLING["temperature"]),
                *[a for k, v in SIZE.items() for a in (f"--{k}", str(v))]]
        args = parser.parse_args(argv)
        # main_mar: model = mar.__dict__[args.model](these keywords); mar_tiny's sizes as a mar_* factory gives them
        model = mar_module.MAR(
            **WIDTH, norm_layer=partial(nn.LayerNorm, eps=1e-6), img_size=args.img_size, vae_stride=args.vae_stride,
            patch_size=args.patch_size, vae_embed_dim=args.vae_embed_dim, mask_ratio_min=args.mask_ratio_min,
            label_drop_prob=args.label_drop_prob, class_num=args.class_num, attn_dropout=args.attn_dropout,
            proj_dropout=args.proj_dropout, buffer_size=args.buffer_size, diffloss_d=args.diffloss_d,
            diffloss_w=args.diffloss_w, num_sampling_steps=args.num_sampling_steps,
            diffusion_batch_mul=args.diffusion_batch_mul, grad_checkpointing=args.grad_checkpointing)
        torch.manual_seed(seed)
        randomise(model, seed)
        generator = torch.Generator().manual_seed(seed + 1)
        ema_params = [p.detach() + 0.05 * torch.randn(p.shape, generator=generator) for p in model.parameters()]
        param_groups = misc.add_weight_decay(model, args.weight_decay)
        optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95))
        loss_scaler = misc.NativeScalerWithGradNormCount()
        misc.save_model(args=args, model=model, model_without_ddp=model, optimizer=optimizer,
                        loss_scaler=loss_scaler, epoch=0, ema_params=ema_params, epoch_name="last")
        mar_folder = out / "mar_tiny"
        shutil.rmtree(mar_folder, ignore_errors=True)
        mar_folder.mkdir(parents=True)
        shutil.copy(Path(scratch) / "checkpoint-last.pth", mar_folder / "checkpoint-last.pth")
    # the heads of a non-official size: the config FastAR asks for beside the file
    (mar_folder / "checkpoint-last.json").write_text(json.dumps({"num_heads": WIDTH["encoder_num_heads"]}) + "\n")

    # engine_mar.evaluate: switch to the EMA weights, then sample_tokens
    checkpoint = torch.load(mar_folder / "checkpoint-last.pth", map_location="cpu", weights_only=False)
    model.load_state_dict(checkpoint["model_ema"])
    model.eval()
    orders, masks, draws = [], [], []
    sample_orders, mask_by_order = model.sample_orders, mar_module.mask_by_order
    model.sample_orders = lambda bsz: orders.append(sample_orders(bsz)) or orders[-1]
    mar_module.mask_by_order = lambda *a: masks.append(mask_by_order(*a)) or masks[-1]
    torch.manual_seed(seed)
    np.random.seed(seed)
    with torch.no_grad(), recorded_randomness(draws):
        tokens = model.sample_tokens(bsz=len(LABELS), labels=torch.tensor(LABELS), **SAMPLING)
    mar_module.mask_by_order = mask_by_order
    plan = plan_of(model, orders, masks, draws, len(LABELS), SAMPLING["num_iter"])
    latents = tokens / 0.2325  # engine_mar.evaluate: vae.decode(sampled_tokens / 0.2325)
    np.save(mar_folder / "official_tokens.npy", tokens.numpy().astype(np.float32))
    np.save(mar_folder / "plan_start.npy", plan["start"])
    np.save(mar_folder / "plan_noise.npy", plan["noise"])
    spread = float(tokens.std())
    assert spread > 0.05, f"the official tokens hardly vary ({spread}): re-initialise more"

    commit = subprocess.run(["git", "-C", str(official), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    versions = packages("torch", "timm", "scipy", "numpy")
    source = {"repository": "LTH14/mar", "commit": commit, "packages": versions,
              "builder": "tests/conformance/build/mar.py",
              "made_with": "main_mar.get_args_parser (compiled from the file) at tiny sizes; models.mar.MAR with "
                           "those args and encoder/decoder 32 wide, 1 block, 2 heads; zero-initialised tensors and "
                           "norms randomised; EMA = weights + noise; util.misc.save_model (AdamW, "
                           "NativeScalerWithGradNormCount, ema_params, epoch_name 'last'); the EMA weights loaded "
                           "as engine_mar.evaluate does; sample_tokens(labels, num_iter 4, cfg 3, linear, "
                           "temperature 1) under torch.manual_seed / np.random.seed with Tensor.cuda a no-op, its "
                           "orders (sample_orders), masks (mask_by_order) and torch.randn / randn_like draws "
                           "(DiffLoss.sample's x_T, p_sample's noise) recorded and laid out per token position "
                           "(plan_start.npy [B, L, C], plan_noise.npy [S, B, L, C] by reverse index); "
                           "checkpoint-last.json (num_heads) is FastAR's config for a non-official size"}
    run = {"name": "cfg3-linear-4steps", "labels": LABELS, **SAMPLING,
           "diffusion_steps": int(SIZE["num_sampling_steps"]), "orders": plan["orders"], "masked": plan["masked"],
           "tokens": "official_tokens.npy", "start": "plan_start.npy", "noise": "plan_noise.npy"}
    (mar_folder / "expected.json").write_text(json.dumps({"source": source, "runs": [run]}, indent=1) + "\n")
    print(mar_folder, sum(f.stat().st_size for f in mar_folder.iterdir()), "bytes")

    # the KL-16 autoencoder
    torch.manual_seed(seed + 2)
    vae = vae_module.AutoencoderKL(embed_dim=16, ch_mult=TINY_KL["ch_mult"], ckpt_path=None)
    vae.encoder = vae_module.Encoder(**TINY_KL)
    vae.decoder = vae_module.Decoder(**TINY_KL)
    randomise(vae, seed + 2)
    kl_folder = out / "mar_kl16"
    shutil.rmtree(kl_folder, ignore_errors=True)
    kl_folder.mkdir(parents=True)
    torch.save({"model": vae.state_dict()}, kl_folder / "kl16.ckpt")
    vae = vae_module.AutoencoderKL(embed_dim=16, ch_mult=TINY_KL["ch_mult"], ckpt_path=None)
    vae.encoder, vae.decoder = vae_module.Encoder(**TINY_KL), vae_module.Decoder(**TINY_KL)
    vae.load_state_dict(torch.load(kl_folder / "kl16.ckpt", map_location="cpu")["model"])  # init_from_ckpt's read
    vae.eval()
    with torch.no_grad():
        pixels = vae.decode(latents)
    np.save(kl_folder / "official_latents.npy", latents.numpy().astype(np.float32))
    images = []
    for i, image in enumerate(pixels):
        images.append(f"decoded_{i}.png")
        save_image(image.numpy(), kl_folder / images[-1])
    source = dict(source, made_with="models.vae.AutoencoderKL(embed_dim 16) whose Encoder/Decoder are the official "
                                    "classes at ch 32, ch_mult (1, 1), num_res_blocks 0 (one block per decoder level), "
                                    "attention only in the middle blocks (the class itself always builds the 256-px "
                                    "KL-16), norms "
                                    "randomised, saved as {'model': state_dict}, read back as init_from_ckpt does; "
                                    "decode(mar_tiny's official sample_tokens / 0.2325) as engine_mar.evaluate")
    (kl_folder / "expected.json").write_text(json.dumps(
        {"source": source, "runs": [{"name": "decode", "args": [], "latents": "official_latents.npy",
                                     "images": images}]}, indent=1) + "\n")
    print(kl_folder, sum(f.stat().st_size for f in kl_folder.iterdir()), "bytes")


def plan_of(model, orders: list, masks: list, draws: list, batch: int, num_iter: int) -> dict:
    """The official draws laid out per token position: x_T ``[B, L, C]`` and the noise of each reverse step
    ``[S, B, L, C]`` by reverse index (the loop runs S-1 .. 0); also the orders and the masked counts."""
    assert len(orders) == 1 and len(masks) == num_iter, (len(orders), len(masks))
    L, C = model.seq_len, model.token_embed_dim
    steps = model.diffloss.gen_diffusion.num_timesteps
    start = np.zeros((batch, L, C), np.float32)
    noise = np.zeros((steps, batch, L, C), np.float32)
    assert len(draws) == num_iter * (1 + steps), len(draws)
    before = torch.ones(batch, L, dtype=torch.bool)
    masked = [L]
    for step in range(num_iter):
        after = masks[step][:batch].bool()
        predicted = before if step == num_iter - 1 else before & ~after
        rows, positions = predicted.nonzero(as_tuple=True)  # the order sample_tokens gathers them in
        n = len(rows)
        group = draws[step * (1 + steps): (step + 1) * (1 + steps)]
        assert group[0].shape == (n, C), group[0].shape  # x_T of the cond half (the uncond half repeats it)
        start[rows, positions] = group[0].numpy()
        for k, drawn in enumerate(group[1:]):  # reverse index steps-1-k; only the first half is ever used
            noise[steps - 1 - k, rows, positions] = drawn[:n].numpy()
        masked.append(0 if step == num_iter - 1 else int(after[0].sum()))
        before = after
    return {"orders": orders[0].tolist(), "masked": masked, "start": start, "noise": noise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", required=True, help="a checkout of LTH14/mar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    build(args.out, args.seed, Path(args.official).resolve())


if __name__ == "__main__":
    main()
