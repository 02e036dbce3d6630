"""Tensor-count sweeps for the benches that build their fleet for one model
(``--hosts``, ``--trainer-ranks``): each count is a run of its own (its engines boot
with that count's model), and the sweep reports every run and, per row, the time per
byte at each count over the same at the first count (1.0 = the count costs nothing),
from the one invocation -- as the single-trainer bench does within one fleet.
"""

from __future__ import annotations

import json
from collections.abc import Callable


def sweep_counts(run_one: Callable[[int], dict], counts: list[int], *, row_key: str, json_path: str = "",
                 on_report: Callable[[int, dict], None] | None = None) -> dict:
    """``run_one(count)`` for every count, in order (``on_report(count, report)`` after
    each: a sweep of fleets takes minutes); returns (and optionally writes) the sweep:
    ``tensor_counts``, ``reports`` (each run's own report) and ``per_byte_vs_first``
    ({row: [ratio per count]}, rows named by ``row_key``)."""
    reports = []
    for count in counts:
        reports.append(run_one(count))
        if on_report is not None:
            on_report(count, reports[-1])
    report = {"tensor_counts": list(counts), "reports": reports, "per_byte_vs_first": per_byte_vs_first(reports, row_key)}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def per_byte_vs_first(reports: list[dict], row_key: str) -> dict[str, list[float]]:
    """Per row found in every report: median seconds per payload byte at each count over
    the same at the first. Per byte, because one ``--size`` split into more tensors
    totals slightly different bytes."""
    def per_byte(report: dict) -> dict[str, float]:
        return {r[row_key]: r["median_s"] / r["payload_bytes"] for r in report["results"]}

    measured = [per_byte(report) for report in reports]
    rows = [name for name in measured[0] if all(name in m for m in measured)]
    return {name: [m[name] / measured[0][name] for m in measured] for name in rows}


def sweep_lines(report: dict) -> list[str]:
    """One line per row: its time per byte at each count against the first count."""
    counts = report["tensor_counts"]
    lines = []
    for name, ratios in report["per_byte_vs_first"].items():
        parts = ", ".join(f"{ratio:.2f}x at {count}" for count, ratio in zip(counts[1:], ratios[1:], strict=True))
        lines.append(f"{name}: time per byte against {counts[0]} tensors: {parts}")
    return lines


__all__ = ["sweep_counts", "per_byte_vs_first", "sweep_lines"]
