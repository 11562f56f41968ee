"""Byte sizes as people write them: IEC strings (`512MiB`, `2GiB`), SI (`4GB`) or integers."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in `value`; raises ValueError with the accepted forms when it cannot be read."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot read size {value!r}: write bytes as an integer or with a unit "
            "(KiB, MiB, GiB, TiB; or KB, MB, GB, TB), e.g. '512MiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(size_bytes: int) -> str:
    """The shortest exact IEC string for `size_bytes` (e.g. 1073741824 -> '1GiB')."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= factor and size_bytes % factor == 0:
            return f"{size_bytes // factor}{unit}"
    return str(size_bytes)


def human_size(size_bytes: float) -> str:
    """An approximate IEC string for display (e.g. '1.5 GiB')."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= factor:
            return f"{size_bytes / factor:.1f} {unit}"
    return f"{int(size_bytes)} B"
