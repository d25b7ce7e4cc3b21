"""The token-AR protocol between samplers and model adapters (see architecture.md).

Samplers work in image-code space: integers ``0..V-1`` in raster order over an ``h x w`` grid.
Everything family-specific (vocabulary ids, layout tokens, how CFG's unconditional branch is built)
stays inside the adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class ModelOutput:
    """Logits over image codes, ``[B, W, V]`` fp32; ``uncond`` is set when CFG runs. ``hidden`` is the
    last hidden state after the final norm, ``[R, W, D]`` for every row the model ran (cond rows, then
    uncond rows under CFG), present only when the session was started with ``hidden=True``."""

    cond: torch.Tensor
    uncond: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None

    def pick(self, slot: torch.Tensor) -> "ModelOutput":
        """One output slot per row (``slot`` [B]), keeping the window dimension: ``[B, 1, ...]``."""
        return self.take(slot.unsqueeze(1))

    def take(self, slots: torch.Tensor) -> "ModelOutput":
        """Output slots ``slots`` [B, J] of each row: ``[B, J, ...]`` (a draft tree's accepted path)."""
        def take(t):
            if t is None:
                return None
            index = slots.repeat(t.shape[0] // slots.shape[0], 1)  # uncond / hidden rows follow the cond rows
            return t.gather(1, index.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

        return ModelOutput(take(self.cond), take(self.uncond), take(self.hidden))


@dataclass
class ClassConditioning:
    """Class-conditional generation: one label per row."""

    labels: torch.Tensor  # [B] int64

    @property
    def batch(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class CaptionConditioning:
    """Text-conditional generation from precomputed caption features (e.g. FLAN-T5-XL).

    ``embeddings`` is ``[B, T, C]`` and ``mask`` ``[B, T]`` (1 = real token), in the layout the model was
    trained on: left-padded (the real tokens last) for LlamaGen's T2I models, the real tokens first for Infinity
    (its ``caption_padding = "right"``).
    """

    embeddings: torch.Tensor
    mask: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.embeddings.shape[0])


@dataclass
class PromptConditioning:
    """Text-to-image generation from prompt text, for models that tokenise it themselves (Lumina-mGPT,
    Anole, Janus, Emu3): one prompt per row. ``negative_prompts`` (one per row, or one for every row) is what CFG
    guides away from, for the models whose release guides against a negative prompt (Emu3); None: the model's own
    default."""

    prompts: list[str]
    negative_prompts: Optional[list[str]] = None

    @property
    def batch(self) -> int:
        return len(self.prompts)


class TokenARSession(Protocol):
    """One generation: a prefilled static KV cache for ``batch`` rows."""

    first: ModelOutput  # predicts image token 0, shape [B, 1, V]

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, keys: Optional[torch.Tensor] = None) -> ModelOutput:
        """Feed ``tokens[b, j]`` as image token ``start[b] + j``; output ``j`` predicts token
        ``start[b] + j + 1``. Rows may be at different positions; positions past the last image
        token are scratch (their outputs are meaningless and must be ignored). ``keys``: what
        ``key_slots`` gave for this forward (None: attend over the whole cache)."""
        ...

    def forward_tree(self, tokens: torch.Tensor, start: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
                     keys: Optional[torch.Tensor] = None, first: int = 0) -> ModelOutput:
        """Feed nodes ``first`` .. ``first + T - 1`` of a draft tree per row (optional: speculative decoding on trees
        needs it; node 0 is the root, at image position ``start[b]``): ``tokens[b, t]`` as image token
        ``start[b] + depth[b, first + t]`` (``depth`` [B, A]: every node's), seeing the positions up to the root and
        the nodes ``ancestors[b, t]`` [B, T, A] marks (its ancestors and itself, fed now or by an earlier call for this tree); output t predicts the token
        after its node. Node m takes the cache slot of position start + m (a chain's own slots), so a later forward
        overwrites it; ``keep_path`` moves the accepted nodes into place first."""
        ...

    def keep_path(self, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """After ``forward_tree`` from ``start``: the nodes ``path[b, j]`` (the accepted node at depth j + 1) for
        j < ``accepted[b]`` take the cache slots of their positions, start + 1 + j."""
        ...

    def key_slots(self, horizon: int) -> Optional[torch.Tensor]:
        """For a forward that feeds no position at or past ``horizon`` (nor did any before it, in any row): the
        cache slots it need attend over, to pass as ``forward``'s ``keys`` (None: a session without the choice).
        A decoder knows such a bound on the host without waiting for the device (verifier.RowProgress)."""
        ...

    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                   row_start: torch.Tensor) -> ModelOutput:
        """Feeds anywhere in the image, each with its own view (ZipAR; optional: decoders that need it say so).
        ``tokens[b, m]`` is fed as image token ``positions[b, m]`` and sees the prefix, itself and the image
        positions ``visible[b, m]`` ([B, M, N] bool; those must hold what the caller fixed, fed now or before);
        output m predicts the next token of its row. Where ``row_start[b, m]``, the feed only serves to predict
        the first token of the next row (``positions`` is then the last of its own row, which need not be known):
        unless that position is visible to it, its token is a stand-in that no other feed sees (a model with row
        ends feeds its row-end token there instead, which the feeds that see the next row's first token see)."""
        ...


class TokenARModel(Protocol):
    vocab_size: int
    grid: tuple[int, int]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The weights' precision (named when its logits overflow)."""
        ...

    def start(self, conditioning, *, cfg: bool, max_window: int, hidden: bool = False) -> TokenARSession:
        """Prefill ``conditioning`` (cond rows, plus uncond rows when ``cfg``) and return a session
        whose forwards carry at most ``max_window`` tokens; ``hidden`` adds ``ModelOutput.hidden``."""
        ...

    def code_embeddings(self) -> torch.Tensor:
        """``[V, D]`` embedding of each image code, for distance-based decoders."""
        ...


class DrafterSession(Protocol):
    """One generation's drafter state (its own cache), driven by the speculative loop.

    Positions are image-token indices. The loop calls ``catch_up`` once per iteration, then ``step``
    for each further draft; the drafter's outputs go through the same processing as the target's.
    """

    def catch_up(self, seq: torch.Tensor, n: torch.Tensor, target: ModelOutput, target_start: torch.Tensor) -> ModelOutput:
        """Absorb what was fixed since the last call and predict image token ``n``.

        ``seq`` [B, >=N] holds the fixed tokens (positions ``< n[b]`` of row b are fixed, later ones are
        garbage); ``target`` is the target's latest output, whose slot j predicts image token
        ``target_start[b] + 1 + j`` (``target_start = -1`` for the prefill's ``first``). Every token
        fixed since the previous call lies in that range. Returns logits ``[B, 1, V]``."""
        ...

    def step(self, tokens: torch.Tensor, position: torch.Tensor) -> ModelOutput:
        """Feed draft ``tokens`` [B, 1] as image token ``position`` [B]; predict ``position + 1``.
        Positions past the last image token are scratch."""
        ...

    def grow(self, tokens: torch.Tensor, start: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
             parent: torch.Tensor, first: int) -> ModelOutput:
        """Feed nodes ``first`` .. of a draft tree whose root (node 0, image token ``start``) the last ``catch_up``
        fed, as ``TokenARSession.forward_tree`` does; ``parent`` [B, T] is each node's parent (fed before it).
        Predicts each node's children: ``[B, T, V]``."""
        ...


class Drafter(Protocol):
    """Proposes draft tokens in the target's code space (a smaller AR model, an EAGLE-style head)."""

    name: str
    needs_target_hidden: bool  # the target session must be started with hidden=True

    def start(self, conditioning, *, cfg: bool, max_window: int, target_session: TokenARSession,
              tree_nodes: int = 0) -> DrafterSession:
        """A session fixing at most ``max_window`` tokens per iteration, growing trees of ``tree_nodes`` drafts (0:
        chains, fed by ``step``)."""
        ...


class FewStepModel(Protocol):
    """A Distilled Decoding student: a whole sequence of continuous tokens in (noise, or code vectors for the
    first t positions), every final token out, in one forward. ``cfg`` has ``channels``, ``split``, ``t2``."""

    kind: str  # "few-step"
    vocab_size: int
    grid: tuple[int, int]
    num_tokens: int  # the noise's length: h * w for LlamaGen-DD, every scale's tokens for VAR-DD
    teacher_sampler: tuple[str, int]  # the teacher's own sampler and its forwards per image: ("AR", 255), ("VAR", 10)

    def predict(self, x: torch.Tensor, labels: torch.Tensor, t) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, N, C] -> (continuous prediction [B, N, C], logits [B, N, V]) of every final token, fp32."""
        ...

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, N, C] in raster order -> the VQ decoder's input [B, C, h, w]."""
        ...

    def check_teacher(self, teacher) -> None:
        """Raise a FastARError unless ``teacher`` (a token model) is the model this student was distilled from."""
        ...


class NextScaleSession(Protocol):
    """One VAR generation: scales are fed in order, each attending to the earlier ones (cached)."""

    def forward(self, scale: int, inputs: Optional[torch.Tensor] = None) -> ModelOutput:
        """Logits of every token of ``scale`` ``[B, pn^2, V]`` (cond, and uncond under CFG); ``inputs``
        [B, pn^2, C] is that scale's input (the VQVAE's f_hat so far, area-downsampled; None for scale 0)."""
        ...

    def forward_pruned(self, scale: int, inputs: Optional[torch.Tensor], pruning: ScalePruning, *,
                       cond_only: bool = False) -> ModelOutput:
        """``forward`` with every block's sub-layers going through ``pruning``; ``cond_only`` runs the conditional
        rows alone (no ``uncond`` in the output; SkipVAR's replacement). Eager; once a session takes it, it takes
        every scale (the cache then holds only the keys and values of the tokens that ran)."""
        ...


class ScalePruning(Protocol):
    """What a next-scale model's blocks call at every sub-layer of an accelerated scale (FastVAR's cached token
    pruning, samplers/few_step_loops/scale_acceleration.py), so the rule stays family-blind:
    ``kept = keep(block, name, x)``, ``out = sublayer(take(x, kept))``, ``out = restore(block, name, out, kept)``.
    ``x`` is the sub-layer's input residual ``[R, n, C]`` before its norm; ``kept`` ``[R, k]`` the token indices the
    sub-layer runs on (None: all; counted either way), which a family with RoPE gathers its angles by; only the kept
    tokens' keys and values go to the cache. ``restore`` gives the output at every token ``[R, n, C]``."""

    def keep(self, block: int, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        ...

    def take(self, x: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
        ...

    def restore(self, block: int, name: str, out: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
        ...


class NextScaleModel(Protocol):
    """A next-scale model (VAR): ``cfg.patch_nums`` scales of ``pn x pn`` tokens; its multi-scale VQVAE turns each
    scale's codes into the next scale's input and the last f_hat into the image."""

    kind: str  # "next-scale"
    vocab_size: int
    grid: tuple[int, int]  # the last scale's

    def start(self, conditioning: ClassConditioning, *, cfg: bool) -> NextScaleSession:
        ...
