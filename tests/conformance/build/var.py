"""Builds the VAR-family conformance fixtures with the official code (run by hand, never by the tests).

    python tests/conformance/build/var.py var    --official CHECKOUT_OF_FoundationVision/VAR [--commit SHA]
    python tests/conformance/build/var.py var_dd --official CHECKOUT_OF_microsoft/distilled_decoding/VAR [--commit SHA]

``var``: a tiny VAR and its multi-scale VQVAE made with the official classes (models.VAR, models.VQVAE), saved as
the release saves them (raw state dicts: ``var_d2.pth``, ``vae_ch32v32z8.pth``) with the NAME.json FastAR needs for
scales the release does not have; codes from the official ``VAR.autoregressive_infer_cfg`` (top_k=1), recorded
per scale where it calls ``sample_with_top_k_top_p_``; images from its return (the VQVAE's ``fhat_to_img``).

``var_dd``: a tiny VAR-DD student from the Distilled Decoding release's VAR code, saved in the release's layout
(``["trainer"]["ema_parameters"]``), with the official one- and two-step sampling from a given noise (saved as
``noise.npy``), at two splits; it decodes with the ``var`` case's VQVAE.

Everything runs on a CPU (the official code picks the CPU itself when there is no GPU).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import FIXTURES, save_image  # noqa: E402
from provenance import commit_of, packages, stub_torchvision, write_expected  # noqa: E402

PATCH_NUMS = (1, 2, 3, 4)  # 30 tokens, a 4 x 4 f_hat
VOCAB, CVAE = 32, 8  # codebook 32 x 8
VAE_CH = 32  # the smallest width the official GroupNorm(32) allows
DEPTH, WIDTH, HEADS = 2, 32, 2
NUM_CLASSES = 4
CLASSES = [1, 3]
CFG = 1.5
SEED = 0
VAR_FILE, VAE_FILE = "var_d2.pth", "vae_ch32v32z8.pth"
# the official Encoder/Decoder arguments of the tiny VQVAE (VQVAE itself hard-codes ch_mult (1, 1, 2, 2, 4) and
# num_res_blocks 2: megabytes even at ch=32)
SMALL_VAE = dict(dropout=0.0, ch=VAE_CH, z_channels=CVAE, in_channels=3, ch_mult=(1, 1), num_res_blocks=0,
                 using_sa=True, using_mid_sa=True)


def scale_sides() -> list:
    return [[p, p] for p in PATCH_NUMS]


class ScaleRecorder:
    """Wraps the official ``sample_with_top_k_top_p_`` as the official var.py calls it: keeps each scale's codes
    ``[B, pn*pn]`` and the smallest gap between the two largest (guided) logits, so a greedy fixture never rests on
    a near tie that float order could flip."""

    def __init__(self, module):
        self.module, self.original, self.codes, self.gaps = module, module.sample_with_top_k_top_p_, [], []

    def __enter__(self):
        def sample(logits_BlV, *args, **kwargs):
            top = logits_BlV.float().topk(2, dim=-1).values
            self.gaps.append((top[..., 0] - top[..., 1]).min().item())
            out = self.original(logits_BlV, *args, **kwargs)
            self.codes.append(out[:, :, 0].clone())
            return out
        self.module.sample_with_top_k_top_p_ = sample
        return self

    def __exit__(self, *exc):
        self.module.sample_with_top_k_top_p_ = self.original

    def check(self, least=1e-3):
        worst = min(self.gaps)
        assert worst > least, f"a greedy scale has a near tie (top-2 logit gap {worst:.2e}): change the seed"
        joined = torch.cat(self.codes, dim=1)
        for row in joined:
            distinct = len(set(row.tolist()))
            assert distinct >= 8, f"greedy codes use only {distinct} distinct values: {row.tolist()}"

    def per_image(self) -> list:
        """[image][scale][pn*pn]"""
        return [[c[i].tolist() for c in self.codes] for i in range(self.codes[0].shape[0])]


# -- the VQVAE ------------------------------------------------------------------------------------------


def official_vqvae(models, basic_vae):
    """The official VQVAE (its quantiser: 4 shared Phi convs over PATCH_NUMS, a 32 x 8 codebook) with the official
    Encoder and Decoder classes at SMALL_VAE's sizes."""
    vae = models.VQVAE(vocab_size=VOCAB, z_channels=CVAE, ch=VAE_CH, test_mode=True, share_quant_resi=4,
                       v_patch_nums=PATCH_NUMS)
    vae.encoder = basic_vae.Encoder(double_z=False, **SMALL_VAE)
    vae.decoder = basic_vae.Decoder(**SMALL_VAE)
    return vae


def build_vqvae(models, basic_vae):
    """``official_vqvae`` with random weights that make a varied image."""
    torch.manual_seed(SEED)
    vae = official_vqvae(models, basic_vae)
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.Conv2d):  # PyTorch's default init, but spread so the image varies
                torch.nn.init.normal_(module.weight, std=(module.in_channels * 9) ** -0.5)
                torch.nn.init.normal_(module.bias, std=0.1)
            elif isinstance(module, torch.nn.GroupNorm):  # affine 1/0 by default: vary so a misplaced norm shows
                torch.nn.init.normal_(module.weight, 1.0, 0.2)
                torch.nn.init.normal_(module.bias, 0.0, 0.2)
        torch.nn.init.normal_(vae.quantize.embedding.weight, std=1.0)  # not normalised at lookup: rows of any norm
        vae.quantize.ema_vocab_hit_SV.uniform_(0, 1)  # the usage statistics a trained file carries
    return vae.eval().requires_grad_(False)


# -- case 1: VAR ----------------------------------------------------------------------------------------


def tiny_var(models, vae, seed: int):
    """The official VAR as models.build_vae_var builds it (attn_l2_norm, no shared AdaLN, cond_drop 0.1, its
    init_weights), at width 32 with 2 heads (build_vae_var ties them to the depth), then every weight redrawn: the
    official init (head x 0.02, AdaLN gammas x 1e-5) makes a tiny model's logits flat and its blocks inert."""
    torch.manual_seed(seed)
    var = models.VAR(vae_local=vae, num_classes=NUM_CLASSES, depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS,
                     drop_rate=0., attn_drop_rate=0., drop_path_rate=0., norm_eps=1e-6, shared_aln=False,
                     cond_drop_rate=0.1, attn_l2_norm=True, patch_nums=PATCH_NUMS, flash_if_available=True,
                     fused_if_available=True)
    var.init_weights(init_adaln=0.5, init_adaln_gamma=1e-5, init_head=0.02, init_std=-1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in var.named_parameters():
            if name.endswith("scale_mul_1H11"):  # log of the attention temperature, clamped at log 100
                p.copy_(torch.log(torch.full_like(p, 4.0)) + torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(".weight") and p.dim() == 2 and not name.endswith(("_emb.weight", "_embed.weight")):
                gain = 3.0 if name == "head.weight" else 0.5 if "ada_lin" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain * p.shape[1] ** -0.5)  # Linear weights: unit gain
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # class, level and position embeddings
                p.copy_(torch.randn(p.shape, generator=g))
    assert var.head.weight.abs().max() > 0.1 and var.blocks[0].ada_lin[1].weight[: 2 * WIDTH].abs().max() > 0.1
    return var.eval().requires_grad_(False)


def official_var_greedy(var_module, var, labels):
    """Codes per scale and the images in [-1, 1] from the official sampler (greedy: top_k=1)."""
    with ScaleRecorder(var_module) as recorder:
        images = var.autoregressive_infer_cfg(B=len(labels), label_B=torch.tensor(labels), g_seed=SEED, cfg=CFG,
                                              top_k=1, top_p=0.0)
    recorder.check()
    images = images * 2 - 1  # the sampler returns fhat_to_img(...) mapped to [0, 1]
    assert 0.05 < (images.abs() < 1).float().mean() and images.std() > 0.1, "degenerate official image"
    return recorder, images


def build_var(checkout: Path, commit: str | None) -> None:
    sys.path.insert(0, str(checkout))
    import models
    from models import basic_vae
    from models import var as var_module

    folder = FIXTURES / "var"
    folder.mkdir(parents=True, exist_ok=True)
    vae = build_vqvae(models, basic_vae)
    torch.save(vae.state_dict(), folder / VAE_FILE)  # the release's vae_ch160v4096z32.pth: a raw state dict
    (folder / VAE_FILE).with_suffix(".json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS)}) + "\n")
    for seed in range(20):
        var = tiny_var(models, vae, seed)
        try:
            recorder, images = official_var_greedy(var_module, var, CLASSES)
            break
        except AssertionError as e:
            print(f"seed {seed}: {e}")
    else:
        raise SystemExit("no seed gave varied greedy codes")
    torch.save(var.state_dict(), folder / VAR_FILE)  # the release's var_d16.pth: a raw state dict
    (folder / VAR_FILE).with_suffix(".json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS)}) + "\n")
    # the sampler again on the files as saved, reloaded into fresh official modules: the fixture is what they give
    vae2 = official_vqvae(models, basic_vae)
    vae2.load_state_dict(torch.load(folder / VAE_FILE, map_location="cpu"), strict=True)
    var2 = models.VAR(vae_local=vae2.eval(), num_classes=NUM_CLASSES, depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS,
                      norm_eps=1e-6, shared_aln=False, attn_l2_norm=True, patch_nums=PATCH_NUMS)
    var2.load_state_dict(torch.load(folder / VAR_FILE, map_location="cpu"), strict=True)
    recorder, images = official_var_greedy(var_module, var2.eval(), CLASSES)
    names = []
    for i, image in enumerate(images):
        names.append(f"var_{i}.png")
        save_image(image.numpy(), folder / names[-1])
    runs = [{"name": f"greedy ar cfg {CFG}", "args": ["--classes", ",".join(map(str, CLASSES)), "--cfg", CFG,
                                                      "--top-k", 1, "--decoder", "ar"],
             "scales": scale_sides(), "codes": recorder.per_image(), "images": names}]
    source = {"repository": "FoundationVision/VAR", "commit": commit or commit_of(checkout),
              "packages": packages("torch", "numpy"), "builder": "tests/conformance/build/var.py var",
              "made_with": (
                  f"models.VQVAE(vocab_size={VOCAB}, z_channels={CVAE}, ch={VAE_CH}, share_quant_resi=4, "
                  f"v_patch_nums={PATCH_NUMS}) with its encoder/decoder replaced by models.basic_vae.Encoder/Decoder "
                  "(ch=32, ch_mult=(1, 1), num_res_blocks=0; convs, GroupNorm affines and the codebook redrawn), "
                  f"and models.VAR(depth={DEPTH}, embed_dim={WIDTH}, num_heads={HEADS}, num_classes={NUM_CLASSES}, "
                  "attn_l2_norm=True, shared_aln=False, norm_eps=1e-6) with VAR.init_weights as build_vae_var runs "
                  "it, then every parameter redrawn (the first weight seed whose greedy codes vary); both saved as "
                  "raw state dicts (torch.save(module.state_dict())) with NAME.json {patch_nums}; reloaded into "
                  f"fresh modules, codes from VAR.autoregressive_infer_cfg(cfg={CFG}, top_k=1, top_p=0.0, "
                  "g_seed=0), recorded at models.helpers.sample_with_top_k_top_p_ as var.py calls it; images from "
                  "its return (VQVAE.fhat_to_img, [0, 1] mapped back to [-1, 1])")}
    write_expected(folder, source, runs)
    print(f"wrote {folder}: codes {recorder.per_image()}")


# -- case 2: VAR-DD ------------------------------------------------------------------------------------

# (name, t_list in teacher scales, loss_split_t in teacher scales, whether NAME.json's split_t stands for the flags)
DD_RUNS = [
    ("1 step split 2", [0], 2, False),
    ("2 steps t 2 split 3", [0, 2], 3, False),  # the split after t2
    ("2 steps t 3 split 2", [0, 3], 2, False),  # the split before t2
    ("2 steps by split_t", [0, 2], 2, True),
]
DD_SPLIT_T = 2  # NAME.json's split_t (the student is of no released depth)
DD_FILE = "var-d2.pth"


def scale_tokens(scales: int) -> int:
    """Tokens of the first ``scales`` teacher scales."""
    return sum(p * p for p in PATCH_NUMS[:scales])


def tiny_student(dd_models, vae, seed: int):
    """The official DD_Model as models.build_vae_dd builds it (attn_l2_norm, n_d_embed and layerwise n_d_embed on,
    its init_weights) at the VAR case's sizes, then every weight redrawn (its final layer and gammas start flat)."""
    torch.manual_seed(seed)
    dd = dd_models.DD_Model(vae_local=vae, num_classes=NUM_CLASSES, depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS,
                            drop_rate=0., attn_drop_rate=0., drop_path_rate=0., norm_eps=1e-6, shared_aln=False,
                            cond_drop_rate=0.1, attn_l2_norm=True, patch_nums=PATCH_NUMS, flash_if_available=True,
                            fused_if_available=True, n_d_embed_enable=True, layerwise_n_d_embed=True)
    dd.init_weights(init_adaln=0.5, init_adaln_gamma=1e-5, init_head=0.02, init_std=-1)
    redraw(dd, seed)
    assert dd.final_layer_conti.linear.weight.abs().max() > 0.1 and dd.head.weight.abs().max() > 0.1
    return dd.eval().requires_grad_(False)


def redraw(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_mul_1H11"):  # log of the attention temperature, clamped at log 100
                p.copy_(torch.log(torch.full_like(p, 4.0)) + torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(".weight") and p.dim() == 2 and not name.endswith(("_emb.weight", "_embed.weight")):
                gain = 3.0 if name == "head.weight" else 0.5 if "ada_lin" in name or "n_d_embed" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain * p.shape[1] ** -0.5)  # Linear weights: unit gain
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # class, level, position and noise/data embeddings, the final layer's scale-shift table
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "scale_shift" in name else 1.0))


def official_dd(dd, vae, labels, noise, t_list, split_t):
    """sample.py's loop (perturb_data, final_predict, get_final_sequence at loss_split_t for each t of t_list),
    then its transfer_BLCv_to_B3HW image; returns (final sequence, f_hat, images in [-1, 1], smallest greedy gap)."""
    import sample as sample_module

    label_B = torch.tensor(labels)
    x, gaps = noise.clone(), []
    for t in t_list:
        tensor_t = torch.zeros([len(labels)]) + t
        x = dd.perturb_data(x, tensor_t, noise)
        token, logits = dd.final_predict(label_B, x, tensor_t)
        greedy = logits[:, scale_tokens(t): scale_tokens(split_t)]  # the positions that take a greedy code
        if greedy.numel():
            top = greedy.topk(2, dim=-1).values
            gaps.append((top[..., 0] - top[..., 1]).min().item())
        x = dd.get_final_sequence(token, logits, split_t)
    f_hats = []
    original = vae.fhat_to_img
    vae.fhat_to_img = lambda f_hat: (f_hats.append(f_hat.clone()), original(f_hat))[1]
    try:
        images = sample_module.transfer_BLCv_to_B3HW(x.clone(), dd, vae)
    finally:
        vae.fhat_to_img = original
    return x, f_hats[0], images * 2 - 1, min(gaps, default=float("inf"))


def build_var_dd(checkout: Path, commit: str | None) -> None:
    import numpy as np

    stub_torchvision()
    sys.path.insert(0, str(checkout))
    import models as dd_models
    from models import basic_vae

    var_folder, folder = FIXTURES / "var", FIXTURES / "var_dd"
    folder.mkdir(parents=True, exist_ok=True)
    vae = official_vqvae(dd_models, basic_vae)  # the VAR case's VQVAE, in the DD release's own classes
    vae.load_state_dict(torch.load(var_folder / VAE_FILE, map_location="cpu"), strict=True)
    vae = vae.eval()
    noise = torch.randn(len(CLASSES), scale_tokens(len(PATCH_NUMS)), CVAE, generator=torch.Generator().manual_seed(1))
    for seed in range(20):
        dd = tiny_student(dd_models, vae, seed)
        try:
            for _, t_list, split_t, _ in DD_RUNS:
                x, _, images, gap = official_dd(dd, vae, CLASSES, noise, t_list, split_t)
                assert gap > 1e-3, f"a greedy code has a near tie (top-2 logit gap {gap:.2e})"
                codes = torch.cdist(x[:, : scale_tokens(split_t)].flatten(0, 1), vae.quantize.embedding.weight)
                distinct = len(set(codes.argmin(-1).tolist()))
                assert distinct >= 3, f"the greedy codes use only {distinct} distinct values"
                assert 0.05 < (images.abs() < 1).float().mean() and images.std() > 0.1, "degenerate official image"
            break
        except AssertionError as e:
            print(f"seed {seed}: {e}")
    else:
        raise SystemExit("no seed gave a usable student")
    other = tiny_student(dd_models, vae, seed + 100).state_dict()  # the non-EMA weights: must not be the ones read
    torch.save({"trainer": {"var_wo_ddp": other, "ema_parameters": dd.state_dict()}}, folder / DD_FILE)
    (folder / DD_FILE).with_suffix(".json").write_text(
        json.dumps({"patch_nums": list(PATCH_NUMS), "split_t": DD_SPLIT_T}) + "\n")
    np.save(folder / "noise.npy", noise.numpy())
    # again on the file as saved, loaded as sample.py loads it into a fresh official DD_Model
    fresh = dd_models.DD_Model(vae_local=vae, num_classes=NUM_CLASSES, depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS,
                               norm_eps=1e-6, shared_aln=False, attn_l2_norm=True, patch_nums=PATCH_NUMS)
    missing, unexpected = fresh.load_state_dict(torch.load(folder / DD_FILE, map_location="cpu")["trainer"]
                                                ["ema_parameters"], strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    fresh = fresh.eval()
    runs = []
    for name, t_list, split_t, from_json in DD_RUNS:
        x, f_hat, images, _ = official_dd(fresh, vae, CLASSES, noise, t_list, split_t)
        tag = name.replace(" ", "_")
        np.save(folder / f"{tag}.npy", f_hat.numpy())
        names = []
        for i, image in enumerate(images):
            names.append(f"{tag}_{i}.png")
            save_image(image.numpy(), folder / names[-1])
        nearest = torch.cdist(x.flatten(0, 1), vae.quantize.embedding.weight).argmin(-1).view(len(CLASSES), -1)
        codes = [[part.tolist() for part in row.split([p * p for p in PATCH_NUMS])] for row in nearest]
        args = ["--classes", ",".join(map(str, CLASSES)), "--dd-steps", len(t_list)]
        if not from_json:
            args += ["--dd-split", scale_tokens(split_t)] + (["--dd-t2", scale_tokens(t_list[1])] if len(t_list) > 1
                                                              else [])
        runs.append({"name": name, "args": args, "t_list": t_list, "loss_split_t": split_t, "scales": scale_sides(),
                     "codes": codes, "f_hat": f"{tag}.npy", "images": names})
    source = {"repository": "microsoft/distilled_decoding", "commit": commit or commit_of(checkout),
              "packages": packages("torch", "numpy", "typed-argument-parser"),
              "builder": "tests/conformance/build/var.py var_dd",
              "made_with": (
                  f"VAR/models.DD_Model(depth={DEPTH}, embed_dim={WIDTH}, num_heads={HEADS}, "
                  f"num_classes={NUM_CLASSES}, patch_nums={PATCH_NUMS}, attn_l2_norm=True, n_d_embed_enable=True, "
                  "layerwise_n_d_embed=True) with DD_Model.init_weights as build_vae_dd runs it, then every parameter "
                  "redrawn (the first seed whose greedy codes vary without near ties), saved as "
                  "{'trainer': {'ema_parameters': sd, 'var_wo_ddp': other weights}} (sample.py reads ema_parameters) "
                  f"+ NAME.json {{patch_nums, split_t: {DD_SPLIT_T}}}; the var case's VQVAE file loaded into "
                  "VAR/models.VQVAE (Encoder/Decoder as there); torchvision.utils.save_image stubbed (imported, "
                  "never called); from noise.npy, sample.py's loop on the reloaded "
                  "file: perturb_data, final_predict, get_final_sequence(loss_split_t) for each t of t_list "
                  "(teacher scales), f_hat and images from sample.transfer_BLCv_to_B3HW (f_hat recorded at "
                  "VQVAE.fhat_to_img); codes: the nearest code of each final vector, per scale")}
    write_expected(folder, source, runs)
    print(f"wrote {folder} (weight seed {seed})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=("var", "var_dd"))
    parser.add_argument("--official", type=Path, required=True, help="the official checkout (see above)")
    parser.add_argument("--commit", help="the checkout's commit, for a checkout without .git")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.case == "var":
        build_var(args.official.resolve(), args.commit)
    else:
        build_var_dd(args.official.resolve(), args.commit)


if __name__ == "__main__":
    main()
