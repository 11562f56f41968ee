"""Same-run A/B of the NVMe tier's start-up scan: `NvmeTier.open()` of this checkout
against the one at a git revision (its `kvtier/tiers/nvme.py` and `record.py`), on one
directory of --records records, alternated, warm (page cache hot) and cold (caches
dropped before each open: needs root; skipped with a note otherwise).

    python benchmarks/nvme_recovery.py --baseline-rev 966397a --directory /var/tmp/kvr \\
        [--records 100000] [--payload 4KiB] [--rounds 3] [--keep]

The records are written once through this checkout's tier (buffered, not synced; the
bytes are the same as a daemon writes) and reused: a directory that already holds them
is not rewritten. It is deleted at the end unless --keep. Put it on the real disk, not a
tmpfs. Each open is of a fresh tier object and is closed after; both versions must
recover the same records.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import xxhash

import kvtier.tiers.nvme as current
from kvtier.buffers import aligned_buffer
from kvtier.sizes import parse_size
from kvtier.tiers.record import RecordHeader, header_size_for

NS_ID = "bench|kv"
_REPO = Path(__file__).resolve().parent.parent
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def _load(rev: str, rel: str, name: str, scratch: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:{rel}"], capture_output=True, text=True, check=True, cwd=_REPO
    ).stdout
    path = scratch / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _baseline(rev: str, scratch: Path) -> ModuleType:
    """The revision's nvme.py, importing the revision's record.py (swapped in while it
    loads, so this checkout's record helpers are not measured as the baseline's)."""
    record = _load(rev, "kvtier/tiers/record.py", "kvtier.tiers.record_baseline", scratch)
    ours = sys.modules["kvtier.tiers.record"]
    sys.modules["kvtier.tiers.record"] = record
    try:
        return _load(rev, "kvtier/tiers/nvme.py", "kvtier.tiers.nvme_baseline", scratch)
    finally:
        sys.modules["kvtier.tiers.record"] = ours


def _populate(root: Path, records: int, payload_bytes: int) -> None:
    marker = root / f".bench-{records}x{payload_bytes}"
    if marker.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    payload = aligned_buffer(max(4096, -(-payload_bytes // 4096) * 4096))
    payload[:payload_bytes] = os.urandom(payload_bytes)
    digest = xxhash.xxh3_64_intdigest(memoryview(payload)[:payload_bytes])
    tier = current.NvmeTier(root, 1 << 50, direct_io=False, sync_writes=False)
    tier.open()
    started = time.perf_counter()
    try:
        for i in range(records):
            key = i.to_bytes(8, "little") * 4
            size = header_size_for(NS_ID, key)
            header = RecordHeader(NS_ID, key, 1, payload_bytes, digest, size)
            tier.write(header, [memoryview(payload)])
    finally:
        tier.close()
    os.sync()
    marker.touch()
    print(f"wrote {records} records in {time.perf_counter() - started:.1f} s", flush=True)


def _drop_caches() -> bool:
    os.sync()
    try:
        _DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def _open_s(module: ModuleType, root: Path, expect: int) -> float:
    tier = module.NvmeTier(root, 1 << 50, direct_io=True, sync_writes=False)
    started = time.perf_counter()
    report = tier.open()
    elapsed = time.perf_counter() - started
    tier.close()
    if len(report.records) != expect or report.dropped_corrupt or report.dropped_stale:
        raise SystemExit(f"{module.__name__} recovered {len(report.records)} of {expect}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--payload", default="4KiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="leave the records directory")
    args = parser.parse_args()
    root = args.directory / "kvtier-recovery-ab"
    try:
        _populate(root, args.records, parse_size(args.payload))
        with tempfile.TemporaryDirectory() as scratch:
            versions = {"baseline": _baseline(args.baseline_rev, Path(scratch)), "this": current}
            modes = ["warm", "cold"] if _drop_caches() else ["warm"]
            if "cold" not in modes:
                print("cold: skipped (cannot write /proc/sys/vm/drop_caches: not root?)")
            for module in versions.values():  # warm the cache (and the imports) once
                _open_s(module, root, args.records)
            times: dict[tuple[str, str], list[float]] = {
                (m, v): [] for m in modes for v in versions
            }
            for round_index in range(args.rounds):
                for mode in modes:
                    names = list(versions)
                    if round_index % 2:
                        names.reverse()
                    for name in names:
                        if mode == "cold":
                            _drop_caches()
                        times[mode, name].append(_open_s(versions[name], root, args.records))
        print(f"{args.records} records of {args.payload}, {args.rounds} rounds (open() seconds):")
        for mode in modes:
            base, this = times[mode, "baseline"], times[mode, "this"]
            ratios = sorted(b / t for b, t in zip(base, this, strict=True))
            print(
                f"  {mode}: baseline {statistics.median(base):7.2f} s -> this "
                f"{statistics.median(this):7.2f} s, paired speedup "
                f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}); "
                f"baseline {' '.join(f'{t:.2f}' for t in base)}, "
                f"this {' '.join(f'{t:.2f}' for t in this)}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
