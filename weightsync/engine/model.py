"""The reference model: a small decoder-only transformer LM in plain torch.

Both sides build it from the same ``ModelConfig`` (a named preset or explicit
fields), so parameter names, dtypes and shapes agree between trainer and engine by
construction. ``forward`` is the batched causal pass used for training;
``forward_cached`` is the incremental pass the engine uses, reading and writing one
request's KV cache.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.errors import InvalidArgument


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference LM. Byte-level vocabulary by default."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 128
    seed: int = 0
    # Mixture of experts: with n_experts > 0 each layer's MLP is n_experts separate
    # SwiGLU experts (three weight tensors each, hidden size d_ff) and a router that
    # sends every token to its top experts_per_token -- the shape of MoE checkpoints,
    # where every expert's weights are tensors of their own.
    n_experts: int = 0
    experts_per_token: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"model config {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise InvalidArgument(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not isinstance(self.n_experts, int) or isinstance(self.n_experts, bool) or self.n_experts < 0:
            raise InvalidArgument(f"model config n_experts must be an integer >= 0, got {self.n_experts!r}")
        if self.n_experts and (not isinstance(self.experts_per_token, int)
                               or not 1 <= self.experts_per_token <= self.n_experts):
            raise InvalidArgument(f"model config experts_per_token must be between 1 and n_experts "
                                  f"({self.n_experts}), got {self.experts_per_token!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """Parses an explicit config; InvalidArgument on unknown or bad fields."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"model config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise InvalidArgument("model config must be a JSON object")
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown model config fields: {sorted(unknown)}")
        return cls(**fields)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),                                                   # ~0.2 M params
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=256),  # ~3.3 M
    "medium": ModelConfig(d_model=1024, n_layers=8, n_heads=8, d_ff=4096, max_seq_len=256),  # ~101 M
}


def resolve_config(model: str) -> ModelConfig:
    """A preset name (``tiny``, ``small``, ``medium``) or an explicit JSON config."""
    if model in PRESETS:
        return PRESETS[model]
    if model.lstrip().startswith("{"):
        return ModelConfig.from_json(model)
    raise InvalidArgument(f"unknown model {model!r}: use one of {sorted(PRESETS)} or a JSON config")


SHAPE_PROFILES = ("dense", "moe")


def config_for_size(total_bytes: int, tensors: int, *, seed: int = 0, profile: str = "dense") -> ModelConfig:
    """A config whose fp32 parameters total roughly ``total_bytes`` in about ``tensors`` tensors.

    Used by benchmarks. ``dense``: each layer holds 12 tensors (weights and biases of
    qkv, proj, fc1, fc2 and two LayerNorms), plus 5 outside the layers; d_ff = 4 *
    d_model. ``moe``: each layer holds 8 attention and LayerNorm tensors, a router,
    and 3 small tensors per expert (up to 128 experts per layer, at least 4 layers
    where the count allows; expert hidden size d_model / 2), so most tensors are
    small expert matrices, as in mixture-of-experts checkpoints.
    """
    if total_bytes <= 0 or tensors <= 0:
        raise InvalidArgument("total_bytes and tensors must be positive")
    if profile not in SHAPE_PROFILES:
        raise InvalidArgument(f"unknown shape profile {profile!r}; known: {list(SHAPE_PROFILES)}")
    params = total_bytes // 4
    if profile == "moe":
        experts, n_layers = 2, max(1, round((tensors - 5) / (9 + 3 * 2)))
        for candidate in (128, 64, 32, 16, 8, 4):
            layers = round((tensors - 5) / (9 + 3 * candidate))
            if layers >= 4:
                experts, n_layers = candidate, layers
                break
        # per layer ~ 4 d^2 (attention) + experts * 3 * d * d/2 (+ the router)
        d = int(math.sqrt(max(params - 576 * 64, 1) / (n_layers * (4 + 1.5 * experts))))
        d = max(32, d // 32 * 32)  # d_ff = d / 2 stays a multiple of 16
        return replace(ModelConfig(), d_model=d, n_layers=n_layers, n_heads=d // 16, d_ff=d // 2, max_seq_len=64,
                       seed=seed, n_experts=experts, experts_per_token=2)
    n_layers = max(1, (tensors - 5) // 12)
    # per layer ~ 12 d^2 (+ small terms); embeddings 2 * 256 * d
    d = max(16, int(math.sqrt(max(params - 512 * 64, 1) / (12 * n_layers))))
    d = max(16, d // 16 * 16)
    return replace(ModelConfig(), d_model=d, n_layers=n_layers, n_heads=d // 16, d_ff=4 * d, max_seq_len=64,
                   seed=seed)


class _Expert(nn.Module):
    """One SwiGLU expert: three weight tensors, no biases (as in MoE checkpoints)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Experts(nn.Module):
    """A router and ``n_experts`` experts; each token goes to its top ``experts_per_token``,
    weighted by its renormalised router probabilities."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top = cfg.experts_per_token
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(cfg.d_model, cfg.d_ff) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(flat), dim=-1).topk(self.top, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # only the experts some token chose
            rows, which = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, which].unsqueeze(-1))
        return out.reshape(x.shape)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.n_experts:
            self.moe = _Experts(cfg)
        else:  # dense: the parameter names stay blocks.N.fc1 / fc2
            self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
            self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.n_experts:
            return self.moe(x)
        return self.fc2(F.gelu(self.fc1(x)))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [..., T, D] -> three [..., H, T, Dh]
        *lead, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.cfg.d_model, dim=-1)
        shape = (*lead, t, self.cfg.n_heads, self.cfg.head_dim)
        return tuple(z.reshape(shape).transpose(-3, -2) for z in (q, k, v))  # type: ignore[return-value]

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        *lead, _, t, _ = y.shape
        return y.transpose(-3, -2).reshape(*lead, t, self.cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.ln1(x))
        x = x + self.proj(self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self._mlp(self.ln2(x))

    def forward_cached(self, x: torch.Tensor, cache: torch.Tensor, start: int) -> torch.Tensor:
        # x: [T, D]; cache: [2, H, S, Dh] for this layer; writes positions start..start+T
        q, k, v = self._split(self.ln1(x))
        t = x.shape[0]
        cache[0, :, start:start + t] = k
        cache[1, :, start:start + t] = v
        keys, values = cache[0, :, :start + t], cache[1, :, :start + t]
        # causal mask for the new tokens against everything cached so far
        mask = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.proj(self._merge(y))
        return x + self._mlp(self.ln2(x))


class ReferenceLM(nn.Module):
    """Decoder-only transformer LM (learned positions, pre-LN, untied head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)  # same config -> bitwise identical initial weights
        try:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        finally:
            torch.random.set_rng_state(generator_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (causal)."""
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def kv_shape(self) -> tuple[int, ...]:
        """Shape of one request's KV cache: [layers, 2, heads, max_seq, head_dim]."""
        c = self.cfg
        return (c.n_layers, 2, c.n_heads, c.max_seq_len, c.head_dim)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache: torch.Tensor, start: int, *,
                       all_logits: bool = False) -> torch.Tensor:
        """tokens [T] at positions start.. with ``cache`` (see kv_shape) -> logits of the last
        token ([V]), or of every token ([T, V]) with ``all_logits`` (scoring a probe)."""
        t = tokens.shape[0]
        x = self.embed(tokens) + self.pos(torch.arange(start, start + t))
        for i, block in enumerate(self.blocks):
            x = block.forward_cached(x, cache[i], start)
        return self.head(self.ln_f(x if all_logits else x[-1]))


__all__ = ["ModelConfig", "PRESETS", "SHAPE_PROFILES", "ReferenceLM", "resolve_config", "config_for_size"]
