"""User values -> the settings objects the samplers take: what the command line's flags (and the benchmark's,
which shares them) mean, with their defaults and ranges, in one place below both."""
from __future__ import annotations

from types import SimpleNamespace

from .errors import FastARError
from .samplers.masked_loops.cspd import REFERENCE_TEMPERATURE, CSpDSettings
from .samplers.decoders import DecoderSpec
from .samplers.few_step_loops.distilled import DDSettings
from .samplers.few_step_loops.scale_acceleration import FASTVAR, ScaleAcceleration
from .samplers.masked_loops.feature_reuse import FeatureReuse
from .samplers.masked_loops.masked import MaskedSettings
from .samplers.processing import SamplingSettings

NO_FLAGS = SimpleNamespace()  # what the nodes pass for "the model's own settings": no flag given
SPEC_DEFAULTS = DecoderSpec()
SAMPLING_DEFAULTS = SamplingSettings()
MASKED_DEFAULTS = MaskedSettings()
CSPD_DEFAULTS = CSpDSettings()
REUSE_DEFAULTS = FeatureReuse()
DD_DEFAULTS = DDSettings()


def spec_from(args, decoder: str) -> DecoderSpec:
    return DecoderSpec(decoder=decoder, window=args.window, init=args.init, coupling=args.coupling,
                       group=args.group, prob_threshold=args.prob_threshold, prob_filter=args.prob_filter,
                       distance_threshold=args.distance_threshold,
                       gamma=SPEC_DEFAULTS.gamma if args.gamma is None else args.gamma,
                       lantern_k=args.lantern_k, lantern_delta=args.lantern_delta, flow_steps=args.flow_steps,
                       zipar_lead=args.zipar_lead, zipar_attention=args.zipar_attention, drafts=args.drafts,
                       lantern_lambda=args.lantern_lambda, tree=args.tree, tree_shape=args.tree_shape,
                       tree_depth=args.tree_depth, tree_topk=args.tree_topk, tree_nodes=args.tree_nodes,
                       pac_branches=args.pac_branches, pac_depth=args.pac_depth, entropy_strength=args.entropy_strength)


def masked_settings_from(args, model=None) -> MaskedSettings:
    if top_k_of(args) != SAMPLING_DEFAULTS.top_k or top_p_of(args) != SAMPLING_DEFAULTS.top_p:
        raise FastARError("--top-k and --top-p act on token probabilities; a MAR model samples continuous tokens: "
                          "leave them out (--temperature and --cfg apply)")
    return MaskedSettings(num_iter=given(args, "num_iter", model, MASKED_DEFAULTS.num_iter),
                          cfg_scale=cfg_of(args, model),
                          cfg_schedule=given(args, "cfg_schedule", model, MASKED_DEFAULTS.cfg_schedule),
                          temperature=given(args, "temperature", model, MASKED_DEFAULTS.temperature),
                          diffusion_steps=given(args, "diffusion_steps", model, MASKED_DEFAULTS.diffusion_steps),
                          reuse=reuse_from(args))


def given(args, name: str, model=None, fallback=None):
    """A flag's value; when it is absent, the model's own default (a bundled model's best measured setting, read
    from its file: ``model.defaults``), else ``fallback`` (the family's or the release's)."""
    value = getattr(args, name, None)
    if value is not None:
        return value
    return getattr(model, "defaults", {}).get(name, fallback)


def reuse_from(args, always: bool = False) -> FeatureReuse | None:
    """--reuse's settings (None without it, unless ``always``: the bench's lazy rows take them either way)."""
    if not (getattr(args, "reuse", False) or always):
        return None
    return FeatureReuse(start_percent=args.reuse_start, end_percent=args.reuse_end, refresh_every=args.refresh_every,
                        token_reuse=args.token_reuse, head_refresh_every=args.head_refresh_every).validate()


def ratios_of(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise FastARError(f"--fastvar-ratios {text!r}: give comma-separated shares of tokens to prune, e.g. 0.4,0.5")


def acceleration_from(args) -> ScaleAcceleration | None:
    """VAR's scale accelerators (None: none asked for). --fastvar is the release's schedule from the end: prune
    0.4 and 0.5 of the tokens at the two scales before the last two, which are skipped; --fastvar-ratios prunes
    other shares, --skip-scales skips another count (0 keeps every scale), --uncond-scales is SkipVAR's."""
    ratios = getattr(args, "fastvar_ratios", None)
    fastvar = getattr(args, "fastvar", False) or ratios is not None
    skip, uncond = getattr(args, "skip_scales", None), getattr(args, "uncond_scales", None) or 0
    acceleration = ScaleAcceleration(
        prune_ratios=(ratios_of(ratios) if ratios is not None else FASTVAR.prune_ratios) if fastvar else (),
        skip_last=skip if skip is not None else FASTVAR.skip_last if fastvar else 0, uncond_last=uncond).validate()
    return acceleration if acceleration.active else None


def cspd_from(args, decoder: str = "cspd") -> CSpDSettings:
    """CSpD's settings; ``cspd-relaxed`` takes the reference code's ratio temperature unless one is given."""
    gamma = CSPD_DEFAULTS.gamma if args.gamma is None else args.gamma
    temperature = args.cspd_temperature
    if temperature is None:
        temperature = REFERENCE_TEMPERATURE if decoder == "cspd-relaxed" else 1.0
    return CSpDSettings(gamma=gamma, prefill=args.prefill, verify=args.cspd_verify, ratio_temperature=temperature,
                        path_factor=args.cspd_path_factor).validate()


def cfg_of(args, model=None, fallback: SamplingSettings = SAMPLING_DEFAULTS) -> float:
    return given(args, "cfg", model, fallback.cfg_scale)


def top_k_of(args, model=None, fallback: SamplingSettings = SAMPLING_DEFAULTS) -> int:
    """--top-k, or the model's or ``fallback``'s when the flag is absent (0 given means off, never the default)."""
    return given(args, "top_k", model, fallback.top_k)


def top_p_of(args, model=None, fallback: SamplingSettings = SAMPLING_DEFAULTS) -> float:
    """--top-p, or the model's or ``fallback``'s when the flag is absent (1 given means off, never the default)."""
    return given(args, "top_p", model, fallback.top_p)


def sampling_from(args, model=None, fallback: SamplingSettings = SAMPLING_DEFAULTS) -> SamplingSettings:
    """The sampling settings: each flag given, else the model's own default, else ``fallback``'s (VAR: the
    release's)."""
    return SamplingSettings(cfg_scale=cfg_of(args, model, fallback),
                            temperature=given(args, "temperature", model, fallback.temperature),
                            top_k=top_k_of(args, model, fallback), top_p=top_p_of(args, model, fallback)).validate()


def check_arguments(args) -> None:
    """The settings' ranges, before anything loads (a big model takes minutes to): the decoder's, the sampling's,
    CSpD's and the batch. What depends on the model (its classes, token count, drafter) is checked after."""
    spec_from(args, getattr(args, "decoder", None) or SPEC_DEFAULTS.decoder).validate()
    sampling_from(args)
    cspd_from(args, getattr(args, "decoder", None) or "cspd")
    reuse_from(args)
    acceleration_from(args)
    if getattr(args, "batch", 1) < 1:
        raise FastARError(f"--batch {args.batch}: generate at least 1 image")
