"""The engines an agent can drive, each behind an ``EngineAdapter`` (``adapter.py``).

``make_adapter`` is the one place that maps an engine's name to its adapter; the
adapters are imported only when chosen (vLLM's and SGLang's pull in HTTP and
checkpoint code a reference agent never needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync.errors import InvalidArgument

if TYPE_CHECKING:
    from weightsync.engine.adapter import EngineAdapter

ENGINES = ("reference", "vllm", "sglang")


def check_engine_choice(engine: str, url: str) -> None:
    """InvalidArgument for an unknown engine, or an HTTP engine without its URL."""
    if engine not in ENGINES:
        raise InvalidArgument(f"engine {engine!r} is not supported; use {', '.join(ENGINES)}")
    if engine != "reference" and not url:
        raise InvalidArgument(f"--engine {engine} needs --engine-url (e.g. http://127.0.0.1:8000)")


def make_adapter(engine: str, *, url: str = "", checkpoint_dir: str = "", model: str = "tiny",
                 step_delay_s: float = 0.0, sglang_flattened: bool = False) -> EngineAdapter:
    """The adapter for ``engine``: the reference engine in this process (``model``,
    ``step_delay_s``), or a vLLM or SGLang server at ``url`` (SGLang also reads its
    checkpoint's tensor specs from ``checkpoint_dir``; ``sglang_flattened``: it takes
    the group transport's flattened layout)."""
    check_engine_choice(engine, url)
    adapter: EngineAdapter
    if engine == "vllm":
        from weightsync.engine.vllm import VllmAdapter
        adapter = VllmAdapter(url)
    elif engine == "sglang":
        from weightsync.engine.sglang import SglangAdapter
        adapter = SglangAdapter(url, checkpoint_dir=checkpoint_dir, flattened=sglang_flattened)
    else:
        from weightsync.engine.model import PRESETS, resolve_config
        from weightsync.engine.reference import ReferenceAdapter
        adapter = ReferenceAdapter(resolve_config(model), step_delay_s=step_delay_s)
    # What the agent reports as its engine's model (weightsync status shows it): the
    # reference engine's preset, or the server a vLLM or SGLang agent drives.
    adapter.model_label = (f"{engine}:{model}" if model in PRESETS else f"{engine}:custom") \
        if engine == "reference" else f"{engine}@{url}"
    return adapter


__all__ = ["ENGINES", "check_engine_choice", "make_adapter"]
