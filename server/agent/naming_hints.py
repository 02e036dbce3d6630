"""Why a plan's tensor names may not be the engine's, said in the refusal: a wrapped
module's names (torch.compile, DDP, FSDP prefixes) or a layer's experts fused into one
tensor where the engine's checkpoint keeps them apart."""

from __future__ import annotations

# Segments torch's wrappers put in front of a module's parameter names: torch.compile
# (``_orig_mod``), DistributedDataParallel (``module``), FSDP1 and activation
# checkpointing when their names are not cleaned.
WRAPPER_SEGMENTS = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def unwrapped(name: str) -> str:
    """``name`` without the wrapper segments (anywhere in it: wrappers nest)."""
    parts = [p for p in name.split(".") if f"{p}." not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def naming_hint(unknown: list[str], specs) -> str:
    """Why a plan's names may not be the engine's, where it can be told: a wrapped
    module's names, or fused experts. Empty otherwise."""
    return wrapper_hint(unknown, specs) or fused_experts_hint(unknown, specs)


def wrapper_hint(unknown: list[str], specs) -> str:
    """Names of a wrapped module (``torch.compile(model).named_parameters()`` gives
    ``_orig_mod.embed.weight``) where the engine has the bare ones."""
    for name in unknown:
        bare = unwrapped(name)
        if bare != name and bare in specs:
            segments = sorted({f"{p}." for p in name.split(".") if f"{p}." in WRAPPER_SEGMENTS})
            return (f"; {name!r} is the engine's {bare!r} under a wrapper's {' '.join(segments)} prefix "
                    f"(torch.compile, DistributedDataParallel, FSDP): send the wrapped module's own tensors "
                    f"(model._orig_mod, model.module) or their names without it")
    return ""


def fused_experts_hint(unknown: list[str], specs) -> str:
    """A hint for the commonest such refusal: a trainer whose model holds a layer's
    experts fused into one tensor (transformers 5 loads Qwen-MoE and Mixtral so:
    ``mlp.experts.gate_up_proj``), against an engine whose checkpoint keeps every
    expert's matrices apart (``mlp.experts.0.gate_proj.weight``). Empty otherwise."""
    for name in unknown:
        parent = name.rpartition(".")[0] + "."
        example = next((n for n in specs if n.startswith(parent) and n[len(parent):len(parent) + 1].isdigit()), None)
        if example is not None:
            return (f"; the engine's checkpoint keeps each expert's matrices apart (e.g. {example!r}) where the "
                    f"plan has one tensor for all of a layer's experts: send the model's tensors by checkpoint "
                    f"names (docs/guides/trainer.md: 'Mixture-of-experts models')")
    return ""
