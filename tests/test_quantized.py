"""8-bit weights (model_loaders/shared/quantized.py): each weight within its format's rounding bound, the codes and
scales kept exact through every move and dtype change, only the blocks' linear layers quantised, the demo model
nearly unchanged by it, and streaming still working on 8-bit layers."""
import copy
from pathlib import Path

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_MAR, DEMO_TEXT, DEMO_VAR, DEMO_VAR_DD
from fastar.model_loaders.shared import quantized
from fastar.model_loaders.shared.quantized import (QuantizedLinear, check_weight_format, quantize_rows,
                                                   quantize_weights, weight_format)
from fastar.model_loaders.shared.streaming import make_streamable, model_bytes, streamable_layers
from fastar.commands.bench.toy_model import ToyModel
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from test_exact_distribution import ALPHA, ROWS, chi_square_p_value
from tiny_llamagen import tiny_conditioning, tiny_model

FORMATS = ("int8", "fp8")


def rows_of_every_scale() -> torch.Tensor:
    """Rows whose magnitudes span six decades, with an all-zero row and a row of one outlier."""
    weight = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 1, 8)[:, None]
    weight[3] = 0.0
    weight[5, 7] = 40.0
    return weight


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_weight_is_within_its_formats_rounding_bound(fmt):
    """int8: half a step of max|row| / 127. fp8 e4m3: a sixteenth of the weight (3 mantissa bits), or half the
    smallest subnormal step near zero."""
    weight = rows_of_every_scale()
    codes, scale = quantize_rows(weight, fmt)
    error = (codes.float() * scale[:, None] - weight).abs()
    bound = scale[:, None] / 2 if fmt == "int8" else weight.abs() / 16 + scale[:, None] * 2.0 ** -10
    assert (error <= bound * (1 + 1e-5)).all()
    peaks = codes.float().abs().amax(1)[weight.abs().amax(1) > 0]
    assert (peaks == (127.0 if fmt == "int8" else 448.0)).all()  # each row uses its format's whole range
    assert (codes[3] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantised_model_moves_but_never_casts_its_codes_or_scales(fmt):
    model = quantize_weights(make_streamable(tiny_model()), fmt)
    layer = next(m for m in model.modules() if isinstance(m, QuantizedLinear))
    codes, scale = layer.weight.clone(), layer.weight_scale.clone()
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float16),
                 lambda m: m.float()):
        move(model)
        assert layer.weight.dtype == codes.dtype and torch.equal(layer.weight.view(torch.int8), codes.view(torch.int8))
        assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
        assert torch.equal(layer.bf16_scale, scale.to(torch.bfloat16))  # rounded once, from the fp32 scales
    model.load_state_dict(quantize_weights(make_streamable(tiny_model(seed=1)), fmt).state_dict())
    assert not torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.bf16_scale, layer.weight_scale.to(torch.bfloat16))  # loaded scales, rounded again
    model.to(torch.bfloat16)
    assert layer.bias is None or layer.bias.dtype == torch.bfloat16
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16 and torch.isfinite(layer(x)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_only_the_blocks_linear_layers_hold_8_bit_weights(fmt):
    model = make_streamable(tiny_model())
    blocks = len(streamable_layers(model))
    before = model_bytes(model)
    quantize_weights(model, fmt)
    quantised = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantised) == blocks == len(streamable_layers(model)) and weight_format(model) == fmt
    assert type(model.output) is torch.nn.Linear and model.output.weight.dtype == torch.float32
    assert model.tok_embeddings.weight.dtype == torch.float32
    saved = sum(m.weight.numel() * 3 - m.weight_scale.numel() * 4 for m in quantised)  # 4 bytes to 1, plus scales
    assert model_bytes(model) == before - saved
    assert quantize_weights(model, fmt) is model and len(streamable_layers(model)) == blocks  # twice: no change


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(FastARError, match="int8, fp8"):
        check_weight_format("int4")
    with pytest.raises(FastARError, match="int8, fp8"):
        load_ar_model(DEMO_AR, weights="nf4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_demo_model_in_8_bits_predicts_nearly_as_in_full_precision(fmt):
    """On the bundled demo's greedy sequences, fed to both (teacher forcing: a sequence decoded by each would part
    at its first different token), the 8-bit model's next-token choices nearly all the same, its logits close."""
    full, eight = load_ar_model(DEMO_AR), load_ar_model(DEMO_AR, weights=fmt)
    assert weight_format(eight) == fmt and model_bytes(eight) < 0.75 * model_bytes(full)
    rows = tiny_conditioning(full)
    greedy = SamplingSettings(temperature=0.0)
    reference, _ = decode(full, rows, greedy, DecoderSpec("ar"), seed=0)
    with torch.no_grad():
        logits_full, logits_eight = full.training_logits(rows, reference), eight.training_logits(rows, reference)
    agreement = (logits_eight.argmax(-1) == logits_full.argmax(-1)).float().mean()
    assert agreement > 0.97
    assert (logits_eight - logits_full).abs().max() < 0.05 * logits_full.abs().max()


def test_generate_runs_with_8_bit_weights(tmp_path):
    from fastar.cli import main
    from PIL import Image

    out = tmp_path / "int8.png"
    main(["generate", "--weights", "int8", "--class", "3", "--decoder", "sjd", "--out", str(out), "--quiet"])
    assert Image.open(out).size == (128, 128)


def tabulated(model, label: int) -> ToyModel:
    """An enumerable twin of the tiny ``model`` (3 codes on 2x2): every prefix's logits, for ``label`` and the null
    class, read from ``model`` by teacher forcing, so the toy's exact joint is the model's."""
    twin = ToyModel(vocab=3, grid=(2, 2), num_classes=2)
    sequences = torch.tensor(twin.sequences())
    with torch.no_grad():
        for row in (label, twin.num_classes):
            logits = model.training_logits(ClassConditioning(torch.full((len(sequences),), row)), sequences)
            for pos in range(twin.num_tokens):
                twin.tables[pos][row, twin.prefix_index(sequences[:, :pos])] = logits[:, pos]
    return twin


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spec", [DecoderSpec("ar"), DecoderSpec("sjd", window=3), DecoderSpec("spec", gamma=2)],
                         ids=lambda s: s.decoder)
def test_lossless_decoders_sample_the_8_bit_models_distribution_exactly(spec, fmt):
    """The decoders see only the quantised model: a Jacobi window, a drafter's chain and one-token steps read the
    same 8-bit weights, so their samples follow its exact joint (chi-square, as in test_exact_distribution.py,
    where broken rules are shown to fail it; here a joint at temperature 1 instead of 0.9 fails too)."""
    full = tiny_model(vocab_size=3, grid=(2, 2), num_classes=2, seed=5)
    with torch.no_grad():
        full.output.weight.mul_(3.0)  # distributions neither flat nor certain
    eight = quantize_weights(make_streamable(copy.deepcopy(full)), fmt)
    drafter = SmallARDrafter(quantize_weights(make_streamable(tiny_model(vocab_size=3, grid=(2, 2), num_classes=2,
                                                                         seed=9)), fmt))
    settings = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=2)
    tokens, _ = decode(eight, ClassConditioning(torch.full((ROWS,), 1)), settings, spec, seed=0,
                       drafter=drafter if spec.decoder == "spec" else None)
    twin = tabulated(eight, 1)
    assert chi_square_p_value(tokens, twin.exact_joint(1, cfg_scale=2.0, temperature=0.9, top_k=2), twin) > ALPHA
    assert chi_square_p_value(tokens, twin.exact_joint(1, cfg_scale=2.0, temperature=1.0, top_k=2), twin) < ALPHA


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model, decoder", [(None, "spec"), (DEMO_MAR, "cspd")], ids=["eagle", "mar-draft"])
def test_the_demo_drafters_load_with_8_bit_blocks_and_draft(model, decoder, fmt):
    """--weights reaches the drafter as well: the demo's EAGLE head and MAR draft in 8 bits, drafting."""
    from fastar.model_loaders.drafters.loader import drafter_weights
    from fastar.pipeline import load_models

    models = load_models(model and str(model), None, "cpu", "fp32", drafter_path="demo", weights=fmt)
    assert weight_format(models.ar) == fmt and weight_format(drafter_weights(models.drafter)) == fmt
    if decoder == "spec":
        rows = ClassConditioning(torch.tensor([1, 6]))
        _, stats = decode(models.ar, rows, SamplingSettings(), DecoderSpec("spec"), seed=0, drafter=models.drafter)
        assert stats.drafter_forwards > 0 and stats.step_compression > 2  # its drafts are kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_8_bit_blocks_run_in_the_gpus_dtypes(fmt, dtype):
    """bf16 and fp16 compute (emulated on the CPU): the dequantised weights in that dtype, the codes valid."""
    model = load_ar_model(DEMO_AR, fmt, device="cpu", dtype=dtype)
    assert model.dtype == dtype and weight_format(model) == fmt
    codes, stats = decode(model, ClassConditioning(torch.tensor([0, 5])), SamplingSettings(top_k=50),
                          DecoderSpec("sjd"), seed=1)
    assert codes.shape == (2, 256) and 0 <= int(codes.min()) and int(codes.max()) < model.vocab_size
    assert stats.step_compression > 1


def test_next_token_agreement_compares_two_models_along_the_same_codes():
    """check_demo --weights: 1 for a model and itself, far below for another model, near 1 for its 8-bit twin."""
    from fastar.demo_recipes.check_demo import next_token_agreement

    model = tiny_model(seed=1)
    rows = tiny_conditioning(model)
    codes, _ = decode(model, rows, SamplingSettings(), DecoderSpec("ar"), seed=0)
    assert next_token_agreement((model, model), rows, codes) == 1.0
    assert next_token_agreement((model, tiny_model(seed=2)), rows, codes) < 0.5
    eight = quantize_weights(copy.deepcopy(model), "int8")
    assert next_token_agreement((model, eight), rows, codes) > 0.9


def dequantised_product(layer: QuantizedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's product in fp64 from its codes and scales (what every path approximates), and the sum of its
    terms' magnitudes (what a path's rounding error scales with)."""
    weight = layer.weight.double() * layer.weight_scale.double()[:, None]
    bias = layer.bias.double()
    terms = torch.nn.functional.linear(x.double().abs(), weight.abs(), bias.abs())
    return torch.nn.functional.linear(x.double(), weight, bias), terms


CPU_PATHS = [  # (format, compute dtype, input rows, input width): torch's int8 kernel where it applies, else widened
    ("int8", torch.bfloat16, 1, 64), ("int8", torch.bfloat16, 8, 48), ("int8", torch.bfloat16, 9, 64),
    ("int8", torch.bfloat16, 4, 40), ("int8", torch.float32, 4, 64), ("int8", torch.float32, 33, 40),
    ("fp8", torch.bfloat16, 4, 64), ("fp8", torch.float32, 33, 64), ("int8", torch.float16, 4, 64)]


@pytest.mark.parametrize("fmt, dtype, rows, width", CPU_PATHS, ids=lambda v: str(v).replace("torch.", ""))
def test_8_bit_products_on_the_cpu_are_the_dequantised_ones(fmt, dtype, rows, width):
    """Every CPU path (torch's int8 kernel for a step's few bf16 rows, the codes widened into the shared buffer and
    the output scaled, the dequantised weight in fp16) gives the product of the codes and scales, bias included,
    within the compute dtype's rounding; rows of very different scales each keep theirs."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(width, 24, dtype=dtype)
    with torch.no_grad():
        dense.weight.mul_(torch.logspace(-3, 1, 24, dtype=dtype)[:, None])
    layer = QuantizedLinear(dense, fmt)
    x = torch.randn(rows, 3, width, dtype=dtype)[:, 0]  # not contiguous
    got = layer(x)
    want, terms = dequantised_product(layer, x)
    assert got.dtype == dtype and got.shape == want.shape
    error = ((got.double() - want).abs() / terms).amax(0)  # per output channel: the small ones keep their scale
    assert error.max() < (1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.skipif(not quantized._CPU_INT8_KERNEL, reason="torch's int8 kernel is taken on AVX-512 CPUs only")
def test_torchs_int8_kernel_takes_a_steps_few_bf16_rows_of_width_16n_only():
    layer = QuantizedLinear(torch.nn.Linear(64, 8), "int8")
    calls = []
    packed = torch._weight_int8pack_mm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape) or packed(*a))
        for rows, dtype in ((1, torch.bfloat16), (8, torch.bfloat16), (9, torch.bfloat16), (4, torch.float32)):
            layer(torch.randn(rows, 64, dtype=dtype))
        QuantizedLinear(torch.nn.Linear(40, 8), "int8")(torch.randn(2, 40, dtype=torch.bfloat16))
    assert calls == [(1, 64), (8, 64)]


@pytest.mark.skipif(not quantized._CPU_INT8_KERNEL, reason="torch's int8 kernel is taken on AVX-512 CPUs only")
def test_a_compiled_steps_few_bf16_rows_run_torchs_int8_kernel_too():
    """Inside a compiled step inductor replaces the product by the same kernel (it counts each replacement): the
    same outputs as eager, bit for bit, for inputs of two and three dimensions; more rows are left to inductor."""
    from torch._dynamo.utils import counters

    layer = QuantizedLinear(torch.nn.Linear(64, 48), "int8").to(torch.bfloat16)
    for shape, replaced in (((2, 3, 64), 1), ((5, 64), 1), ((3, 4, 64), 0)):
        x = torch.randn(shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(len(shape)))
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(layer)(x)
        assert counters["inductor"]["woq_matcher_count"] == replaced, shape
        assert torch.equal(compiled, layer(x)) if replaced else torch.allclose(compiled, layer(x), atol=0.05)


def test_a_models_8_bit_layers_widen_into_one_buffer_of_its_largest_layer():
    """One buffer per model and dtype, the size of its largest layer's weight, not a fresh weight per call."""
    model = quantize_weights(make_streamable(tiny_model()), "int8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len({id(m.widened) for m in layers}) == 1
    rows = tiny_conditioning(model)
    decode(model, rows, SamplingSettings(), DecoderSpec("sjd", window=12), seed=0)  # fp32 windows: widened
    flat = layers[0].widened.flat
    assert list(flat) == [torch.float32] and flat[torch.float32].numel() == max(m.weight.numel() for m in layers)


def test_fp8_on_the_cpu_warns_that_int8_is_the_faster_choice_there():
    import warnings

    from fastar.errors import FastARWarning
    from fastar.pipeline import load_models

    with pytest.warns(FastARWarning, match="--weights int8"):
        load_models(None, None, "cpu", "fp32", weights="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastARWarning)
        load_models(None, None, "cpu", "fp32", weights="int8")


FIXTURES = Path(__file__).resolve().parent / "conformance" / "fixtures"
EVERY_FAMILY = [DEMO_AR, DEMO_MAR, DEMO_TEXT, DEMO_VAR, DEMO_VAR_DD, DEMO_DD, FIXTURES / "anole",
                FIXTURES / "lumina_mgpt", FIXTURES / "janus_deepseek", FIXTURES / "janus_transformers"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", EVERY_FAMILY, ids=lambda p: p.stem)
def test_quantising_as_weights_load_gives_the_codes_of_quantising_the_loaded_model(path, dtype):
    """Each family's loader (single files and folders, joined layers, MAR's fp32 head): the model quantised while it
    loads holds exactly what quantising the whole loaded model gives, in the same layers."""
    fmt = "fp8" if dtype == torch.float32 else "int8"
    loaded = load_ar_model(path, fmt, device="cpu", dtype=dtype)
    after = quantize_weights(load_ar_model(path, device="cpu", dtype=dtype), fmt)
    got, want = loaded.state_dict(), after.state_dict()
    assert weight_format(loaded) == fmt and list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k].view(-1).view(torch.uint8),
                                                             want[k].view(-1).view(torch.uint8)) for k in got)
    layers = [m for m in loaded.modules() if isinstance(m, QuantizedLinear)]
    assert all(torch.equal(m.bf16_scale, m.weight_scale.to(torch.bfloat16)) for m in layers)  # made from the loaded


def test_a_folder_loads_into_8_bits_without_holding_its_full_precision_weights():
    """Host memory holds the 8-bit model and a layer or two as a sharded folder loads: when each weight is quantised,
    the full-precision weights quantised before it are gone (quantising the loaded model would hold them all)."""
    import weakref

    seen, alive_at_each = [], []
    quantize = quantized.quantize_rows

    def tracked(weight, fmt):
        alive_at_each.append(sum(ref() is not None for ref in seen))
        if weight.device.type != "meta":
            seen.append(weakref.ref(weight))
        return quantize(weight, fmt)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantized, "quantize_rows", tracked)
        model = load_ar_model(DEMO_TEXT, "int8", device="cpu", dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(seen) == len(layers) > 8 and max(alive_at_each) <= 1
