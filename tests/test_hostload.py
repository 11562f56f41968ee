"""The polling gate (kvtier/hostload.py) over fake /proc and cgroup trees: the cgroup a
process is in (v2, v1, a cgroup namespace), the CPUs its quota allows along its
ancestors, CPU pressure (the cgroup's before the host's), throttling, and the load
average where no pressure is kept."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import hostload
from kvtier.hostload import (
    PRESSURE_BUSY_PCT,
    Cgroup,
    HostLoad,
    find_cgroup,
    pressure_pct,
    quota_cpus,
    throttled_count,
    usable_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_proc(tmp: Path, cgroup: str, mounts: list[str], host_pressure: str | None = None) -> Path:
    proc = tmp / "proc"
    write(proc / "self" / "cgroup", cgroup)
    write(proc / "self" / "mountinfo", "\n".join(mounts) + "\n")
    if host_pressure is not None:
        write(proc / "pressure" / "cpu", host_pressure)
    return proc


def v2_mount(point: Path, root: str = "/") -> str:
    return f"30 25 0:26 {root} {point} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate"


def v1_mount(point: Path, options: str = "rw,cpu,cpuacct", root: str = "/") -> str:
    return f"31 25 0:27 {root} {point} rw,nosuid shared:5 - cgroup cgroup {options}"


def pressure(some_avg10: float) -> str:
    return (
        f"some avg10={some_avg10:.2f} avg60=1.00 avg300=0.50 total=12345\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )


def test_a_kubernetes_limit_along_the_v2_ancestors_caps_the_cpus(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    pod = mount / "kubepods" / "pod1"
    write(mount / "kubepods" / "cpu.max", "max 100000\n")
    write(pod / "cpu.max", "400000 100000\n")  # limits.cpu: "4"
    write(pod / "ctr" / "cpu.max", "max 100000\n")
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/ctr\n", [v2_mount(mount)])
    cgroup = find_cgroup(proc)
    assert cgroup.v2 == pod / "ctr" and cgroup.v1_cpu is None
    assert quota_cpus(cgroup) == 4.0
    assert usable_cpus(cgroup) == min(AFFINITY, 4)
    write(pod / "ctr" / "cpu.max", "150000 100000\n")  # 1.5 CPUs: a second one in part
    assert quota_cpus(cgroup) == 1.5
    assert usable_cpus(cgroup) == min(AFFINITY, 2)


def test_a_v1_quota_and_a_cgroup_namespace(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    write(cpu / "docker" / "cpu.cfs_quota_us", "-1\n")
    write(cpu / "docker" / "cpu.cfs_period_us", "100000\n")
    write(cpu / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    write(cpu / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    mounts = [v1_mount(tmp_path / "cpuacct", "rw,cpuacct"), v1_mount(cpu)]
    proc = fake_proc(tmp_path, "5:cpuacct:/docker/abc\n4:cpu:/docker/abc\n", mounts)
    cgroup = find_cgroup(proc)
    assert cgroup.v1_cpu == cpu / "docker" / "abc" and cgroup.v2 is None
    assert quota_cpus(cgroup) == 0.5
    assert usable_cpus(cgroup) == 1
    # In a cgroup namespace the process sees "/" and the mount is its own cgroup.
    ns = tmp_path / "ns"
    write(ns / "cg" / "cpu.max", "200000 100000\n")
    proc = fake_proc(ns, "0::/\n", [v2_mount(ns / "cg")])
    assert find_cgroup(proc).v2 == ns / "cg"
    assert quota_cpus(find_cgroup(proc)) == 2.0


def test_without_cgroup_files_nothing_is_capped(tmp_path: Path) -> None:
    cgroup = find_cgroup(tmp_path / "no-proc")
    assert cgroup == Cgroup()
    assert quota_cpus(cgroup) is None and usable_cpus(cgroup) == AFFINITY
    assert pressure_pct(cgroup, tmp_path / "no-proc") is None
    assert throttled_count(cgroup) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1, 64_000_000)), min_size=1, max_size=5))
def test_the_quota_is_the_least_along_the_ancestors(quotas_us: list[int | None]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        mount = Path(scratch) / "cg"
        directory = mount
        names = []
        for depth, quota in enumerate(quotas_us):
            directory = directory / f"level{depth}"
            names.append(f"level{depth}")
            write(directory / "cpu.max", f"{'max' if quota is None else quota} 100000\n")
        proc = fake_proc(Path(scratch), "0::/" + "/".join(names) + "\n", [v2_mount(mount)])
        limits = [q / 100000 for q in quotas_us if q is not None]
        assert quota_cpus(find_cgroup(proc)) == (min(limits) if limits else None)


def test_the_cgroups_pressure_before_the_hosts(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    proc = fake_proc(tmp_path, "0::/app\n", [v2_mount(mount)], host_pressure=pressure(3.5))
    write(mount / "app" / "cpu.max", "max 100000\n")
    cgroup = find_cgroup(proc)
    assert pressure_pct(cgroup, proc) == 3.5  # the cgroup keeps none: the host's
    write(mount / "app" / "cpu.pressure", pressure(42.25))
    assert pressure_pct(cgroup, proc) == 42.25
    write(mount / "app" / "cpu.pressure", "some avg10=garbage\n")
    assert pressure_pct(cgroup, proc) == 3.5


def test_busy_by_pressure_by_throttling_and_else_by_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mount = tmp_path / "cg"
    proc = fake_proc(tmp_path, "0::/app\n", [v2_mount(mount)])
    write(mount / "app" / "cpu.max", "100000 100000\n")  # one CPU
    write(mount / "app" / "cpu.stat", "usage_usec 10\nnr_periods 5\nnr_throttled 2\n")
    load = HostLoad(proc=proc)
    assert load.cpus == 1
    # No pressure kept: the load average against the CPUs the quota allows, not the host's.
    monkeypatch.setattr(hostload.os, "getloadavg", lambda: (1.6, 0.0, 0.0))
    assert load.look() is True
    monkeypatch.setattr(hostload.os, "getloadavg", lambda: (1.4, 0.0, 0.0))
    assert load.look() is False
    # Pressure kept: it alone decides, whatever the load average says.
    write(mount / "app" / "cpu.pressure", pressure(PRESSURE_BUSY_PCT + 0.5))
    assert load.look() is True
    monkeypatch.setattr(hostload.os, "getloadavg", lambda: (50.0, 0.0, 0.0))
    write(mount / "app" / "cpu.pressure", pressure(PRESSURE_BUSY_PCT - 0.5))
    assert load.look() is False
    # Throttled since the last look: busy for that look.
    write(mount / "app" / "cpu.stat", "usage_usec 10\nnr_periods 9\nnr_throttled 3\n")
    assert load.look() is True
    assert load.look() is False


def test_a_look_at_most_once_per_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = fake_proc(tmp_path, "0::/\n", [], host_pressure=pressure(50.0))
    load = HostLoad(proc=proc)
    load.check_s = 3600.0
    assert load.busy_now() is True
    write(proc / "pressure" / "cpu", pressure(0.0))
    assert load.busy_now() is True  # not looked at again yet
    load.check_s = 0.0
    assert load.busy_now() is False
