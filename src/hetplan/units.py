"""Parsing of quantities with units (bandwidths, durations, counts) from user files."""

from __future__ import annotations

import re

from hetplan.errors import InputError, shown

_BANDWIDTH_TO_BYTES_PER_S = {
    "gbit/s": 1e9 / 8,
    "gbps": 1e9 / 8,
    "gb/s": 1e9,
    "gbyte/s": 1e9,
    "mbit/s": 1e6 / 8,
    "mbps": 1e6 / 8,
    "mb/s": 1e6,
    "tb/s": 1e12,
    "tbit/s": 1e12 / 8,
}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_bandwidth_bytes_per_s(value: object, field: str) -> float:
    """Returns bytes/s of '10 Gbit/s', '25Gbps', '600 GB/s', '400 MB/s' (bare number: Gbit/s)."""
    if isinstance(value, bool):
        raise InputError(field, f"expected a bandwidth such as '100 Gbit/s', got {shown(value)}")
    if isinstance(value, int | float):
        out = float(value) * 1e9 / 8
    else:
        text = str(value).strip()
        match = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]+)", text)
        if match is None:
            raise InputError(
                field, f"expected a bandwidth such as '100 Gbit/s' or '600 GB/s', got {shown(text)}"
            )
        unit = match.group(2).lower()
        if unit not in _BANDWIDTH_TO_BYTES_PER_S:
            raise InputError(
                field,
                f"unknown bandwidth unit {shown(match.group(2))} (use Gbit/s, Gbps, GB/s, MB/s)",
            )
        out = float(match.group(1)) * _BANDWIDTH_TO_BYTES_PER_S[unit]
    if out <= 0:
        raise InputError(field, "bandwidth must be positive")
    return out


_DURATION_S = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def duration_unit(longest_s: float) -> tuple[str, float]:
    """Returns the unit times up to ``longest_s`` read best in (days from two days, hours
    from two hours, else minutes) and its length in seconds."""
    if longest_s >= 2 * 86400:
        return "days", 86400.0
    if longest_s >= 2 * 3600:
        return "hours", 3600.0
    return "minutes", 60.0


def duration_text(*seconds: float, sep: str = " to ") -> str:
    """Returns durations for a person, in the unit of the longest: '3.50 days', '45.00
    minutes', '1.20 to 0.80 hours' (several joined by ``sep``)."""
    unit, length = duration_unit(max(seconds))
    return sep.join(f"{s / length:,.2f}" for s in seconds) + f" {unit}"


def parse_duration_s(value: object, field: str) -> float:
    """Returns seconds for '30d', '12h', '90m', '45s' or a bare number of seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        out = float(value)
    else:
        text = str(value).strip().lower()
        match = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text)
        if match is None or match.group(2) not in {*_DURATION_S, ""}:
            raise InputError(
                field, f"expected a duration such as '30d' or '12h', got {shown(value)}"
            )
        out = float(match.group(1)) * _DURATION_S.get(match.group(2), 1.0)
    if out <= 0:
        raise InputError(field, "duration must be positive")
    return out


def parse_count(value: object, field: str) -> float:
    """Returns a positive number from '300e9', '1.5e12', 1000 (for token counts and budgets)."""
    try:
        out = float(str(value).replace("_", ""))
    except ValueError:
        raise InputError(field, f"expected a number, got {shown(value)}") from None
    if not out > 0:
        raise InputError(field, "must be positive")
    return out
