"""A careless or hostile local user against the NVMe tier's files (issue 28 items 3-5): a
umask that would open the tier to the socket's group, symbolic links planted as spares,
FIFOs in place of records, spares and temporary files.

Two tenants (alice and bob) with their own tokens keep blocks on NVMe; the attacker is a
local user with write access to the tier's directories (what the old 0770/0755 modes
gave the socket's group, or the service user's own mistake). Each row checks every
tenant's blocks against the shadow (0 wrong bytes), that the daemon keeps serving, and
bob's get latency (p50/p99) before and during the attack.
"""

from __future__ import annotations

import contextlib
import os
import stat
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier.keys import hash_token
from kvtier.tiers.record import parse_header, read_header_region
from tests.conftest import DaemonProcess, block_bytes, free_port
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves, wait_for

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/files"
TOKENS = {"alice": "alice-files-token-1", "bob": "bob-files-token-22"}
BLOCK_BYTES = 256 << 10
RECORD_BYTES = 4096 + BLOCK_BYTES  # a short key's header page, then the payload


class Tier:
    """The daemon, its two tenants' clients, their shadows and its metrics endpoint."""

    def __init__(self, daemon: DaemonProcess, port: int) -> None:
        self.daemon = daemon
        self.port = port
        self.shadow = Shadow()

    @property
    def root(self) -> Path:
        return self.daemon.nvme_path

    def client(self, tenant: str) -> kvtier.Client:
        return self.daemon.client(token=TOKENS[tenant])

    def put(self, client: kvtier.Client, tenant: str, prefix: str, count: int, seed: int) -> None:
        for i in range(count):
            key = f"{prefix}{i}"
            data = block_bytes(seed * 1000 + i, BLOCK_BYTES)
            client.put(NS, key, data, overwrite=True)
            self.shadow.put(tenant, key, data, acknowledged=True)

    def check(self, row: Row, must_survive: set[tuple[str, str]] | None = None) -> None:
        """Every key of both tenants against the shadow (`must_survive`: must hit)."""
        for tenant in TOKENS:
            with self.client(tenant) as c:
                view = Shadow()
                for t, key in self.shadow.known():
                    if t == tenant:
                        for data in self.shadow.allowed(t, key):
                            view.put(NS, key, data, acknowledged=False)
                keep = {k for t, k in (must_survive or set()) if t == tenant}
                check_all(row, c, view, must_survive=keep)

    def refused(self) -> float:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvtier_nvme_refused_files_total":
                    return float(sample.value)
        raise AssertionError("kvtier_nvme_refused_files_total is not exported")

    def on_nvme(self, client: kvtier.Client, prefix: str, count: int) -> list[str]:
        keys = [f"{prefix}{i}" for i in range(count)]
        tiers = client.lookup(NS, keys).tiers
        return [k for k, t in zip(keys, tiers, strict=True) if t == "nvme"]

    def spares(self) -> list[Path]:
        """Spares of the blocks' record size (calibration leaves smaller ones)."""
        return sorted((self.root / "free").glob(f"{RECORD_BYTES}.*"))


@pytest.fixture
def tier(start_daemon: StartDaemon, workdir: Path) -> Iterator[Callable[..., Tier]]:
    def start(prefix: list[str] | None = None) -> Tier:
        config = workdir / "tenants.toml"
        config.write_text(
            "[auth.tokens]\n"
            + "".join(f'"{hash_token(t)}" = "{n}"\n' for n, t in TOKENS.items())
            + '[tenants.alice]\ndram_capacity_bytes = "4MiB"\nnvme_capacity_bytes = "128MiB"\n'
            + '[tenants.bob]\ndram_capacity_bytes = "4MiB"\nnvme_capacity_bytes = "128MiB"\n'
        )
        port = free_port()
        daemon = start_daemon(
            dram="8MiB",
            nvme="2GiB",  # a free/ pool of up to 32 MiB (calibration's spares take 8)
            extra=["--config", str(config), "--metrics-listen", f"127.0.0.1:{port}"],
            prefix=prefix,
            # No demotion ahead of need: a batch still in flight after the puts would take
            # the spares these tests count (a new record reuses a spare of its size).
            env={"KVTIER_DRAM__DEMOTE_FREE_FRACTION": "0"},
        )
        return Tier(daemon, port)

    yield start


def get_latency_s(client: kvtier.Client, keys: list[str], rounds: int) -> list[float]:
    out = []
    for i in range(rounds):
        started = time.perf_counter()
        client.get(NS, keys[i % len(keys)])
        out.append(time.perf_counter() - started)
    return out


def p50_p99_ms(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100)
    return statistics.median(samples) * 1e3, cuts[98] * 1e3


class Latency:
    """bob's gets, measured on a thread while the attack runs."""

    def __init__(self, t: Tier, keys: list[str]) -> None:
        self._tier = t
        self._keys = keys
        self._stop = threading.Event()
        self.samples: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self._tier.client("bob") as bob:
            while not self._stop.is_set():
                self.samples += get_latency_s(bob, self._keys, 1)

    def __enter__(self) -> Latency:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def note_latency(row: Row, before: list[float], during: list[float], when: str = "during") -> None:
    """bob's p50/p99 in the row's notes; his p50 must stay within 5x (or 50 ms) of before."""
    b50, b99 = p50_p99_ms(before)
    d50, d99 = p50_p99_ms(during)
    row.notes.append(
        f"bob's gets: p50/p99 {b50:.1f}/{b99:.1f} ms before, {d50:.1f}/{d99:.1f} ms {when} "
        f"({len(during)} gets)"
    )
    assert d50 < max(5 * b50, 50.0), row.notes[-1]


def loose_entries(root: Path) -> list[str]:
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if mode & 0o077:
            found.append(f"{path.relative_to(root)} {stat.filemode(mode)}")
    return found


def daemon_umask(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    return int(
        next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8
    )


def fill_and_free(t: Tier) -> list[str]:
    """alice and bob fill their arenas onto NVMe; alice deletes some NVMe blocks, so their
    records become spares in free/. Returns bob's keys."""
    with t.client("alice") as alice, t.client("bob") as bob:
        t.put(alice, "alice", "a", 40, seed=1)
        t.put(bob, "bob", "b", 30, seed=2)
        gone = t.on_nvme(alice, "a", 40)[:12]
        for key in gone:
            assert alice.delete(NS, key) is True
            t.shadow.delete("alice", key, acknowledged=True)
    wait_for(lambda: len(t.spares()) >= len(gone), "deleted records did not become spares")
    return [f"b{i}" for i in range(30)]


# ---- item 3: modes -------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["0007", "022"])
def test_tier_is_private_whatever_the_umask(
    tier: Callable[..., Tier], report: Report, mask: str
) -> None:
    row = report.row(
        f"NVMe tier files under umask {mask}",
        f"daemon started by sh -c 'umask {mask}; exec kvtier serve'; records, spares, "
        "tombstones.log, lock and directories walked for group/other bits",
    )
    t = tier(prefix=["sh", "-c", f'umask {mask}; exec "$@"', "sh"])
    row.injected = int(daemon_umask(t.daemon) == int(mask, 8))
    fill_and_free(t)
    with t.client("bob") as bob:
        before = get_latency_s(bob, [f"b{i}" for i in range(30)], 40)
    loose = loose_entries(t.root)
    # Walked before the restart: its flush may reuse every spare for DRAM-only blocks.
    had_spares = bool(t.spares())
    t.daemon.restart()  # a flush, a compacted log, records read back at start
    assert daemon_umask(t.daemon) == int(mask, 8)
    loose += loose_entries(t.root)
    walked = len(list(t.root.rglob("*")))
    with t.client("bob") as bob:
        t.check(row)
        during = get_latency_s(bob, [f"b{i}" for i in range(30)], 40)
        row.serving = still_serves(bob)
    row.notes.append(f"{walked} files and directories walked, {len(loose)} open to group/others")
    note_latency(row, before, during, "after the restart")
    assert (t.root / "tombstones.log").exists() and had_spares and walked > 256
    assert loose == [], loose[:10]
    row.assert_ok()


# ---- item 4: symbolic links in free/ -------------------------------------------------------
def test_symlinks_planted_as_spares_are_never_written_through(
    tier: Callable[..., Tier], workdir: Path, report: Report
) -> None:
    row = report.row(
        "symbolic links planted as spares in free/",
        "every spare in free/ replaced (rename over it) by a link to a victim file of the "
        "same size owned by the test user; then puts until the spares would be reused",
    )
    t = tier()
    bob_keys = fill_and_free(t)
    victims = workdir / "victims"
    victims.mkdir()
    planted: dict[Path, bytes] = {}
    for i, spare in enumerate(t.spares()):
        victim = victims / f"v{i}"
        content = os.urandom(spare.stat().st_size)
        victim.write_bytes(content)
        link = spare.with_name(f".link{i}")
        link.symlink_to(victim)
        os.rename(link, spare)  # atomically: the pool's name is now the link
        planted[victim] = content
    row.injected = len(planted)
    with t.client("bob") as bob:
        before = get_latency_s(bob, bob_keys, 40)
    with Latency(t, bob_keys) as during, t.client("alice") as alice:
        t.put(alice, "alice", "new", 3 * len(planted), seed=3)  # demotions take spares
    changed = sum(victim.read_bytes() != content for victim, content in planted.items())
    links_in_v1 = [p for p in (t.root / "v1").rglob("*") if p.is_symlink()]
    row.notes.append(f"{changed} of {len(planted)} victim files changed")
    t.check(row)
    with t.client("bob") as bob:
        row.serving = still_serves(bob)
    refused = t.refused()
    row.notes.append(f"kvtier_nvme_refused_files_total {refused:.0f}")
    note_latency(row, before, during.samples)
    t.daemon.restart()
    with t.client("alice") as alice:
        row.serving = row.serving and still_serves(alice)
    t.check(row)
    assert changed == 0, row.notes
    assert links_in_v1 == [], links_in_v1[:5]
    assert not any(p.is_symlink() for p in t.spares())
    assert refused == len(planted)
    row.assert_ok()


# ---- item 5: FIFOs -------------------------------------------------------------------------
def _unblock_fifos_after(fifos: list[Path], delay_s: float) -> threading.Timer:
    """Open each FIFO for reading and writing after `delay_s` (never blocks), so a daemon
    stuck in open(2) on one gets past it and the test can end instead of hanging."""

    def unblock() -> None:
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))

    timer = threading.Timer(delay_s, unblock)
    timer.daemon = True
    timer.start()
    return timer


def _record_of(root: Path, ns_suffix: str, key: str) -> Path:
    for path in (root / "v1").glob("*/*.kvr"):
        fd = os.open(path, os.O_RDONLY)
        try:
            header = parse_header(read_header_region(fd)).header
        finally:
            os.close(fd)
        if header.ns_id.endswith(ns_suffix) and header.key == key.encode():
            return path
    raise AssertionError(f"no record of {ns_suffix} {key}")


def test_fifos_in_place_of_a_record_a_spare_and_a_temporary_file_at_start(
    tier: Callable[..., Tier], report: Report
) -> None:
    row = report.row(
        "FIFOs as a record, a spare and a temporary file at start",
        "daemon stopped; one of alice's record files replaced by a FIFO (same name), a FIFO "
        "named like a spare in free/ and one in tmp/; restart",
    )
    t = tier()
    bob_keys = fill_and_free(t)
    with t.client("bob") as bob:
        before = get_latency_s(bob, bob_keys, 40)
    started = time.monotonic()
    t.daemon.restart()  # a clean stop writes DRAM out: every block is on NVMe now
    normal_start_s = time.monotonic() - started
    t.daemon.terminate()
    victim_key = next(k for t_, k in t.shadow.known() if t_ == "alice")
    record = _record_of(t.root, f"|{NS}", victim_key)
    record.unlink()
    os.mkfifo(record, 0o600)
    fifos = [record, t.root / "free" / f"{RECORD_BYTES}.{'e' * 32}", t.root / "tmp" / "x.tmp"]
    for fifo in fifos[1:]:
        os.mkfifo(fifo, 0o600)
    row.injected = len(fifos)
    bound_s = max(15.0, 5 * normal_start_s)
    timer = _unblock_fifos_after(fifos, bound_s + 30)
    started = time.monotonic()
    t.daemon.start(timeout_s=bound_s + 60)
    start_s = time.monotonic() - started
    timer.cancel()
    row.notes.append(f"ready in {start_s:.1f} s (a normal restart: {normal_start_s:.1f} s)")
    with t.client("alice") as alice:
        assert alice.get(NS, victim_key) is None  # the FIFO'd record: a miss
    t.shadow.delete("alice", victim_key, acknowledged=True)
    every = set(t.shadow.known())
    with Latency(t, bob_keys) as during:
        t.check(row, must_survive=every)  # the rest bit-exact, none lost
    with t.client("bob") as bob:
        during.samples += get_latency_s(bob, bob_keys, 40)
        row.serving = still_serves(bob)
    refused = t.refused()
    row.notes.append(f"kvtier_nvme_refused_files_total {refused:.0f}")
    note_latency(row, before, during.samples)
    assert start_s < bound_s, row.notes[0]
    assert refused == len(fifos)
    assert not any(p.exists() for p in fifos)
    row.assert_ok()


def test_a_fifo_as_a_spare_at_run_time_does_not_block_an_io_thread(
    tier: Callable[..., Tier], report: Report
) -> None:
    row = report.row(
        "FIFOs planted as spares at run time",
        "every spare in free/ replaced (rename over it) by a FIFO while the daemon runs; "
        "then puts until the spares would be reused",
    )
    t = tier()
    bob_keys = fill_and_free(t)
    fifos = []
    for i, spare in enumerate(t.spares()):
        fifo = spare.with_name(f".fifo{i}")
        os.mkfifo(fifo, 0o600)
        os.rename(fifo, spare)
        fifos.append(spare)
    row.injected = len(fifos)
    with t.client("bob") as bob:
        before = get_latency_s(bob, bob_keys, 40)
    timer = _unblock_fifos_after(fifos, 60)
    started = time.monotonic()
    with Latency(t, bob_keys) as during, t.client("alice") as alice:
        t.put(alice, "alice", "new", 3 * len(fifos), seed=4)
    puts_s = time.monotonic() - started
    timer.cancel()
    row.notes.append(f"{3 * len(fifos)} puts over the FIFOs in {puts_s:.1f} s")
    t.check(row)
    with t.client("bob") as bob:
        row.serving = still_serves(bob)
    refused = t.refused()
    row.notes.append(f"kvtier_nvme_refused_files_total {refused:.0f}")
    note_latency(row, before, during.samples)
    assert puts_s < 30, row.notes[0]
    assert refused == len(fifos)
    assert not any(p.exists() for p in fifos)
    row.assert_ok()
