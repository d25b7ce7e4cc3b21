"""EAGLE-style drafter: one decoder layer that reads the target's hidden states (LANTERN's format),
bound to its LlamaGen or Chameleon-family target.

Facts of the released format (jadohu/LANTERN: models/drafters/cnets_llamagen.py, models/ea_model_llamagen.py,
entrypoints/train_drafter/data_utils.py), each pinned by a test:
- ``fc`` maps concat(token embedding, target hidden after the target's final norm) to the width, with a
  bias unless config.json says ``"bias": false``; no activation.
- One LLaMA layer without input norm: ``x + attn(x)``, then ``+ mlp(post_attention_layernorm(.))``;
  q/k/v biases when ``qkv_bias``; no final norm: the target's output head reads the feature directly.
- Rows: row t pairs the target's hidden state of slot t with the token that follows slot t and predicts
  the target's hidden state of slot t+1. For LlamaGen the first C-1 rows replay the conditioning slots
  (token id 0), then image row p pairs the hidden that predicts image token p with token p.
- RoPE: LlamaGen's interleaved 2-D table, zero on the replayed conditioning rows, image row p at grid
  position p (the released code hard-codes a grid per ``input_type``; we use the target's grid).
- Attention is causal over all rows; padded caption rows are not hidden (the release trains without a mask).

The Anole drafter (models/drafters/cnets_anole.py, data/configs/anole_config.json: a Chameleon config of
one layer, ``model_type`` "chameleon"): the same ``fc`` (bias) over concat(embedding of the vocabulary id,
target hidden), then a whole Chameleon decoder layer (input RMSNorm, per-head QK LayerNorm with per-head
weight and bias, 1-D rotate_half RoPE at the sequence position, unconditional rows shifted to count from
their first real token); logits from the target's output head over image tokens only. Its rows replay
the prompt: row t pairs the target's hidden at slot t with the token at slot t+1.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import FastARError
from ..llamagen.model import rope_2d_table, rope_attention
from ..shared.compiled import BoundStep, compiled_function, following_mode
from ..shared.transformer import KVCache, RMSNorm, attention_mask, tree_mask
from ..shared.llm_decoder import MLP, DecoderConfig, DecoderLayer, rope_tables
from ..shared.protocol import ModelOutput

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    bias: bool = True  # fc bias
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    input_type: str | None = None  # "c2i", "t2i", "t2i2" (the released names)
    grid: tuple[int, int] | None = None  # recorded by FastAR's trainer; the release implies it by input_type
    family: str = "llama"  # config.json's model_type: "llama" (LlamaGen targets) or "chameleon" (Anole)
    swin_norm: bool = False  # chameleon: norm after each branch
    skips_row_ends: bool = False  # FastAR's Lumina-mGPT drafters: rows of image codes only (drafters/teacher.py)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def model_type(self) -> str | None:
        """c2i or t2i, as LlamaGenConfig names them (t2i2 is LlamaGen's stage-II text-to-image)."""
        return None if self.input_type is None else "t2i" if self.input_type.startswith("t2i") else "c2i"

    @classmethod
    def from_json(cls, config: dict | None, source: str) -> "EagleConfig":
        if config is None:
            raise FastARError(f"{source} looks like an EAGLE drafter but has no config.json beside its weights: "
                              "keep the drafter's folder whole (config.json + weights), or re-download it (FastAR's "
                              "docs/models.md lists the drafters)")
        missing = [k for k in CONFIG_KEYS if k not in config]
        if missing:
            raise FastARError(f"{source}: its config.json lacks {', '.join(missing)}: it is not an EAGLE drafter "
                              "config, re-download the drafter")
        layers = config.get("num_hidden_layers", 1)
        if layers != 1 or config.get("hidden_act", "silu") != "silu":
            raise FastARError(f"{source}: a {layers}-layer drafter with {config.get('hidden_act')} activation; "
                              "FastAR runs EAGLE drafters of one SiLU layer (LANTERN's format)")
        fastar = config.get("fastar") or {}
        return cls(
            hidden_size=int(config["hidden_size"]), intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            bias=bool(config.get("bias", True)), qkv_bias=bool(config.get("qkv_bias", False)),
            rope_theta=float(config.get("rope_theta") or 10000.0), input_type=config.get("input_type"),
            grid=tuple(fastar["grid"]) if fastar.get("grid") else None,
            family="chameleon" if config.get("model_type") == "chameleon" else "llama",
            swin_norm=bool(config.get("swin_norm", False)), skips_row_ends=fastar.get("row_ends") == "skipped",
        )

    def to_json(self) -> dict:
        """HF keys as the release writes them (a Llama config, or for Anole a Chameleon one), plus under ``fastar``
        the grid and, for a layout with row ends, that the drafter's rows skip them."""
        architecture = "ChameleonForConditionalGeneration" if self.family == "chameleon" else "LlamaForCausalLM"
        config = {
            "architectures": [architecture], "model_type": self.family, "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": 1, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "bias": self.bias, "qkv_bias": self.qkv_bias, "rope_theta": self.rope_theta,
            "input_type": self.input_type, "torch_dtype": "float16",
        }
        if self.family == "chameleon":
            config["swin_norm"] = self.swin_norm
        fastar = {"grid": list(self.grid)} if self.grid is not None else {}
        if self.skips_row_ends:
            fastar["row_ends"] = "skipped"
        if fastar:
            config["fastar"] = fastar
        return config


class EagleAttention(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        D, H, KV, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if D % H or H % KV or hd % 4:
            raise ValueError(f"inconsistent head layout: width {D}, {H} heads, {KV} kv heads")
        self.n_head, self.n_kv_head, self.head_dim = H, KV, hd
        self.qkv_proj = nn.Linear(D, (H + 2 * KV) * hd, bias=cfg.qkv_bias)  # q, k, v: one matmul
        self.joined = {"qkv_proj": (("q_proj", H * hd), ("k_proj", KV * hd), ("v_proj", KV * hd))}  # joined.py
        self.o_proj = nn.Linear(H * hd, D, bias=False)

    def forward(self, x, rope, mask, cache=None, slots=None):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.n_head * self.head_dim, *[self.n_kv_head * self.head_dim] * 2], -1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k, v = k.view(B, T, self.n_kv_head, self.head_dim), v.view(B, T, self.n_kv_head, self.head_dim)
        return self.o_proj(rope_attention(q, k, v, rope, mask, cache, slots))


class EagleLayer(nn.Module):
    """LLaMA decoder layer 0 of an EAGLE head: no input norm (fc's output goes straight in)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.self_attn = EagleAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache=None, slots=None):
        h = x + self.self_attn(x, rope, mask, cache, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


def chameleon_layer(cfg: EagleConfig) -> nn.Module:
    """A whole Chameleon decoder layer (input norm, per-head QK norm), as LANTERN's Anole drafter has."""
    return DecoderLayer(DecoderConfig(cfg.hidden_size, 1, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps,
                                      qk_norm=True, swin_norm=cfg.swin_norm))


class EagleHead(nn.Module):
    """The drafter's weights, under the released key names; its layer is the target family's."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.layers = nn.ModuleList([chameleon_layer(cfg) if cfg.family == "chameleon" else EagleLayer(cfg)])

    def forward(self, tokens, hidden, rope, mask, cache=None, slots=None):
        """Features ``[R, T, D]`` of rows pairing ``tokens`` [R, T] with target ``hidden`` [R, T, D]."""
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))
        return self.layers[0](x, rope, mask, cache, slots)


class EagleDrafter:
    """A ``Drafter``: the head bound to the target whose hidden states it reads and whose output head
    turns its features into logits. Subclasses for other target families say how the target's prefix is
    replayed, where each row sits (RoPE), and how image codes map to the head's token ids."""

    name = "eagle"
    needs_target_hidden = True

    def __init__(self, head: nn.Module, target):
        self.head, self.target = head, target

    @torch.no_grad()
    def start(self, conditioning, *, cfg: bool, max_window: int, target_session, tree_nodes: int = 0) -> "EagleSession":
        return EagleSession(self, target_session, batch=conditioning.batch, cfg=cfg,
                            max_window=max(max_window, tree_nodes + 1))

    # -- the target family's geometry (LlamaGen) ---------------------------------------------------
    def replayed_prefix(self, target_session, rows: int, offset: int):
        """Token ids of the rows replaying the target's prefix slots 0..offset-1 and which of those slots
        are real ([R, offset] or [R, 0] when none is padding). LlamaGen: the conditioning slots, token 0."""
        device = self.target.device
        return (torch.zeros(rows, offset, dtype=torch.long, device=device),
                torch.ones(rows, 0, dtype=torch.bool, device=device))

    def rope_for(self, shift, offset: int, max_window: int):
        """slots [R, T] -> the rotary table of those rows (LlamaGen's 2-D table, zero on the ``offset`` prefix rows;
        ``shift`` [R]: each row's left padding, which a layout model's positions skip)."""
        cfg = self.head.cfg
        table = rope_2d_table(self.target.grid, cfg.head_dim, offset, max_window, cfg.rope_theta).to(self.target.device)
        return lambda slots: table[slots]

    def token_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return codes

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.target.output(feature).float()

    def training_features(self, rows) -> torch.Tensor:
        """Teacher-forced features ``[B, N-1, D]`` of image rows 0..N-2 (no cache; for training): image row q
        approximates ``rows.following[:, q]``, the target's state predicting code q + 1 (``teacher.TeacherRows``)."""
        B, T = rows.ids.shape
        slots = torch.arange(T, device=rows.ids.device).expand(B, T)
        mask = attention_mask(slots, rows.valid, T)
        replayed = T - rows.following.shape[1]
        rope = self.rope_for(rows.shift, replayed, 0)
        return self.head(rows.ids, rows.hidden, rope(slots), mask)[:, replayed:]


class EagleSession:
    """One generation's drafter state: a static cache over [replayed prefix rows | image rows | scratch],
    one row per target row (cond rows, then uncond rows under CFG). Row slot s pairs the target's hidden
    state at its slot s with the token that follows it, so it sits where that hidden state sits."""

    def __init__(self, drafter: EagleDrafter, target_session, *, batch: int, cfg: bool, max_window: int):
        prefix = getattr(target_session, "prefix_hidden", None)
        if prefix is None:
            raise FastARError("the EAGLE drafter reads the target's hidden states: start the target session "
                              "with hidden=True")
        head, target = drafter.head, drafter.target
        self.drafter, self.head, self.batch, self.cfg = drafter, head, batch, cfg
        rows, self.offset = prefix.shape[0], prefix.shape[1] - 1
        N = target.grid[0] * target.grid[1]
        self.total_slots = self.offset + N + max_window  # scratch absorbs windows that run past the end
        self.rope = drafter.rope_for(getattr(target_session, "position_offset", None), self.offset, max_window)
        self.cache = KVCache(rows, head.cfg.num_key_value_heads, self.total_slots, head.cfg.head_dim,
                             head.fc.weight.dtype, target.device)
        tokens, self.prefix_valid = drafter.replayed_prefix(target_session, rows, self.offset)
        self.feature = None  # the last row's output, the next step's input feature
        if self.offset:
            self._run(tokens, prefix[:, :-1], torch.arange(self.offset, device=target.device).expand(rows, -1))
        # the drafter's steps compile while the target's run compiled (compiled.py: following_mode)
        self.target_step = getattr(target_session, "forward", None)
        self.steps = {}

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.cfg else x

    def _run(self, tokens, hidden, slots):
        slots = slots.clamp(max=self.total_slots - 1)
        mask = attention_mask(slots, self.prefix_valid, self.total_slots)
        return self.head(tokens, hidden, self.rope(slots), mask, self.cache, slots)

    def _output(self, feature) -> ModelOutput:
        logits = self.drafter.logits(feature)
        if self.cfg:
            return ModelOutput(cond=logits[: self.batch], uncond=logits[self.batch :])
        return ModelOutput(cond=logits)

    @torch.no_grad()
    def catch_up(self, seq, n, target: ModelOutput, target_start) -> ModelOutput:
        self.feature, out = self.run("caught_up", seq, n, target.hidden, target_start)
        return out

    @torch.no_grad()
    def step(self, tokens, position) -> ModelOutput:
        self.feature, out = self.run("stepped", tokens, position, self.feature)
        return out

    def run(self, name: str, *tensors):
        """Method ``name`` on ``tensors``: through torch.compile while the target's steps are compiled (one
        small layer, dozens of kernels per draft eagerly), else eagerly."""
        mode = following_mode(self.target_step)
        if mode is None:
            return getattr(self, name)(*tensors)
        if name not in self.steps:  # one per session: its repeated calls skip dynamo's full guards
            self.steps[name] = BoundStep(compiled_function(getattr(EagleSession, name), mode), weakref.ref(self))
        return self.steps[name](*tensors)

    def caught_up(self, seq, n, hidden, target_start):
        """The feature and output after re-feeding the rows the target just verified (its hidden states)."""
        width = hidden.shape[1]
        positions = target_start.unsqueeze(1) + 1 + torch.arange(width, device=seq.device)
        codes = seq.gather(1, positions.clamp(max=seq.shape[1] - 1))  # past the buffer: garbage rows
        tokens = self.drafter.token_ids(self._rows(codes))
        features = self._run(tokens, hidden, self._rows(positions) + self.offset)
        last = self._rows((n - target_start - 2).clamp(0, width - 1))  # row n-1 predicts token n
        feature = features.gather(1, last.view(-1, 1, 1).expand(-1, 1, features.shape[-1]))
        return feature, self._output(feature)

    @torch.no_grad()
    def grow(self, tokens, start, depth, ancestors, parent, first: int) -> ModelOutput:
        """Nodes of a draft tree (``DrafterSession.grow``): each row pairs its node's token with its parent's output
        feature (the root's: the catch-up's), written at the slot of position start + node, at its own position's
        RoPE, seeing the rows up to the root and its ancestors' rows."""
        if first <= 1:  # a new tree: its root's feature is the catch-up's
            self.node_features = self.feature.new_zeros(self.feature.shape[0], ancestors.shape[2], self.feature.shape[2])
            self.node_features[:, :1] = self.feature
        features, out = self.run("grown", tokens, start, depth, ancestors, parent, self.node_features, first)
        self.node_features[:, first:first + tokens.shape[1]] = features
        return out

    def grown(self, tokens, start, depth, ancestors, parent, node_features, first: int):
        """The features and outputs of tree nodes ``first``.. (``grow``)."""
        rows = self._rows
        parent_feature = node_features.gather(1, rows(parent).unsqueeze(-1).expand(-1, -1, node_features.shape[-1]))
        root = rows(start) + self.offset
        slots = (root[:, None] + first + torch.arange(tokens.shape[1], device=tokens.device)).clamp(max=self.total_slots - 1)
        mask = tree_mask(root, rows(ancestors), self.prefix_valid, self.total_slots)
        rope = self.rope(root[:, None] + rows(depth)[:, first:first + tokens.shape[1]])
        features = self.head(self.drafter.token_ids(rows(tokens)), parent_feature, rope, mask, self.cache, slots)
        return features, self._output(features)

    def stepped(self, tokens, position, feature):
        """The feature and output after one drafted token at ``position``."""
        slots = self._rows(position.unsqueeze(1)) + self.offset
        feature = self._run(self.drafter.token_ids(self._rows(tokens)), feature, slots)
        return feature, self._output(feature)


class LayoutEagleDrafter(EagleDrafter):
    """An EAGLE drafter for a target behind ``llm_decoder.LayoutSession`` (Chameleon family: LANTERN's Anole
    drafter). Its rows replay the prompt (row t: the target's hidden at slot t with the prompt token at
    t+1), padded slots hidden as the target hides them, 1-D RoPE at the target's positions (each row's
    from its first real token, as LANTERN shifts the unconditional rows), vocabulary ids in, the target's
    image-code logits out. With row-end tokens (Lumina-mGPT) its rows hold image codes only: those of a drafter
    trained so (``train-drafter``, ``skips_row_ends``), where a row's first code follows its row end's state."""

    def replayed_prefix(self, target_session, rows: int, offset: int):
        return target_session.prefix_ids[:, 1:], target_session.valid[:, :-1]

    def rope_for(self, shift, offset: int, max_window: int):
        cfg, dtype = self.head.cfg, self.head.fc.weight.dtype
        return lambda slots: rope_tables(slots - shift[:, None], cfg.head_dim, cfg.rope_theta, dtype)

    def token_ids(self, codes: torch.Tensor) -> torch.Tensor:
        return self.target.image_ids[codes]

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.target.image_logits(feature)

