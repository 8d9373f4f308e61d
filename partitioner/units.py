"""Parses and formats sizes and rates: "16GiB", "50GB/s", 1.5e12."""

from __future__ import annotations

import math
import re

from partitioner.errors import InputError

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse_size(value: int | float | str, name: str) -> float:
    """Returns the positive, finite number of bytes ``value`` stands for, not rounded."""
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number of bytes or a string like '16GiB'. Received: {value!r}.")
    if isinstance(value, (int, float)):
        number = float(value)
        unit = ""
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None or match.group(2).lower() not in _BYTE_UNITS:
            raise InputError(
                f"{name} {value!r} is not a size. Expected a positive number of bytes or a number "
                "with a unit such as '16GiB', '40GB' or '512MiB'."
            )
        number = float(match.group(1))
        unit = match.group(2).lower()
    else:
        raise InputError(f"{name} must be a number of bytes or a string like '16GiB'. Received: {value!r}.")
    if not math.isfinite(number) or number <= 0:
        raise InputError(f"{name} must be positive and finite. Received: {value!r}. Use e.g. '16GiB'.")
    return number * _BYTE_UNITS[unit]


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Returns a byte count from an int, a float or a string such as "16GiB" or "40 GB".

    Args:
        value: bytes as a number, or a number followed by B, KB, MB, GB, TB (powers of 1000)
            or KiB, MiB, GiB, TiB (powers of 1024).
        name: what the value is, for the error message.

    Raises:
        InputError: for negative, zero (or under one byte), non-finite or unparseable values.

    Example:
        >>> parse_bytes("16GiB")
        17179869184
    """
    num_bytes = round(_parse_size(value, name))
    if num_bytes < 1:
        raise InputError(f"{name} must be at least one byte. Received: {value!r}. Use e.g. '16GiB'.")
    return num_bytes


def parse_rate(value: int | float | str, *, name: str = "rate", unit: str = "bytes/s") -> float:
    """Returns a positive rate from a number or a string like "50GB/s", "1.5e12" or "900 GiB/s".

    Args:
        value: the rate as a number, or as a size string optionally followed by "/s".
        name: what the value is, for the error message.
        unit: the unit of a bare number, for the error message.

    Raises:
        InputError: for negative, zero, non-finite or unparseable values.

    Example:
        >>> parse_rate("50GB/s")
        50000000000.0
    """
    if isinstance(value, str):
        text = value.strip()
        if text.lower().endswith("/s"):
            text = text[:-2]
        return _parse_size(text if text else value, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number of {unit} or a string like '50GB/s'. Received: {value!r}.")
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be positive and finite ({unit}). Received: {value!r}.")
    return float(value)


def format_bytes(num_bytes: float) -> str:
    """Formats bytes with a binary unit: 1536 -> '1.5 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """Formats a duration with a readable unit: 0.0123 -> '12.3 ms'."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def format_flops(flops: float) -> str:
    """Formats a FLOP count with an SI prefix: 2.5e9 -> '2.50 G'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {prefix}"
    return f"{flops:.0f}"
