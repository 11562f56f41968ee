"""Recovery of the segment layout in columns (issue 22 item 2): footers decoded into numpy
columns give exactly the records `read_footer` gives, and a tier with an owner (the
columnar path) recovers exactly what the per-record path recovers — the same records at
the same locations, the same counts, the same tombstones carried — over random histories
of puts, overwrites, deletes, evictions, reclaims, crashes and torn segments."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.buffers import aligned_buffer
from kvtier.tiers import segment_format, segment_recovery
from kvtier.tiers.allocator import round_up
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.segment_format import (
    columns_of_entries,
    encode_footer,
    encode_footer_entry,
    encode_segment_header,
    encode_trailer,
    footer_into,
    read_footer,
    read_footer_columns,
)
from kvtier.tiers.segment_recovery import _blob_of
from kvtier.tiers.segments import SegmentTier
from tests.tiers.test_segments import crash

MiB = 1 << 20
NAMESPACES = ["a|m", "b|m", "tenant|model/x"]  # two of one length: compared as bytes


class NoOwner:
    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        return [False] * len(headers)

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        return [False] * len(headers)


def header_of(ns: str, key: bytes, gen: int, payload: int, codec: int = 0) -> RecordHeader:
    return RecordHeader(
        ns, key, gen, payload, (gen * 7919) % 2**64, header_size_for(ns, key), codec
    )


# ---- the footer decoder against read_footer --------------------------------------------
ENTRY = st.tuples(
    st.integers(0, 40),  # page of the record (offsets past the footer are dropped)
    st.sampled_from(NAMESPACES),
    st.binary(min_size=0, max_size=40),
    st.integers(1, 2**63),
    st.integers(0, 3 * 4096),
    st.booleans(),  # misaligned offset
)


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(ENTRY, max_size=30),
    uniform=st.booleans(),
    rows_a_call=st.integers(1, 9),
    run_window=st.integers(1, 5),
)
def test_footer_columns_are_read_footer(
    entries: list[tuple[int, str, bytes, int, int, bool]],
    uniform: bool,
    rows_a_call: int,
    run_window: int,
) -> None:
    saved = segment_format.ROWS_A_CALL, segment_format.RUN_WINDOW
    segment_format.ROWS_A_CALL, segment_format.RUN_WINDOW = rows_a_call, run_window
    try:
        _footer_columns_are_read_footer(entries, uniform)
    finally:
        segment_format.ROWS_A_CALL, segment_format.RUN_WINDOW = saved


# Runs of entries of one key length (a tier's first segment: the daemon's calibration
# records, then an engine's): (run length, key length, namespace).
RUNS = st.lists(
    st.tuples(st.integers(1, 300), st.sampled_from([0, 7, 16, 32]), st.sampled_from(NAMESPACES)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(runs=RUNS, run_window=st.sampled_from([1, 2, 64]), extra=st.integers(-3, 3))
def test_footer_columns_of_runs_are_read_footer(
    runs: list[tuple[int, int, str]], run_window: int, extra: int
) -> None:
    """Long runs of one stride between changes, the window that finds a run's end
    doubling across them; and a footer whose head counts `extra` entries more or fewer
    than it holds (more: it ends inside an entry, both readers refuse it)."""
    entries = []
    for count, key_len, ns in runs:
        for _ in range(count):
            i = len(entries)
            key = (i.to_bytes(4, "little") * 8)[:key_len]
            entries.append((i % 40, ns, key, i + 1, 4096, False))
    saved, segment_format.RUN_WINDOW = segment_format.RUN_WINDOW, run_window
    try:
        _footer_columns_are_read_footer(entries, False, extra)
    finally:
        segment_format.RUN_WINDOW = saved


def _footer_columns_are_read_footer(
    entries: list[tuple[int, str, bytes, int, int, bool]], uniform: bool, extra: int = 0
) -> None:
    size = 256 * 4096
    listed = []
    for page, ns, key, gen, payload, odd in entries:
        if uniform:  # one key and namespace length: the strided fast path
            key, ns = (key + b"\0" * 16)[:16], NAMESPACES[0] if len(ns) == 3 else ns
            ns = NAMESPACES[0] if ns != NAMESPACES[1] else ns
        listed.append((page * 4096 + (100 if odd else 0), header_of(ns, key, gen, payload)))
    footer = encode_footer(listed)
    if extra:  # the head's count changed, the footer's own checksum made to match it
        count = max(0, len(listed) + extra)
        body = footer[:8] + count.to_bytes(4, "little") + footer[12:-8]
        footer = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    footer_at = 30 * 4096
    with tempfile.TemporaryFile() as fh:
        fh.write(encode_segment_header(9, size).ljust(4096, b"\0"))
        fh.seek(footer_at)
        fh.write(footer)
        fh.seek(size - 4096)
        fh.write(encode_trailer(9, footer_at, footer))
        fh.truncate(size)
        fh.flush()
        fd = fh.fileno()
        want = read_footer(fd, 9, size)
        got = read_footer_columns(fd, 9, size)
    if extra > 0:  # past the last entry: refused by both
        assert want is None and got is None
        return
    assert want is not None and got is not None
    assert [(int(got.offset[i]), got.header(i)) for i in range(len(got))] == want


@settings(max_examples=100, deadline=None)
@given(entries=st.lists(ENTRY, max_size=30), join=st.integers(1, 40))
def test_footer_built_in_place_is_the_joined_one(
    entries: list[tuple[int, str, bytes, int, int, bool]], join: int
) -> None:
    """The seal writes its footer straight into the aligned buffer (no joined copy on
    the I/O thread's heap): the same bytes as `encode_footer`, zero to the page's end,
    and a trailer over the view is the trailer over the bytes."""
    listed = [
        (page * 4096, header_of(ns, key, gen, size)) for page, ns, key, gen, size, _ in entries
    ]
    want = encode_footer(listed)
    buf, length = footer_into([encode_footer_entry(off, h) for off, h in listed], join)
    assert length == len(want)
    assert len(buf) == round_up(length, 4096)
    assert buf[:length] == want
    assert buf[length:] == bytes(len(buf) - length)
    with memoryview(buf) as view:
        assert encode_trailer(3, 8192, view[:length]) == encode_trailer(3, 8192, want)


def test_columns_of_a_scan_round_trip() -> None:
    entries = [
        (4096 * (i + 1), header_of(NAMESPACES[i % 3], b"k" * i, i + 1, 100)) for i in range(9)
    ]
    cols = columns_of_entries(entries)
    assert [(int(cols.offset[i]), cols.header(i)) for i in range(len(cols))] == entries
    assert list(cols.record_bytes) == [h.record_bytes for _, h in entries]


# ---- the columnar recovery against the per-record one ------------------------------------
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(1, 30_000)),
        # An overwrite whose old record is never removed (a crash between the write and
        # the removal): two records of one block on disk, the newer must win.
        st.tuples(st.just("put_keep"), st.integers(0, 7), st.integers(1, 30_000)),
        st.tuples(st.just("delete"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("reclaim"), st.just(0), st.just(0)),
        st.tuples(st.just("crash"), st.just(0), st.just(0)),
        st.tuples(st.just("restart"), st.just(0), st.just(0)),
        st.tuples(st.just("tear"), st.integers(0, 3), st.just(0)),
    ),
    max_size=50,
)


def new_tier(root: Path) -> SegmentTier:
    return SegmentTier(root, 16 * MiB, True, False, segment_bytes=256 << 10)


def recovered(root: Path, owned: bool) -> tuple[object, ...]:
    tier = new_tier(root)
    tier.prepare()
    if owned:
        tier.attach_owner(NoOwner())
    try:
        report = tier.recover()
        records = sorted(
            ((r.header.ns_id, r.header.key, r.header.generation), r.header, r.location)
            for r in report.records
        )
        live = sorted(
            (s.seg_id, s.live_count, s.live_bytes, s.stored_count, s.stored_bytes)
            for s in tier._segments.values()
        )
        return (
            records,
            report.dropped_corrupt,
            report.dropped_stale,
            report.dropped_deleted,
            report.max_generation,
            sorted(tier._carry),
            live,
        )
    finally:
        crash(tier)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, gather_rows=st.integers(1, 9))
def test_columnar_recovery_equals_the_per_record_one(
    ops: list[tuple[str, int, int]], gather_rows: int
) -> None:
    # Keys are gathered, and columns listed, a few rows at a time (8192 in the daemon), so
    # that slicing is tested on these small histories too.
    saved, segment_format.ROWS_A_CALL = segment_format.ROWS_A_CALL, gather_rows
    try:
        _columnar_equals_per_record(ops)
    finally:
        segment_format.ROWS_A_CALL = saved


class _WeakDigests:
    """xxhash as `segment_recovery` sees it, its seeded digests folded into `buckets`
    values: distinct blocks then share a digest often, which the columnar path must
    notice (it hands the choice to the per-record path) or tell apart from stale
    records of one block."""

    def __init__(self, buckets: int) -> None:
        self._buckets = buckets

    def xxh3_64_intdigest(self, data: bytes | memoryview, seed: int = 0) -> int:
        return int(xxhash.xxh3_64_intdigest(data, seed)) % self._buckets


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, buckets=st.integers(1, 6))
def test_columnar_recovery_with_colliding_digests_equals_the_per_record_one(
    ops: list[tuple[str, int, int]], buckets: int
) -> None:
    saved = segment_recovery.xxhash
    segment_recovery.xxhash = _WeakDigests(buckets)  # type: ignore[assignment]
    try:
        _columnar_equals_per_record(ops)
    finally:
        segment_recovery.xxhash = saved


@settings(max_examples=100, deadline=None)
@given(
    columns=st.integers(1, 3).flatmap(
        lambda k: st.lists(st.tuples(*[st.integers(0, 2**32) for _ in range(k)]), max_size=40)
    ),
    rows_a_call=st.integers(1, 9),
)
def test_values_of_is_zip_of_tolist(columns: list[tuple[int, ...]], rows_a_call: int) -> None:
    width = len(columns[0]) if columns else 1
    arrays = [np.array([row[i] for row in columns], dtype=np.uint64) for i in range(width)]
    saved, segment_format.ROWS_A_CALL = segment_format.ROWS_A_CALL, rows_a_call
    try:
        assert list(segment_format.values_of(*arrays)) == list(
            zip(*(a.tolist() for a in arrays), strict=True)
        )
    finally:
        segment_format.ROWS_A_CALL = saved


def _columnar_equals_per_record(ops: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tier"
        tier = new_tier(root)
        tier.open()
        next_gen = tier.first_generation
        assert next_gen is not None
        model: dict[bytes, RecordHeader] = {}
        try:
            for op, k, size in ops:
                ns = NAMESPACES[k % 3]
                key = b"k%d" % k if k % 2 else b"key-%d" % k  # mixed key lengths
                if op in ("put", "put_keep"):
                    data = os.urandom(size)
                    header = RecordHeader(
                        ns,
                        key,
                        next_gen,
                        size,
                        xxhash.xxh3_64_intdigest(data),
                        header_size_for(ns, key),
                    )
                    buf = aligned_buffer(round_up(size, 4096))
                    buf[:size] = data
                    tier.write(header, [memoryview(buf)])
                    next_gen += 1
                    old = model.get(key)
                    model[key] = header
                    if old is not None and op == "put":
                        tier.remove(old)
                elif op in ("delete", "evict"):
                    old = model.pop(key, None)
                    if old is not None:
                        if op == "delete":
                            tier.tombstone(ns, key, old.generation)
                        tier.remove(old)
                elif op == "reclaim":
                    tier.reclaim(force=True)
                elif op == "tear":  # garbage over a page of some segment's records
                    segs = sorted((tier._seg_dir).glob("*.kvs"))
                    if segs:
                        path = segs[k % len(segs)]
                        # The tier's reclaimer may delete an emptied one meanwhile.
                        with contextlib.suppress(FileNotFoundError), open(path, "r+b") as fh:
                            fh.seek(4096 * (1 + k))
                            fh.write(b"\xa5" * 4096)
                else:
                    if op == "crash":
                        crash(tier)
                    else:
                        tier.close()
                    # The two paths, each on its own copy (recovery seals scanned segments).
                    a, b = Path(tmp) / "a", Path(tmp) / "b"
                    for copy in (a, b):
                        shutil.rmtree(copy, ignore_errors=True)
                        shutil.copytree(root, copy)
                    assert recovered(a, owned=False) == recovered(b, owned=True)
                    tier = new_tier(root)
                    tier.open()
                    next_gen = tier.first_generation
                    assert next_gen is not None
                    model = {h.key: h for _, _, h in tier.record_locations()}
        finally:
            if tier._tombstone_fd is not None:
                tier.close()


@given(st.lists(st.binary(max_size=300), max_size=12))
def test_the_key_blob_is_the_chunks_back_to_back_and_slices_to_bytes(
    chunks: list[bytes],
) -> None:
    blob = _blob_of([np.frombuffer(c, dtype=np.uint8) for c in chunks])
    joined = b"".join(chunks)
    assert len(blob) == len(joined)
    assert blob[:] == joined
    if joined:
        piece = blob[1 : len(joined) // 2 + 1]
        assert isinstance(piece, bytes) and piece == joined[1 : len(joined) // 2 + 1]
