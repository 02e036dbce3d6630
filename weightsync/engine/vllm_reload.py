"""Reloading received weights into vLLM's model in place, completely (runs in vLLM's worker).

vLLM's ``model_runner.reload_weights`` loads checkpoint-format tensors layer by layer
and re-runs each layer's post-load processing (on CPU: repacking Linear weights into
oneDNN handles). A layer that loads nothing of its own is skipped: vLLM logs
``Failed to load weights`` and puts its old kernel tensors back. That is right for a
layer the checkpoint does not cover, and wrong for a *tied* layer: with
``tie_word_embeddings`` the output layer's weight is the input embedding's Parameter,
so the checkpoint has no ``lm_head.weight``, the embedding loads new values, and the
output layer keeps the matmul packed from the boot weights. The engine then serves
new weights with the old output layer, while every byte check passes.

``reload_in_place`` therefore re-runs the post-load processing of every layer whose
parameters all alias parameters of another layer, after the reload, when the shared
tensors hold the new values. Every other layer is covered: the agent refuses a plan
that lacks any tensor of the served checkpoint.

Mixture-of-experts layers have a second gap. A fused-MoE layer's post-load step
builds its expert kernel once; on a weight update (its kernel already built) vLLM
copies the new weights into the kernel's tensors and skips the experts' own
post-load step. Where that step is what makes the kernel's layout (vLLM's CPU
experts prepack every expert matrix into blocks), the experts then compute with the
new values read in the wrong layout: a tiny Qwen3-MoE synced this way answered
nothing like a fresh boot of the same checkpoint, every byte check passing. So, for
each such layer on CPU, ``reload_in_place`` drops the built kernel before the
reload: vLLM then processes the new weights as it did at boot (kernel, padding,
prepacking) and copies the result into the tensors the engine computes with (GPU:
see ``experts_built_once``).

What the engine then computes is checked independently of this path by the
attestation probe (``vllm_probe.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn


def tied_layers(model: nn.Module) -> list[nn.Module]:
    """Layers with post-load processing whose every parameter is also another layer's
    parameter (the same tensor object): e.g. ``lm_head`` tied to ``embed_tokens``."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    tied = []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if params and getattr(module, "quant_method", None) is not None and all(
                len(owners[id(p)]) > 1 for p in params):
            tied.append(module)
    return tied


def experts_built_once(model: nn.Module) -> list:
    """The quantisation methods of fused-MoE layers on CPU whose built expert kernel
    has a post-load step of its own, which vLLM runs when it builds the kernel and
    skips on a weight update (see the module docstring).

    CPU only: that is where the gap was found and the rebuild is tested (against the
    trainer's model and a fresh boot). GPU expert kernels with a post-load step of
    their own exist too, but rebuilding a kernel under captured CUDA graphs has not
    run on a GPU here; there, vLLM's update stands and attestation is the check."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    base_step = FusedMoEExperts.process_weights_after_loading
    methods = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        weight = getattr(module, "w13_weight", None)
        if (experts is not None and type(experts).process_weights_after_loading is not base_step
                and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"):
            methods.append(method)
    return methods


def reload_in_place(model_runner, named: Iterable[tuple[str, torch.Tensor]], *, repair: bool = True) -> None:
    """Reloads ``named`` (checkpoint names and formats; an iterator is consumed as vLLM
    loads, so tensors can arrive while earlier ones load) into the runner's model,
    with the mixture-of-experts kernels rebuilt as at boot, then re-processes tied
    layers. ``repair=False`` exists only for fault injection: it reproduces vLLM's own
    behaviour (neither) so that attestation can be shown to catch it.
    """
    model = model_runner.get_model()
    tied = tied_layers(model)
    experts = experts_built_once(model) if repair else []
    kernels = [(method, method.moe_kernel) for method in experts]
    for method in experts:
        method.moe_kernel = None  # vLLM's post-load step then builds it, and lays the experts out, anew
    try:
        model_runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
    except BaseException:
        for method, kernel in kernels:  # a layer the failed reload never reached keeps its kernel
            if method.moe_kernel is None:
                method.moe_kernel = kernel
        _finish_cut_reload(model_runner, model)
        raise
    if not repair:
        return
    for layer in tied:
        _process_after_loading(layer)


def _finish_cut_reload(model_runner, model: nn.Module) -> None:
    """vLLM's reload moves every layer to the meta device as it starts, and back as the
    layer's weights complete; only its end puts the rest back. A reload cut short (the
    sender gone mid-stream, the deadline) skips that end: layers it never finished stay
    on the meta device, and the next reload failed on them ("'Parameter' object has no
    attribute 'weight_loader'"), so a torn vLLM took two rounds to heal. Ending it here
    puts every layer back (old values where nothing arrived; the engine is torn and
    stays paused until a whole round lands)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
    except ImportError:  # a vLLM without layerwise reload has nothing to end
        return
    try:
        finalize_layerwise_reload(model, model_runner.vllm_config.model_config)
    except Exception as exc:  # the original failure is the one to report; this one is logged
        logging.getLogger("weightsync.vllm").warning("could not end a reload cut short: %r", exc)


def _process_after_loading(layer: nn.Module) -> None:
    quant_method = layer.quant_method
    process = getattr(quant_method, "process_weights_after_loading", None)
    if process is None:
        return
    # vLLM's online quantisation marks layers it already processed; a reload must redo it.
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    with torch.no_grad():
        process(layer)


__all__ = ["reload_in_place", "tied_layers", "experts_built_once"]
