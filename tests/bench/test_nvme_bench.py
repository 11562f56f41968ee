"""`kvtier bench nvme`: fio's flags, fio's JSON layout, clear refusals, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.bench import nvme
from kvtier.bench.fio import comparison, comparison_text
from kvtier.bench.results import Direction, job_options, normal_text
from kvtier.bench.stats import median_ci
from kvtier.tiers.nvme import NvmeTier

# fio's default completion-latency percentiles, as its JSON writes their keys.
FIO_PERCENTILE_KEYS = [
    "1.000000",
    "5.000000",
    "10.000000",
    "20.000000",
    "30.000000",
    "40.000000",
    "50.000000",
    "60.000000",
    "70.000000",
    "80.000000",
    "90.000000",
    "95.000000",
    "99.000000",
    "99.500000",
    "99.900000",
    "99.950000",
    "99.990000",
]
DIRECTION_LAYOUT = {
    "io_bytes": int,
    "io_kbytes": int,
    "bw_bytes": int,
    "bw": int,
    "iops": float,
    "runtime": int,
    "total_ios": int,
    "clat_ns": dict,
    "lat_ns": dict,
}
CLAT_LAYOUT = {"min": int, "max": int, "mean": float, "stddev": float, "N": int, "percentile": dict}


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", "nvme", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def validate(doc: dict[str, Any]) -> None:
    """The documented layout (README, 'For storage teams')."""
    assert doc["kvtier-bench version"].startswith("kvtier-")
    assert isinstance(doc["timestamp"], int) and isinstance(doc["global options"], dict)
    assert doc["jobs"], "at least one job"
    for job in doc["jobs"]:
        assert {"jobname", "groupid", "error", "job options", "read", "write"} <= set(job)
        for direction in ("read", "write"):
            d = job[direction]
            for key, kind in DIRECTION_LAYOUT.items():
                assert isinstance(d[key], kind if kind is not float else (int, float)), key
            for key, kind in CLAT_LAYOUT.items():
                assert isinstance(d["clat_ns"][key], kind if kind is not float else (int, float))
            assert list(d["clat_ns"]["percentile"]) == FIO_PERCENTILE_KEYS
            values = list(d["clat_ns"]["percentile"].values())
            assert values == sorted(values), "percentiles must not decrease"
            if d["total_ios"]:
                assert d["clat_ns"]["min"] <= values[0] and values[-1] <= d["clat_ns"]["max"]


@pytest.mark.parametrize(
    ("rw", "mode"), [("read", "raw"), ("randrw", "raw"), ("write", "tier"), ("randread", "tier")]
)
def test_json_is_laid_out_like_fio(tmp_path: Path, rw: str, mode: str) -> None:
    out = bench(
        "--directory",
        str(tmp_path),
        "--size",
        "8M",
        "--bs",
        "1M",
        "--rw",
        rw,
        "--mode",
        mode,
        "--iodepth",
        "2",
        "--output-format",
        "json",
    )
    doc = json.loads(out.stdout)  # stdout is pure JSON
    validate(doc)
    job = doc["jobs"][0]
    assert job["job options"]["rw"] == rw and job["job options"]["mode"] == mode
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    assert ios == 8  # 8 MiB in 1 MiB blocks, each once
    assert job["read"]["io_bytes"] == job["read"]["total_ios"] << 20
    if rw == "randrw":
        assert job["read"]["total_ios"] and job["write"]["total_ios"]
    assert list(tmp_path.iterdir()) == [], "the run must leave nothing behind"


def test_model_shortcut_chains_and_time_based(tmp_path: Path) -> None:
    out = bench(
        "--directory",
        str(tmp_path),
        "--size",
        "32M",
        "--model",
        "llama3-8b",
        "--tokens-per-block",
        "4",
        "--rw",
        "randread",
        "--pattern",
        "chain",
        "--mode",
        "tier",
        "--runtime",
        "1",
        "--time-based",
        "--numjobs",
        "2",
        "--output-format",
        "json",
    )
    doc = json.loads(out.stdout)
    validate(doc)
    assert doc["jobs"][0]["job options"]["bs"] == str(4 * (128 << 10))
    assert len(doc["jobs"]) == 2
    assert all(j["read"]["total_ios"] > 8 for j in doc["jobs"])  # time-based: past --size
    assert list(tmp_path.iterdir()) == []


def test_normal_output_reads_like_fio(tmp_path: Path) -> None:
    out = bench("--directory", str(tmp_path), "--size", "4M", "--bs", "1M")
    assert "read: IOPS=" in out.stdout and ", BW=" in out.stdout
    assert "clat percentiles (usec):" in out.stdout and "99.00th=[" in out.stdout


def test_refusals_say_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = bench("--directory", str(tmp_path), "--size", "900T", "--bs", "1M", check=False)
    assert out.returncode == 2 and "not enough free space" in out.stderr
    assert "lower --size" in out.stderr
    out = bench("--directory", str(tmp_path / "absent"), check=False)
    assert out.returncode == 2 and "not a directory" in out.stderr
    out = bench("--directory", str(tmp_path), "--bs", "1000", "--size", "1M", check=False)
    assert out.returncode == 2 and "multiple of 4096" in out.stderr
    monkeypatch.setattr(nvme, "supports_o_direct", lambda directory: False)
    assert nvme.main(["--directory", str(tmp_path), "--size", "1M", "--bs", "64K"]) == 2
    assert "--direct=0" in capsys.readouterr().err
    assert (
        nvme.main(
            [
                "--directory",
                str(tmp_path),
                "--size",
                "1M",
                "--bs",
                "64K",
                "--direct",
                "0",
                "--output-format",
                "json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["jobs"][0]["read"]["total_ios"] == 16
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier",
            "bench",
            "nvme",
            "--directory",
            str(tmp_path),
            "--size",
            "16M",
            "--bs",
            "1M",
            "--runtime",
            "60",
            "--time-based",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal: a job started in the background (nohup ... &) inherits
        # SIGINT ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while not any(tmp_path.iterdir()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_percentiles_follow_fios_rank_rule() -> None:
    d = Direction()
    for ns in range(1, 101):
        d.record(0, ns, 4096, 0)
    pct = d.to_fio(1.0)["clat_ns"]["percentile"]
    assert pct["50.000000"] == 50 and pct["99.000000"] == 99 and pct["1.000000"] == 1
    assert pct["99.990000"] == 100


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
def test_vs_fio_runs_the_equivalent_job(tmp_path: Path) -> None:
    out = bench(
        "--directory",
        str(tmp_path),
        "--size",
        "16M",
        "--bs",
        "1M",
        "--rw",
        "write",
        "--vs-fio",
        "--output-format",
        "json",
    )
    doc = json.loads(out.stdout)
    ratio = doc["vs_fio"]["write"]["bw_ratio"]
    assert ratio is not None and ratio > 0
    assert "--rw=write" in doc["fio"]["command"] and "--bs=1048576" in doc["fio"]["command"]
    assert list(tmp_path.iterdir()) == []


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path.parent / f"{tmp_path.name}.png"
    data = tmp_path / "data"
    data.mkdir()
    bench("--directory", str(data), "--size", "8M", "--bs", "1M", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    os.unlink(png)


@pytest.mark.parametrize("engine", ["libaio", "psync"])
@pytest.mark.parametrize("rw", ["read", "randrw"])
def test_both_io_engines_move_every_block_and_say_which_ran(
    tmp_path: Path, engine: str, rw: str
) -> None:
    from kvtier.bench.nvme import libaio_available

    if engine == "libaio" and not libaio_available():
        pytest.skip("needs the libaio package and libaio.so.1")
    out = bench(
        "--directory",
        str(tmp_path),
        "--size",
        "16M",
        "--bs",
        "1M",
        "--rw",
        rw,
        "--iodepth",
        "4",
        "--ioengine",
        engine,
        "--output-format",
        "json",
    )
    doc = json.loads(out.stdout)
    validate(doc)
    assert doc["global options"]["ioengine"] == engine
    job = doc["jobs"][0]
    assert job["read"]["total_ios"] + job["write"]["total_ios"] == 16
    assert job["read"]["io_bytes"] + job["write"]["io_bytes"] == 16 << 20
    assert list(tmp_path.iterdir()) == []


def _run_doc(read_bw: float) -> dict[str, Any]:
    side = {"bw_bytes": read_bw, "total_ios": 10, "clat_ns": {"percentile": {"50.000000": 1}}}
    idle = {"bw_bytes": 0, "total_ios": 0, "clat_ns": {"percentile": {}}}
    return {"jobs": [{"read": side, "write": idle}]}


def test_paired_ratio_follows_a_drifting_disk_that_the_ratio_of_medians_does_not() -> None:
    """The disk slows 3x halfway through: each of our runs is as fast as fio's run right
    after it, but the median runs come from different halves."""
    pairs = {"read": [(900.0, 900.0), (800.0, 800.0), (300.0, 300.0), (250.0, 250.0)]}
    cmp = comparison(_run_doc(800.0), _run_doc(300.0), pairs)["read"]
    assert cmp["bw_ratio"] == pytest.approx(800 / 300, rel=1e-3)
    assert cmp["paired_bw_ratio"] == 1.0
    assert "paired_bw_ratio" not in comparison(_run_doc(1.0), _run_doc(2.0))["read"]
    assert comparison(_run_doc(1.0), _run_doc(2.0), {"read": [(1.0, 2.0), (3.0, 2.0)]})["read"][
        "paired_bw_ratio"
    ] == pytest.approx(1.0)


def _engines() -> list[str]:
    return ["psync", "libaio"] if nvme.libaio_available() else ["psync"]


@pytest.mark.parametrize("engine", _engines())
def test_the_clock_leaves_out_each_workers_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """fio's runtime counts from the first I/O: a worker's setup (here its buffers made
    0.5 s slow) must not be billed to the drive."""
    real = nvme._touched

    def slow_touched(size_bytes: int) -> Any:
        time.sleep(0.5)
        return real(size_bytes)

    monkeypatch.setattr(nvme, "_touched", slow_touched)
    flags = f"--size 4M --bs 1M --iodepth 2 --ioengine {engine}".split()
    args = nvme._parse(["--directory", str(tmp_path), *flags])
    started = time.monotonic()
    doc, _ = nvme.run_once(args)
    assert time.monotonic() - started >= 0.5  # the setup did run
    read = doc["jobs"][0]["read"]
    assert read["total_ios"] == 4
    assert read["runtime"] < 400, "setup was counted as I/O time"
    assert read["bw_bytes"] > (4 << 20) / 0.4


def test_a_worker_that_fails_its_setup_stops_the_run_instead_of_hanging_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other workers wait for everyone's setup before the clock starts; one that
    cannot set up must release them, and the run ends with its error."""
    real = nvme._touched
    calls = []

    def failing_touched(size_bytes: int) -> Any:
        calls.append(size_bytes)
        if len(calls) == 3:
            raise MemoryError("no buffer for you")
        return real(size_bytes)

    monkeypatch.setattr(nvme, "_touched", failing_touched)
    flags = ["--size", "4M", "--bs", "1M", "--iodepth", "4", "--ioengine", "psync"]
    args = nvme._parse(["--directory", str(tmp_path), *flags])
    runner = nvme.Runner(args)
    with runner.workspace():
        worker = threading.Thread(target=runner.run, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the run hung on a worker that failed its setup"
    assert "MemoryError: no buffer for you" in runner.jobs[0].error
    assert list(tmp_path.iterdir()) == []


def test_vs_fio_takes_turns_going_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first of two back-to-back runs measured slower on a virtio disk: whoever always
    led would carry that bias, so the rounds alternate who starts."""
    order: list[str] = []

    def ours(args: Any) -> tuple[dict[str, Any], list[Any]]:
        order.append("kvtier")
        doc = _run_doc(100.0 + len(order))
        doc["jobs"][0]["error"] = 0
        return doc, []

    def fio(args: Any, directory: Path) -> dict[str, Any]:
        order.append("fio")
        return _run_doc(100.0)

    monkeypatch.setattr(nvme, "run_once", ours)
    monkeypatch.setattr(nvme, "run_fio", fio)
    flags = ["--size", "4M", "--bs", "1M", "--vs-fio", "--repeat", "4", "--output-format", "json"]
    out = tmp_path / "out.json"
    assert nvme.main(["--directory", str(tmp_path), *flags, "--output", str(out)]) == 0
    assert order == ["kvtier", "fio", "fio", "kvtier", "kvtier", "fio", "fio", "kvtier"]
    # Each round's pair is its own two runs, whichever went first.
    doc = json.loads(out.read_text())
    assert doc["repeats"]["read"] == [101.0, 104.0, 105.0, 108.0]
    assert doc["vs_fio"]["read"]["paired_bw_ratio"] == pytest.approx(1.045)


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=40))
def test_the_median_confidence_interval_holds_the_median(values: list[float]) -> None:
    ci = median_ci(values)
    if len(values) < 6:
        assert ci is None  # the widest interval (min, max) covers under 95 % below 6
        return
    assert ci is not None
    low, high = ci
    assert low <= statistics.median(values) <= high
    assert min(values) <= low and high <= max(values)


def test_the_median_confidence_interval_is_the_sign_tests() -> None:
    # Published order statistics for 95 %: n=10 -> 2nd..9th, n=20 -> 6th..15th.
    assert median_ci([float(x) for x in range(1, 11)]) == (2.0, 9.0)
    assert median_ci([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_ci([float(x) for x in range(1, 7)]) == (1.0, 6.0)
    doc = comparison(
        _run_doc(1.0), _run_doc(1.0), {"read": [(float(x), 10.0) for x in range(1, 11)]}
    )
    assert doc["read"]["paired_bw_ratio_ci95"] == [0.2, 0.9]
    assert "95% CI 0.20-0.90" in comparison_text(doc)


@pytest.mark.parametrize("mode", ["raw", "tier"])
def test_the_layout_is_on_the_drive_before_the_clock_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """fio fsyncs the files it lays out (create_fsync=1): reads measured while a write-back
    cache still drains the layout ran 0.86x as fast on the virtio disk here."""
    events: list[str] = []
    real_fsync, real_sync = os.fsync, NvmeTier.sync

    def fsync(fd: int) -> None:
        events.append("sync")
        real_fsync(fd)

    def tier_sync(tier: NvmeTier) -> None:
        events.append("sync")
        real_sync(tier)

    def clock(runner: nvme.Runner) -> None:
        events.append("clock")
        runner._t0_ns = time.monotonic_ns()

    # Raw files are synced one by one, the tier as a whole (its start-up also fsyncs its
    # epoch file: not the layout, so not counted).
    if mode == "raw":
        monkeypatch.setattr(os, "fsync", fsync)
    else:
        monkeypatch.setattr(NvmeTier, "sync", tier_sync)
    monkeypatch.setattr(nvme.Runner, "_start_clock", clock)
    flags = ["--size", "4M", "--bs", "1M", "--rw", "read", "--mode", mode]
    doc, _ = nvme.run_once(nvme._parse(["--directory", str(tmp_path), *flags]))
    assert doc["jobs"][0]["read"]["total_ios"] == 4
    assert events == ["sync", "clock"]


def _bench_without_libaio(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvtier bench nvme` where the libaio package cannot be imported."""
    code = (
        "import sys\nsys.modules['libaio'] = None  # import libaio: ImportError\n"
        "from kvtier.cli import main\nsys.exit(main(['bench', 'nvme', *sys.argv[1:]]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


def test_text_output_starts_with_the_settings_it_ran_with(tmp_path: Path) -> None:
    flags = ["--size", "4M", "--bs", "1M", "--iodepth", "2", "--ioengine", "psync"]
    out = bench("--directory", str(tmp_path), *flags, "--rw", "randrw", "--rwmixread", "70")
    first, second = out.stdout.splitlines()[:2]
    for setting in ("rw=randrw", "bs=1.0 MiB", "size=4.0 MiB", "ioengine=psync", "iodepth=2"):
        assert setting in first
    assert "numjobs=1" in first and "direct=1" in first and "rwmixread=70" in first
    assert second.strip() == f"directory={tmp_path}"


def test_a_depth_without_libaio_warns_and_names_the_fallback(tmp_path: Path) -> None:
    flags = ["--directory", str(tmp_path), "--size", "4M", "--bs", "1M", "--iodepth", "8"]
    out = _bench_without_libaio(*flags)
    assert out.returncode == 0, out.stderr
    assert "warning: --iodepth 8 without libaio" in out.stderr
    assert (
        "running --ioengine psync, 8 threads" in out.stderr and "pip install libaio" in out.stderr
    )
    assert "ioengine=psync, iodepth=8" in out.stdout
    # Asked for by name, as fio does for an engine it lacks: a refusal, not a fallback.
    out = _bench_without_libaio(*flags, "--ioengine", "libaio")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--ioengine libaio needs the libaio package" in out.stderr
    # Chosen, or at depth 1 (nothing to keep in flight): no warning.
    for extra in (["--ioengine", "psync"], ["--iodepth", "1"]):
        assert "warning" not in _bench_without_libaio(*flags, *extra).stderr
    assert list(tmp_path.iterdir()) == []


def test_percentiles_keep_microseconds_past_10_ms() -> None:
    args = nvme._parse(["--directory", "/", "--size", "4M", "--bs", "1M"])
    d = Direction()
    for clat_ns in [250_000 + 1_000 * i for i in range(99)] + [15_000_000]:
        d.record(0, clat_ns, 1 << 20, 0)
    job = {"jobname": "j", "error": 0, "error_message": "", "job_runtime": 1000}
    job |= {"job options": job_options(args), "read": d.to_fio(1.0)}
    job["write"] = Direction().to_fio(1.0)
    text = normal_text({"global options": {"directory": "/", "ioengine": "psync"}, "jobs": [job]})
    # One 15 ms outlier used to switch every cell to whole msec: [0] and [15].
    assert "clat percentiles (usec):" in text and "min=250, max=15000" in text
    assert "50.00th=[   299]" in text and "99.00th=[   348]" in text
    assert "99.99th=[ 15000]" in text


def test_runtime_without_time_based_says_why_it_ended_early(tmp_path: Path) -> None:
    flags = ["--directory", str(tmp_path), "--size", "4M", "--bs", "1M", "--runtime", "5"]
    out = bench(*flags)
    assert "note: ended after" in out.stdout and "before --runtime 5s" in out.stdout
    assert "--time-based loops" in out.stdout and "runtime=5s" in out.stdout
    out = bench(*flags, "--output-format", "json")
    assert json.loads(out.stdout)["jobs"][0]["job options"]["runtime"] == "5.0"
    assert "before --runtime 5s" in out.stderr
    # Time-based: it runs the whole --runtime, and nothing needs explaining.
    timed = bench(*flags[:-1], "0.3", "--time-based")
    assert "note:" not in timed.stdout and "runtime=0.3s, time_based" in timed.stdout
