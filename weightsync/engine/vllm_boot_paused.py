"""A vLLM that boots paused: ``--scheduler-cls weightsync.engine.vllm_boot_paused.scheduler``.

A vLLM restarted behind its agent (systemd, Kubernetes, a person) comes back serving
its boot weights. The agent tells that from vLLM's version record at its next poll
and fences it (pauses it) then; until that poll -- up to half a second, more when the
machine is busy -- a request sent straight to vLLM ran on the boot weights. An
engine the agent relaunches has the same window, from its first healthy answer to
the agent's pause. No poll can close it: the engine must not schedule anything before
someone who knows the fleet's version lets it.

vLLM builds its scheduler from ``--scheduler-cls`` (any callable, resolved by its
qualified name, called with the scheduler's arguments). ``scheduler`` below builds the
one vLLM would have built -- ``AsyncScheduler`` when vLLM schedules asynchronously
(its default where supported), ``Scheduler`` otherwise -- and pauses it before the
engine takes its first request (``PAUSED_ALL``: requests are queued, none is
scheduled). The engine answers ``/health`` and takes requests as always; ``/is_paused``
says ``true``. The agent lifts the pause the way it lifts its own: at once when the
fleet has no version yet, otherwise once a catch-up or a round has brought vLLM to the
fleet's version. Requests that arrived meanwhile then run on those weights.

A vLLM booted this way without an agent serves nothing until something calls its
``/resume``. Imported only inside vLLM's engine process (it imports vLLM).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler


def scheduler(vllm_config: Any, *args: Any, **kwargs: Any) -> Scheduler:
    """vLLM's own scheduler for this configuration, paused before its first step."""
    base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    built = base(vllm_config, *args, **kwargs)
    built.set_pause_state(PauseState.PAUSED_ALL)
    logging.getLogger("weightsync.vllm").warning(
        "vLLM boots paused (weightsync's scheduler, %s): it serves nothing until its agent lets it", base.__name__)
    return built


__all__ = ["scheduler"]
