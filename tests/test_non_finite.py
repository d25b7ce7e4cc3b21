"""Non-finite logits (fp16 overflowing inside a model, a damaged checkpoint): never a code outside the vocabulary
(on CUDA the next embedding lookup would be a device-side assert that leaves ComfyUI needing a restart), and a
clear error after the generation that names the dtype and what to load instead. On a CPU an out-of-range code
raises IndexError in the embedding, so reaching the FastARError proves every code stayed in range."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.decoders import DecoderSpec, decode, decode_next_scale
from fastar.samplers.processing import SamplingSettings, sample
from tiny_llamagen import tiny_conditioning, tiny_model
from tiny_var import tiny_var, tiny_vqvae

SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)


def overflowing(head: torch.nn.Module, after: int, value=float("nan")) -> list:
    """From the head's ``after``-th call on, its first row's outputs become ``value`` (what an fp16 overflow in
    the layers below does); returns the list of calls, to see the generation went on past that point."""
    calls = []

    def hook(module, inputs, out):
        calls.append(len(calls))
        if len(calls) > after:
            out = out.clone()
            out[0] = value
            return out

    head.register_forward_hook(hook)
    return calls


def test_sample_keeps_a_nan_distribution_in_range():
    dist = torch.softmax(torch.randn(3, 5, 10), -1)
    dist[1, 2] = float("nan")
    codes = sample(dist, torch.Generator().manual_seed(0))
    assert codes.shape == (3, 5) and 0 <= codes.min() and codes.max() <= 9


@pytest.mark.parametrize("spec", [DecoderSpec("ar"), DecoderSpec("sjd", window=4), DecoderSpec("gsd", window=4),
                                  DecoderSpec("spec", gamma=3)], ids=lambda s: s.decoder)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_token_decoders_report_non_finite_logits_after_the_run(spec, value):
    model = tiny_model(seed=3)
    calls = overflowing(model.output, after=4, value=value)
    drafter = SmallARDrafter(tiny_model(seed=4)) if spec.decoder == "spec" else None
    with pytest.raises(FastARError, match=r"logits were not finite \(NaN or inf\) in fp32.*load it in fp32; if fp32 "
                                          r"fails too, the checkpoint is damaged"):
        decode(model, tiny_conditioning(model), SAMPLING, spec, seed=0, drafter=drafter)
    assert len(calls) > 6  # it ran on, in range, to the end


def test_fp16_is_told_to_load_bf16_or_fp32():
    model = tiny_model(seed=3).half()
    overflowing(model.output, after=2, value=float("inf"))
    with pytest.raises(FastARError, match="in fp16.*fp16's range overflowed inside the model: load it in bf16 where "
                                          "the GPU supports it, else fp32"):
        decode(model, tiny_conditioning(model), SAMPLING, DecoderSpec("sjd", window=3), seed=0)


def test_var_reports_non_finite_logits():
    model = tiny_var()
    overflowing(model.head, after=1)
    with pytest.raises(FastARError, match="logits were not finite"):
        decode_next_scale(model, ClassConditioning(torch.tensor([1, 2])), SAMPLING, seed=0, vqvae=tiny_vqvae())


def test_finite_logits_pass_and_the_next_run_is_clean():
    model = tiny_model(seed=3)
    codes, _ = decode(model, tiny_conditioning(model), SAMPLING, DecoderSpec("sjd", window=4), seed=0)
    assert codes.shape[0] == 2
