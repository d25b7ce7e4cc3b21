"""The decoders by name, with their parameters: the one entry point for the CLI, the benchmark and
the nodes.

``DECODER_TABLE`` says which model kind each decoder runs on, whether it is lossless and whether it takes
a drafter; the CLI choices, the bench rows and the checks below read it. A token-AR decoder is an
acceptance rule plus a draft source: Jacobi self-drafts (the window of the previous iteration's samples)
or a drafter model (a chain of gamma drafts per target forward). ``ar`` is every kind's own baseline
sampler (raster AR for token models, MAR's masked schedule for MAR, VAR's scales for next-scale models).
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from ..errors import FastARError, FastARWarning, check_choice
from ..model_loaders.shared.compiled import COMPILE_CLOCK
from .token_loops.acceptance import EntropyRule, ExactRule, GroupedRule, LanternRule
from .token_loops.jacobi import ar_decode, jacobi_decode
from .token_loops.proactive import PacSettings
from .token_loops.latent_neighbours import latent_neighbours
from .processing import SamplingSettings, finite_logits
from .masked_loops.cspd import CSpDSettings, cspd_decode
from .few_step_loops.distilled import DDSettings, Hybrid, dd_decode
from .few_step_loops.flow_map import FlowMapSettings, NoiseToCode, token_noise
from .masked_loops.masked import MaskedSettings, masked_decode
from .few_step_loops.next_scale import next_scale_decode
from .few_step_loops.scale_acceleration import ScaleAcceleration
from .token_loops.drafting import DRAFTS, TreeSettings
from .token_loops.speculative import speculative_decode
from .stats import Stopwatch
from .token_loops.verifier import ProgressFn
from .token_loops.zipar import ATTENTIONS as ZIPAR_ATTENTIONS, zipar_decode

TOKEN_AR, MASKED_AR, FEW_STEP, NEXT_SCALE = "token-ar", "masked-ar", "few-step", "next-scale"
KIND_NAMES = {TOKEN_AR: "a token model (LlamaGen)", MASKED_AR: "a MAR model", FEW_STEP: "a Distilled Decoding student",
              NEXT_SCALE: "a next-scale model (VAR, Infinity)"}


@dataclass(frozen=True)
class Decoder:
    name: str
    kinds: tuple[str, ...]  # the model kinds it runs on
    lossless: bool
    drafter: str  # "no", "optional", "preferred" (runs without one, at a cost in quality) or "required"
    codebook: str = ""  # why it needs the image decoder's code vectors ("" = it does not)
    windows: bool = False  # without a drafter, it verifies Jacobi windows of ``window`` tokens


DECODER_TABLE = (
    Decoder("ar", (TOKEN_AR, MASKED_AR, NEXT_SCALE), lossless=True, drafter="no"),
    Decoder("sjd", (TOKEN_AR,), lossless=True, drafter="no", windows=True),
    Decoder("sjd-pac", (TOKEN_AR,), lossless=True, drafter="no", windows=True),
    Decoder("sjd-entropy", (TOKEN_AR,), lossless=False, drafter="no", windows=True),
    Decoder("gsd", (TOKEN_AR,), lossless=False, drafter="optional", windows=True),
    Decoder("spec", (TOKEN_AR,), lossless=True, drafter="required"),
    Decoder("zipar", (TOKEN_AR,), lossless=False, drafter="no"),
    Decoder("zipar-sjd", (TOKEN_AR,), lossless=False, drafter="no"),
    Decoder("lantern", (TOKEN_AR,), lossless=False, drafter="preferred", codebook="to find latent neighbours",
            windows=True),
    Decoder("cspd", (MASKED_AR,), lossless=True, drafter="required"),
    Decoder("cspd-relaxed", (MASKED_AR,), lossless=False, drafter="required"),
    Decoder("fm", (TOKEN_AR, NEXT_SCALE), lossless=True, drafter="no", codebook="to map noise to codes"),
    Decoder("dd", (FEW_STEP,), lossless=False, drafter="no", codebook="to turn logits into code vectors"),
)
DECODER_BY_NAME = {d.name: d for d in DECODER_TABLE}
DECODERS = tuple(DECODER_BY_NAME)
LOSSLESS = {d.name: d.lossless for d in DECODER_TABLE}
WITH_DRAFTER = tuple(d.name for d in DECODER_TABLE if d.drafter != "no")  # decoders that verify a drafter's drafts
NEEDS_DRAFTER = tuple(d.name for d in DECODER_TABLE if d.drafter == "required")
WINDOWED = tuple(d.name for d in DECODER_TABLE if d.windows)
DRAFTED_BY_DEFAULT = tuple(d.name for d in DECODER_TABLE if d.drafter in ("required", "preferred"))  # a bundled
# model's bundled drafter is taken for these when none is given


def decoders_for(kind: str) -> tuple[str, ...]:
    return tuple(d.name for d in DECODER_TABLE if kind in d.kinds)


def check_decoder(name: str, model, drafter) -> Decoder:
    """The table entry of ``name``, checked against the model's kind and the drafter given."""
    if name not in DECODER_BY_NAME:
        raise FastARError(f"unknown decoder '{name}': choose one of {', '.join(DECODERS)}")
    decoder = DECODER_BY_NAME[name]
    kind = getattr(model, "kind", TOKEN_AR)
    if kind not in decoder.kinds:
        needs = " or ".join(KIND_NAMES[k] for k in decoder.kinds)
        raise FastARError(f"{name} needs {needs}; this is {getattr(model, 'what', KIND_NAMES[kind])}: use one of "
                          f"{', '.join(decoders_for(kind))} with it")
    if drafter is None and decoder.drafter == "required":
        if kind == MASKED_AR:
            raise FastARError("CSpD needs a draft model: load a smaller MAR trained on the same VAE latents as the "
                              "drafter (e.g. mar_base for mar_huge; the demo's is demo_mar_draft)")
        raise FastARError("speculative decoding needs a drafter: load one (a smaller AR model of the same family "
                          "or an EAGLE-style head), or use 'sjd' to draft with the model itself")
    if drafter is not None and decoder.drafter == "no":
        raise FastARError(f"the '{name}' decoder does not use a drafter: choose one of "
                          f"{', '.join(d for d in WITH_DRAFTER if kind in DECODER_BY_NAME[d].kinds)}, or remove the drafter")
    return decoder


@dataclass(frozen=True)
class DecoderSpec:
    decoder: str = "sjd"
    window: int = 16  # Jacobi: tokens per forward (last fixed token + drafts)
    init: str = "random"
    coupling: str = "independent"
    group: int = 10  # GSD cluster size G (1 = SJD)
    prob_threshold: float = 0.15  # GSD: drop cluster members whose p differs more than this
    prob_filter: str = "absolute"  # GSD: how the gap is measured: "absolute" (the paper's) or "relative"
    distance_threshold: float = 0.5  # GSD: keep members among the nearest this fraction of codes
    gamma: int = 4  # drafter: drafts per target forward
    drafts: str = "sampled"  # drafter: "sampled" from its q, or its "top" code (EAGLE-2's and LANTERN's reference's)
    tree: str = "chain"  # drafter: "chain" (gamma drafts), "static" (tree_shape) or "dynamic" (EAGLE-2's)
    tree_shape: str = TreeSettings.shape  # a static tree's name (trees.STATIC_SHAPES)
    tree_depth: int = TreeSettings.depth  # dynamic trees: the deepest a draft may be
    tree_topk: int = TreeSettings.topk  # dynamic trees: nodes expanded per depth, and children per node
    tree_nodes: int = TreeSettings.nodes  # dynamic trees: drafts verified per target forward
    lantern_k: int = 1000  # LANTERN: latent neighbours considered per draft (capped at the codebook size)
    lantern_delta: float = 0.1  # LANTERN: total-variation budget per token (0 = exact)
    lantern_lambda: float = 0.0  # LANTERN++: relaxed probability at most lambda p(x), in place of delta (0 = off)
    flow_steps: int = FlowMapSettings.steps  # fm: solver steps of the flow-matching map
    zipar_lead: int = 4  # ZipAR: tokens of the row above fixed before a row starts (>= the width: plain AR)
    zipar_attention: str = "masked"  # ZipAR: "masked" (what the schedule fixed) or "reference" (zero-filled slots)
    pac_branches: int = PacSettings.branches  # SJD-PAC: candidates per node at the window's branched depths
    pac_depth: int = PacSettings.depth  # SJD-PAC: the branched tree's levels, its root included
    entropy_strength: float = 1.0  # sjd-entropy: 0 = exact SJD, 1 = the paper's entropy-aware acceptance

    def as_dict(self) -> dict:
        return asdict(self)

    def pac_settings(self) -> PacSettings:
        """SJD-PAC's window tree."""
        return PacSettings(self.window, self.pac_branches, self.pac_depth)

    def tree_settings(self) -> TreeSettings:
        """What a drafter drafts per target forward."""
        return TreeSettings(self.tree, self.gamma, self.tree_shape, self.tree_depth, self.tree_topk, self.tree_nodes)

    def validate(self) -> "DecoderSpec":
        """The settings' ranges, whatever the model (the front ends check them before loading anything)."""
        if self.window < 2:
            raise FastARError(f"Jacobi window {self.window} is too small: a window holds the last fixed token and at "
                              "least one draft, so use 2 or more; for plain AR (one token per forward) use --decoder "
                              "ar and leave --window out")
        if self.group < 1:
            raise FastARError(f"GSD group size {self.group} must be at least 1 (1 = plain SJD)")
        if self.prob_threshold < 0 or not 0 <= self.distance_threshold <= 1:
            raise FastARError("GSD thresholds: the probability gap must be >= 0 and the distance (a fraction "
                              "of the codes) between 0 and 1")
        if self.lantern_k < 1:
            raise FastARError(f"LANTERN k {self.lantern_k}: consider at least 1 neighbour (the code itself)")
        if self.lantern_lambda and not self.lantern_lambda >= 1.0:
            raise FastARError(f"LANTERN++ lambda {self.lantern_lambda} is out of range: use 1 or more (1 = exact; the "
                              "paper's 2-3 relax), or 0 for the additive delta")
        if not 0.0 <= self.lantern_delta <= 1.0:
            raise FastARError(f"LANTERN delta {self.lantern_delta} is out of range: use 0..1 (0 = exact "
                              "speculative decoding)")
        check_choice("ZipAR attention", self.zipar_attention, ZIPAR_ATTENTIONS)
        check_choice("drafts", self.drafts, DRAFTS)
        self.tree_settings().validate()
        if self.decoder == "sjd-pac":
            self.pac_settings().validate()
        if not 0.0 <= self.entropy_strength <= 1.0:
            raise FastARError(f"entropy strength {self.entropy_strength} is out of range: use 0..1 (0 = exact SJD, "
                              "1 = the paper's entropy-aware acceptance)")
        if self.zipar_lead < 1:
            raise FastARError(f"ZipAR lead {self.zipar_lead} is too small: a row starts once the row above has at "
                              "least 1 token (the grid's width or more: plain AR)")
        FlowMapSettings(steps=self.flow_steps).validate()
        return self


def make_generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def make_rule(spec: DecoderSpec, model, sampling: SamplingSettings, codebook):
    if spec.decoder == "gsd":
        return GroupedRule(spec.group, model.code_embeddings(), spec.prob_threshold, spec.distance_threshold,
                           spec.prob_filter)
    if spec.decoder == "lantern":
        table = latent_neighbours(codebook.to(model.device), spec.lantern_k)
        return LanternRule(table, spec.lantern_delta, greedy=sampling.temperature == 0.0, lam=spec.lantern_lambda)
    if spec.decoder == "sjd-entropy":
        return EntropyRule(spec.entropy_strength)
    return ExactRule()


def decode(model, conditioning, sampling: SamplingSettings, spec: DecoderSpec, *, seed: int,
           on_iteration: ProgressFn | None = None, drafter=None, codebook=None):
    """Generate image codes ``[B, h*w]`` and their DecodeStats. Same seed, settings and device give
    the same codes. ``drafter`` (spec, gsd, lantern) drafts chains instead of Jacobi windows;
    ``codebook`` [V, D] (the VQ decoder's code vectors) is needed by LANTERN and fm."""
    check_codebook(check_decoder(spec.decoder, model, drafter), model, codebook)
    spec.validate()
    if spec.drafts != "sampled" and drafter is None:
        raise FastARError(f"drafts '{spec.drafts}' choose how a drafter drafts: give {spec.decoder} a drafter "
                          "(--drafter, or the drafter socket in ComfyUI), or leave drafts at 'sampled'")
    sampling.validate()
    notes = quality_warnings(spec, drafter)
    for note in notes:
        warnings.warn(note, FastARWarning, stacklevel=2)
    with finite_logits(model.dtype):
        codes, stats = counting_compile_time(run_decoder, model, conditioning, sampling, spec,
                                             make_generator(seed, model.device), on_iteration, drafter, codebook)
    stats.warnings.extend(notes)
    warn_of_low_acceptance(stats)
    return codes, stats


def counting_compile_time(run, *args, **kwargs):
    """``run(...)``'s (output, stats), its stats with the seconds it spent compiling steps (a first run's compilation
    reported apart from the decoder's time)."""
    compiling = COMPILE_CLOCK.seconds
    out, stats = run(*args, **kwargs)
    stats.compile_time_s = COMPILE_CLOCK.seconds - compiling
    return out, stats


def check_codebook(decoder: Decoder, model, codebook) -> None:
    if not decoder.codebook:
        return
    if codebook is None:
        raise FastARError(f"{decoder.name} needs the VQ decoder's codebook {decoder.codebook}: give the VQ model that "
                          "decodes this model's tokens (--vq on the command line; in ComfyUI, connect a FastAR Load "
                          "Image Decoder to the sampler's vq input)")
    if codebook.shape[0] != model.vocab_size:
        raise FastARError(f"the VQ codebook has {codebook.shape[0]} codes but the AR model predicts "
                          f"{model.vocab_size}: load the VQ decoder this AR model was trained with")


def quality_warnings(spec: DecoderSpec, drafter) -> list[str]:
    """Settings that run but cost a lot of quality: said on the command line and on the Stats node."""
    if spec.decoder == "lantern" and drafter is None and spec.lantern_delta > 0:
        return ["LANTERN without a drafter verifies Jacobi drafts, which its relaxation accepts far too easily: "
                "expect a fast but badly degraded image. Connect a drafter (--drafter), lower lantern delta, or "
                "use sjd (lossless)"]
    return []


LOW_ACCEPTANCE = 0.05  # below it, drafting costs more than it saves
INSTEAD = {  # what to use when a decoder's drafts are nearly all rejected
    "sjd": "plain ar: on this model the window's drafts are nearly never the model's own picks",
    "gsd": "plain ar, or a larger group size",
    "sjd-entropy": "plain ar: on this model the window's drafts are nearly never the model's own picks",
    "spec": "sjd (no drafter), or a drafter trained on this model's own samples (python -m fastar train-drafter)",
    "lantern": "sjd (no drafter), or a drafter trained on this model's own samples (python -m fastar train-drafter)",
    "zipar-sjd": "plain zipar (row_window 1): the drafts inside its rows do not pay here",
    "cspd": "plain MAR with fewer steps (num_iter), or its feature reuse (--reuse, the LazyMAR sampler): the draft "
            "MAR does not track this model closely enough for its tokens to be kept",
}


def warn_of_low_acceptance(stats) -> None:
    """When a run kept under LOW_ACCEPTANCE of its drafts, one line says so and what to use instead (said on the
    command line and the Stats node, kept in the statistics)."""
    rate = stats.acceptance_rate
    if rate is None or rate >= LOW_ACCEPTANCE or stats.drafted_tokens < 20:  # too few drafts to tell
        return
    instead = INSTEAD[stats.decoder.split("+")[0].replace("cspd-relaxed", "cspd")]
    note = (f"{stats.decoder} kept {rate:.1%} of its {stats.drafted_tokens} drafts: its drafting costs more than it "
            f"saves on this model; use {instead}")
    warnings.warn(note, FastARWarning, stacklevel=3)
    stats.warnings.append(note)


def run_decoder(model, conditioning, sampling, spec, generator, on_iteration, drafter, codebook):
    watch = Stopwatch(model.device)  # from here on: the generation's setup counts in its wall time
    if spec.decoder == "ar":
        return ar_decode(model, conditioning, sampling, generator=generator, on_iteration=on_iteration, watch=watch)
    if spec.decoder == "fm":
        noise = token_noise(conditioning.batch, model.grid[0] * model.grid[1], codebook.shape[1], generator)
        return fm_decode(model, conditioning, sampling, noise, codebook, spec.flow_steps, on_iteration, watch)
    rule = make_rule(spec, model, sampling, codebook)
    watch.lap("setup")
    if spec.decoder in ("zipar", "zipar-sjd"):
        return zipar_decode(model, conditioning, sampling, generator=generator, lead=spec.zipar_lead,
                            window=spec.window if spec.decoder == "zipar-sjd" else 1, coupling=spec.coupling, rule=rule,
                            attention=spec.zipar_attention, name=spec.decoder, on_iteration=on_iteration, watch=watch)
    if drafter is not None:
        return speculative_decode(model, drafter, conditioning, sampling, generator=generator,
                                  tree=spec.tree_settings(), drafts=spec.drafts, rule=rule, name=spec.decoder,
                                  on_iteration=on_iteration,
                                  watch=watch)
    return jacobi_decode(
        model, conditioning, sampling, generator=generator, window=spec.window, init=spec.init,
        coupling=spec.coupling, rule=rule, name=spec.decoder, on_iteration=on_iteration, watch=watch,
        pac=spec.pac_settings() if spec.decoder == "sjd-pac" else None,
    )


def fm_decode(model, conditioning, sampling: SamplingSettings, noise: torch.Tensor, codebook: torch.Tensor,
              flow_steps: int = FlowMapSettings.steps, on_iteration: ProgressFn | None = None, watch=None):
    """Plain AR in which token i of every row is the flow map of ``noise[:, i]`` ([B, N, C]): codes [B, N]
    that are a deterministic function of the noise (DD's training pairs). Same distribution as ``ar``."""
    draw = NoiseToCode(noise.to(model.device), codebook.to(model.device), FlowMapSettings(steps=flow_steps))
    return ar_decode(model, conditioning, sampling, generator=None, on_iteration=on_iteration, watch=watch,
                     draw=draw, name="fm")


def decode_masked(model, conditioning, settings: MaskedSettings, decoder: str = "ar", *, seed: int,
                  cspd: CSpDSettings = CSpDSettings(), drafter=None, on_iteration: ProgressFn | None = None):
    """Generate MAR tokens ``[B, L, C]`` and their DecodeStats: ``ar`` (MAR's own sampler), ``cspd`` or
    ``cspd-relaxed`` (``drafter``: a smaller MAR; ``cspd`` says which rule). Same seed, settings and device give the
    same tokens."""
    check_decoder(decoder, model, drafter)
    generator = make_generator(seed, model.device)
    watch = Stopwatch(model.device)
    if decoder.startswith("cspd"):
        if cspd.decoder != decoder:
            raise FastARError("cspd is exact: its ratio temperature is 1 and it has no path factor; use cspd-relaxed "
                              "for the reference code's rule" if decoder == "cspd" else
                              "cspd-relaxed needs a ratio temperature above 1 or the path factor (the reference "
                              "code: temperature 42); at 1 without it, it is cspd")
        tokens, stats = counting_compile_time(cspd_decode, model, drafter, conditioning, settings, cspd,
                                              generator=generator, on_iteration=on_iteration, watch=watch)
        warn_of_low_acceptance(stats)
        return tokens, stats
    return counting_compile_time(masked_decode, model, conditioning, settings, generator=generator,
                                 on_iteration=on_iteration, watch=watch)


def decode_next_scale(model, conditioning, sampling: SamplingSettings, *, seed: int, vqvae, decoder: str = "ar",
                      on_iteration: ProgressFn | None = None, noise=None, flow_steps: int = FlowMapSettings.steps,
                      scale_codes: list | None = None, acceleration: ScaleAcceleration | None = None):
    """VAR's and Infinity's sampler: f_hat ``[B, C, h, w]`` (the image decoder's input) and its DecodeStats.
    ``vqvae`` (VAR's multi-scale VQVAE, Infinity's BSQ VAE) turns each scale's codes into the next scale's input.
    ``fm`` (VAR) draws every token by the flow map of its own noise (``noise`` [B, L, C], or seeded): the same
    distribution, a deterministic image. ``scale_codes``, a list, receives each scale's codes ``[B, pn, pn]``
    (Infinity's bits ``[B, h, w, bits]``). ``acceleration``: FastVAR's pruning and skipping, SkipVAR's
    (few_step_loops/scale_acceleration.py)."""
    check_decoder(decoder, model, None)
    own_check = getattr(model, "check_image_decoder", None)  # Infinity's: its BSQ VAE
    if own_check is not None:
        own_check(vqvae)
    elif vqvae is None or getattr(vqvae, "input_kind", None) != "multi-scale":
        raise FastARError("a VAR model needs its multi-scale VQVAE as the image decoder (vae_ch160v4096z32.pth for "
                          "the release, demo/demo_var_vqvae.safetensors for the demo): each scale's codes become the "
                          "next scale's input through it. Give it with --vq on the command line; in ComfyUI, connect "
                          "a FastAR Load Image Decoder to the VAR sampler")
    generator = make_generator(seed, model.device)
    draw = None
    if decoder == "fm":
        if vqvae.codebook() is None:
            raise FastARError(f"fm maps noise to the code vectors of a codebook; {model.what} draws bits: use ar")
        if noise is None:
            noise = token_noise(conditioning.batch, model.cfg.seq_len, model.cfg.channels, generator)
        draw = NoiseToCode(noise.to(model.device), vqvae.codebook().float().to(model.device),
                           FlowMapSettings(steps=flow_steps)).span
    with finite_logits(model.dtype):
        return counting_compile_time(next_scale_decode, model, vqvae, conditioning, sampling.validate(),
                                     generator=generator, on_iteration=on_iteration, draw=draw, name=decoder,
                                     scale_codes=scale_codes, acceleration=acceleration)


def check_hybrid_teacher(student, teacher) -> None:
    """The hybrid's teacher must be a token model, and the student's own (same codes, grid, classes)."""
    if getattr(teacher, "kind", TOKEN_AR) != TOKEN_AR:
        raise FastARError(f"the teacher regenerates tokens: it must be a token model, not {teacher.what}")
    student.check_teacher(teacher)


def decode_distilled(student, conditioning, settings: DDSettings, *, seed: int, codebook, noise=None,
                     on_iteration: ProgressFn | None = None, teacher=None, sampling: SamplingSettings | None = None):
    """Distilled Decoding: latents ``[B, N, C]`` (code space, raster order) and their DecodeStats. ``noise``
    [B, N, C] reproduces a run; without it the noise is drawn from ``seed``. With ``teacher`` (and
    ``settings.regenerate``) the teacher samples positions regenerate..t2-1 at ``sampling`` between the steps."""
    check_codebook(check_decoder("dd", student, None), student, codebook)
    generator = make_generator(seed, student.device)
    if noise is None:
        noise = token_noise(conditioning.batch, student.num_tokens, student.cfg.channels, generator)
    elif noise.shape[0] != conditioning.batch:
        raise FastARError(f"the noise has {noise.shape[0]} rows but {conditioning.batch} images were asked for: "
                          "give as many classes as noise rows")
    hybrid = None
    if teacher is not None:
        check_hybrid_teacher(student, teacher)
        hybrid = Hybrid(teacher, (sampling or SamplingSettings()).validate(), generator)
    return dd_decode(student, conditioning.labels, noise, codebook, settings, on_iteration=on_iteration, hybrid=hybrid)
