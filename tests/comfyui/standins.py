"""Tiny stand-in checkpoints for the ComfyUI tests, written in the formats of the real ones:
a demo-like c2i model (FastAR safetensors with class names) and its VQ, an official-format LlamaGen c2i
``.pt`` (1000 classes) and its ``vq_ds16``-style ``.pt``, a t2i model with a tiny FLAN-T5 folder, a slow
model for the interrupt test, a tiny Distilled Decoding student in the released layout, a tiny VAR and its
multi-scale VQVAE in the release's layouts, Lumina-mGPT, Anole and
Janus-Pro folders in their release layouts, Emu3 in both release layouts (the conformance fixtures), Infinity-2B
and -8B under the release's names (random weights, the conformance fixtures' VAEs), and a corrupt file. Drafters: EAGLE drafter folders for the t2i model
and the Anole folder in LANTERN's released layouts, one for another vocabulary, and a demo drafter while the
bundled one is missing.
Random weights: the images are noise, the plumbing is real.

Run as a script to write them into a folder: ``python tests/comfyui/standins.py DIR [--demo]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastar.model_loaders.dd.student import DDStudent, DDStudentConfig
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DRAFTER
from fastar.tests.tiny_mar import KL, mar_config, official_kl, official_mar
from fastar.tests.tiny_var import write_release_files as write_var
from fastar.tests.tiny_var import write_release_student as write_var_dd
from fastar.model_loaders.drafters.eagle import EagleConfig, EagleHead
from fastar.model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from fastar.model_loaders.llamagen.vq import VQConfig, VQModel
from fastar.model_loaders.shared.joined import parted_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "comfyui"))
from workflows import (ANOLE_7B, CHAMELEON_VQGAN, DEMO_DRAFTER as DEMO_DRAFTER_NAME, EMU3_GEN,  # noqa: E402
                       EMU3_GEN_HF, EMU3_VISION_TOKENIZER, FLAN_T5, JANUS_PRO_7B, LANTERN_DRAFTER_ANOLE,
                       LANTERN_DRAFTER_T2I, LLAMAGEN_C2I, LLAMAGEN_DD_B, LLAMAGEN_T2I, LLAMAGEN_VQ_C2I, LLAMAGEN_VQ_T2I, LUMINA_768, MAR_BASE, MAR_HUGE, MAR_KL16,
                       VAR_D30, VAR_DD_D24, VAR_VQVAE,
                       INFINITY_2B, INFINITY_8B, INFINITY_VAE_2B, INFINITY_VAE_8B)

DEMO_CLASSES = ["circle", "square", "triangle", "stripes", "checkerboard", "ring", "cross", "blob"]
VQ_CONFIG = VQConfig(codebook_size=512, embed_dim=8, z_channels=64, ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1,
                     with_encoder=False)


def randomised(module: torch.nn.Module, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights under the release's names (joined layers in their parts)."""
    generator = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=generator) * scale).contiguous()
            for k, v in parted_state_dict(module).items()}


def gpt_sd(cfg: LlamaGenConfig, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    return randomised(model, seed)


def vq_sd(seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = VQModel(VQ_CONFIG)
    return randomised(model, seed, 0.1)


def save_with_config(path: Path, sd, cfg) -> Path:
    save_file(sd, str(path), metadata={"fastar_config": json.dumps(dataclasses.asdict(cfg))})
    return path


def demo_config(**overrides) -> LlamaGenConfig:
    fields = dict(dim=64, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), model_type="c2i", num_classes=8,
                  class_names=list(DEMO_CLASSES))
    return LlamaGenConfig(**{**fields, **overrides})


def write_demo(folder: Path) -> None:
    """demo_c2i.safetensors + demo_vq.safetensors, shaped like the bundled demo models."""
    save_with_config(folder / "demo_c2i.safetensors", gpt_sd(demo_config(), 1), demo_config())
    save_with_config(folder / "demo_vq.safetensors", vq_sd(2), VQ_CONFIG)


def t2i_config() -> LlamaGenConfig:
    return LlamaGenConfig(dim=64, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), model_type="t2i",
                          caption_dim=32, cls_token_num=120)


def write_llamagen(folder: Path) -> None:
    """Official-format pickles under the names of the LlamaGen release (the real-checkpoint workflows
    name them): a 1000-class c2i GPT with training args, its VQ, and a t2i GPT (caption dim 32, 120
    caption tokens as the official ones) with a tiny FLAN-T5 folder."""
    args = argparse.Namespace(gpt_model="custom", image_size=128, downsample_size=8, n_head=4)
    c2i = LlamaGenConfig(dim=64, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), num_classes=1000)
    torch.save({"model": gpt_sd(c2i, 3), "args": args}, folder / LLAMAGEN_C2I)
    torch.save({"model": vq_sd(4)}, folder / LLAMAGEN_VQ_C2I)
    torch.save({"model": gpt_sd(t2i_config(), 5), "args": args}, folder / LLAMAGEN_T2I)
    torch.save({"model": vq_sd(7)}, folder / LLAMAGEN_VQ_T2I)
    write_t5(folder / FLAN_T5.rstrip("/"))


HF_FOLDER = "LlamaGen-c2i-tiny"


def write_hf_folder(folder: Path) -> None:
    """A Hugging Face style model folder: config.json beside model.safetensors (official key names)."""
    folder = folder / HF_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaGenConfig(dim=64, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), num_classes=1000)
    save_file(gpt_sd(cfg, 8), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"n_head": 4, "image_size": 128, "downsample_size": 8}))


PT_FOLDER = "LlamaGen-c2i-pt"


def write_pt_folder(folder: Path) -> None:
    """A model folder holding one pickled checkpoint of any name beside its config.json."""
    folder = folder / PT_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaGenConfig(dim=64, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), num_classes=1000)
    torch.save({"model": gpt_sd(cfg, 9)}, folder / "c2i_tiny_step_5000.pt")
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 4, "image_size": 128,
                                                    "downsample_size": 8}))


def write_t5(folder: Path) -> None:
    """A random 1-layer T5 encoder (d_model 32) with a word-level tokenizer: a real transformers folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    folder.mkdir(parents=True, exist_ok=True)
    words = "<pad> </s> <unk> a an the photo of red green blue cube apple ball on wooden table".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    config = T5Config(vocab_size=len(words), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      decoder_start_token_id=0)
    torch.manual_seed(0)
    T5EncoderModel(config).save_pretrained(folder)


OTHER_VOCAB_DRAFTER = "other_vocab_drafter/"


def eagle_config(target: LlamaGenConfig, **overrides) -> EagleConfig:
    """An EAGLE head shaped for ``target`` (the checks on loading compare these with the target)."""
    fields = {"hidden_size": target.dim, "intermediate_size": target.ffn_hidden, "num_attention_heads": target.n_head,
              "num_key_value_heads": target.n_kv_head, "vocab_size": target.vocab_size,
              "input_type": target.model_type}
    return EagleConfig(**{**fields, **overrides})


def write_eagle(folder: Path, cfg: EagleConfig, seed: int, pickled: bool = True) -> None:
    """An EAGLE drafter folder as LANTERN releases it: the base model's config.json with one layer,
    generation_config.json and pytorch_model.bin (``pickled``), or model.safetensors as FastAR writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        head = EagleHead(cfg)
    sd = {k: v.half() for k, v in randomised(head, seed).items()}
    if pickled:
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def write_drafters(folder: Path) -> None:
    """For a ``fastar_drafters`` folder: LANTERN's drafters for the t2i stand-in and for the Anole stand-in, one
    for another vocabulary (a mismatch the loader must name), and the MAR release's MAR-B (MAR-H's draft)."""
    from fastar.tests import tiny_chameleon

    write_eagle(folder / LANTERN_DRAFTER_T2I.rstrip("/"), eagle_config(t2i_config()), 9)
    tiny_chameleon.write_anole_drafter(folder / LANTERN_DRAFTER_ANOLE.rstrip("/"),
                                       tiny_chameleon.hf_model(seed=ANOLE_SEED), seed=7)
    write_eagle(folder / OTHER_VOCAB_DRAFTER.rstrip("/"), eagle_config(t2i_config(), vocab_size=1024), 10)
    official_mar(folder / MAR_BASE, dataclasses.replace(OFFICIAL_MAR, dim=16, decoder_dim=16), 22, num_heads=2)


def write_demo_drafter(folder: Path, demo: bool) -> None:
    """A random EAGLE head for the demo model (stand-in or bundled), while the bundled drafter is missing."""
    if DEMO_DRAFTER.exists():
        return
    if demo:
        target = demo_config()
    else:
        with safe_open(str(DEMO_AR), framework="pt") as f:
            target = LlamaGenConfig(**json.loads(f.metadata()["fastar_config"]))
    write_eagle(folder / DEMO_DRAFTER_NAME.rstrip("/"), eagle_config(target, grid=tuple(target.grid)), 11,
                pickled=False)


OFFICIAL_MAR = mar_config(grid=(8, 8), num_classes=1000)  # 64 tokens: MAR's 64 default steps fit


def write_mar(folder: Path) -> None:
    """The MAR release's MAR-H and KL-16 under their names."""
    official_mar(folder / MAR_HUGE, OFFICIAL_MAR, 21, num_heads=2)
    official_kl(folder / MAR_KL16, KL, 23)


ANOLE_SEED = 6


def write_text_models(folder: Path) -> None:
    """Tiny text-to-image models in their release layouts and names: a Lumina-mGPT folder (its config.json says
    128 px, 8 x 8 tokens, over the 768 of its name) with Meta's VQGAN checkpoint layout beside it, an Anole
    folder (transformers' layout), and a Janus-Pro folder (its VQ inside)."""
    from fastar.model_loaders.chameleon.vqgan import VQGAN
    from fastar.model_loaders.shared.ldm_blocks import VQGANConfig
    from fastar.tests import tiny_chameleon, tiny_janus

    tiny_chameleon.write_folder(folder / LUMINA_768.rstrip("/"), tiny_chameleon.hf_model(seed=3), lumina=True,
                                image_size=128)
    tiny_chameleon.write_folder(folder / ANOLE_7B.rstrip("/"), tiny_chameleon.hf_model(seed=ANOLE_SEED), lumina=False,
                                image_size=None)
    torch.manual_seed(4)
    vqgan = VQGAN(VQGANConfig(codebook_size=tiny_chameleon.CODES, embed_dim=8, z_channels=32, ch=32, ch_mult=(1, 2, 2),
                              num_res_blocks=1))
    torch.save({"state_dict": vqgan.state_dict()}, folder / CHAMELEON_VQGAN)
    tiny_janus.write_converted(folder / JANUS_PRO_7B.rstrip("/"), tiny_janus.hf_model(seed=5))


EMU3_FIXTURES = Path(__file__).resolve().parents[1] / "conformance" / "fixtures"
EMU3_AREA = 36 * 36  # the fixtures' image area: the release's 720 x 720 is more than their 512 positions hold


def write_emu3(folder: Path) -> None:
    """Tiny Emu3 models under the release's folder names, from the conformance fixtures: transformers' layout
    (its VQ model inside; config.json given the fixtures' image area, as BAAI's config.json gives its own) and BAAI's
    model folder with its VisionTokenizer folder beside it."""
    hf = folder / EMU3_GEN_HF.rstrip("/")
    shutil.copytree(EMU3_FIXTURES / "emu3_hf", hf, ignore=shutil.ignore_patterns("*.png", "expected.json"))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "image_area": EMU3_AREA}))
    baai = EMU3_FIXTURES / "emu3_baai"
    shutil.copytree(baai, folder / EMU3_GEN.rstrip("/"),
                    ignore=shutil.ignore_patterns("*.png", "expected.json", "VisionTokenizer"))
    shutil.copytree(baai / "VisionTokenizer", folder / EMU3_VISION_TOKENIZER.rstrip("/"))


INFINITY_FIXTURES = EMU3_FIXTURES


def write_infinity(folder: Path) -> None:
    """Tiny Infinity models under the release's names, for the Infinity workflows: random weights read by the
    stand-in FLAN-T5 folder's 32-wide features, the 2B's raw state dict and the 8B's two safetensors shards with their
    index, beside the conformance fixtures' BSQ VAEs under the release's VAE names (d32; d14 in 8 px patches)."""
    from fastar.model_loaders.infinity.model import Infinity, InfinityConfig
    from fastar.tests.tiny_infinity import release_state_dict

    for name, bits, patchify, seed in ((INFINITY_2B, 32, False, 11), (INFINITY_8B, 56, True, 12)):
        torch.manual_seed(seed)
        model = Infinity(InfinityConfig(depth=2, dim=32, n_head=2, ffn_hidden=64, text_channels=32, pool_heads=2,
                                        bits=bits, patchify=patchify))
        with torch.no_grad():  # about unit gain, as tests/tiny_infinity.py draws them: every part moves the bits
            for key, p in model.named_parameters():
                if key.endswith("scale_mul_1H11"):
                    p.fill_(float(torch.log(torch.tensor(4.0))))
                elif p.dim() == 2 and "embed" not in key and key != "cfg_uncond":
                    p.copy_(torch.randn(p.shape) * p.shape[1] ** -0.5)
                else:
                    p.copy_(torch.randn(p.shape) * (0.1 if key.endswith("bias") else 1.0))
        sd = release_state_dict(model)
        if not name.endswith("/"):
            torch.save(sd, folder / name)
            continue
        shards, keys = folder / name.rstrip("/"), sorted(sd)
        shards.mkdir(parents=True, exist_ok=True)
        weight_map = {}
        for n, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), start=1):
            shard = f"model-0000{n}-of-00002.safetensors"
            save_file({k: sd[k].contiguous() for k in part}, str(shards / shard))
            weight_map |= {k: shard for k in part}
        (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    vaes = INFINITY_FIXTURES / "infinity_vae"
    shutil.copy(vaes / "vae_d32.pth", folder / INFINITY_VAE_2B)
    shutil.copy(vaes / "vae_d14_patchify.pth", folder / INFINITY_VAE_8B)


def write_slow(folder: Path) -> None:
    """A wider model on a 32x32 grid: an AR decode of it takes many seconds on a CPU (interrupt test)."""
    cfg = demo_config(dim=256, n_layer=6, n_head=8, grid=(32, 32), class_names=[])
    save_with_config(folder / "slow_c2i.safetensors", gpt_sd(cfg, 6), cfg)


def write_dd_student(folder: Path) -> None:
    """A tiny Distilled Decoding student under the release's name and layout (``ema`` and ``model``, no
    sizes; 1000 classes, 16x16 tokens), with a sidecar config for what the official size table cannot say
    (it is no official size); it decodes with the stand-in LlamaGen VQ (512 codes)."""
    cfg = DDStudentConfig(dim=32, n_layer=2, n_head=4, vocab_size=512, grid=(16, 16), ffn_hidden=64, num_classes=1000,
                          split=100, t2=80)
    ema = randomised(DDStudent(cfg), 24)
    torch.save({"model": {k: torch.zeros_like(v) for k, v in ema.items()}, "ema": ema}, folder / LLAMAGEN_DD_B)
    (folder / LLAMAGEN_DD_B).with_suffix(".json").write_text(json.dumps({"num_attention_heads": 4, "split_t": 100}))


def write_corrupt(folder: Path) -> None:
    data = (folder / "demo_c2i.safetensors").read_bytes() if (folder / "demo_c2i.safetensors").exists() else b""
    (folder / "corrupt_c2i.pt").write_bytes(b"PK\x03\x04 not really a checkpoint" + data[:100])


def write_all(folder: Path, demo: bool, drafters: Path | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if demo:
        write_demo(folder)
    write_demo_drafter(folder, demo)
    if drafters is not None:
        write_drafters(drafters)
    write_llamagen(folder)
    write_mar(folder)
    write_text_models(folder)
    write_emu3(folder)
    write_hf_folder(folder)
    write_pt_folder(folder)
    write_slow(folder)
    write_dd_student(folder)
    write_var(folder)
    write_var_dd(folder)
    write_var(folder, VAR_D30, VAR_VQVAE, classes=1000)  # under the release's names, for the VAR workflows
    write_var_dd(folder, VAR_DD_D24, classes=1000)
    write_infinity(folder)
    write_corrupt(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--demo", action="store_true", help="also write demo_c2i/demo_vq stand-ins")
    parser.add_argument("--drafters", type=Path, help="also write the stand-in drafters into this folder")
    a = parser.parse_args()
    write_all(a.folder, a.demo, a.drafters)
    print(f"stand-ins written to {a.folder}", file=sys.stderr)
