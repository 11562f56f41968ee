"""Where a daemon's RssAnon goes: the daemon run under a SIGUSR1 accounting hook.

    PYTHONPATH=. python benchmarks/rss_account.py serve --config kvtier.toml
    kill -USR1 <pid>   # writes $KVTIER_RSS_ACCOUNT (default /tmp/kvtier-rss-<pid>.json)

`benchmarks/scale.py --account` starts its daemon this way and takes an account after
the fill and after the restart. An account is:

* RssAnon split by mapping from /proc/self/smaps: the brk heap, the anonymous mappings
  the catalog's columns live in (matched by address), glibc's thread arenas (64 MiB
  aligned reservations), and every other anonymous mapping;
* the bytes of every buffer reachable from the `Store` (numpy arrays by their owner,
  `array.array`s, bytes/bytearrays, mmaps, and the containers themselves by
  `sys.getsizeof`), summed by attribute path (`residency.catalog._keys`), each object
  counted once, on the first path that reaches it;
* the objects the garbage collector tracks, by type (the top ones).

The hook runs in the main thread between bytecodes (the event loop's thread), so it reads
the structures as the loop left them. It is a measuring tool: it walks everything once
(seconds at a million blocks) and writes nothing the daemon reads.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import re
import signal
import sys
import time
import weakref
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, FunctionType, MethodType, ModuleType
from typing import Any

_ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's reservation
_OBMALLOC_ARENA = 1 << 20  # CPython 3.10+'s arena for objects of up to 512 bytes
_STACK = 8 << 20  # a thread's default stack
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def smaps_anon() -> list[dict[str, Any]]:
    """Each mapping with its Anonymous kB (those with any)."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = _MAPPING.match(line)
        if m:
            current = {
                "start": int(m.group(1), 16),
                "end": int(m.group(2), 16),
                "perms": m.group(3),
                "name": m.group(4).strip(),
                "anon": 0,
            }
            out.append(current)
        elif line.startswith("Anonymous:") and current is not None:
            current["anon"] = int(line.split()[1]) * 1024
    return [m for m in out if m["anon"]]


def _mmap_address(m: mmap.mmap) -> int | None:
    try:
        view = (ctypes.c_char * 1).from_buffer(m)
    except (TypeError, ValueError, BufferError):
        return None
    address = ctypes.addressof(view)
    del view
    return address


def _buffer_bytes(obj: Any) -> int:
    """Bytes an object holds beyond its header (approximately what malloc gave it)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) if obj.base is None else 0  # a view owns nothing
    if isinstance(obj, array):
        return obj.buffer_info()[1] * obj.itemsize
    if isinstance(obj, mmap.mmap):
        return 0  # counted from smaps (resident, not mapped)
    try:
        return sys.getsizeof(obj)
    except TypeError:
        return 0


_UNSET = object()
_SKIP = (ModuleType, FunctionType, MethodType, type, FrameType)


def _children(obj: Any) -> Iterable[tuple[str, Any]]:
    import numpy as np

    if isinstance(obj, np.ndarray):
        if obj.base is not None:
            yield ".base", obj.base
        return
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(obj.items()):
            if i >= 64 and len(obj) > 1024:  # a big dict: its values, under one name
                yield "[*]", v
            else:
                yield f"[{k!r:.40}]", v
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield "[*]", v
        return
    if isinstance(obj, (str, bytes, bytearray, int, float, array, memoryview, mmap.mmap)):
        if isinstance(obj, memoryview):
            yield ".obj", obj.obj
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in d.items():
            yield f".{k}", v
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            value = getattr(obj, name, _UNSET)
            if value is not _UNSET:
                yield f".{name}", value


def walk(root: Any, name: str, max_depth: int = 9) -> dict[str, int]:
    """Bytes by path (folded to `max_depth` components), every object counted once."""
    seen: set[int] = set()
    by_path: Counter[str] = Counter()
    stack: list[tuple[str, Any, int]] = [(name, root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP) or obj is None:
            continue
        seen.add(id(obj))
        by_path[path] += _buffer_bytes(obj)
        for label, child in _children(obj):
            child_path = path if depth >= max_depth or label == "[*]" else path + label
            if label == "[*]" and depth < max_depth:
                child_path = path + "[*]"
            stack.append((child_path, child, depth + 1))
    return dict(by_path)


def _mmaps_by_path(root: Any, name: str) -> dict[int, str]:
    """Start address -> path of each mmap reachable from `root` (the catalog's columns)."""
    out: dict[int, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP) or obj is None or depth > 12:
            continue
        seen.add(id(obj))
        if isinstance(obj, mmap.mmap):
            address = _mmap_address(obj)
            if address is not None:
                out[address] = path
            continue
        for label, child in _children(obj):
            stack.append((path + ("" if label == "[*]" else label), child, depth + 1))
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_state() -> dict[str, Any]:
    """glibc's own view: mallinfo2 (all arenas) and malloc_info's per-arena totals, so
    free-but-resident heap (a thread arena's top, which malloc_trim does not shrink) is
    told from memory in use."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    out: dict[str, Any] = {f: getattr(info, f) for f, _ in _Mallinfo2._fields_}
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    xml = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    heaps = []
    for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):

        def total(kind: str, body: str = body) -> int:
            m = re.search(rf'<total type="{kind}" count="\d+" size="(\d+)"/>', body)
            return int(m.group(1)) if m else 0

        current = re.search(r'<system type="current" size="(\d+)"/>', body)
        heaps.append(
            {
                "nr": int(nr),
                "free_fast": total("fast"),
                "free_rest": total("rest"),
                "system_current": int(current.group(1)) if current else 0,
            }
        )
    out["heaps"] = heaps
    return out


def account() -> dict[str, Any]:
    from kvtier.engine.store import Store

    began = time.perf_counter()
    del Store
    stores = [s for s in (ref() for ref in _STORES) if s is not None]
    maps = smaps_anon()
    mmaps = _mmaps_by_path(stores[0], "store") if stores else {}
    split: Counter[str] = Counter()
    columns: Counter[str] = Counter()
    for m in maps:
        if m["name"] == "[heap]":
            split["heap (brk)"] += m["anon"]
        elif m["start"] in mmaps:
            split["catalog/policy mmaps"] += m["anon"]
            columns[mmaps[m["start"]]] += m["anon"]
        elif m["start"] % _ARENA_ALIGN == 0 and m["end"] - m["start"] <= _ARENA_ALIGN:
            split["thread arenas (64 MiB aligned)"] += m["anon"]
        elif m["end"] - m["start"] == _OBMALLOC_ARENA and not m["name"]:
            split["1 MiB mappings (Python's object arenas)"] += m["anon"]
        elif m["end"] - m["start"] == _STACK and not m["name"]:
            split["8 MiB mappings (thread stacks)"] += m["anon"]
        elif m["name"]:
            split["named (libraries' data, the stack)"] += m["anon"]
        else:
            split["other anonymous"] += m["anon"]
    by_path = walk(stores[0], "store") if stores else {}
    tracked = Counter(type(o).__name__ for o in gc.get_objects())
    big_other = sorted(
        (
            m
            for m in maps
            if m["name"] == ""
            and m["start"] not in mmaps
            and m["end"] - m["start"] not in (_OBMALLOC_ARENA, _STACK)
        ),
        key=lambda m: -m["anon"],
    )[:12]
    status = Path("/proc/self/status").read_text()
    rss_anon = int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]
    return {
        "rss_anon_bytes": rss_anon,
        "smaps_split_bytes": dict(split.most_common()),
        "mmap_columns_bytes": dict(columns.most_common()),
        "largest_other_anon": [
            {"start": hex(m["start"]), "size": m["end"] - m["start"], "anon": m["anon"]}
            for m in big_other
        ],
        "other_anon_mappings": sorted(
            [m["end"] - m["start"], m["anon"]]
            for m in maps
            if m["name"] == ""
            and m["start"] not in mmaps
            and not (m["start"] % _ARENA_ALIGN == 0 and m["end"] - m["start"] <= _ARENA_ALIGN)
        ),
        "malloc": malloc_state(),
        "reachable_bytes_total": sum(by_path.values()),
        "reachable_bytes_top": dict(sorted(by_path.items(), key=lambda kv: -kv[1])[:60]),
        "gc_tracked": sum(tracked.values()),
        "gc_tracked_top": dict(tracked.most_common(15)),
        "gc_frozen": gc.get_freeze_count(),
        "account_s": round(time.perf_counter() - began, 2),
    }


def _rss_anon() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]


def _on_signal(signum: int, frame: FrameType | None) -> None:
    out = os.environ.get("KVTIER_RSS_ACCOUNT") or f"/tmp/kvtier-rss-{os.getpid()}.json"
    result = account()
    # Last (it changes what it measures): how much of RssAnon malloc_trim hands back,
    # i.e. free heap rather than live data; not when the caller measures on after it.
    if not Path(out + ".no-trim").exists():
        before = _rss_anon()
        began = time.perf_counter()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        result["malloc_trim_s"] = round(time.perf_counter() - began, 4)
        result["malloc_trim_returned_bytes"] = before - _rss_anon()
    tmp = out + ".tmp"
    Path(tmp).write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)


_STORES: list[weakref.ref[Any]] = []


def main() -> int:
    signal.signal(signal.SIGUSR1, _on_signal)
    # The daemon freezes its start-up objects (gc.freeze), so gc.get_objects() does not
    # list its Store: note each one as it is made.
    from kvtier.engine.store import Store

    made = Store.__init__

    def noting(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        _STORES.append(weakref.ref(self))

    Store.__init__ = noting  # type: ignore[method-assign]
    from kvtier.cli import main as cli_main

    sys.argv = ["kvtier", *sys.argv[1:]]
    return int(cli_main() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
