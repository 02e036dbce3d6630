"""Sizes as people write them (``32MiB``, ``1GiB``, ``4096``): one parser for every option."""

from __future__ import annotations

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str) -> int:
    """``1GiB``, ``256MiB``, ``1000000`` -> bytes; ValueError otherwise."""
    text = str(text).strip()
    unit = next((u for u in UNITS if text.endswith(u)), "")  # longest units come first
    try:
        size = int(float(text[: len(text) - len(unit)]) * UNITS.get(unit, 1))
    except ValueError:
        raise ValueError(f"not a size: {text!r} (write it as 32MiB, 1GiB or a number of bytes)") from None
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


__all__ = ["UNITS", "parse_size"]
