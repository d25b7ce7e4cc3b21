"""``python -m fastar generate|decode|bench|profile|quantize|train-drafter|distill-dd``: the command line. It parses the
flags and dispatches to the commands (commands/); what the flags mean is settings.py."""
from __future__ import annotations

import argparse
import difflib
import os
import sys
import warnings
from pathlib import Path

from .errors import FastARError, FastARWarning
from .model_loaders.shared.compiled import COMPILE_MODES, SWITCH
from .model_loaders.shared.quantized import WEIGHT_FORMATS
from .samplers.token_loops.acceptance import PROB_FILTERS
from .samplers.masked_loops.cspd import VERIFY_MODES
from .samplers.decoders import DECODERS
from .commands.profile.speed import DEFAULT_DECODERS, PROFILED, parse_decoders
from .samplers.token_loops.drafts import COUPLINGS, INIT_STRATEGIES
from .samplers.masked_loops.masked import CFG_SCHEDULES
from .samplers.few_step_loops.next_scale import VAR_SAMPLING
from .samplers.token_loops.drafting import DRAFTS
from .samplers.token_loops.trees import STATIC_SHAPES, TREE_KINDS
from .samplers.token_loops.zipar import ATTENTIONS as ZIPAR_ATTENTIONS
from .speed_dial import SPEEDS
from .settings import (CSPD_DEFAULTS, DD_DEFAULTS, MASKED_DEFAULTS, REUSE_DEFAULTS, SAMPLING_DEFAULTS, SPEC_DEFAULTS,
                       check_arguments)
from .commands.distill_dd import add_arguments as add_distill_args
from .commands.train_drafter import add_arguments as add_drafter_training_args


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="the model: a checkpoint file or model folder of LlamaGen (class or text to "
                   "image), Lumina-mGPT or Anole, Janus-Pro, MAR, VAR, or a Distilled Decoding student (default: the "
                   "bundled class-to-image demo; the other demos are in demo/, see README)")
    p.add_argument("--vq", "--vae", dest="vq", help="the model's image decoder: its VQ tokenizer (LlamaGen, DD "
                   "students), VQGAN (Lumina-mGPT, Anole), KL autoencoder (MAR) or multi-scale VQVAE (VAR, VAR-DD); a "
                   "Janus folder holds its own: give the --model folder again (default: a bundled model's own)")
    p.add_argument("--image-size", type=int, help="image size in pixels (square), for a checkpoint that does not say "
                   "it or to run at another size (default: from its training args, config or file name, e.g. 384 for "
                   "c2i_L_384.pt; Infinity: 1024, or 256, 512, 768 for its smaller schedules)")
    p.add_argument("--cfg", type=float, help="classifier-free guidance. Token models and MAR: 1 = off, default "
                   f"{SAMPLING_DEFAULTS.cfg_scale} (the bundled MAR demo's own: 3; Emu3: the release's 3); VAR: ramped "
                   "from none at the first "
                   f"scale to --cfg at the last (1 still guides), 0 = off, default the release's "
                   f"{VAR_SAMPLING.cfg_scale}; Infinity: the same at every scale, 1 = off, default the release's 3; "
                   "a DD student has none (1)")
    p.add_argument("--temperature", type=float, help=f"0 = greedy (default {SAMPLING_DEFAULTS.temperature:g}, or the "
                   "model's own: Infinity's tau, 0.5 for the 2B and 1 for the 8B as their releases sample)")
    p.add_argument("--top-k", type=int, help=f"0 = off; default off ({SAMPLING_DEFAULTS.top_k}), for VAR the "
                   f"release's {VAR_SAMPLING.top_k} (Infinity's too), for Emu3 the release's 2048 (give 0 to turn it off)")
    p.add_argument("--top-p", type=float, help=f"1 = off; default off ({SAMPLING_DEFAULTS.top_p:g}), for VAR the "
                   f"release's {VAR_SAMPLING.top_p:g} (the bundled VAR demo's own: 0.7; Infinity's 0.97; give 1 to turn it off)")
    p.add_argument("--window", type=int, default=SPEC_DEFAULTS.window,
                   help="SJD/GSD: tokens per forward (last fixed token + drafts: at least 2; plain AR is --decoder ar)")
    p.add_argument("--init", choices=INIT_STRATEGIES, default=SPEC_DEFAULTS.init, help="SJD/GSD: draft initialisation")
    p.add_argument("--coupling", choices=COUPLINGS, default=SPEC_DEFAULTS.coupling,
                   help="SJD/GSD: how drafts are redrawn after a rejection (all lossless)")
    p.add_argument("--group", type=int, default=SPEC_DEFAULTS.group, help="GSD group size G (1 = SJD)")
    p.add_argument("--prob-threshold", type=float, default=SPEC_DEFAULTS.prob_threshold,
                   help="GSD delta: drop group members whose probability differs from the draft's by more")
    p.add_argument("--prob-filter", choices=PROB_FILTERS, default=SPEC_DEFAULTS.prob_filter,
                   help="GSD: measure that difference relative to the larger probability (means the same on "
                   "confident and flat models) or absolute (the paper's rule)")
    p.add_argument("--distance-threshold", type=float, default=SPEC_DEFAULTS.distance_threshold,
                   help="GSD d: keep group members among the draft's nearest codes (0.5 = nearer half, 1 = all)")
    p.add_argument("--drafter", help="spec/lantern/gsd: a drafter to draft chains with: a LANTERN/EAGLE drafter "
                   "folder or a smaller AR checkpoint of the same family; 'demo' = the bundled demo drafter "
                   "(default for spec and lantern on the class demo, for cspd on the MAR demo); 'none' = no drafter. "
                   "Without one, lantern and gsd draft Jacobi windows (for lantern much faster but at a large quality "
                   "loss: use a drafter)")
    p.add_argument("--gamma", type=int, help=f"drafter: drafts per target forward (default {SPEC_DEFAULTS.gamma}; "
                   f"CSpD: draft MAR steps per target call, default {CSPD_DEFAULTS.gamma})")
    p.add_argument("--drafts", choices=DRAFTS, default=SPEC_DEFAULTS.drafts,
                   help="drafter: sampled (each draft drawn from the drafter's distribution) or top (its most likely "
                   "code, as EAGLE-2 and LANTERN's reference code draft; accepted with the target's probability of "
                   "it alone, so far less often on ambiguous image models: the setting of the LANTERN paper's figures)")
    p.add_argument("--tree", choices=TREE_KINDS, default=SPEC_DEFAULTS.tree,
                   help="drafter: what is drafted per target forward: a chain of --gamma drafts, a static tree "
                   "(--tree-shape) or an EAGLE-2 dynamic tree of the drafter's top codes (--tree-depth, --tree-topk, "
                   "--tree-nodes); trees fix more tokens per forward for a wider forward")
    p.add_argument("--tree-shape", choices=tuple(STATIC_SHAPES), default=SPEC_DEFAULTS.tree_shape,
                   help="--tree static: the shape (lantern++57: LANTERN++'s 57 drafts, 5 deep)")
    p.add_argument("--tree-depth", type=int, default=SPEC_DEFAULTS.tree_depth,
                   help="--tree dynamic: the deepest a draft may be (LANTERN's reference depth 4 drafts 5 deep)")
    p.add_argument("--tree-topk", type=int, default=SPEC_DEFAULTS.tree_topk,
                   help="--tree dynamic: nodes expanded per depth, and children drafted per node")
    p.add_argument("--tree-nodes", type=int, default=SPEC_DEFAULTS.tree_nodes,
                   help="--tree dynamic: drafts the target verifies per forward (the best by path probability), the root "
                   "not counted: LANTERN's total_token 59 is 58 here")
    p.add_argument("--pac-branches", type=int, default=SPEC_DEFAULTS.pac_branches,
                   help="sjd-pac: candidates per node at the window's first --pac-depth - 1 depths (1 = SJD on a chain)")
    p.add_argument("--pac-depth", type=int, default=SPEC_DEFAULTS.pac_depth,
                   help="sjd-pac: levels of the window's branched front, its root included (the rest of the window is a "
                   "chain)")
    p.add_argument("--entropy-strength", type=float, default=SPEC_DEFAULTS.entropy_strength,
                   help="sjd-entropy: how far a confident target relaxes a draft's acceptance (0 = exact SJD, 1 = the "
                   "entropy-aware rule of Ma et al. 2025; relaxed)")
    mar = p.add_argument_group("MAR models (ar and cspd)")
    mar.add_argument("--num-iter", type=int,
                     help="MAR steps: tokens are fixed in this many parallel steps (1 to the token count; default the "
                     f"model's own: 32 for the bundled demo, the release's {MASKED_DEFAULTS.num_iter} otherwise)")
    mar.add_argument("--cfg-schedule", choices=CFG_SCHEDULES,
                     help="MAR: guidance grows with the tokens fixed (linear, MAR's default) or stays at --cfg")
    mar.add_argument("--diffusion-steps", type=int,
                     help="MAR: reverse diffusion steps of the token head (default the model's own: 50 for the bundled "
                     f"demo, the release's {MASKED_DEFAULTS.diffusion_steps} otherwise)")
    mar.add_argument("--prefill", type=float, default=CSPD_DEFAULTS.prefill,
                     help="CSpD: fraction of the steps the target does alone first")
    mar.add_argument("--cspd-verify", choices=VERIFY_MODES, default=CSPD_DEFAULTS.verify,
                     help="CSpD: 'steps' = exactly plain MAR at --num-iter (lossless); 'merged' = the paper's scheme, "
                     "exactly plain MAR with each round of drafted steps merged into one step")
    mar.add_argument("--cspd-temperature", type=float,
                     help="cspd-relaxed: the last step's density ratio with its exponents divided by this squared "
                     "(the reference code's rule, default its 42; 1 with no --cspd-path-factor is exact cspd)")
    mar.add_argument("--cspd-path-factor", action="store_true",
                     help="cspd-relaxed: also multiply the ratio by the reference code's product of the intermediate "
                     "steps' std ratios (target over draft)")
    mar.add_argument("--reuse", action="store_true",
                     help="MAR (ar, cspd): LazyMAR-style feature reuse: between full steps, compute the conditional branch "
                     "only, encode only the newly fixed tokens and recompute the later decoder blocks only for the "
                     "tokens that changed most (relaxed: faster, not exactly plain MAR)")
    mar.add_argument("--reuse-start", type=float, default=REUSE_DEFAULTS.start_percent,
                     help="--reuse: the fraction of the steps computed in full first")
    mar.add_argument("--reuse-end", type=float, default=REUSE_DEFAULTS.end_percent,
                     help="--reuse: the fraction of the steps after which every step is computed in full again")
    mar.add_argument("--refresh-every", type=int, default=REUSE_DEFAULTS.refresh_every,
                     help="--reuse: one full step (refilling the cache) every this many steps")
    mar.add_argument("--token-reuse", type=float, default=REUSE_DEFAULTS.token_reuse,
                     help="--reuse: the share of the other tokens whose later decoder features a reusing step takes "
                     "from the cache (0: recompute all; the steps' own tokens are always recomputed)")
    mar.add_argument("--head-refresh-every", type=int, default=REUSE_DEFAULTS.head_refresh_every,
                     help="--reuse: inside the diffusion head, one full call every this many reverse steps; the "
                     "others compute the guided branch only and reuse the full call's MLP outputs (0: off; "
                     "LazyMAR's 7)")
    p.add_argument("--lantern-k", type=int, default=SPEC_DEFAULTS.lantern_k,
                   help="LANTERN k: latent neighbours considered per draft (capped at the codebook size)")
    p.add_argument("--lantern-delta", type=float, default=SPEC_DEFAULTS.lantern_delta,
                   help="LANTERN delta: total-variation budget per token (0 = exact speculative decoding)")
    p.add_argument("--lantern-lambda", type=float, default=SPEC_DEFAULTS.lantern_lambda,
                   help="LANTERN++ lambda: a draft's relaxed probability at most lambda times its own, in place of "
                   "--lantern-delta (0 = off, 1 = exact; LANTERN++ uses it with --tree static)")
    p.add_argument("--zipar-lead", type=int, default=SPEC_DEFAULTS.zipar_lead,
                   help="ZipAR: tokens of the row above fixed before a row starts (smaller: fewer forwards, each token "
                   "sees less of the row above; the grid's width: plain AR). zipar-sjd also drafts --window per row")
    p.add_argument("--zipar-attention", choices=ZIPAR_ATTENTIONS, default=SPEC_DEFAULTS.zipar_attention,
                   help="ZipAR: masked (a token attends to what the schedule fixed before it) or reference (as the "
                   "reference code: every earlier slot, the unfinished ones as the zeros the cache holds)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=SWITCH,
                   help="token models: every decoding step through torch.compile, with each iteration's sampling and "
                   "verification and the drafter's steps (same tokens as eager). The first image of each batch and "
                   "window compiles (3-20 s on a CPU), later ones run up to 1.7x faster, so a one-shot run leaves it "
                   "off; auto: on where proven equal (CPU and CUDA). MAR: its transformer call and diffusion head's "
                   "reverse steps, VAR: each scale's forward (both for GPUs, where eager steps are launch bound; auto "
                   "leaves them eager until the GPU check has compared them); --compile = on")
    p.add_argument("--flow-steps", type=int, default=SPEC_DEFAULTS.flow_steps,
                   help="fm: solver steps of the flow-matching map that turns each token's noise into its code")
    var = p.add_argument_group("next-scale models (VAR, Infinity): FastVAR and SkipVAR (training-free, relaxed)")
    var.add_argument("--fastvar", action="store_true",
                     help="FastVAR's cached token pruning with its release's schedule counted from the last scale: at "
                     "the two scales before the last two, each block's attention and FFN run on the 60%% and 50%% of "
                     "tokens farthest from their scale's mean, the rest restored from the scale before; the last two "
                     "scales are skipped (--skip-scales 0 keeps them)")
    var.add_argument("--fastvar-ratios", metavar="R1,R2,...",
                     help="FastVAR with these shares of tokens pruned (each in [0, 1)) at the last scales that run, in "
                     "order (default 0.4,0.5; implies --fastvar)")
    var.add_argument("--skip-scales", type=int, metavar="N",
                     help="skip the last N scales: they neither run nor add to the image (FastVAR's 2, default with "
                     "--fastvar; SkipVAR's step skipping, 1 to 3)")
    var.add_argument("--uncond-scales", type=int, metavar="N",
                     help="SkipVAR's unconditional-branch replacement: the last N scales that run skip the guidance "
                     "branch (half the rows); their conditional logits are used unguided")
    dd = p.add_argument_group("Distilled Decoding students (dd)")
    dd.add_argument("--dd-steps", type=int, choices=(1, 2),
                    help="student forwards: 1 (t = 0) or 2 (t = 0, then t2 with the same noise); default: the speed "
                    f"dial's (2, 1 at --speed fast), {DD_DEFAULTS.steps} with --decoder dd")
    dd.add_argument("--dd-t2", type=int, help="the second step's data length in tokens (default: the student's, 80 "
                    "for the released LlamaGen-DD ones; VAR-DD whole scales, d16 55, d20/d24 30)")
    dd.add_argument("--dd-split", type=int, help="positions before it take the logits' greedy code, later ones the "
                    "continuous output (default: the student's; released B 80, L 130, VAR-DD as t2). A VAR-DD "
                    "student of another depth without split_t in its NAME.json needs both")
    dd.add_argument("--dd-regenerate", type=int, help="hybrid (the paper's Alg. 4, needs --teacher and --dd-steps 2): "
                    "the teacher keeps the first S codes of DD's first step and samples positions S..t2-1 itself "
                    "(at --cfg, --temperature, --top-k, --top-p) before DD's second step")
    dd.add_argument("--teacher", help="dd hybrid, and bench --dd: the student's teacher (a token model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                   help="weights' precision; auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on a CPU")
    p.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="the transformer blocks of the model and its drafter in 8 bits, quantised at load: int8 or fp8 "
                   "(e4m3, as ComfyUI's 8-bit weights), each with a scale per output channel: half bf16's memory; "
                   "auto: as the checkpoint")
    p.add_argument("--gpu-weights", type=float, metavar="GB", help="a model bigger than the GPU: keep this many GB "
                   "of its weights on the GPU and stream the rest of its blocks from system memory at every step "
                   "(slower: they cross PCIe each step; compiled steps off). 0: only what cannot stream. Default: all of "
                   "them on the GPU")
    p.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: one per core that other jobs leave "
                   "free, from the load average: on a busy machine fewer threads are many times faster)")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every option's default, unless its text already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if no_default(action.default) or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def argument_type(parse):
    """An argparse ``type`` from a parser that raises FastARError (argparse then names the option and stops)."""
    def parsed(text: str):
        try:
            return parse(text)
        except FastARError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parsed


def no_default(default) -> bool:
    """None, a flag's False or SUPPRESS; by identity, since a default of 0 equals False and is worth showing."""
    return any(default is nothing for nothing in (None, False, argparse.SUPPRESS))


class CommandLineParser(argparse.ArgumentParser):
    """A parser whose errors are one line and a pointer to --help (argparse's usage is dozens of lines that bury
    the error), with the nearest choice to a mistyped one."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices
        return action

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an option the command does not know is said by the command's parser, whose --help
        lists the options (argparse says it at the top, whose --help lists only the commands)."""
        known, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.commands.get(getattr(known, "command", None), self).error(
                f"unrecognized arguments: {' '.join(unknown)}")
        return known

    def _check_value(self, action, value):
        """argparse's check of a choice, naming the nearest one to a typo (Python 3.14's suggest_on_error does the
        same; earlier ones have no public hook)."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            close = difflib.get_close_matches(str(value), [str(choice) for choice in action.choices], n=1)
            if not close:
                raise
            raise argparse.ArgumentError(action, f"{error.message}; did you mean '{close[0]}'?") from None

    def error(self, message):
        listed = "commands" if self.commands else "options and their defaults"
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists the {listed}\n")


class DefaultsParser(CommandLineParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=DefaultsFormatter, **kwargs)


def add_command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A command whose summary heads its --help and the list of commands."""
    return sub.add_parser(name, help=summary, description=summary)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m fastar", description="Fast autoregressive image generation.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=DefaultsParser)

    gen = add_command(sub, "generate", "generate images with one decoder")
    add_decoding_args(gen)
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--class", dest="class_", metavar="CLASS", help="class index or name, repeated over --batch "
                       "(default: 0, the model's first class)")
    which.add_argument("--classes", help="comma-separated classes, one per row")
    gen.add_argument("--prompt", action="append", help="text-to-image models: a prompt (repeat for several rows)")
    gen.add_argument("--negative-prompt", action="append", help="Emu3: what CFG guides away from, one for every row "
                     "or one per --prompt (default: the release's published negative prompt)")
    gen.add_argument("--aspect-ratio", help="Emu3: the image's WIDTH:HEIGHT (e.g. 16:9) at the area of --image-size "
                     "squared (default 1:1); Lumina-mGPT: its release's shape of that ratio at --image-size; "
                     "Infinity: the scale schedule of its nearest template (1:1 to 3:1 and 1:3)")
    gen.add_argument("--t5", help="text-to-image models that read FLAN-T5 features (LlamaGen t2i, Infinity): local "
                     "FLAN-T5 folder (google/flan-t5-xl)")
    gen.add_argument("--batch", type=int, default=1, help="images at once (rows of one class or prompt)")
    gen.add_argument("--decoder", choices=("auto", *DECODERS), default="auto",
                     help="auto: the speed dial picks the decoder and its settings for the model, drafter and device "
                     "(--speed; docs/speed.md); or one decoder by name, with its own options below")
    gen.add_argument("--speed", choices=SPEEDS, help="with --decoder auto: lossless (exactly the model's distribution), "
                     "balanced (the default: the fastest within a few points of plain sampling's quality) or fast")
    gen.add_argument("--seed", type=int, default=0, help="the same seed, settings and device give the same image")
    gen.add_argument("--out", help="PNG path (batch > 1: PATH_0.png, PATH_1.png, ...); default, when no output is "
                     "given: out/MODEL_DECODER_seedS.png")
    gen.add_argument("--tokens-out", help="write the image codes as JSON (token models)")
    gen.add_argument("--latents-out", help="write the image decoder's input as float32 .npy [B, C, h, w] (MAR: the "
                     "tokens divided by the scale factor; token models and DD: code vectors); python -m fastar decode "
                     "turns it into images")
    gen.add_argument("--noise-in", help="dd: the noise [B, h*w, C] (.npy) to map, e.g. one --noise-out saved")
    gen.add_argument("--noise-out", help="dd: write the noise the run used (.npy), to reproduce or vary it")
    gen.add_argument("--stats-out", help="write the decode statistics as JSON")
    gen.add_argument("--map-out", help="write the acceptance heatmap (iteration that fixed each token) as PNG")
    gen.add_argument("--quiet", action="store_true", help="no progress line")

    dec = add_command(sub, "decode", "decode saved latents (--latents-out) or codes (--tokens-out) into images")
    dec.add_argument("--vq", "--vae", dest="vq", required=True, help="the image decoder (VQ tokenizer or KL autoencoder)")
    source = dec.add_mutually_exclusive_group(required=True)
    source.add_argument("--latents-in", help=".npy of float32 latents [B, C, h, w]")
    source.add_argument("--tokens-in", help="JSON of image codes, as --tokens-out writes it")
    dec.add_argument("--out", required=True, help="PNG path (several images: PATH_0.png, PATH_1.png, ...)")
    dec.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")

    bench = add_command(sub, "bench", "compare decoders side by side (speed, fidelity, quality) on a model, by "
                                       "default the demo model")
    add_decoding_args(bench)
    bench.add_argument("--mar", action="store_true", help="bench MAR: plain MAR at several step counts against CSpD "
                       "in both verify modes, on the demo MAR (or --model/--vq/--drafter); --decoders and the "
                       "sweeps do not apply")
    bench.add_argument("--dd", action="store_true", help="bench a Distilled Decoding student (--model, default the "
                       "demo's) in 1 and 2 steps against its teacher's plain AR and flow-map AR (--teacher, default the "
                       "demo model; --cfg, --top-k ... are the teacher's: give the student's pair settings, cfg default 2.0)")
    bench.add_argument("--var", action="store_true", help="bench a VAR model (--model, default the demo's) plain "
                       "against FastVAR's and SkipVAR's settings, same classes and seeds: quality, tokens forwarded, "
                       "FLOPs")
    bench.add_argument("--dial", action="store_true", help="measure the speed dial's candidates for token models "
                       "(speed_dial.py: every decoder and setting it can pick) and print each level's pick from them; "
                       "--decoders and the sweeps do not apply")
    bench.add_argument("--mar-steps", default="256,64,32,16", help="with --mar: the step counts of the plain MAR rows "
                       "beside --num-iter (counts above the model's token count are skipped)")
    bench.add_argument("--mar-rows", help="with --mar: only these rows, by their labels in the table (e.g. "
                       "mar@16,cspd-merged,lazy); the plain MAR row at --num-iter always runs: every ratio is against it")
    bench.add_argument("--decoders", default="ar,sjd,gsd,spec,spec-top,lantern,lantern-top,lantern-jacobi,zipar,zipar-sjd",
                       help=f"comma-separated, from {', '.join(DECODERS)}; NAME-jacobi drafts Jacobi windows, "
                       "NAME-drafter chains from the drafter (spec and lantern use the drafter by default), NAME-top "
                       "chains the drafter's most likely codes (--drafts top)")
    bench.add_argument("--samples", type=int, default=64, help="images per decoder for the quality metrics")
    bench.add_argument("--timing-runs", type=int, default=5, help="batch-1 runs per decoder for latency (interleaved)")
    bench.add_argument("--seed", type=int, default=0, help="first seed of the samples")
    bench.add_argument("--out", help="output folder for bench.json, bench.md, pareto.png (default: out/bench, "
                       "out/bench-mar with --mar, out/bench-dd with --dd)")
    bench.add_argument("--sweep-samples", type=int, help="images per slider-sweep point (default: half of --samples)")
    bench.add_argument("--no-pareto", action="store_true", help="skip the slider sweeps (faster)")
    bench.add_argument("--toy-rows", type=int, default=20000,
                       help="samples per setting for the relaxed decoders' total-variation distance on the toy")

    quant = add_command(sub, "quantize", "write a model's 8-bit weights once, to load directly (half the bytes, "
                        "nothing to quantise at each load)")
    quant.add_argument("--model", required=True, help="the AR model's checkpoint file or model folder (any family "
                       "generate loads)")
    quant.add_argument("--weights", choices=[w for w in WEIGHT_FORMATS if w != "auto"], default="int8",
                       help="the 8-bit format (see README: int8 is the faster one on CPUs and GPUs)")
    quant.add_argument("--out", help="where to write: a .safetensors file for a file, a folder for a model folder "
                       "(default: beside the model, its name plus -int8 or -fp8)")
    quant.add_argument("--image-size", type=int, help="the image size to record, for a checkpoint that does not say "
                       "it (default: as generate reads it)")

    drafter = add_command(sub, "train-drafter", "train a drafter (EAGLE head or small AR) on a target's samples")
    add_drafter_training_args(drafter)

    prof = add_command(sub, "profile", "ms per target forward and decoder iteration against the memory-bandwidth "
                                       "floor, on a random-weight model of a real shape")
    prof.add_argument("--shape", default="demo", help="tiny, demo, llamagen-b/-l/-xl/-xxl, lumina-mgpt-7b-768, "
                      "anole-7b, lumina-tiny, anole-tiny, janus-tiny, janus-pro-1b, janus-pro-7b; MAR: mar-tiny, mar-b, "
                      "mar-l, mar-h; VAR (plain against FastVAR and SkipVAR, time per scale): var-d16, var-d20, "
                      "var-d24, var-d30")
    prof.add_argument("--grid", help="a random shape's image grid, rows x columns of tokens (e.g. 8x8 for a quick CPU "
                      "run of a big shape; default: the release's)")
    prof.add_argument("--model", help="a token model's or a MAR's checkpoint instead of a random shape (e.g. the "
                      "bundled demo/demo_c2i.safetensors or demo/demo_mar.safetensors)")
    prof.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    prof.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="default: bf16 on cuda and for --memory, "
                      "fp32 on cpu")
    prof.add_argument("--windows", default="1,2,4,8,16,32,64", help="window widths W whose forward is timed")
    prof.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2],
                      help="images per call (each with its CFG row)")
    prof.add_argument("--repeats", type=int, default=10, help="timed repeats per measurement (medians)")
    prof.add_argument("--drafter", help="with --model: the drafter of the spec runs (a random shape drafts with a "
                      "random 2-layer model of its shape; without either, spec is left out)")
    prof.add_argument("--no-decoders", action="store_true", help="skip the whole-image decoder runs (ar stays with "
                      "--baselines)")
    prof.add_argument("--decoders", type=argument_type(parse_decoders), default=",".join(DEFAULT_DECODERS),
                      help=f"the decoders whose whole images are timed, comma-separated, or all "
                      f"({', '.join(PROFILED)}; spec-static and spec-dynamic: spec on LANTERN++'s static tree and "
                      "EAGLE-2's dynamic one; ar always)")
    prof.add_argument("--kernels", action="store_true", help="where a 1-token and the widest window's forward spend "
                      "their time (torch.profiler): matrix products, attention, copies, elementwise, against wall time")
    prof.add_argument("--baselines", action="store_true", help="time the usual loop on the same weights beside "
                      "FastAR's ar: a plain per-token loop without static cache and, with --llamagen-code, the "
                      "release's generate() (LlamaGen class-to-image), or transformers' generate (Janus shapes; needs "
                      "transformers)")
    prof.add_argument("--llamagen-code", metavar="DIR", help="with --baselines: a checkout of FoundationVision/LlamaGen "
                      "whose generate() is timed on the same weights (compiled as its sample script does, too, with "
                      "--compile)")
    prof.add_argument("--compile", action="store_true", help="the steps through torch.compile (each window compiles "
                      "once before it is timed), beside an eager twin with the same weights and again with every call "
                      "guarded in full; the graphs dynamo compiled and any graph break")
    prof.add_argument("--no-eager-twin", action="store_true", help="with --compile: leave out the eager twin's "
                      "runs (the compiled steps alone, as a user on CUDA runs them)")
    prof.add_argument("--compile-mode", choices=COMPILE_MODES,
                      help="torch.compile's mode for --compile (default: reduce-overhead on CUDA, default elsewhere); "
                      "max-autotune-no-cudagraphs / max-autotune try GEMM configurations (minutes per width)")
    prof.add_argument("--gpu-weights", type=float, metavar="GB", help="keep this many GB of the model's weights "
                      "on the GPU and stream the rest of its blocks from host memory (token models; not with --compile)")
    prof.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                      help="the blocks of the model (and drafter) in 8 bits: int8 or fp8; the floor counts their bytes")
    prof.add_argument("--memory", action="store_true", help="only the memory a generation needs (weights, and the "
                      "KV cache with CFG at each --batches), the --shape built on no device: any size, on any machine; "
                      "in bf16, as a GPU runs it, unless --dtype says otherwise")
    prof.add_argument("--out", help="write the report as JSON")
    prof.add_argument("--threads", type=int, help="CPU threads")

    distill = add_command(sub, "distill-dd", "distil a class-to-image LlamaGen-format or VAR model into a "
                                           "one/two-step Distilled Decoding student")
    add_distill_args(distill)
    return parser


def command_generate(args) -> int:
    from .commands.generate import command_generate as run

    return run(args)


def command_decode(args) -> int:
    from .commands.decode import command_decode as run

    return run(args)


def command_bench(args) -> int:
    from .commands.bench.decoders import run_bench
    from .commands.bench.dd import run_dd_bench
    from .commands.bench.mar import run_mar_bench
    from .commands.bench.var import run_var_bench

    check_arguments(args)
    args.out = args.out or str(Path("out") / ("bench-mar" if args.mar else "bench-dd" if args.dd else
                                              "bench-var" if args.var else "bench"))
    (run_mar_bench if args.mar else run_dd_bench if args.dd else run_var_bench if args.var else run_bench)(args)
    print(f"[bench] the report, its JSON and plots are in {args.out}")
    return 0


def command_profile(args) -> int:
    from .commands.profile.speed import run_profile

    run_profile(args)
    return 0


def command_quantize(args) -> int:
    from .commands.quantize import command_quantize as run

    return run(args)


def command_train_drafter(args) -> int:
    from .commands.train_drafter import train

    train(args)
    return 0


def command_distill_dd(args) -> int:
    from .commands.distill_dd import distill

    distill(args)
    return 0


def show_warning(message, category, filename, lineno, file=None, line=None):
    """FastAR's own warnings as one plain line; others as Python prints them."""
    if issubclass(category, FastARWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def set_threads(threads: int | None) -> None:
    """--threads, else one per core that other jobs leave free (PyTorch's default takes every core, which on a
    busy machine is many times slower than fewer threads: 122 s against 10.7 s seen for the first example)."""
    if threads is not None and threads < 1:
        raise FastARError(f"--threads {threads}: give at least 1 (or leave it out for one per free core)")
    import torch

    torch.set_num_threads(threads or free_cores())


def free_cores() -> int:
    """The cores the load average leaves idle (all of them where there is no load average), at least 1."""
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return cores
    return max(1, min(cores, round(cores - busy)))


def overview(parser: CommandLineParser) -> str:
    """What ``python -m fastar`` alone prints: the commands, one line each, and where their options are."""
    width = max(map(len, parser.commands))
    lines = [f"  {name:<{width}}  {command.description}" for name, command in parser.commands.items()]
    return "\n".join([f"usage: {parser.prog} COMMAND [options]", "", "commands:", *lines, "",
                      f"{parser.prog} COMMAND --help lists a command's options and their defaults"])


def main(argv=None) -> int:
    warnings.showwarning = show_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(overview(parser))
        return 0
    try:
        set_threads(getattr(args, "threads", None))
        commands = {"generate": command_generate, "decode": command_decode, "bench": command_bench,
                    "train-drafter": command_train_drafter, "distill-dd": command_distill_dd,
                    "profile": command_profile, "quantize": command_quantize}
        return commands[args.command](args)
    except FastARError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
