"""Scoring an attestation probe with vLLM's own model, while vLLM is paused (runs in its worker).

A paused vLLM schedules nothing, so the probe cannot go through the OpenAI API; and
resuming to ask would serve unchecked weights. Instead the worker runs its model's
forward directly: vLLM's embedding, its fused and repacked Linear kernels, norms,
rotary embedding, output layer and logits processor -- everything that holds weights,
in the form vLLM computes with. Only the attention *kernel* is replaced, for the
duration of the probe, by a causal softmax attention over the probe sequence
(attention holds no weights, and the real kernel needs KV-cache blocks that belong to
the requests a KEEP pause holds). The KV cache, the scheduler and the requests are
never touched.

Attention variants the stand-in does not reproduce (sliding windows shorter than the
probe, logit soft-capping, encoder or MLA attention) are refused before the sync with
a clear error instead of being compared approximately.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class ProbeUnsupported(RuntimeError):
    """The model uses an attention variant the probe cannot reproduce exactly."""


def attention_layers(vllm_config) -> list[nn.Module]:
    """Every attention layer vLLM registered for this model (one per decoder layer).

    vLLM's forward context registers other layers beside them (a mixture-of-experts
    model's expert runners, LoRA's linear layers); those hold weights and run as they
    are, so only its attention kinds (``AttentionLayerBase``: attention, MLA, state
    space mixers) count here."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return [layer for layer in vllm_config.compilation_config.static_forward_context.values()
            if isinstance(layer, AttentionLayerBase)]


def check_supported(vllm_config, longest: int) -> None:
    """Raises ProbeUnsupported if the probe cannot score this model faithfully."""
    from vllm.model_executor.layers.attention import Attention

    layers = attention_layers(vllm_config)
    if not layers:
        raise ProbeUnsupported("the model registers no attention layers")
    for layer in layers:
        if type(layer) is not Attention:
            raise ProbeUnsupported(f"attention layer {type(layer).__name__} is not plain decoder attention")
        if str(getattr(layer, "attn_type", "decoder")).lower().split(".")[-1] != "decoder":
            raise ProbeUnsupported(f"attention type {layer.attn_type} is not decoder attention")
        window = getattr(layer, "sliding_window", None)
        if window is not None and window < longest:
            raise ProbeUnsupported(f"sliding window {window} is shorter than a probe sequence ({longest})")
        if getattr(layer.impl, "logits_soft_cap", None):
            raise ProbeUnsupported("attention logit soft-capping is not reproduced by the probe")


def _causal_attention(layer: nn.Module):
    """A stand-in for ``Attention.forward`` over one whole sequence (no KV cache)."""
    heads, kv_heads, size, size_v = layer.num_heads, layer.num_kv_heads, layer.head_size, layer.head_size_v
    scale = layer.impl.scale

    def forward(query, key, value, output_shape=None, output_dtype=None):
        t = query.shape[0]
        q = query.reshape(t, heads, size).transpose(0, 1).float()
        k = key.reshape(t, kv_heads, size).transpose(0, 1).float()
        v = value.reshape(t, kv_heads, size_v).transpose(0, 1).float()
        if kv_heads != heads:  # grouped-query attention: each KV head serves a group of query heads
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(0, 1).reshape(t, heads * size_v).to(output_dtype or query.dtype)
    return forward


@contextlib.contextmanager
def probe_attention(vllm_config) -> Iterator[None]:
    """Swaps every attention layer's forward for ``_causal_attention``; always restores."""
    layers = attention_layers(vllm_config)
    try:
        for layer in layers:
            layer.forward = _causal_attention(layer)  # instance attribute shadows the class's forward
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def score(model_runner, vllm_config, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Teacher-forced log-probs of each sequence through vLLM's model (see module docstring)."""
    from vllm.forward_context import set_forward_context

    check_supported(vllm_config, max(len(s) for s in sequences))
    model = model_runner.get_model()
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode(), probe_attention(vllm_config):
        for seq in sequences:
            tokens = torch.tensor(list(seq), dtype=torch.long, device=device)
            positions = torch.arange(len(seq), dtype=torch.long, device=device)
            # skip_compiled: run the eager module, never a captured graph or a new compile.
            with set_forward_context(None, vllm_config, num_tokens=len(seq), skip_compiled=True):
                hidden = model(input_ids=tokens, positions=positions)
                logits = model.compute_logits(hidden)
            logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
            out.append(logprobs.gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1).cpu().tolist())
    return out


__all__ = ["score", "check_supported", "probe_attention", "ProbeUnsupported"]
