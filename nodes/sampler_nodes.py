"""One sampler node per decoder (AR, SJD, GSD, speculative, LANTERN, CSpD, DD). The token and MAR ones share one
base class: the base reads the shared widgets and runs ``samplers.decoders.decode`` (token models) or
``decode_masked`` (MAR); a subclass only adds its decoder's sockets (drafter, VQ) and widgets and builds its
settings. DD's student has no sampling widgets and has its own small node.

Widget order is part of saved workflows: append new widgets at the end, never insert or rename.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from comfy_api.latest import io

from ..errors import FastARError, check_choice
from ..memory import (cache_rows, decode_bytes_per_image, decode_window, element_bytes, kv_bytes, kv_cache_bytes,
                      token_working_bytes)
from ..model_loaders.drafters.eagle import EagleHead
from ..model_loaders.shared.protocol import CaptionConditioning, ClassConditioning, PromptConditioning
from ..model_loaders.shared.quantized import weight_format
from ..pipeline import CONDITIONING_NAMES, check_image_decoder, class_conditioning, conditioning_type
from ..settings import NO_FLAGS, masked_settings_from, ratios_of, sampling_from
from ..speed_dial import SPEEDS, choose
from ..samplers.token_loops.acceptance import PROB_FILTERS
from ..samplers.masked_loops.cspd import VERIFY_MODES, CSpDSettings
from ..samplers.token_loops.zipar import ATTENTIONS as ZIPAR_ATTENTIONS
from ..samplers.decoders import (
    DRAFTED_BY_DEFAULT,
    FEW_STEP,
    MASKED_AR,
    NEXT_SCALE,
    DecoderSpec,
    check_decoder,
    check_hybrid_teacher,
    decode,
    decode_distilled,
    decode_masked,
    decode_next_scale,
)
from ..samplers.few_step_loops.distilled import DDSettings
from ..samplers.few_step_loops.next_scale import VAR_SAMPLING
from ..samplers.few_step_loops.scale_acceleration import ScaleAcceleration
from ..samplers.token_loops.drafts import COUPLINGS, INIT_STRATEGIES
from ..samplers.masked_loops.feature_reuse import FeatureReuse
from ..samplers.masked_loops.masked import CFG_SCHEDULES, MaskedSettings
from ..samplers.processing import SamplingSettings
from ..samplers.token_loops.drafting import DRAFTS
from ..samplers.token_loops.trees import STATIC_SHAPES
from . import comfy_glue as glue
from .loader_nodes import FastARConditioning, FastARDrafter, FastARModel, FastARVQ, bundled_drafter
from .values import STATS_TYPE, TOKENS_TYPE, Conditioning, DrafterHandle, Latents, ModelHandle, Tokens

FastARTokens = io.Custom(TOKENS_TYPE)
FastARStats = io.Custom(STATS_TYPE)

SPEC = DecoderSpec()
SAMPLING = SamplingSettings()
MASKED = MaskedSettings()
CSPD = CSpDSettings()
REUSE = FeatureReuse()
DD = DDSettings()
SEED_MAX = 0xFFFFFFFFFFFFFFFF

LOSSLESS_NOTE = ("Lossless: samples exactly the distribution of plain AR sampling, but a given seed gives a "
                 "different image than the AR sampler.")
RELAXED_NOTE = ("Relaxed: trades fidelity for speed (accepts drafts that are close to, not exactly, what the model "
                "would sample); group size 1 is exactly SJD. A given seed gives a different image than AR or SJD.")
CSPD_NOTE = ("Lossless with verify = steps: exactly plain MAR sampling at the same settings (with its last "
             "diffusion step kept Gaussian, a change of about 0.006 in token space); merged follows the paper and "
             "is exactly a MAR run that merges each draft round into one step (fewer, larger steps). A given seed "
             "gives a different image than the AR sampler.")
DD_NOTE = ("Needs the VQ decoder of the student's teacher; FastAR Decode Image with the same VQ makes the images.")
LANTERN_NOTE = ("Relaxed: trades fidelity for speed (also accepts a draft when codes close to it in the VQ latent "
                "space carry the target's mass); delta 0 is exact speculative decoding. A given seed gives a "
                "different image than plain AR sampling.")


def slider(id, default, lo, hi, step, tooltip, optional=False):
    return io.Float.Input(id, default=default, min=lo, max=hi, step=step, display_mode=io.NumberDisplay.slider,
                          tooltip=tooltip, optional=optional)


def preview_vq_input():
    return FastARVQ.Input("preview_vq", optional=True,
                          tooltip="The image decoder (VQ, KL or VAR's VQVAE): optional for a live preview of the partly "
                                  "decoded image (shown when ComfyUI runs with --preview-method other than none); "
                                  "needed for VAR models, which sample through their VQVAE.")


def drafter_input(optional: bool, tooltip: str):
    return FastARDrafter.Input("drafter", optional=optional,
                               tooltip=f"{tooltip} Load it with FastAR Load Drafter from the same model as this "
                                       "sampler's.")


def gamma_input(optional: bool = False):
    return io.Int.Input("gamma", default=SPEC.gamma, min=1, max=64, optional=optional,
                        tooltip="With a drafter: drafts per model forward (the drafter proposes a chain of gamma "
                                "tokens, the model verifies them in one forward and fixes up to gamma+1). Larger "
                                "pays off when the drafter is often right; 3-6 is typical.")


def drafts_input():
    return io.Combo.Input("drafts", options=list(DRAFTS), default=SPEC.drafts, optional=True,
                          tooltip="With a drafter: how it proposes each token. sampled (FastAR's default) draws it "
                                  "from the drafter's distribution and keeps it with probability 1 - TV(p, q): "
                                  "fastest when the drafter learnt the model's spread. top proposes the drafter's most "
                                  "likely code and keeps it with the model's probability of it (EAGLE-2's and the "
                                  "LANTERN paper's setting). Both are lossless.")


TREES = ("chain", *STATIC_SHAPES, "dynamic")  # the tree widget: a chain, a static shape by name, or EAGLE-2's


def tree_input():
    return io.Combo.Input("tree", options=list(TREES), default="chain", optional=True,
                          tooltip="With a drafter: what it drafts per model forward. chain: gamma tokens in a row. "
                                  "lantern++57: LANTERN++'s static tree of 57 drafts, 5 deep (several guesses per "
                                  "position, siblings drawn without replacement). dynamic: EAGLE-2's tree of the "
                                  "drafter's 58 likeliest paths, 5 deep (top codes). Trees fix more tokens per "
                                  "forward, each forward feeding more tokens: best on a GPU. All lossless.")


def tree_fields(tree: str) -> dict:
    """DecoderSpec fields of the tree widget's value."""
    if tree in STATIC_SHAPES:
        return {"tree": "static", "tree_shape": tree}
    return {"tree": tree}


def jacobi_inputs() -> list:
    """SJD's widgets, shared by GSD."""
    return [
        io.Int.Input("window", default=SPEC.window, min=2, max=256,
                     tooltip="Tokens per forward: the last fixed token plus window-1 draft tokens verified at once. "
                             "At most this many tokens are fixed per forward; larger windows cost more per forward. "
                             "16-32 is a good start."),
        io.Combo.Input("init", options=list(INIT_STRATEGIES), default=SPEC.init,
                       tooltip="How new draft tokens are initialised: random codes, copies of the token to the left "
                               "(horizontal) or above (vertical), or samples from the latest distribution of the "
                               "left or above position. All are lossless; the better the guess, the more tokens per "
                               "forward."),
        io.Combo.Input("coupling", options=list(COUPLINGS), default=SPEC.coupling,
                       tooltip="How a draft is redrawn after a rejection: independent resampling (SJD), maximal "
                               "coupling, or Gumbel coupling (SCD), which keeps drafts stable across iterations. "
                               "All are lossless."),
    ]


def masked_inputs(optional: bool) -> list:
    """MAR's widgets, shared by the AR and CSpD samplers (optional on the AR sampler: token models ignore them)."""
    return [
        io.Int.Input("num_iter", default=MASKED.num_iter, min=1, max=4096, optional=optional,
                     tooltip="MAR models: masked-generation steps (each step predicts a share of the still-masked "
                             "tokens, on a cosine schedule). 64 is MAR's default; fewer is faster and rougher. At "
                             "most the model's token count (256 for MAR at 256 px)."),
        io.Int.Input("diffusion_steps", default=MASKED.diffusion_steps, min=1, max=1000, optional=optional,
                     tooltip="MAR models: reverse-diffusion steps of the head for each token (100 is MAR's default; "
                             "the head is small, so they cost less than the transformer)."),
        io.Combo.Input("cfg_schedule", options=list(CFG_SCHEDULES), default=MASKED.cfg_schedule, optional=optional,
                       tooltip="MAR models: how guidance grows over the steps. linear (MAR's default) ramps from 1 "
                               "towards cfg as tokens get fixed; constant uses cfg at every step."),
    ]


class SamplerBase(io.ComfyNode):
    """Shared widgets and execution; subclasses set the class attributes and ``decoder_inputs``/``spec``."""

    DECODER = "ar"
    NODE_ID = DISPLAY = DESCRIPTION = ""
    MAR_ONLY = False

    @classmethod
    def socket_inputs(cls) -> list:
        """Model inputs after the conditioning (drafter, VQ); sockets are matched by name, not position."""
        return [preview_vq_input()]

    @classmethod
    def sampling_inputs(cls) -> list:
        """The sampling widgets between seed and batch."""
        return [
            slider("cfg", SAMPLING.cfg_scale, 0.0, 20.0, 0.1,
                   "Classifier-free guidance scale: higher follows the class or prompt more closely. Token and MAR "
                   "models: 1.0 turns guidance off (and halves the work). VAR models: guidance ramps from none at "
                   "the first scale to cfg at the last, so 1.0 still guides and 0 turns it off (the release uses "
                   "1.5)."),
            slider("temperature", SAMPLING.temperature, 0.0, 2.0, 0.01,
                   "Sampling temperature: 1.0 is the model's distribution, lower is more conservative, 0 is greedy "
                   "(token models; MAR needs a temperature above 0: it scales the noise of each diffusion step)."),
            io.Int.Input("top_k", default=SAMPLING.top_k, min=0, max=1_000_000,
                         tooltip="Token and VAR models: sample only among the k most likely codes (0 = off; the VAR "
                                 "release uses 900). MAR models sample continuous tokens: keep 0."),
            slider("top_p", SAMPLING.top_p, 0.0, 1.0, 0.01,
                   "Token and VAR models: nucleus sampling, keep the most likely codes that cover this probability "
                   "mass (1.0 = off, must be above 0; the VAR release uses 0.96). MAR models: keep 1.0."),
        ]

    @classmethod
    def decoder_inputs(cls) -> list:
        """The decoder's widgets, after the shared ones; append only (saved workflows store them by position)."""
        return []

    @classmethod
    def spec(cls, **decoder_widgets) -> DecoderSpec:
        return DecoderSpec(decoder=cls.DECODER)

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id=cls.NODE_ID,
            display_name=cls.DISPLAY,
            category="FastAR/sampling",
            description=cls.DESCRIPTION,
            inputs=[
                FastARModel.Input("model", tooltip="The AR model (FastAR Load AR Model)."),
                FastARConditioning.Input("conditioning", tooltip="FastAR Class Label or FastAR Text Conditioning."),
                *cls.socket_inputs(),
                io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="All randomness comes from this seed: same seed, settings and device give the "
                                     "same image."),
                *cls.sampling_inputs(),
                io.Int.Input("batch", default=1, min=1, max=64,
                             tooltip="Images per run, all with the same conditioning (each row is its own sample)."),
                *cls.decoder_inputs(),
            ],
            outputs=[
                FastARTokens.Output("tokens", display_name="tokens",
                                    tooltip="The model's output (image codes, or MAR's latents): connect to FastAR "
                                            "Decode Image."),
                FastARStats.Output("stats", display_name="stats",
                                   tooltip="Decode statistics: connect to FastAR Stats or FastAR "
                                           "Acceptance Map."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, top_p=SAMPLING.top_p):
        """Before the run, what ComfyUI's own checks miss: top_p must be above 0 (the slider starts at 0). It
        names top_p alone: ComfyUI reports what it returns on every input it names and skips its own checks of
        those, so the other widgets keep ComfyUI's range and list checks (ComfyUI 0.3.75 checks no V3 list: the
        decoders check their choices when the node runs)."""
        if not isinstance(top_p, (int, float)):
            return True  # ComfyUI reports a value of the wrong type itself
        try:
            SamplingSettings(top_p=top_p).validate()
        except FastARError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, model: ModelHandle, conditioning: Conditioning, seed, cfg, temperature, batch,
                top_k=SAMPLING.top_k, top_p=SAMPLING.top_p, preview_vq: ModelHandle | None = None,
                vq: ModelHandle | None = None, drafter: DrafterHandle | None = None,
                **decoder_widgets) -> io.NodeOutput:
        if cls.MAR_ONLY and model.module.kind != MASKED_AR:
            raise FastARError(f"{cls.DISPLAY} reuses the features of a MAR model between its steps; {model.name} is "
                              f"{model.module.what}: use it with a MAR model, or another FastAR sampler for this one")
        if drafter is None and cls.DECODER in DRAFTED_BY_DEFAULT:
            drafter = bundled_drafter(model)
        job = Job(cls.hidden.unique_id, cls.DECODER,
                  SamplingSettings(cfg_scale=cfg, temperature=temperature, top_k=top_k, top_p=top_p),
                  spec=cls.spec(**{k: v for k, v in decoder_widgets.items() if k not in MASKED_WIDGETS}),
                  masked=MaskedSettings(cfg_scale=cfg, temperature=temperature, reuse=cls.reuse(**decoder_widgets),
                                        **masked_widgets(decoder_widgets)),
                  cspd=cls.cspd_settings(**decoder_widgets), acceleration=cls.acceleration(**decoder_widgets))
        return io.NodeOutput(*job.run(model, conditioning, seed, batch, preview_vq or vq, vq, drafter))

    @classmethod
    def cspd_settings(cls, **decoder_widgets) -> CSpDSettings | None:
        return None

    @classmethod
    def reuse(cls, **decoder_widgets) -> FeatureReuse | None:
        """MAR's feature reuse (the LazyMAR sampler's widgets); None: every step in full."""
        return None

    @classmethod
    def acceleration(cls, **decoder_widgets) -> ScaleAcceleration | None:
        """VAR's FastVAR / SkipVAR (the AR sampler's last widgets); None: every scale in full."""
        return None


@dataclass(frozen=True)
class Job:
    """What a sampler node runs, its widgets read: the decoder and every setting it may need (a token model's
    ``spec``, a MAR's ``masked`` and ``cspd``), under the node ``node_id`` (progress and previews)."""

    node_id: str
    decoder: str
    sampling: SamplingSettings
    spec: DecoderSpec
    masked: MaskedSettings
    cspd: CSpDSettings | None = None
    acceleration: ScaleAcceleration | None = None  # VAR's FastVAR / SkipVAR

    def run(self, model: ModelHandle, conditioning: Conditioning, seed: int, batch: int,
            preview_vq: ModelHandle | None, vq: ModelHandle | None, drafter: DrafterHandle | None):
        """The model's output (tokens or latents) and its stats: memory asked of ComfyUI, progress with a live
        preview, Cancel."""
        ar, sampling = model.module, self.sampling
        wanted = conditioning_type(ar)
        if conditioning.model_type != wanted:
            raise FastARError(f"the conditioning is for a {CONDITIONING_NAMES[conditioning.model_type]} model but "
                              f"{model.name} is {CONDITIONING_NAMES[wanted]}: connect "
                              f"{'FastAR Class Label' if wanted == 'c2i' else 'FastAR Text Conditioning'} made for it")
        if drafter is not None and drafter.target is not ar:
            raise FastARError(f"the drafter {drafter.name} was loaded for another model than {model.name}: connect "
                              "the model that goes into this sampler to FastAR Load Drafter as well")
        check_decoder(self.decoder, ar, drafter.drafter if drafter is not None else None)
        check_fits(ar, conditioning.rows)
        rows = repeat_rows(conditioning.rows, batch)
        settings = {"seed": seed, "cfg": sampling.cfg_scale, "temperature": sampling.temperature,
                    "conditioning": conditioning.label, "model": model.name}
        if drafter is not None:
            settings["drafter_file"] = drafter.name
        if weight_format(ar) != "auto":
            settings["weights"] = weight_format(ar)
        if self.acceleration is not None and ar.kind != NEXT_SCALE:
            raise FastARError(f"fastvar_ratios, skip_scales and uncond_scales act on a VAR model's scales; "
                              f"{model.name} is {ar.what}: clear them (empty, 0, 0)")
        if ar.kind == NEXT_SCALE:
            return run_next_scale(self.node_id, model, rows, seed, sampling, preview_vq, settings, self.acceleration)
        if ar.kind == MASKED_AR:
            if sampling.top_k != SAMPLING.top_k or sampling.top_p != SAMPLING.top_p:
                raise FastARError(f"top_k {sampling.top_k} / top_p {sampling.top_p}: {model.name} is a MAR model, which "
                                  "samples continuous tokens with a diffusion head; top-k and top-p filter token "
                                  "codes: set top_k to 0 and top_p to 1.0")
            latents, stats = run_masked(self, model, rows, seed, self.masked.validate(ar.cfg.num_tokens), preview_vq,
                                        drafter)
            stats.settings = {**stats.settings, **settings}
            return latents, stats
        return self.run_tokens(model, conditioning, rows, seed, preview_vq, vq, drafter, settings)

    def run_tokens(self, model, conditioning, rows, seed, preview_vq, vq, drafter, settings):
        ar, sampling, spec = model.module, self.sampling.validate(), self.spec
        shown = preview_vq.module if preview_vq is not None and glue.previews_enabled() else None
        if shown is not None and (shown.input_kind != "codes" or shown.cfg.codebook_size != ar.vocab_size):
            shown = None  # FastAR Decode Image reports the mismatch
        named = [(model.name, model.patcher), *([(drafter.name, drafter.patcher)] if drafter is not None else []),
                 *([(preview_vq.name, preview_vq.patcher)] if shown is not None else [])]
        preview_bytes = decode_bytes_per_image(shown, ar.grid) if shown is not None else 0

        def working(images: int) -> int:
            return working_memory(ar, conditioning.rows, images, sampling.use_cfg, spec, drafter) + preview_bytes

        glue.load_checked(named, working, rows.batch, ar.dtype)

        total = ar.grid[0] * ar.grid[1]
        preview = (lambda tokens, done: glue.partial_image(shown, tokens, done, ar.grid)) if shown is not None else None
        progress = glue.DecodeProgress(self.node_id, total, spec.decoder.upper(), preview)
        codebook = vq.module.codebook() if vq is not None else None
        if vq is not None and codebook is None:
            raise FastARError(f"{vq.name} is {vq.module.what}, which has no codebook: connect the VQ decoder of "
                              f"{model.name}")
        with glue.decoding():
            codes, stats = decode(ar, rows, sampling, spec, seed=seed, on_iteration=progress,
                                  drafter=drafter.drafter if drafter is not None else None, codebook=codebook)
        stats.settings = {**stats.settings, **settings, "top_k": sampling.top_k, "top_p": sampling.top_p}
        return Tokens(codes.cpu(), tuple(ar.grid), ar.vocab_size), stats


def run_next_scale(node_id: str, model: ModelHandle, rows, seed: int, sampling: SamplingSettings,
                   vqvae: ModelHandle | None, settings: dict, acceleration: ScaleAcceleration | None = None):
    """A VAR generation under ComfyUI: each scale's codes go through the VQVAE into the next scale's input,
    so the VQVAE is needed here and not only to decode. Returns f_hat (``Latents``) and the stats."""
    ar = model.module
    own_check = getattr(ar, "check_image_decoder", None)  # Infinity's: its BSQ VAE, in the model's words
    if vqvae is None and own_check is not None:
        raise FastARError(f"{model.name} is {ar.what}: it samples through its BSQ VAE. Connect FastAR Load Image "
                          "Decoder with the VAE (infinity_vae_d32reg.pth for Infinity-2B, "
                          "infinity_vae_d56_f8_14_patchify.pth for the 8B) to this sampler's preview_vq input")
    if own_check is not None:
        own_check(vqvae.module)
    elif vqvae is None or vqvae.module.input_kind != "multi-scale":
        raise FastARError(f"{model.name} is a VAR model: it samples through its multi-scale VQVAE. Connect FastAR Load "
                          "Image Decoder with the VQVAE (vae_ch160v4096z32.pth for the release) to this sampler's "
                          "image decoder input")
    sampling = sampling.validate()
    dims = ar.cfg.dim * (ar.cfg.depth * 2 + 16)  # the KV cache of every block, plus one scale's activations
    guided = sampling.cfg_scale != 0.0
    glue.load_checked([(model.name, model.patcher), (vqvae.name, vqvae.patcher)],
                      lambda images: cache_rows(images, guided) * ar.cfg.seq_len * dims * 4, rows.batch, ar.dtype)
    view = (lambda f_hat, done: glue.partial_latents_image(vqvae.module, f_hat[:1])) if glue.previews_enabled() else None
    progress = glue.DecodeProgress(node_id, ar.cfg.seq_len, "VAR", view)
    with glue.decoding():
        f_hat, stats = decode_next_scale(ar, rows, sampling, seed=seed, vqvae=vqvae.module, on_iteration=progress,
                                         acceleration=acceleration)
    stats.settings = {**stats.settings, **settings, "top_k": sampling.top_k, "top_p": sampling.top_p}
    return Latents(f_hat.float().cpu(), source="infinity" if own_check is not None else "var"), stats


MASKED_WIDGETS = ("num_iter", "diffusion_steps", "cfg_schedule")


def masked_widgets(widgets: dict) -> dict:
    return {k: widgets[k] for k in MASKED_WIDGETS if k in widgets}


def run_masked(job: Job, model: ModelHandle, rows, seed: int, settings: MaskedSettings, preview: ModelHandle | None,
               drafter: DrafterHandle | None):
    """A MAR generation under ComfyUI: memory, progress with a live preview, Cancel; returns the image
    decoder's input (``Latents``) and the stats."""
    ar, cspd = model.module, job.cspd
    batch = rows.batch
    shown = preview.module if preview is not None and glue.previews_enabled() else None
    if shown is not None and (shown.input_kind != "latents" or shown.cfg.embed_dim != ar.cfg.token_dim):
        shown = None  # FastAR Decode Image reports the mismatch
    named = [(model.name, model.patcher), *([(drafter.name, drafter.patcher)] if drafter is not None else []),
             *([(preview.name, preview.patcher)] if shown is not None else [])]
    contexts = cspd.gamma if cspd is not None and cspd.verify == "steps" else 1
    glue.load_checked(named, lambda images: masked_working_memory(ar, images, settings.cfg_scale != 1.0, contexts,
                                                                  settings.reuse is not None), batch, ar.dtype)
    view = (lambda tokens, done: glue.partial_latents_image(shown, ar.decoder_input(tokens[:1]))) if shown else None
    decoder = cspd.decoder if cspd is not None else job.decoder
    progress = glue.DecodeProgress(job.node_id, ar.cfg.num_tokens, decoder.upper(), view)
    with glue.decoding():
        tokens, stats = decode_masked(ar, rows, settings, decoder, seed=seed, cspd=cspd or CSPD,
                                      drafter=drafter.drafter if drafter is not None else None, on_iteration=progress)
    return Latents(ar.decoder_input(tokens).float().cpu()), stats


def masked_working_memory(ar, batch: int, use_cfg: bool, contexts: int, reuse: bool = False) -> int:
    """Bytes a MAR step needs beyond the weights (MAR keeps no cache, but feature reuse does): the encoder and
    decoder activations and attention scores for every row and scored context, the diffusion head's batch of
    tokens (fp32), and with ``reuse`` the conditional rows' keys and values of every block, the decoder's input and
    the guidance gap."""
    cfg = ar.cfg
    rows = cache_rows(batch, use_cfg) * contexts
    slots = cfg.buffer + cfg.num_tokens
    width = max(cfg.dim, cfg.decoder_dim)
    element = element_bytes(ar.dtype)
    activations = rows * slots * width * (4 + 2 * cfg.mlp_ratio) * element * 2
    scores = rows * max(cfg.encoder_heads, cfg.decoder_heads) * slots * slots * 4
    head = rows * cfg.num_tokens * cfg.head_width * 8 * 4
    kept = 2 * (cfg.encoder_depth * cfg.dim + cfg.decoder_depth * cfg.decoder_dim) + 2 * cfg.decoder_dim
    cache = batch * slots * kept * element if reuse else 0
    return int(activations + scores + head + cache)


def check_fits(ar, rows) -> None:
    """The conditioning was made for this model: classes in range, caption features of its width."""
    if isinstance(rows, ClassConditioning):
        class_conditioning(ar, rows.labels.tolist())  # FastARError naming the model's classes
    elif isinstance(rows, CaptionConditioning):
        tokens, width = rows.embeddings.shape[-2:]
        if getattr(ar, "caption_padding", "left") == "right":  # Infinity: each prompt's own tokens, real ones first
            if width != ar.cfg.text_channels:
                raise FastARError(f"the text encoder gives {width}-wide caption features but {ar.what} reads "
                                  f"{ar.cfg.text_channels}-wide ones: use the FLAN-T5 the model was trained with "
                                  "(google/flan-t5-xl)")
            return
        if width != ar.cfg.caption_dim or tokens != ar.cfg.cls_token_num:
            raise FastARError(f"the text encoder gives {tokens} x {width} caption features but this model expects "
                              f"{ar.cfg.cls_token_num} x {ar.cfg.caption_dim}: use the FLAN-T5 the model was "
                              "trained with (google/flan-t5-xl for LlamaGen)")


def repeat_rows(rows, batch: int):
    if isinstance(rows, ClassConditioning):
        return ClassConditioning(rows.labels.repeat(batch))
    if isinstance(rows, CaptionConditioning):
        return CaptionConditioning(rows.embeddings.repeat(batch, 1, 1), rows.mask.repeat(batch, 1))
    if isinstance(rows, PromptConditioning):  # the negative prompts (one for all rows, or one per row) go along
        negatives = rows.negative_prompts
        if negatives is not None and len(negatives) == rows.batch:
            negatives = list(negatives) * batch
        return replace(rows, prompts=rows.prompts * batch, negative_prompts=negatives)
    raise FastARError("unknown conditioning: connect FastAR Class Label or FastAR Text Conditioning")


def drafter_cache_bytes(handle: DrafterHandle, ar, rows, batch: int, use_cfg: bool, window: int) -> int:
    """The drafter's own KV cache: a smaller AR model keeps one like the target's; an EAGLE head keeps one
    layer over at most the target's slots."""
    weights = handle.weights
    if not isinstance(weights, EagleHead):
        return kv_cache_bytes(weights, rows, batch, use_cfg, window)
    return kv_bytes(len(weights.layers), weights.cfg.num_key_value_heads, weights.cfg.head_dim,
                    cache_rows(batch, use_cfg), ar.cache_slots(rows, window), weights.fc.weight.dtype)


def working_memory(ar, rows, batch: int, use_cfg: bool, spec: DecoderSpec, drafter: DrafterHandle | None = None) -> int:
    """Bytes a decode of conditioning ``rows`` (one image's) needs beyond the weights, asked of ComfyUI before
    loading (memory.token_working_bytes, with the drafter's cache)."""
    drafted = drafter is not None
    cache = drafter_cache_bytes(drafter, ar, rows, batch, use_cfg, decode_window(spec, drafted, ar.grid)) if drafted else 0
    return token_working_bytes(ar, rows, batch, use_cfg, spec, drafted=drafted, drafter_cache=cache)


class SamplerAR(SamplerBase):
    DECODER = "ar"
    NODE_ID = "FastARSamplerAR"
    DISPLAY = "FastAR Sampler (AR baseline)"
    DESCRIPTION = ("Plain sampling, the exact baseline the accelerated samplers are measured against: one model "
                   "forward per token for token models (LlamaGen), MAR's own masked sampler (num_iter steps) for MAR "
                   "models, VAR's scale-by-scale sampler (one forward per scale, through the VQVAE connected as "
                   "preview_vq) for VAR models.")

    @classmethod
    def decoder_inputs(cls) -> list:
        return [*masked_inputs(optional=True), *scale_acceleration_inputs()]  # optional: older prompts stay valid

    @classmethod
    def acceleration(cls, fastvar_ratios: str = "", skip_scales: int = 0, uncond_scales: int = 0,
                     **widgets) -> ScaleAcceleration | None:
        acceleration = ScaleAcceleration(prune_ratios=ratios_of(fastvar_ratios or ""), skip_last=skip_scales,
                                         uncond_last=uncond_scales).validate()
        return acceleration if acceleration.active else None


def scale_acceleration_inputs() -> list:
    """The next-scale models' training-free accelerators on the AR sampler (all off by default: the exact
    baseline)."""
    return [
        io.String.Input("fastvar_ratios", default="", optional=True,
                        tooltip="VAR and Infinity, FastVAR: shares of tokens pruned at the last scales that run, e.g. "
                                "0.4,0.5 (its release's). At those scales each block's attention and FFN run on the "
                                "tokens farthest from their scale's mean; the rest take the outputs of the scale "
                                "before them. Empty: off. Relaxed: faster, not the exact baseline."),
        io.Int.Input("skip_scales", default=0, min=0, max=16, optional=True,
                     tooltip="VAR and Infinity: skip the last N scales (they neither run nor add detail). FastVAR's release "
                             "skips 2 with 0.4,0.5; SkipVAR skips 1 to 3. 0: every scale."),
        io.Int.Input("uncond_scales", default=0, min=0, max=16, optional=True,
                     tooltip="VAR and Infinity, SkipVAR: the last N scales that run drop the guidance branch (half the "
                             "work there) and sample from the conditional logits unguided. 0: off."),
    ]


class SamplerSJD(SamplerBase):
    DECODER = "sjd"
    NODE_ID = "FastARSamplerSJD"
    DISPLAY = "FastAR Sampler (SJD, lossless)"
    DESCRIPTION = ("Speculative Jacobi Decoding: verifies a window of draft tokens per forward and keeps the "
                   "accepted ones, so several tokens are fixed per forward. With pac_branches above 1, SJD-PAC: the "
                   "window's first depths branch into several candidates each. " + LOSSLESS_NOTE)

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            *jacobi_inputs(),
            io.Int.Input("pac_branches", default=1, min=1, max=8, optional=True,
                         tooltip="SJD-PAC: candidates per draft at the window's first pac_depth - 1 depths (1 = plain "
                                 "SJD). They take part of the window, and where the first candidate is rejected a "
                                 "sibling may be kept; lossless. Pair it with maximal coupling, SJD-PAC's adaptive "
                                 "continuation."),
            io.Int.Input("pac_depth", default=SPEC.pac_depth, min=2, max=5, optional=True,
                         tooltip="SJD-PAC: levels of the window's branched front, its root included (3: two "
                                 "branched depths)."),
        ]

    @classmethod
    def spec(cls, window=SPEC.window, init=SPEC.init, coupling=SPEC.coupling, pac_branches=1, pac_depth=SPEC.pac_depth,
             **more) -> DecoderSpec:
        proactive = {"decoder": "sjd-pac", "pac_branches": pac_branches, "pac_depth": pac_depth}
        return DecoderSpec(**{"decoder": cls.DECODER, **(proactive if pac_branches > 1 else {})}, window=window,
                           init=init, coupling=coupling, **more)


class SamplerSJDEntropy(SamplerBase):
    DECODER = "sjd-entropy"
    NODE_ID = "FastARSamplerSJDEntropy"
    DISPLAY = "FastAR Sampler (SJD entropy-aware, relaxed)"
    DESCRIPTION = ("SJD with entropy-aware acceptance (Ma et al. 2025): where the model is confident, a draft is "
                   "accepted more easily, so a few more tokens are fixed per forward than with SJD. " + RELAXED_NOTE)

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            *jacobi_inputs(),
            slider("strength", SPEC.entropy_strength, 0.0, 1.0, 0.05,
                   "The speed/quality slider: 0 = exactly SJD (lossless), 1 = the paper's rule (a draft under a "
                   "confident model is accepted with up to 20 times its SJD odds)."),
        ]

    @classmethod
    def spec(cls, window=SPEC.window, init=SPEC.init, coupling=SPEC.coupling,
             strength=SPEC.entropy_strength) -> DecoderSpec:
        return DecoderSpec(decoder=cls.DECODER, window=window, init=init, coupling=coupling, entropy_strength=strength)


class SamplerGSD(SamplerSJD):
    DECODER = "gsd"
    NODE_ID = "FastARSamplerGSD"
    DISPLAY = "FastAR Sampler (GSD, relaxed)"
    DESCRIPTION = ("Grouped Speculative Decoding: SJD that also accepts a draft when a group of similar, similarly "
                   "likely codes covers it. Faster than SJD. With a drafter, it verifies the drafter's chains "
                   "instead of Jacobi windows. " + RELAXED_NOTE)

    @classmethod
    def socket_inputs(cls) -> list:
        return [preview_vq_input(),
                drafter_input(True, "Optional: a drafter whose chains GSD verifies instead of Jacobi windows "
                                    "(window, init and coupling are then unused).")]

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            *jacobi_inputs(),
            io.Int.Input("group", default=SPEC.group, min=1, max=1000,
                         tooltip="Group size G, the speed/quality slider: how many similar codes may stand in for a "
                                 "draft. 1 = exactly SJD (lossless); larger is faster and less faithful."),
            slider("prob_threshold", SPEC.prob_threshold, 0.0, 1.0, 0.01,
                   "Drop group members whose probability differs from the draft's by more than this (see "
                   "prob_filter for how the difference is measured)."),
            slider("distance_threshold", SPEC.distance_threshold, 0.0, 1.0, 0.01,
                   "Drop group members that are not among the draft's nearest codes: 0.5 keeps the nearer half "
                   "of the codebook (by code-embedding distance), 1.0 keeps all."),
            gamma_input(optional=True),  # optional: prompts saved before it existed stay valid
            io.Combo.Input("prob_filter", options=list(PROB_FILTERS), default=SPEC.prob_filter, optional=True,
                           tooltip="How prob_threshold measures a member's probability gap: relative to the larger "
                                   "of the two probabilities (means the same on confident and flat models), or "
                                   "absolute (the GSD paper's rule, tuned on flat distributions)."),
        ]

    @classmethod
    def spec(cls, group=SPEC.group, prob_threshold=SPEC.prob_threshold,
             distance_threshold=SPEC.distance_threshold, prob_filter=SPEC.prob_filter, **jacobi) -> DecoderSpec:
        return super().spec(group=group, prob_threshold=prob_threshold, distance_threshold=distance_threshold,
                            prob_filter=prob_filter, **jacobi)


class SamplerSpeculative(SamplerBase):
    DECODER = "spec"
    NODE_ID = "FastARSamplerSpeculative"
    DISPLAY = "FastAR Sampler (Speculative, lossless)"
    DESCRIPTION = ("Speculative decoding with a drafter: the drafter proposes a chain of gamma tokens, the model "
                   "verifies them in one forward and keeps the accepted run plus one token of its own. "
                   + LOSSLESS_NOTE)

    @classmethod
    def socket_inputs(cls) -> list:
        return [drafter_input(False, "The drafter that proposes the tokens (a LANTERN/EAGLE drafter or a smaller "
                                     "model of the same family); the better it guesses, the faster."),
                preview_vq_input()]

    @classmethod
    def decoder_inputs(cls) -> list:
        return [gamma_input(), drafts_input(), tree_input()]  # optional and last: saved prompts stay valid

    @classmethod
    def spec(cls, gamma=SPEC.gamma, drafts=SPEC.drafts, tree="chain") -> DecoderSpec:
        return DecoderSpec(decoder=cls.DECODER, gamma=gamma, drafts=drafts, **tree_fields(tree))


class SamplerLantern(SamplerBase):
    DECODER = "lantern"
    NODE_ID = "FastARSamplerLANTERN"
    DISPLAY = "FastAR Sampler (LANTERN, relaxed)"
    DESCRIPTION = ("LANTERN relaxed speculative decoding: accepts a draft when the model's probability of it plus "
                   "that of its nearest codes in the VQ latent space covers the draft, within a total-variation "
                   "budget delta per token. Drafts come from the drafter, or without one from Jacobi windows. "
                   + LANTERN_NOTE)

    @classmethod
    def socket_inputs(cls) -> list:
        return [FastARVQ.Input("vq", tooltip="The VQ decoder of this model: LANTERN looks up each draft's nearest "
                                             "codes in its codebook. Also drives the live preview."),
                drafter_input(True, "Optional: the drafter that proposes the tokens (a LANTERN/EAGLE drafter or a "
                                    "smaller model of the same family). Without one, the bundled demo model drafts "
                                    "with its bundled drafter, and any other model verifies Jacobi windows (window, "
                                    "init, coupling) drafted by the model itself; that is much faster but costs a "
                                    "lot of quality (measured on the demo model), because Jacobi drafts are spread "
                                    "thin and get accepted on their neighbours' mass: connect a drafter.")]

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            io.Int.Input("lantern_k", default=SPEC.lantern_k, min=1, max=16384, display_mode=io.NumberDisplay.slider,
                         tooltip="k: how many nearest codes (in the VQ latent space) may lend their probability to a "
                                 "draft (capped at the codebook size). Larger is faster and less faithful."),
            slider("lantern_delta", SPEC.lantern_delta, 0.0, 1.0, 0.01,
                   "delta: the most probability (total variation) each token's distribution may be shifted by "
                   "accepting close codes. 0 = exact speculative decoding (lossless); larger is faster and less "
                   "faithful. 0.1 is LANTERN's default."),
            gamma_input(),
            *jacobi_inputs(),
            drafts_input(),
            tree_input(),
            slider("lambda", SPEC.lantern_lambda, 0.0, 10.0, 0.1,
                   "LANTERN++'s bound, in place of delta when above 0: a draft's probability plus its neighbours' "
                   "stays within lambda times its own. 1 = exact; LANTERN++ uses 2-3 with the lantern++57 tree (3 "
                   "kept plain AR's quality on the demo). 0 = off (delta applies).", optional=True),
        ]

    @classmethod
    def spec(cls, lantern_k=SPEC.lantern_k, lantern_delta=SPEC.lantern_delta, gamma=SPEC.gamma,
             window=SPEC.window, init=SPEC.init, coupling=SPEC.coupling, drafts=SPEC.drafts, tree="chain",
             **more) -> DecoderSpec:
        return DecoderSpec(decoder=cls.DECODER, lantern_k=lantern_k, lantern_delta=lantern_delta, gamma=gamma,
                           window=window, init=init, coupling=coupling, drafts=drafts,
                           lantern_lambda=more.get("lambda", SPEC.lantern_lambda), **tree_fields(tree))


class SamplerZipAR(SamplerBase):
    DECODER = "zipar"
    NODE_ID = "FastARSamplerZipAR"
    DISPLAY = "FastAR Sampler (ZipAR, relaxed)"
    DESCRIPTION = ("ZipAR: after the first two rows, a row starts once the row above has `lead` tokens, so each "
                   "forward extends several rows side by side (2 x width + (rows - 2) x lead forwards instead of rows "
                   "x width). Each token sees the rows above (but the first) only up to `lead` columns ahead of it, "
                   "not their unfinished ends. Relaxed: trades "
                   "fidelity for speed; a given seed gives a different image than AR. row_window 2 or more adds "
                   "Jacobi drafts in every row, verified exactly within what ZipAR shows each token (the same "
                   "distribution of images as row_window 1, in fewer forwards).")

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            io.Int.Input("lead", default=SPEC.zipar_lead, min=1, max=256, display_mode=io.NumberDisplay.slider,
                         tooltip="The speed/quality slider: tokens of the row above fixed before a row starts. "
                                 "Smaller is faster and each token sees less of the row above; the image's width in "
                                 "tokens (or more) is plain AR."),
            io.Int.Input("row_window", default=1, min=1, max=64,
                         tooltip="1: one token per row and forward (ZipAR). 2 or more: the last fixed token plus "
                                 "row_window-1 Jacobi drafts per row, kept when the model agrees (exact within "
                                 "ZipAR's view; helps where rows run ahead of the lead)."),
            io.Combo.Input("attention", options=list(ZIPAR_ATTENTIONS), default=SPEC.zipar_attention, optional=True,
                           tooltip="masked: a token attends only to what ZipAR has fixed before it. reference: as "
                                   "ZipAR's released code, every earlier slot, the unfinished ones as zeros (its "
                                   "images exactly; row_window 1 only)."),
        ]

    @classmethod
    def spec(cls, lead=SPEC.zipar_lead, row_window=1, attention=SPEC.zipar_attention) -> DecoderSpec:
        drafted = row_window > 1
        return DecoderSpec(decoder="zipar-sjd" if drafted else "zipar", zipar_lead=lead, zipar_attention=attention,
                           window=row_window if drafted else SPEC.window)


class SamplerCSpD(SamplerBase):
    DECODER = "cspd"
    NODE_ID = "FastARSamplerCSpD"
    DISPLAY = "FastAR Sampler (CSpD, MAR)"
    DESCRIPTION = ("Continuous speculative decoding for MAR models: a smaller MAR (the drafter) drafts gamma steps, "
                   "the model checks every drafted token with the ratio of the two diffusion heads' densities and "
                   "redraws the rejected ones from the exact residual. " + CSPD_NOTE + " ratio_temperature above 1 "
                   "or path_factor make it relaxed (the reference code's rule): it then trades fidelity for speed.")

    @classmethod
    def socket_inputs(cls) -> list:
        return [drafter_input(False, "The draft MAR: a smaller MAR trained on the same autoencoder's latents "
                                     "(MAR-B for MAR-L/H)."),
                preview_vq_input()]

    @classmethod
    def sampling_inputs(cls) -> list:
        return [
            slider("cfg", 3.0, 1.0, 20.0, 0.1,
                   "Classifier-free guidance scale: higher follows the class more closely, 1.0 turns guidance off "
                   "(and halves the work). MAR-H's paper setting is 3.2 with the linear schedule."),
            slider("temperature", MASKED.temperature, 0.01, 2.0, 0.01,
                   "Scales the noise of each diffusion step: 1.0 is the model's distribution, lower is more "
                   "conservative."),
        ]

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            io.Int.Input("gamma", default=CSPD.gamma, min=1, max=64,
                         tooltip="Draft steps per model call: the drafter runs gamma MAR steps, the model checks "
                                 "them at once. Larger pays off when the drafter agrees with the model often."),
            slider("prefill", CSPD.prefill, 0.0, 0.95, 0.01,
                   "Share of the steps the model does alone before drafting starts (the first steps shape the image "
                   "and drafts are rejected most there). 0.05 is the paper's."),
            io.Combo.Input("verify", options=list(VERIFY_MODES), default=CSPD.verify,
                           tooltip="steps: the model checks each drafted step given the steps before it and keeps "
                                   "up to the first rejection: exactly plain MAR (lossless). merged: the paper's "
                                   "scheme, every drafted token checked from the last verified context: fewer model "
                                   "calls, exactly a MAR run with each draft round merged into one step (fewer, "
                                   "larger steps than num_iter)."),
            *masked_inputs(optional=False),
            io.Float.Input("ratio_temperature", default=1.0, min=1.0, max=100.0, step=0.5, optional=True,
                           display_mode=io.NumberDisplay.slider,
                           tooltip="1: the exact rule (lossless). Above 1: relaxed, the reference code's rule (it "
                                   "uses 42): the density ratio's exponents are divided by its square, so nearly "
                                   "every draft is kept; faster, less faithful (measured in the README)."),
            io.Boolean.Input("path_factor", default=False, optional=True,
                             tooltip="Relaxed: also multiply the ratio by the reference code's product of the "
                                     "intermediate diffusion steps' std ratios (model over drafter). Off: exact."),
        ]

    @classmethod
    def cspd_settings(cls, gamma=CSPD.gamma, prefill=CSPD.prefill, verify=CSPD.verify, ratio_temperature=1.0,
                      path_factor=False, **masked) -> CSpDSettings:
        return CSpDSettings(gamma=gamma, prefill=prefill, verify=verify, ratio_temperature=ratio_temperature,
                            path_factor=path_factor).validate()


class SamplerLazyMAR(SamplerBase):
    NODE_ID = "FastARSamplerLazyMAR"
    DISPLAY = "FastAR Sampler (LazyMAR, relaxed)"
    DESCRIPTION = ("MAR's own sampler with LazyMAR-style feature reuse: between full steps, a step computes the "
                   "class-guided branch only (the unguided one is taken as the guided one plus the gap measured at "
                   "the last full step), encodes only the tokens fixed since the step before, and recomputes the "
                   "later decoder blocks only for the tokens whose features moved most; inside the diffusion head, "
                   "most reverse steps reuse the last full call's MLP outputs and guidance gap. Relaxed: trades fidelity "
                   "for speed (stale features, not exactly plain MAR); the Stats node shows the share of the "
                   "transformer's work done. MAR models only.")
    MAR_ONLY = True

    @classmethod
    def sampling_inputs(cls) -> list:
        return SamplerCSpD.sampling_inputs()

    @classmethod
    def decoder_inputs(cls) -> list:
        return [
            *masked_inputs(optional=False),
            slider("start_percent", REUSE.start_percent, 0.0, 0.99, 0.01,
                   "The share of the steps computed in full before reuse starts (the first steps shape the image)."),
            slider("end_percent", REUSE.end_percent, 0.01, 1.0, 0.01,
                   "Reuse stops after this share of the steps; the rest are computed in full (1.0: reuse to the "
                   "end)."),
            io.Int.Input("refresh_every", default=REUSE.refresh_every, min=2, max=64,
                         tooltip="One full step, refilling the cache, every this many steps. Smaller is closer to "
                                 "plain MAR and slower."),
            slider("token_reuse", REUSE.token_reuse, 0.0, 0.99, 0.01,
                   "The share of the other tokens whose later decoder features a reusing step takes from the cache "
                   "(the step's own tokens are always recomputed). Higher is faster and less faithful."),
            io.Int.Input("head_refresh_every", default=REUSE.head_refresh_every, min=0, max=1000,
                         tooltip="Inside the diffusion head: one full call every this many reverse steps; the others "
                                 "compute the guided branch only and reuse the full call's MLP outputs. 0: off (the "
                                 "head exact); LazyMAR uses 7. On small models the head is most of the time."),
        ]

    @classmethod
    def reuse(cls, start_percent=REUSE.start_percent, end_percent=REUSE.end_percent,
              refresh_every=REUSE.refresh_every, token_reuse=REUSE.token_reuse,
              head_refresh_every=REUSE.head_refresh_every, **masked) -> FeatureReuse:
        return FeatureReuse(start_percent=start_percent, end_percent=end_percent, refresh_every=refresh_every,
                            token_reuse=token_reuse, head_refresh_every=head_refresh_every).validate()


class SamplerDial(io.ComfyNode):
    """The speed dial: one node for every model, whose decoder and settings the dial picks (speed_dial.py)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARSampler",
            display_name="FastAR Sampler",
            category="FastAR/sampling",
            description="One sampler for every FastAR model: set how fast, and it picks the decoder and its "
                        "settings that measured best for the model's family, the connected drafter (a bundled "
                        "model's own when none is) and this device. lossless: exactly the model's distribution; "
                        "balanced: the fastest within 5 class-accuracy points of plain sampling's quality; fast: "
                        "within 10. Guidance and temperature are the model's own (a bundled model's best measured). "
                        "The Stats node says what was picked and why; the per-decoder samplers are there to tune.",
            inputs=[
                FastARModel.Input("model", tooltip="The model (FastAR Load AR Model): token, MAR, VAR or a DD "
                                                   "student."),
                FastARConditioning.Input("conditioning", tooltip="FastAR Class Label or FastAR Text Conditioning."),
                FastARVQ.Input("vq", optional=True,
                               tooltip="The model's image decoder: needed for VAR (it samples through its VQVAE) and "
                                       "DD students, lets the dial pick LANTERN (its neighbours live in the "
                                       "codebook), and drives the live preview."),
                FastARDrafter.Input("drafter", optional=True,
                                    tooltip="Optional: a drafter for the model (FastAR Load Drafter); the dial drafts "
                                            "with it where that measured faster. Without one, a bundled model's own."),
                io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="All randomness comes from this seed: same seed, speed, model and device give "
                                     "the same image (another speed picks another decoder: another image)."),
                io.Combo.Input("speed", options=list(SPEEDS), default="balanced",
                               tooltip="lossless: exactly the model's own distribution, as fast as that goes here "
                                       "(plain sampling where a window costs more than it saves, as on a CPU). "
                                       "balanced: the fastest measured within 5 points of plain sampling's class "
                                       "accuracy. fast: within 10 points, for previews and exploring seeds."),
                io.Int.Input("batch", default=1, min=1, max=64,
                             tooltip="Images per run, all with the same conditioning (each row is its own sample)."),
            ],
            outputs=[
                FastARTokens.Output("tokens", display_name="tokens",
                                    tooltip="The model's output: connect to FastAR Decode Image."),
                FastARStats.Output("stats", display_name="stats",
                                   tooltip="Decode statistics, with what the dial picked and why: connect to FastAR "
                                           "Stats."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: ModelHandle, conditioning: Conditioning, seed, speed, batch, vq: ModelHandle | None = None,
                drafter: DrafterHandle | None = None) -> io.NodeOutput:
        check_choice("speed", speed, SPEEDS)
        ar = model.module
        drafter = drafter or bundled_drafter(model)
        choice = choose(ar, speed, drafter.drafter if drafter is not None else None,
                        codebook=vq is not None and vq.module.codebook() is not None)
        drafter = drafter if choice.candidate.drafter else None
        if ar.kind == FEW_STEP:
            output, stats = run_distilled(cls.hidden.unique_id, model, conditioning, vq, seed, batch, choice.dd_steps)
        else:
            own = NO_FLAGS  # the model's own sampling settings: a bundled model's best measured, else its release's
            sampling = sampling_from(own, ar, VAR_SAMPLING if ar.kind == NEXT_SCALE else SAMPLING)
            masked = choice.masked(masked_settings_from(own, ar)) if ar.kind == MASKED_AR else MASKED
            job = Job(cls.hidden.unique_id, choice.decoder, sampling, spec=choice.spec(), masked=masked)
            output, stats = job.run(model, conditioning, seed, batch, vq, vq, drafter)
        stats.settings["dial"] = choice.summary()
        return io.NodeOutput(output, stats)


class SamplerDD(io.ComfyNode):
    """Distilled Decoding: a student maps seeded noise to the whole image in one or two forwards. Its own
    node: no guidance, temperature or top-k (the teacher's are baked into the student)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARSamplerDD",
            display_name="FastAR Sampler (DD, 1-2 steps)",
            category="FastAR/sampling",
            description="Distilled Decoding: a student distilled from an AR model (LlamaGen-DD, or one made with "
                        "python -m fastar distill-dd) turns a noise image into the whole image in 1 or 2 forwards "
                        "instead of one per token. Relaxed: a fast approximation of its teacher's samples; the same "
                        "seed gives the same image. " + DD_NOTE,
            inputs=[
                FastARModel.Input("model", tooltip="A Distilled Decoding student (FastAR Load AR Model)."),
                FastARConditioning.Input("conditioning", tooltip="FastAR Class Label."),
                FastARVQ.Input("vq", tooltip="The VQ decoder of the student's teacher: its codebook turns the "
                                             "student's logits into code vectors."),
                io.Int.Input("seed", default=0, min=0, max=SEED_MAX, control_after_generate=True,
                             tooltip="The noise comes from this seed: same seed and class give the same image."),
                io.Int.Input("batch", default=1, min=1, max=64, tooltip="Images per run (each its own noise)."),
                io.Int.Input("steps", default=DD.steps, min=1, max=2,
                             tooltip="1: one forward from pure noise. 2: a second forward that keeps the first t2 "
                                     "tokens of the first and re-reads the same noise after them (better images)."),
                io.Int.Input("t2", default=0, min=0, max=65536,
                             tooltip="Tokens the second step keeps (0 = the student's own, 80 for the released "
                                     "ones). Only used with 2 steps."),
                io.Int.Input("split", default=-1, min=-1, max=65536,
                             tooltip="Tokens before it take the logits' most likely code, later ones the "
                                     "continuous output (-1 = the student's own: released B 80, L 130)."),
                # optional: the hybrid (the DD paper's Alg. 4), and prompts saved before it existed stay valid
                FastARModel.Input("teacher", optional=True,
                                  tooltip="Optional: the student's teacher (its AR model). Between the two steps it "
                                          "resamples tokens regenerate..t2-1 itself: t2 - regenerate teacher "
                                          "forwards buy quality back."),
                io.Int.Input("regenerate", default=-1, min=-1, max=65536, optional=True,
                             tooltip="With a teacher: the first token it resamples; it keeps the earlier ones of "
                                     "DD's first step (-1 = t2 / 2; smaller is slower and closer to the teacher)."),
                slider("teacher_cfg", SAMPLING.cfg_scale, 1.0, 20.0, 0.1,
                       "With a teacher: its classifier-free guidance (the demo student's pairs used 2.0).",
                       optional=True),
                io.Int.Input("teacher_top_k", default=SAMPLING.top_k, min=0, max=1_000_000, optional=True,
                             tooltip="With a teacher: sample only among its k most likely codes (0 = off)."),
            ],
            outputs=[
                FastARTokens.Output("tokens", display_name="tokens",
                                    tooltip="The student's code vectors: connect to FastAR Decode Image with the "
                                            "same VQ decoder."),
                FastARStats.Output("stats", display_name="stats", tooltip="Decode statistics: connect to FastAR Stats."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model: ModelHandle, conditioning: Conditioning, vq: ModelHandle, seed, batch, steps, t2,
                split, teacher: ModelHandle | None = None, regenerate=-1, teacher_cfg=SAMPLING.cfg_scale,
                teacher_top_k=SAMPLING.top_k) -> io.NodeOutput:
        return io.NodeOutput(*run_distilled(cls.hidden.unique_id, model, conditioning, vq, seed, batch, steps, t2,
                                            split, teacher, regenerate, teacher_cfg, teacher_top_k))


def run_distilled(node_id: str, model: ModelHandle, conditioning: Conditioning, vq: ModelHandle | None, seed: int,
                  batch: int, steps: int, t2: int = 0, split: int = -1, teacher: ModelHandle | None = None,
                  regenerate: int = -1, teacher_cfg: float = SAMPLING.cfg_scale, teacher_top_k: int = SAMPLING.top_k):
    """A Distilled Decoding student under ComfyUI (the DD sampler's widgets): its latents and stats."""
    if vq is None:
        raise FastARError(f"{model.name} is a Distilled Decoding student: connect the VQ decoder of its teacher (FastAR "
                          "Load Image Decoder) to the sampler's vq input")
    student = model.module
    check_decoder("dd", student, None)
    if conditioning.model_type != "c2i":
        raise FastARError("Distilled Decoding students are class-to-image: connect FastAR Class Label")
    check_fits(student, conditioning.rows)
    if getattr(student, "decoder_kind", "codes") == "multi-scale":
        check_image_decoder(student, vq.module)  # a VAR-DD student needs its teacher's VQVAE
    rows = repeat_rows(conditioning.rows, batch)
    settings = DDSettings(steps=steps, t2=t2 or None, split=None if split < 0 else split)
    named, working = [(model.name, model.patcher), (vq.name, vq.patcher)], lambda images: 0
    sampling = SamplingSettings(teacher_cfg, SAMPLING.temperature, teacher_top_k).validate()
    if teacher is not None:
        if steps != 2:
            raise FastARError("the teacher regenerates tokens between DD's two steps: set steps to 2, or "
                              "disconnect the teacher")
        check_hybrid_teacher(student, teacher.module)  # before its memory is estimated from its layout
        settings = settings.hybrid(student, None if regenerate < 0 else regenerate)
        named.append((teacher.name, teacher.patcher))
        working = lambda images: working_memory(teacher.module, conditioning.rows, images,  # noqa: E731
                                                sampling.use_cfg, DecoderSpec("ar"))
    cfg, n = student.cfg, student.num_tokens
    glue.load_checked(named, lambda images: images * (n + 1) * (cfg.dim * 12 + cfg.vocab_size) * 4
                      + working(images), rows.batch, student.dtype)
    progress = glue.DecodeProgress(node_id, n, "DD")
    with glue.decoding():
        latents, stats = decode_distilled(student, rows, settings, seed=seed, codebook=vq.module.codebook(),
                                          on_iteration=lambda step, total, x: progress(n * step // total, n, x),
                                          teacher=None if teacher is None else teacher.module, sampling=sampling)
    stats.settings = {**stats.settings, "seed": seed, "conditioning": conditioning.label, "model": model.name}
    if teacher is not None:
        stats.settings.update(teacher=teacher.name, teacher_cfg=teacher_cfg, teacher_top_k=teacher_top_k)
    if getattr(student, "decoder_kind", "codes") == "multi-scale":  # VAR-DD: every scale's vectors -> f_hat
        return Latents(vq.module.sequence_to_f_hat(latents).cpu(), source="var"), stats
    return Latents(student.decoder_input(latents).cpu(), source="dd"), stats
