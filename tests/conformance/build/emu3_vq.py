"""Builds the Emu3 vision tokenizer conformance fixture (fixtures/emu3_vq/) with the official code (run by hand,
never by the tests).

    git clone https://github.com/baaivision/Emu3 && python tests/conformance/build/emu3_vq.py --emu3 Emu3
(FastAR's own venv: transformers 5.x; BAAI's ``emu3/tokenizer`` package imports with it; ``--commit`` where the
checkout has no .git)

- Emu3-Gen-hf/: a tiny random ``Emu3ForConditionalGeneration`` (transformers' classes: a one-layer text model over
  a small vocabulary whose image tokens are named ``<|visual token NNNNNN|>`` as in the release, and an
  ``Emu3VQVAE`` of 64 codes of width 4, base channels 32, channel multipliers (1, 1, 2): 4 pixels per code, one
  residual block per level, attention at the lowest level and in the middle, the release's 4 frames per latent
  frame), saved by ``save_pretrained`` (transformers writes the VQ model as ``vqmodel.*``) with an
  ``Emu3ImageProcessor``'s preprocessor_config.json; read back by ``from_pretrained``.
- Emu3-VisionTokenizer/: the same VQ model in BAAI's layout: BAAI's ``Emu3VisionVQModel`` built with the same sizes,
  filled key by key through transformers' conversion renames (convert_emu3_weights_to_hf.py: BAAI's ``decoder.mid``
  is transformers' ``decoder.middle_block``, ``decoder.up`` ``decoder.up_block.up``, an attention block's ``norm``
  its ``attn_norm``/``attn_norms.{j}``, ``q``/``k``/``v``/``proj_out`` 1x1 convolutions its ``q_proj``/``k_proj``/
  ``v_proj``/``out_proj`` linear layers) with ``load_state_dict(strict=True)``, saved by ``save_pretrained`` with
  BAAI's ``Emu3VisionVQImageProcessor``'s preprocessor_config.json; read back by ``from_pretrained``.

The expected outputs, for two batches of two images (4 x 6 and 6 x 4 codes, not square): transformers'
``Emu3Model.decode_image_tokens`` on the generated-token form (rows of visual tokens each ended by ``<|extra_200|>``,
then ``<|extra_201|>``, ``<|image end|>``, eos; asserted equal to ``vqmodel.decode`` of the codes), all four frames
of ``vqmodel.decode`` of the codes as a one-frame video (``frames_*.npy``, normalised values), and the images of
``Emu3ImageProcessor.postprocess`` (PIL); BAAI's ``Emu3VisionVQModel.decode`` and ``Emu3VisionVQImageProcessor.
postprocess`` likewise (their frames asserted within 1e-5 of transformers', which proves the key mapping with BAAI's
own class).

Departures from the release, each forced by a tiny CPU fixture or made so that the test can fail: tiny sizes; the
weights re-initialised where the classes start them at a fixed point (BatchNorm's weight, bias and running
statistics, GroupNorm's weight and bias), the attention's query and key projections scaled up (a random start attends
almost uniformly, which would hide attention faults), the last convolution scaled so that the images fill the pixel range without
saturating; stored in fp16 (the official decodes run in fp32 on the fp16-rounded weights); a mean and std in
preprocessor_config.json unlike the release's 0.5 and 0.5 (and unlike each other per channel) so that a decoder
which ignores them or swaps them fails.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import commit_of, packages, write_expected  # noqa: E402

CODES, WIDTH = 64, 4
MEAN, STD = [0.45, 0.5, 0.55], [0.35, 0.3, 0.4]
GRIDS = [(4, 6), (6, 4)]
BATCH = 2
HF, BAAI = "Emu3-Gen-hf", "Emu3-VisionTokenizer"
SPECIAL = ["<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<|image start|>", "<|image end|>", "<|image token|>",
           "<|extra_200|>", "<|extra_201|>", "<image>"]
VQ_SIZES = dict(codebook_size=CODES, embed_dim=WIDTH, num_res_blocks=1, attn_resolutions=[2],
                temporal_downsample_factor=4)
# transformers' convert_emu3_weights_to_hf.py renames, BAAI's name -> transformers', applied in this order
RENAMES = [(r"\.q\.", ".q_proj."), (r"\.k\.", ".k_proj."), (r"\.v\.", ".v_proj."), (r"\.proj_out\.", ".out_proj."),
           (r"mid\.attn_1\.norm\.", "mid.attn_norm."), (r"attn\.(\d+)\.norm\.", r"attn_norms.\1."),
           (r"^encoder\.down\.", "encoder.down_block.down."), (r"^decoder\.up\.", "decoder.up_block.up."),
           (r"\.mid\.", ".middle_block.")]


def vocabulary() -> dict[str, int]:
    names = SPECIAL + [f"<|visual token {k:06d}|>" for k in range(CODES)] + ["a", "red", "ring"]
    return {name: i for i, name in enumerate(names)}


def transformers_model():
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig, Emu3VQVAEConfig

    vocab = vocabulary()
    vq = Emu3VQVAEConfig(latent_channels=WIDTH, base_channels=32, channel_multiplier=[1, 1, 2], hidden_size=64,
                         num_attention_heads=1, **VQ_SIZES)
    text = Emu3TextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                          pad_token_id=vocab["<|endoftext|>"], bos_token_id=vocab["<|extra_203|>"],
                          eos_token_id=vocab["<|extra_204|>"])
    torch.manual_seed(0)
    model = Emu3ForConditionalGeneration(Emu3Config(vq_config=vq.to_dict(), text_config=text.to_dict(),
                                                    vocabulary_map=vocab)).eval()
    randomise(model.model.vqmodel)
    return model


@torch.no_grad()
def randomise(vq) -> None:
    """Norms away from their fixed starting point, running statistics away from 0 and 1, the output scaled into the
    pixel range; then every weight rounded to fp16, as it is stored."""
    g = torch.Generator().manual_seed(1)

    def noise(t, scale):
        return torch.randn(t.shape, generator=g) * scale

    for module in vq.modules():
        if isinstance(module, (torch.nn.BatchNorm3d, torch.nn.GroupNorm)):
            module.weight.copy_(1 + noise(module.weight, 0.3))
            module.bias.copy_(noise(module.bias, 0.3))
        if isinstance(module, torch.nn.BatchNorm3d):
            module.running_mean.copy_(noise(module.running_mean, 0.5))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=g) * 1.5 + 0.3)
        if hasattr(module, "q_proj"):  # sharper attention than the near-uniform of a random start
            module.q_proj.weight.mul_(4)
            module.k_proj.weight.mul_(4)
    codes = torch.randint(0, CODES, (4, *GRIDS[0]), generator=g)
    spread = vq.decode(codes).std()
    vq.decoder.conv_out.weight.mul_(0.5 / spread)
    vq.decoder.conv_out.bias.mul_(0.5 / spread)
    for t in list(vq.parameters()) + list(vq.buffers()):
        if t.is_floating_point():
            t.copy_(t.half().float())


def baai_classes(checkout: Path):
    # BAAI's emu3/ is a namespace package, which any emu3.py on the path (build/emu3.py here) would shadow
    sys.path[:] = [str(checkout)] + [p for p in sys.path if Path(p).resolve() != HERE]
    from emu3.tokenizer.configuration_emu3visionvq import Emu3VisionVQConfig
    from emu3.tokenizer.image_processing_emu3visionvq import Emu3VisionVQImageProcessor
    from emu3.tokenizer.modeling_emu3visionvq import Emu3VisionVQModel

    return Emu3VisionVQConfig, Emu3VisionVQModel, Emu3VisionVQImageProcessor


def transformers_name(baai_key: str) -> str:
    for pattern, replacement in RENAMES:
        baai_key = re.sub(pattern, replacement, baai_key)
    return baai_key


@torch.no_grad()
def baai_model(classes, hf_vq):
    """BAAI's class with the same sizes, filled from transformers' VQ model through the conversion's renames."""
    config_class, model_class, _ = classes
    model = model_class(config_class(z_channels=WIDTH, ch=32, ch_mult=[1, 1, 2], **VQ_SIZES)).eval()
    source = hf_vq.state_dict()
    filled = {k: source[transformers_name(k)].reshape(v.shape) for k, v in model.state_dict().items()}
    assert len(filled) == len(source), "BAAI's and transformers' VQ models hold different weights"
    model.load_state_dict(filled, strict=True)
    return model


def save_fp16(model, folder: Path) -> None:
    model.to(torch.float16).save_pretrained(folder)
    model.to(torch.float32)


def generated_tokens(codes: torch.Tensor, vocab: dict[str, int]) -> torch.Tensor:
    """The codes as the model writes them: rows of visual tokens each ended by the row end, then the end of frame,
    the end of image and eos (what ``decode_image_tokens`` reads)."""
    ids = torch.tensor([vocab[f"<|visual token {k:06d}|>"] for k in range(CODES)])[codes]
    rows = torch.cat([ids, torch.full((*codes.shape[:2], 1), vocab["<|extra_200|>"])], dim=2).flatten(1)
    tail = torch.tensor([vocab[t] for t in ("<|extra_201|>", "<|image end|>", "<|extra_204|>")]).expand(len(codes), 3)
    return torch.cat([rows, tail], dim=1)


def save_images(pil_images, folder: Path, stem: str) -> list[str]:
    names = []
    for i, image in enumerate(pil_images):
        names.append(f"{stem}_{i}.png")
        image.save(folder / names[-1])
    return names


@torch.no_grad()
def build(checkout: Path, commit: str, out: Path) -> None:
    from transformers import Emu3ForConditionalGeneration, Emu3ImageProcessor

    folder = out / "emu3_vq"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    classes = baai_classes(checkout)

    save_fp16(transformers_model(), folder / HF)
    Emu3ImageProcessor(image_mean=MEAN, image_std=STD).save_pretrained(folder / HF)
    hf = Emu3ForConditionalGeneration.from_pretrained(folder / HF, dtype=torch.float32).eval()
    hf_processor = Emu3ImageProcessor.from_pretrained(folder / HF)

    save_fp16(baai_model(classes, hf.model.vqmodel), folder / BAAI)
    classes[2](image_mean=MEAN, image_std=STD).save_pretrained(folder / BAAI)
    baai = classes[1].from_pretrained(folder / BAAI, dtype=torch.float32).eval()
    baai_processor = classes[2].from_pretrained(folder / BAAI)
    assert baai.dtype == torch.float32 and baai.decoder.conv_out.weight.dtype == torch.float32

    g = torch.Generator().manual_seed(2)
    runs = []
    for h, w in GRIDS:
        codes = torch.randint(0, CODES, (BATCH, h, w), generator=g)
        codes[0, 0, 0], codes[1, -1, -1] = 0, CODES - 1
        image = hf.model.decode_image_tokens(generated_tokens(codes, hf.config.vocabulary_map), height=h, width=w)
        assert torch.equal(image, hf.model.vqmodel.decode(codes))
        video = hf.model.vqmodel.decode(codes[:, None])  # [B, 4, 3, H, W]
        assert torch.equal(video[:, 0], image)
        baai_video = baai.decode(codes[:, None])
        worst = float((baai_video - video).abs().max())
        assert worst < 1e-5, f"BAAI's decode differs from transformers' by {worst}"
        assert torch.equal(baai.decode(codes), baai_video[:, 0])
        pictures = {
            HF: hf_processor.postprocess(list(image.float()), return_tensors="PIL.Image.Image")["pixel_values"],
            BAAI: [baai_processor.postprocess(frame[None].float())["pixel_values"][0] for frame in baai_video[:, 0]],
        }
        for layout, layout_video in ((HF, video), (BAAI, baai_video)):
            stem = f"{layout}_{h}x{w}"
            np.save(folder / f"frames_{stem}.npy", layout_video.numpy().astype(np.float32))
            runs.append({"name": stem, "layout": layout, "grid": [h, w], "codes": codes.tolist(),
                         "frames": f"frames_{stem}.npy", "images": save_images(pictures[layout], folder, stem)})
        print(f"{h}x{w}: frames {tuple(video.shape)}, BAAI vs transformers within {worst:.1e}, "
              f"frame 0 range {float(image.min()):.2f}..{float(image.max()):.2f}")
    for a, b in zip(runs[0::2], runs[1::2]):
        for x, y in zip(a["images"], b["images"]):
            gap = np.abs(image_array(folder / x) - image_array(folder / y)).max()
            assert gap <= 1, f"{x} and {y} differ by {gap}/255"
    write_expected(folder, {
        "repository": "baaivision/Emu3", "commit": commit,
        "packages": packages("torch", "transformers", "safetensors", "numpy", "pillow"),
        "builder": "tests/conformance/build/emu3_vq.py",
        "made_with": "transformers Emu3ForConditionalGeneration (tiny, VQ: 64 codes x 4, base channels 32, channel "
                     "multipliers 1 1 2, one residual block per level, attention at level 2, 4 frames) randomised, "
                     "save_pretrained (fp16) + Emu3ImageProcessor(mean, std).save_pretrained, from_pretrained (fp32); "
                     "Emu3Model.decode_image_tokens, Emu3VQVAE.decode (one-frame video: all frames), "
                     "Emu3ImageProcessor.postprocess; BAAI emu3/tokenizer Emu3VisionVQModel filled through "
                     "transformers' conversion renames (load_state_dict strict), save_pretrained (fp16) + "
                     "Emu3VisionVQImageProcessor(mean, std).save_pretrained, from_pretrained (fp32); its decode and "
                     "postprocess",
        "image_mean": MEAN, "image_std": STD,
    }, runs)


def image_array(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emu3", required=True, type=Path, help="a checkout of baaivision/Emu3")
    parser.add_argument("--commit", help="its commit, where the checkout has no .git")
    parser.add_argument("--out", type=Path, default=HERE.parent / "fixtures")
    args = parser.parse_args()
    build(args.emu3.resolve(), args.commit or commit_of(args.emu3), args.out)


if __name__ == "__main__":
    main()
