"""Builds the Infinity BSQ VAE conformance fixture (fixtures/infinity_vae/) with the official code (run by hand, never
by the tests).

    git clone https://github.com/FoundationVision/Infinity   # or: git -C MIRROR archive HEAD | tar -x -C Infinity
    pip install --target DEPS einops   # the VAE's one import FastAR's venv lacks
    PYTHONPATH=DEPS python tests/conformance/build/infinity_vae.py --infinity Infinity --commit SHA

Two tiny VAEs of the official ``AutoEncoder``, made and loaded by the release's own ``vae_model`` (tools/
run_infinity.py's arguments: schedule "dynamic", codebook_size 2**d, test_mode) from a file saved as the release's
(``torch.save({"vae": state_dict})``, which ``vae_model`` reads back through its ``load_cnn``):
- ``vae_d32.pth``: the 2B's layout (d 32, patch 16, five decoder levels), keys as ``AutoEncoder.state_dict()``
  names them (Infinity's ``Conv``/``Normalize`` wrappers: ``decoder.conv_in.conv.weight``, ``norm1.norm.weight``);
- ``vae_d14_patchify.pth``: the 8B's (d 14, patch 8, four levels, the transformer's 56 bits a token pixel-shuffled to
  2 x 2 cells), keys without the wrappers (``decoder.conv_in.weight``), the other layout ``load_cnn`` reads.
The builder asserts that ``vae_model`` filled every tensor of its model from the file.

The multi-scale accumulation is the release's ``Infinity.autoregressive_infer_cfg`` itself, run unbound on a stand-in
transformer (no blocks; ``get_logits`` puts the given bits of each scale first, top-k 1; ``word_embed`` records the
next scale's input as the loop hands it over, after the 8B's pixel_unshuffle and flattening), with ``vae_type`` d,
``returns_vemb`` 1, ``ret_img`` True, cfg 1. Recorded per scale: the VAE-grid bits the loop gives
``indices_to_codes`` and its codes, the next input; then the summed codes the loop passes to ``vae.decode``, that
decode's output (clamped, as the release's) and the loop's uint8 image (BGR, flipped to RGB for the PNG).

Departures, each forced by a tiny CPU fixture or made so that a test can fail: base_ch 32, ch_mult (1, 1, 2, 2, 2)
and (1, 1, 2, 2), one residual block a level (two in the decoder's levels), a one-level encoder (decoding never runs
it); GroupNorm weights and biases random, the last convolution scaled so the images fill the pixel range; weights
rounded to fp16 and stored so; fp32 throughout (the release decodes under CUDA autocast in bf16); ``infinity/models/
__init__.py`` skipped and timm, flash_attn, pytz, imageio and torchvision stood in for (the transformer's building
blocks are never built).
"""
from __future__ import annotations

import argparse
import re
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import commit_of, packages, stub_torchvision, write_expected  # noqa: E402

BATCH = 2
CASES = [  # name, file, d, patchify, transformer scale schedule (h, w), keys as the module names them
    dict(name="d32", file="vae_d32.pth", d=32, patchify=False, ch_mult=[1, 1, 2, 2, 2], wrapped=True,
         schedule=[(1, 1), (2, 2), (3, 2), (6, 4), (9, 6)]),  # the 1.5 ratio's first scales
    dict(name="d14_patchify", file="vae_d14_patchify.pth", d=14, patchify=True, ch_mult=[1, 1, 2, 2], wrapped=False,
         schedule=[(1, 1), (2, 2), (4, 3), (8, 6), (12, 9)]),  # the 1.333 ratio's first scales
]


def import_official(checkout: Path):
    """The VAE module and ``Infinity`` class, without the packages the transformer's blocks need."""
    sys.path[:] = [str(checkout)] + [p for p in sys.path if Path(p).resolve() != HERE]
    stub_torchvision()
    timm, models, layers = (types.ModuleType(n) for n in ("timm", "timm.models", "timm.models.layers"))
    models.register_model = lambda f: f
    layers.DropPath, layers.drop_path = torch.nn.Identity, None
    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func = flash.flash_attn_varlen_kvpacked_func = None
    package = types.ModuleType("infinity.models")  # its __init__ imports the whole training stack
    package.__path__ = [str(checkout / "infinity" / "models")]
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers, "flash_attn": flash,
                        "pytz": types.ModuleType("pytz"), "imageio": types.ModuleType("imageio"),
                        "infinity.models": package})
    from infinity.models.bsq_vae import vae as official_vae
    from infinity.models.infinity import Infinity
    return official_vae, Infinity


def tiny_vae(official_vae, path, case):
    """``vae_model`` as tools/run_infinity.py calls it, its AutoEncoder's sizes made tiny."""
    real = official_vae.AutoEncoder

    def tiny(args):
        return real(argparse.Namespace(**{**vars(args), "base_ch": 32, "num_res_blocks": 1, "encoder_ch_mult": [1]}))

    official_vae.AutoEncoder = tiny
    try:
        patch = 8 if case["patchify"] else 16
        return official_vae.vae_model(path, "dynamic", case["d"], 2 ** case["d"], patch_size=patch,
                                      encoder_ch_mult=case["ch_mult"], decoder_ch_mult=case["ch_mult"], test_mode=True)
    finally:
        official_vae.AutoEncoder = real


@torch.no_grad()
def randomise(vae, case) -> None:
    g = torch.Generator().manual_seed(3)
    for module in vae.modules():
        if isinstance(module, torch.nn.GroupNorm):
            module.weight.copy_(1 + torch.randn(module.weight.shape, generator=g) * 0.3)
            module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.3)
    h, w = case["schedule"][-1]
    side = 2 if case["patchify"] else 1
    z = F.normalize(torch.randn(4, case["d"], h * side, w * side, generator=g), dim=1)
    spread = vae.decoder(z).std()
    conv_out = vae.decoder.conv_out.conv
    conv_out.weight.mul_(0.45 / spread)
    conv_out.bias.mul_(0.45 / spread)
    for t in vae.state_dict().values():
        if t.is_floating_point():
            t.copy_(t.half().float())


def release_state(vae, wrapped: bool) -> dict:
    """The state dict as saved: the module's names, or without Infinity's wrapper modules (the other form load_cnn
    reads), in fp16."""
    sd = {k: v.half() if v.is_floating_point() else v for k, v in vae.state_dict().items()}
    if wrapped:
        return sd
    return {re.sub(r"\.(conv|norm)\.(weight|bias)$", r".\2", k): v for k, v in sd.items()}


class StandIn:
    """What ``autoregressive_infer_cfg`` asks of its transformer, minus the transformer: the given bits come out of
    ``get_logits`` as the only top-1 choice; ``word_embed`` records each next-scale input."""

    def __init__(self, bits: list[torch.Tensor], patchify: bool, width: int = 8):
        self.bits, self.apply_spatial_patchify, self.inputs, self.scale = bits, patchify, [], 0
        self.use_bit_label, self.use_flex_attn, self.top_k, self.top_p = 1, False, 1, 0.0
        self.unregistered_blocks, self.block_chunks = [], []
        self.pos_start = torch.zeros(1, 1, width)
        self.text_norm = self.text_proj_for_ca = self.norm0_ve = lambda x: x
        self.text_proj_for_sos = lambda packed: torch.zeros(len(bits[0]), width)
        self.shared_ada_lin = lambda c: c

    def get_logits(self, x, cond):
        bits = self.bits[self.scale]  # [B, h, w, bits a token]
        self.scale += 1
        onehot = F.one_hot(bits.long(), 2).float() * 10  # bit j's two logits at 2j, 2j + 1
        return onehot.reshape(bits.shape[0], -1, bits.shape[-1] * 2)

    def word_embed(self, x):
        self.inputs.append(x.clone())
        return x


class Recorder:
    """The VAE as the loop sees it, recording what it hands to ``indices_to_codes`` and ``decode``."""

    def __init__(self, vae):
        self.vae, self.quantizer, self.records = vae, types.SimpleNamespace(), {"bits": [], "codes": []}
        self.quantizer.z_interplote_up = vae.quantizer.z_interplote_up
        self.quantizer.lfq = types.SimpleNamespace(indices_to_codes=self.indices_to_codes)

    def indices_to_codes(self, idx, label_type):
        codes = self.vae.quantizer.lfq.indices_to_codes(idx, label_type=label_type)
        self.records["bits"].append(idx)
        self.records["codes"].append(codes)
        return codes

    def decode(self, z):
        self.records["f_hat"] = z
        self.records["decoded"] = self.vae.decode(z)
        return self.records["decoded"]


def run_case(official_vae, Infinity, case, out: Path) -> dict:
    torch.manual_seed(0)
    vae = tiny_vae(official_vae, {"vae": {}}, case)  # an empty file: random weights
    randomise(vae, case)
    path = out / case["file"]
    torch.save({"vae": release_state(vae, case["wrapped"])}, path)
    loaded = tiny_vae(official_vae, str(path), case)
    for key, value in vae.state_dict().items():  # load_cnn skips what it cannot place: every tensor must have come
        assert torch.equal(loaded.state_dict()[key], value), f"vae_model did not read {key}"
    g = torch.Generator().manual_seed(7)
    per_token = case["d"] * (4 if case["patchify"] else 1)
    bits = [torch.randint(0, 2, (BATCH, h, w, per_token), generator=g) for h, w in case["schedule"]]
    stand_in, recorder = StandIn(bits, case["patchify"]), Recorder(loaded)
    schedule = [(1, h, w) for h, w in case["schedule"]]
    S = len(schedule)
    _, _, img = Infinity.autoregressive_infer_cfg(
        stand_in, vae=recorder, scale_schedule=schedule, label_B_or_BLT=(torch.zeros(1, 8), [1], None, 1), B=BATCH,
        cfg_list=[1] * S, tau_list=[1] * S, top_k=1, top_p=0.0, returns_vemb=1, cfg_insertion_layer=[0],
        vae_type=case["d"], ret_img=True, inference_mode=True)
    name, rec = case["name"], recorder.records
    vae_grid = [tuple(b.shape[2:4]) for b in rec["bits"]]
    np.savez_compressed(out / f"{name}.npz",
                        **{f"bits_{i}": b.squeeze(1).numpy().astype(np.uint8) for i, b in enumerate(rec["bits"])},
                        **{f"codes_{i}": c.squeeze(2).numpy() for i, c in enumerate(rec["codes"])},
                        **{f"input_{i}": x.numpy() for i, x in enumerate(stand_in.inputs)},
                        f_hat=rec["f_hat"].numpy(), decoded=rec["decoded"].numpy())
    images = []
    for i, pixels in enumerate(img.numpy()[..., ::-1]):  # the loop's BGR (for cv2) as RGB
        images.append(f"{name}_{i}.png")
        Image.fromarray(np.ascontiguousarray(pixels)).save(out / images[-1])
    return {"name": name, "file": case["file"], "codebook_dim": case["d"], "patch_size": 8 if case["patchify"] else 16,
            "patchify": case["patchify"], "wrapped_keys": case["wrapped"], "schedule": case["schedule"],
            "vae_grid": vae_grid, "arrays": f"{name}.npz", "images": images}


def build(checkout: Path, commit: str, out: Path) -> None:
    official_vae, Infinity = import_official(checkout)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_case(official_vae, Infinity, case, out) for case in CASES]
    source = {"repository": "FoundationVision/Infinity", "commit": commit, "packages": packages("torch", "einops"),
              "builder": "tests/conformance/build/infinity_vae.py",
              "made_with": "infinity.models.bsq_vae.vae.vae_model (its load_cnn from {'vae': sd}); "
                           "Infinity.autoregressive_infer_cfg unbound on a stand-in transformer, top-k 1, cfg 1",
              "departures": ["tiny sizes: base_ch 32, ch_mult (1,1,2,2,2) / (1,1,2,2), num_res_blocks 1, encoder one "
                             "level", "GroupNorm weights random, conv_out scaled", "weights rounded to and stored in "
                             "fp16", "fp32 throughout (the release: CUDA autocast bf16)", "infinity/models/__init__.py "
                             "skipped; timm, flash_attn, pytz, imageio, torchvision stood in for"]}
    write_expected(out, source, runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--infinity", type=Path, required=True, help="a checkout of FoundationVision/Infinity")
    parser.add_argument("--commit", help="its commit, where the checkout has no .git")
    parser.add_argument("--out", type=Path, default=HERE.parent / "fixtures" / "infinity_vae")
    args = parser.parse_args()
    build(args.infinity.resolve(), args.commit or commit_of(args.infinity), args.out)
