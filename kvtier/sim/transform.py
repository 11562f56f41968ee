"""Other traffic from one trace: re-timed, re-interleaved, rescaled request streams.

A policy tuned on one trace can be fitted to it; a transformed trace is traffic it was
not tuned on, with the same kind of structure (multi-turn conversations whose next turn
re-sends the previous prompt and extends it). Each transform is a pure function of the
requests and a seed, named on the command line as `NAME[:ARG[:ARG]]` and chained with
commas (`kvtier replay T.jsonl --transform interleave:7,gaps:2`):

* `interleave:SEED` — each conversation starts at a new random time within the trace's
  span, its turns keeping their gaps: other neighbours, other reuse distances.
* `shift:SEED:SIGMA_S` — each arrival moves by a uniform ±SIGMA_S seconds; turns of one
  conversation stay in order (a turn never arrives before the one it extends).
* `gaps:FACTOR` — the gaps between a conversation's turns × FACTOR (2: users take twice
  as long to reply, so a block is asked for again twice as far back).
* `speed:FACTOR` — every timestamp ÷ FACTOR (the order, so the replay's figures, stay).
* `scale:FACTOR` — prompts FACTOR × as long (as many blocks, rounded up); each block of
  the original becomes the same run of new ids wherever it occurs, so equal ids still
  mean equal prefixes.
* `sample:FRACTION:SEED` — keep that fraction of conversations (less traffic).
* `head:N` — the first N requests.

A conversation is the requests whose chains begin with the same block id (the trace
chains ids by prefix, so a later turn begins where the first did): in the shared trace
2,211 conversations of 3,993 requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from kvtier.errors import InvalidArgument
from kvtier.sim.replay import Request

__all__ = ["TRANSFORMS", "parse_transforms", "transform"]


def _conversations(requests: Sequence[Request]) -> dict[int, list[int]]:
    """Request indices by conversation (first block id), in trace order."""
    convs: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        root = request.hash_ids[0] if request.hash_ids else -1 - index
        convs.setdefault(root, []).append(index)
    return convs


def _sorted(requests: list[Request]) -> list[Request]:
    # Stable: requests at one timestamp keep their relative order.
    return sorted(requests, key=lambda r: r.timestamp_ms)


def interleave(requests: Sequence[Request], seed: int) -> list[Request]:
    rng = random.Random(seed)
    if not requests:
        return []
    start = min(r.timestamp_ms for r in requests)
    span = max(r.timestamp_ms for r in requests) - start
    out: list[Request] = []
    for indices in _conversations(requests).values():
        first = requests[indices[0]].timestamp_ms
        offset = start + rng.uniform(0, span) - first
        out.extend(
            replace(requests[i], timestamp_ms=requests[i].timestamp_ms + offset) for i in indices
        )
    return _sorted(out)


def shift(requests: Sequence[Request], seed: int, sigma_s: float) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request | None] = [None] * len(requests)
    for indices in _conversations(requests).values():
        previous = -math.inf
        for i in indices:
            moved = requests[i].timestamp_ms + rng.uniform(-sigma_s, sigma_s) * 1e3
            moved = max(moved, previous, 0.0)  # never before the turn it extends
            out[i] = replace(requests[i], timestamp_ms=moved)
            previous = moved
    return _sorted([r for r in out if r is not None])


def gaps(requests: Sequence[Request], factor: float) -> list[Request]:
    out: list[Request | None] = [None] * len(requests)
    for indices in _conversations(requests).values():
        first = requests[indices[0]].timestamp_ms
        for i in indices:
            t = first + (requests[i].timestamp_ms - first) * factor
            out[i] = replace(requests[i], timestamp_ms=t)
    return _sorted([r for r in out if r is not None])


def speed(requests: Sequence[Request], factor: float) -> list[Request]:
    return [replace(r, timestamp_ms=r.timestamp_ms / factor) for r in requests]


def scale(requests: Sequence[Request], factor: float) -> list[Request]:
    """Prompts × factor. Old block i (at position i, as every id always is) becomes new
    positions ceil(i·f) .. ceil((i+1)·f) − 1, so the run depends on the id alone; new ids
    are old id × K + offset in the run (K ≥ the longest run) for f > 1, and for f < 1 the
    id of the old block a new one ends in (it names the same prefix)."""
    out = []
    run = math.ceil(factor) + 1
    for r in requests:
        n = len(r.hash_ids)
        m = max(math.ceil(n * factor), 1) if n else 0
        ids: list[int] = []
        if factor >= 1:
            for i, block in enumerate(r.hash_ids):
                lo, hi = math.ceil(i * factor), math.ceil((i + 1) * factor)
                ids.extend(block * run + k for k in range(hi - lo))
        else:
            for j in range(m):
                ids.append(r.hash_ids[min(math.ceil((j + 1) / factor) - 1, n - 1)])
            ids = list(dict.fromkeys(ids))  # rounding may name one old block twice
        tokens = max(1, min(round(r.input_tokens * factor), 512 * len(ids)))
        out.append(replace(r, input_tokens=tokens, hash_ids=ids))
    return out


def sample(requests: Sequence[Request], fraction: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    keep = {root for root in _conversations(requests) if rng.random() < fraction}
    return [r for r in requests if (r.hash_ids[0] if r.hash_ids else None) in keep]


def head(requests: Sequence[Request], n: int) -> list[Request]:
    return list(requests[:n])


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    args: tuple[str, ...]  # argument names, for messages
    types: tuple[Callable[[str], float | int], ...]
    apply: Callable[..., list[Request]]
    check: Callable[..., bool]


TRANSFORMS: dict[str, _Spec] = {
    "interleave": _Spec("interleave", ("SEED",), (int,), interleave, lambda s: True),
    "shift": _Spec("shift", ("SEED", "SIGMA_S"), (int, float), shift, lambda s, g: g >= 0),
    "gaps": _Spec("gaps", ("FACTOR",), (float,), gaps, lambda f: f > 0),
    "speed": _Spec("speed", ("FACTOR",), (float,), speed, lambda f: f > 0),
    "scale": _Spec("scale", ("FACTOR",), (float,), scale, lambda f: 0 < f <= 64),
    "sample": _Spec("sample", ("FRACTION", "SEED"), (float, int), sample, lambda f, s: 0 < f <= 1),
    "head": _Spec("head", ("N",), (int,), head, lambda n: n >= 0),
}

Transform = Callable[[Sequence[Request]], list[Request]]


def parse_transforms(text: str) -> list[Transform]:
    """`NAME:ARG,...` → the transforms, in order; InvalidArgument says what is wrong."""
    steps: list[Transform] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, *raw = part.split(":")
        spec = TRANSFORMS.get(name)
        if spec is None:
            raise InvalidArgument(
                f"unknown transform {name!r}; choose one of {', '.join(TRANSFORMS)}"
            )
        usage = ":".join((name, *spec.args))
        if len(raw) != len(spec.args):
            raise InvalidArgument(f"transform {part!r}: expected {usage}")
        try:
            values = [convert(v) for convert, v in zip(spec.types, raw, strict=True)]
        except ValueError:
            raise InvalidArgument(f"transform {part!r}: expected {usage} (numbers)") from None
        if not spec.check(*values) or not all(math.isfinite(v) for v in values):
            raise InvalidArgument(f"transform {part!r}: argument out of range for {usage}")
        steps.append(partial(_apply, spec, tuple(values)))
    return steps


def _apply(
    spec: _Spec, values: tuple[float | int, ...], requests: Sequence[Request]
) -> list[Request]:
    return spec.apply(requests, *values)


def transform(requests: Sequence[Request], text: str) -> list[Request]:
    """The requests after every transform in `text` (see the module docstring)."""
    out = list(requests)
    for step in parse_transforms(text):
        out = step(out)
    return out
