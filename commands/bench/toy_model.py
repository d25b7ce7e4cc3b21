"""An enumerable token-AR model for proving decoders exact (bench.md, "Fidelity").

Tiny vocabulary and grid, one fixed random logits table per prefix (and per class, plus a null
class for CFG), served through the same session protocol as real models: a per-row token "cache"
that forwards overwrite, scratch outputs past the last token. Its exact joint distribution is
computed here by enumeration, independently of the samplers' processing code.
"""
from __future__ import annotations

import itertools

import torch

from ...model_loaders.shared.protocol import ClassConditioning, ModelOutput


class ToySession:
    def __init__(self, model: "ToyModel", labels: torch.Tensor, cfg: bool):
        self.model, self.labels, self.cfg = model, labels, cfg
        self.cache = torch.zeros(labels.shape[0], model.num_tokens, dtype=torch.long)
        self.first = self._outputs(torch.zeros(labels.shape[0], 1, dtype=torch.long))

    def _outputs(self, positions):
        """Logits predicting ``positions`` [B, W] from the cached prefix of each row."""
        return self._outputs_seeing(self.cache[:, None, :].expand(-1, positions.shape[1], -1), positions)

    def _outputs_seeing(self, seen, positions):
        """Logits predicting ``positions`` [B, W], each from the tokens its feed sees (``seen`` [B, W, N])."""
        cond = self.model.logits_at(seen, positions, self.labels)
        uncond = self.model.logits_at(seen, positions, torch.full_like(self.labels, self.model.num_classes))
        return ModelOutput(cond=cond, uncond=uncond if self.cfg else None)

    def key_slots(self, horizon: int) -> None:
        return None  # no cache to read in part

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, keys=None) -> ModelOutput:
        N = self.model.num_tokens
        positions = start.unsqueeze(1) + torch.arange(tokens.shape[1])
        inside = positions < N
        rows = torch.arange(tokens.shape[0]).unsqueeze(1).expand_as(positions)
        self.cache[rows[inside], positions[inside]] = tokens[inside]
        return self._outputs(positions + 1)

    def forward_tree(self, tokens, start, depth, ancestors, keys=None, first=0) -> ModelOutput:
        """Nodes of a draft tree: a root fed goes into the cache; each node sees the cache up to the root and its
        ancestors' tokens at their positions (the tokens of nodes fed before are remembered)."""
        B, T = tokens.shape
        A, N, rows = ancestors.shape[2], self.model.num_tokens, torch.arange(B)
        if first <= 1:  # a new tree (its root fed now, or by the last chain forward)
            self.tree_tokens = torch.zeros(B, A, dtype=torch.long)
            self.tree_positions = torch.full((B, A), N)
        self.tree_tokens[:, first:first + T] = tokens
        self.tree_positions[:, first:first + T] = start.unsqueeze(1) + depth[:, first:first + T]
        if first == 0:
            inside = start < N
            self.cache[rows[inside], start[inside]] = tokens[inside, 0]
        seen = self.cache[:, None, :].expand(B, T, N).clone()
        for a in range(1, ancestors.shape[2]):  # node a's token at its position, for the nodes below it
            below = ancestors[:, :, a].cpu() & (self.tree_positions[:, a:a + 1] < N)
            b, t = below.nonzero(as_tuple=True)
            seen[b, t, self.tree_positions[b, a]] = self.tree_tokens[b, a]
        return self._outputs_seeing(seen, self.tree_positions[:, first:first + T] + 1)

    def keep_path(self, start, path, accepted) -> None:
        """The accepted nodes' tokens go into the cache at their positions."""
        for j in range(path.shape[1]):
            b = ((j < accepted) & (start + 1 + j < self.model.num_tokens)).nonzero().flatten()
            self.cache[b, start[b] + 1 + j] = self.tree_tokens[b, path[b, j]]

    def forward_at(self, tokens, positions, visible, row_start) -> ModelOutput:
        """ZipAR's feeds: a position the feed does not see reads as code 0; the fed token (or a row start's
        stand-in) stands at its own position."""
        rows = torch.arange(tokens.shape[0]).unsqueeze(1).expand_as(positions)
        own = ~row_start | visible.cpu().gather(2, positions.unsqueeze(-1)).squeeze(-1)  # a seen stand-in stays
        self.cache[rows[own], positions[own]] = tokens[own]
        seen = torch.where(visible.cpu(), self.cache[:, None, :], 0)
        seen.scatter_(2, positions.unsqueeze(-1), tokens.unsqueeze(-1))
        return self._outputs_seeing(seen, positions + 1)


class ToyModel:
    """``vocab`` codes on a ``grid``; logits ~ N(0, scale^2) per (class, prefix, next code)."""

    kind = "token-ar"
    what = "a toy token model"

    def __init__(self, vocab=3, grid=(2, 2), num_classes=2, scale=2.0, seed=0):
        self.vocab_size, self.grid, self.num_classes = vocab, tuple(grid), num_classes
        self.num_tokens = grid[0] * grid[1]
        g = torch.Generator().manual_seed(seed)
        # tables[i][c] has one row per prefix of length i (the prefix read as a base-V number)
        self.tables = [torch.randn(num_classes + 1, vocab**i, vocab, generator=g) * scale for i in range(self.num_tokens)]
        self.embeddings = torch.randn(vocab, 4, generator=g)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def code_embeddings(self) -> torch.Tensor:
        return self.embeddings

    def start(self, conditioning: ClassConditioning, *, cfg: bool, max_window: int) -> ToySession:
        return ToySession(self, conditioning.labels.cpu(), cfg)

    def logits_at(self, seen, positions, labels):
        """Logits predicting ``positions`` [B, W] from the tokens each slot sees (``seen`` [B, W, N]: a position's
        prefix is read from its first entries)."""
        B, W = positions.shape
        out = torch.randn(B, W, self.vocab_size)  # scratch past the last token: must be ignored
        rows = labels.unsqueeze(1).expand(B, W)
        for pos in range(self.num_tokens):
            hit = positions == pos
            if hit.any():
                out[hit] = self.tables[pos][rows[hit], self.prefix_index(seen[hit][:, :pos])]
        return out

    def prefix_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Base-V number of each row of ``tokens`` [B, i] (0 for the empty prefix)."""
        powers = self.vocab_size ** torch.arange(tokens.shape[1] - 1, -1, -1)
        return (tokens.cpu() * powers).sum(-1)

    # -- exact target distribution ---------------------------------------------------------------
    def sequences(self) -> list[tuple[int, ...]]:
        return list(itertools.product(range(self.vocab_size), repeat=self.num_tokens))

    def exact_joint(self, label: int, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, view=None) -> torch.Tensor:
        """Probability of every sequence (in ``sequences()`` order) under plain AR sampling,
        computed straight from the definitions: CFG mix, temperature, top-k, top-p, softmax. ``view(seq, pos)``:
        the ``pos`` tokens position ``pos`` is drawn from (default ``seq[:pos]``; ZipAR hides some)."""
        probs = []
        for seq in self.sequences():
            total = 1.0
            for pos in range(self.num_tokens):
                prefix = 0
                for t in (seq[:pos] if view is None else view(seq, pos)):
                    prefix = prefix * self.vocab_size + t
                cond = self.tables[pos][label, prefix].double()
                logits = cond
                if cfg_scale != 1.0:
                    uncond = self.tables[pos][self.num_classes, prefix].double()
                    logits = uncond + cfg_scale * (cond - uncond)
                logits = logits / temperature
                if top_k:
                    kth = sorted(logits.tolist(), reverse=True)[top_k - 1]
                    logits = torch.where(logits >= kth, logits, torch.tensor(float("-inf"), dtype=torch.float64))
                step = torch.softmax(logits, 0)
                if top_p < 1.0:  # keep the most likely codes until their mass first exceeds top_p
                    kept, mass = torch.zeros_like(step), 0.0
                    for code in sorted(range(self.vocab_size), key=lambda c: -float(step[c])):
                        if mass > top_p:
                            break
                        kept[code], mass = step[code], mass + float(step[code])
                    step = kept / kept.sum()
                total *= float(step[seq[pos]])
            probs.append(total)
        return torch.tensor(probs, dtype=torch.float64)

    def index_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sequence index (as in ``sequences()``) of each row of ``tokens`` [B, N]."""
        return self.prefix_index(tokens)
