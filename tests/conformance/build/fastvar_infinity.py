"""Builds the FastVAR-on-Infinity conformance fixture (fixtures/fastvar_infinity/) with the official code (run by
hand, never by the tests).

    git -C MIRROR_OF_csguoh/FastVAR archive HEAD Infinity | tar -x -C CHECKOUT
    PYTHONPATH=DEPS python tests/conformance/build/fastvar_infinity.py --fastvar CHECKOUT/Infinity --commit SHA

FastVAR's release ships its own copy of Infinity whose blocks are ``FastVARCrossAttnBlock``s (fastvar_basic.py) and
whose ``autoregressive_infer_cfg`` never runs the scales of width 48 and 64; its pruning is hard-coded for
Infinity-2B at 1024 px, 1:1 (layers 3..27 of 32, widths 32 and 40, the 24 x 24 scale cached). So the tiny random
transformer here is that class at depth 32 over the 1M 1:1 schedule, built, redrawn, saved (2B layout) and read back
as build/infinity.py does (its helpers imported, and its departures), decoding through the infinity_vae fixture's
d32 VAE. Each prompt runs greedily (top_k 1, cfg 3 on the logits, tau 0.5, B 1 per prompt); every scale's bits
are recorded where the loop hands them to the VAE (the skipped scales have none) with the VAE's decode of the
summed codes (stored as 4 x 4 means). FastAR's model, loaded from the saved file, is run teacher-forced on the
official bits through its ``--fastvar`` path; the fixture is refused unless every official margin is ten times
FastAR's largest guided-logit difference (no greedy bit, and no kept token, rests on float order).
"""
from __future__ import annotations

import os

os.environ["TORCHDYNAMO_DISABLE"] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import FIXTURES, save_image  # noqa: E402
from provenance import commit_of, packages  # noqa: E402

import infinity_vae as vae_builder  # noqa: E402
from test_fastvar_infinity import shrink  # noqa: E402

SPEC = importlib.util.spec_from_file_location("infinity_builder", HERE / "infinity.py")  # not the package `infinity`
builder = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(builder)

NAME = "fastvar_infinity"
DEPTH, CHUNKS, WIDTH, HEADS = 32, 8, 32, 2  # the release's layers 3..27 need depth 32
CFG, TAU, SIZE = 3.0, 0.5, 1024
PROMPTS = builder.PROMPTS


def flash_attn_sdpa(q, k, v, dropout_p=0.0, softmax_scale=None, **_):
    """flash_attn_func (q, k, v ``[B, L, H, c]``) by SDPA in fp32, returned in v's dtype."""
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                         v.float().transpose(1, 2), scale=softmax_scale)
    return out.transpose(1, 2).to(v.dtype)


def import_fastvar(checkout: Path):
    sys.modules["cv2"] = types.ModuleType("cv2")  # infinity.py imports it for a debugging helper
    sys.modules["cv2"].__spec__ = importlib.machinery.ModuleSpec("cv2", None)
    official, official_vae, dynamic_resolution = builder.import_official(checkout)
    from infinity.models import fastvar_basic

    fastvar_basic.torch = builder.Bf16AsFp32()  # its CrossAttention's bf16 cast, as build/infinity.py leaves it out
    fastvar_basic.flash_attn_func = official.flash_attn_func = flash_attn_sdpa
    return official, official_vae, dynamic_resolution


def fastar_difference(fastar_model, recorders, texts) -> float:
    """FastAR's model through ``--fastvar`` teacher-forced on each prompt's official bits: the largest difference of
    its guided logits (divided by tau) from the official ones."""
    from fastar.model_loaders.shared.protocol import CaptionConditioning
    from fastar.samplers.few_step_loops.scale_acceleration import FASTVAR, accelerated

    worst = 0.0
    for (features, *_), recorder in zip(texts, recorders):
        cond = CaptionConditioning(features[None], torch.ones(1, features.shape[0], dtype=torch.bool))
        faster = accelerated(FASTVAR, fastar_model, fastar_model.start(cond, cfg=True), 2)
        assert faster.runs == len(recorder.logits), "FastAR runs other scales than the release"
        f_hat, inputs = torch.zeros(1, *fastar_model.f_hat_shape), None
        for scale, (h, w) in enumerate(fastar_model.scale_shapes[: faster.runs]):
            out = faster.forward(scale, inputs)
            guided = (out.uncond + CFG * (out.cond - out.uncond)) / TAU
            worst = max(worst, (guided - recorder.logits[scale].view_as(guided)).abs().max().item())
            f_hat, inputs = fastar_model.next_input(builder.VAE_FOR_FASTAR, f_hat,
                                                    recorder.bits[scale].view(1, h, w, -1), scale)
    return worst


def build(checkout: Path, commit: str) -> None:
    from fastar.model_loaders import load_ar_model, load_image_decoder
    from fastar.model_loaders.infinity.schedules import scale_schedule

    official, official_vae, dynamic_resolution = import_fastvar(checkout)
    builder.DEPTH, builder.CHUNKS, builder.WIDTH, builder.HEADS = DEPTH, CHUNKS, WIDTH, HEADS
    folder = FIXTURES / NAME
    folder.mkdir(parents=True, exist_ok=True)
    vae_case = next(c for c in vae_builder.CASES if c["name"] == "d32")
    vae_file = FIXTURES / "infinity_vae" / vae_case["file"]
    vae = vae_builder.tiny_vae(official_vae, str(vae_file), vae_case).eval()
    builder.VAE_FOR_FASTAR = load_image_decoder(vae_file)
    t5 = FIXTURES / "infinity_2b" / "t5"
    texts = [builder.encode_prompt(t5, p) for p in PROMPTS]
    schedule = [tuple(s[1:]) for s in dynamic_resolution.dynamic_resolution_h_w[1.0]["1M"]["scales"]]
    assert list(scale_schedule(SIZE, "1:1")[0]) == schedule, "FastAR's schedule is not the release's"
    for seed in range(30):
        model = builder.official_transformer(official, vae, False, "1M")
        builder.redraw(model, seed)
        path = builder.save_release(model, folder, False)
        model = builder.load_release(official, vae, path, False, "1M")
        assert type(model.unregistered_blocks[0]).__name__ == "FastVARCrossAttnBlock"
        outs = [builder.official_run(official, model, vae, schedule, text, CFG, TAU) for text in texts]
        fastar_model = load_ar_model(path, image_size=SIZE, aspect_ratio="1:1")
        worst = fastar_difference(fastar_model, [o[0] for o in outs], texts)
        margin = min(min(o[0].margins) for o in outs)
        ones = torch.cat([torch.cat([b.flatten().float() for b in o[0].bits]) for o in outs]).mean().item()
        print(f"seed {seed}: smallest margin {margin:.2e}, FastAR's largest difference {worst:.2e}, ones {ones:.2f}")
        if margin >= builder.MARGIN * worst and 0.2 < ones < 0.8:
            break
    else:
        raise SystemExit("no seed gave clear margins")
    images = []
    for i, (_, _, decoded) in enumerate(outs):
        images.append(f"1x1_{i}.png")
        save_image(decoded.clamp(-1, 1).numpy(), folder / images[-1])
        shrink(folder / images[-1], folder / images[-1])  # kept small: 4 x 4 means, as the test compares them
    mask = vae.quantizer.lfq.mask
    run = {"name": f"greedy 1:1 at {SIZE} px, cfg {CFG}, tau {TAU}, --fastvar",
           "args": ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--cfg", CFG, "--temperature", TAU, "--top-k", 1,
                    "--image-size", SIZE, "--aspect-ratio", "1:1", "--decoder", "ar", "--fastvar"],
           "scales": [list(s) for s in schedule], "vae_grid": [list(b.shape[1:3]) for b in outs[0][1]],
           "codes": [[builder.labels(b[0], mask) for b in o[1]] for o in outs], "images": images,
           "smallest_margin": margin, "fastar_largest_logit_difference": worst}
    source = {
        "repository": "csguoh/FastVAR", "commit": commit,
        "packages": packages("torch", "transformers", "tokenizers", "einops"),
        "builder": "tests/conformance/build/fastvar_infinity.py", "weight_seed": seed,
        "files": {"model": path.name, "vae": f"../infinity_vae/{vae_file.name}", "t5": "../infinity_2b/t5"},
        "made_with": (f"Infinity/infinity/models/infinity.py Infinity (FastVARCrossAttnBlock blocks) with "
                      f"build/infinity.py's load_infinity arguments at depth={DEPTH}, embed_dim={WIDTH}, "
                      f"num_heads={HEADS}, block_chunks={CHUNKS}, pn 1M; saved as torch.save(state_dict); "
                      f"autoregressive_infer_cfg(top_k=1, cfg {CFG} on the logits, tau {TAU}, B=1 per prompt); codes: "
                      "the VAE-grid bits the loop hands to indices_to_codes, as the lfq mask's labels; images: the "
                      "VAE's decode of the summed codes, clamped"),
        "departures": ["tiny sizes (width 32, 2 heads; depth 32 as Infinity-2B)",
                       "flash_attn_func stood in for by SDPA in fp32 (fastvar_basic's self-attention)",
                       "cv2 stood in for (infinity.py's unused debugging helper)",
                       *[d for d in json.loads((FIXTURES / "infinity_2b" / "expected.json").read_text())
                         ["source"]["departures"] if not d.startswith(("tiny sizes", "transformers 5"))]]}
    (folder / "expected.json").write_text(json.dumps({"source": source, "runs": [run]}, indent=1) + "\n")
    print(f"wrote {folder} (weight seed {seed})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fastvar", type=Path, required=True, help="the Infinity folder of a csguoh/FastVAR checkout")
    parser.add_argument("--commit", help="its commit, where the checkout has no .git")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build(args.fastvar.resolve(), args.commit or commit_of(args.fastvar))
