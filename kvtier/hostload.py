"""Whether this process has a CPU to spare, for the ways that spend one waiting (the
client polling for its reply, the daemon's loop kept awake after a reply). A busy CPU is
needed by real work; what polling costs that work is not in the poller's own figures.

Judged once a second, by the first of these that this host can tell:
1. CPU pressure (Linux PSI): the share of the last 10 s in which a runnable task of this
   process's cgroup (cgroup v2's `cpu.pressure`), or of the host (`/proc/pressure/cpu`),
   waited for a CPU. Busy from `PRESSURE_BUSY_PCT`. Pollers on CPUs nobody else wants
   make no pressure, so they do not count themselves, as they do in a load average; and a
   container's own pressure is what its CPU limit leaves it, not the node's.
2. The 1-minute load average at least the CPUs this process may use plus a half.
Either way busy while the cgroup's CPU quota throttled it since the last look (a poll
spends quota the next request needs), and the CPUs it may use are its affinity capped by
its cgroup's quota (a Kubernetes CPU limit: the node's load and CPU count are not its).

Measured on the 2-vCPU VM (BENCHMARKS.md, "The polling gate by CPU pressure"): a client
and the daemon polling alone kept the host's `some avg10` at 0.0-0.1 %; one CPU-bound
process beside them took it to 25 % within 20 s, two to 70 %, while the load average was
still 1.4 and 2.1 (under the 2.5 that gates two CPUs).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

LOAD_CHECK_S = 1.0
PRESSURE_BUSY_PCT = 10.0


@dataclass(frozen=True, slots=True)
class Cgroup:
    """Where this process's cgroup files are: the v2 directory (pressure, `cpu.max`,
    `cpu.stat`) and the v1 `cpu` controller's (`cpu.cfs_quota_us`), each with its
    ancestors up to the mount (a limit anywhere above applies too); None where absent."""

    v2: Path | None = None
    v1_cpu: Path | None = None
    v2_root: Path | None = None
    v1_root: Path | None = None


def find_cgroup(proc: Path = Path("/proc")) -> Cgroup:
    """This process's cgroup directories, from /proc/self/cgroup and /proc/self/mountinfo."""
    try:
        memberships = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return Cgroup()
    paths: dict[str, str] = {}  # "" for v2, else each v1 controller
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    found: dict[str, tuple[Path, Path]] = {}
    for line in mounts:
        # id parent major:minor root mount-point options [optional...] - fstype source super
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype = fields[3], Path(fields[4]), tail[0]
        if fstype == "cgroup2" and "" in paths and "" not in found:
            found[""] = (point, _inside(point, root, paths[""]))
        elif fstype == "cgroup" and "cpu" in tail[2].split(",") and "cpu" in paths:
            found.setdefault("cpu", (point, _inside(point, root, paths["cpu"])))
    v2, v1 = found.get(""), found.get("cpu")
    return Cgroup(
        v2=v2[1] if v2 else None,
        v1_cpu=v1[1] if v1 else None,
        v2_root=v2[0] if v2 else None,
        v1_root=v1[0] if v1 else None,
    )


def _inside(point: Path, root: str, path: str) -> Path:
    """The directory of cgroup `path` under a mount of the hierarchy's `root` (in a
    cgroup namespace both are "/": the mount is the process's own cgroup)."""
    relative = os.path.relpath(path, root) if path.startswith(root) else "."
    directory = (point / relative).resolve() if relative != "." else point
    return directory if directory.is_dir() else point


def _upward(directory: Path, root: Path | None) -> list[Path]:
    """`directory` and its ancestors down to `root` (inclusive)."""
    chain = [directory]
    while root is not None and chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def quota_cpus(cgroup: Cgroup) -> float | None:
    """The CPUs the cgroup's quota allows (the least along its ancestors), None if none."""
    limits: list[float] = []
    if cgroup.v2 is not None:
        for directory in _upward(cgroup.v2, cgroup.v2_root):
            fields = _read(directory / "cpu.max").split()
            if len(fields) == 2 and fields[0] != "max":
                limits.append(_ratio(fields[0], fields[1]))
    if cgroup.v1_cpu is not None:
        for directory in _upward(cgroup.v1_cpu, cgroup.v1_root):
            quota = _read(directory / "cpu.cfs_quota_us").strip()
            period = _read(directory / "cpu.cfs_period_us").strip()
            if quota and period and not quota.startswith("-"):
                limits.append(_ratio(quota, period))
    positive = [limit for limit in limits if limit > 0]
    return min(positive) if positive else None


def usable_cpus(cgroup: Cgroup) -> int:
    """The CPUs this process may use: its affinity, capped by its cgroup's quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = quota_cpus(cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(cpus, 1)


def pressure_pct(cgroup: Cgroup, proc: Path = Path("/proc")) -> float | None:
    """`some avg10` of CPU pressure: the cgroup's (v2) where it has one, else the host's;
    None where the kernel keeps none (no PSI, or `psi=0`)."""
    sources = [cgroup.v2 / "cpu.pressure"] if cgroup.v2 is not None else []
    for source in [*sources, proc / "pressure" / "cpu"]:
        for line in _read(source).splitlines():
            if line.startswith("some "):
                for field in line.split()[1:]:
                    name, _, value = field.partition("=")
                    if name == "avg10":
                        try:
                            return float(value)
                        except ValueError:
                            break
    return None


def throttled_count(cgroup: Cgroup) -> int:
    """How often the cgroup's quota has throttled it (0 where nothing says)."""
    for directory in (cgroup.v2, cgroup.v1_cpu):
        if directory is None:
            continue
        for line in _read(directory / "cpu.stat").splitlines():
            name, _, value = line.partition(" ")
            if name == "nr_throttled" and value.strip().isdigit():
                return int(value)
    return 0


class HostLoad:
    """Busy or not, as of the last look (at most one look per `check_s`)."""

    def __init__(self, cgroup: Cgroup | None = None, proc: Path = Path("/proc")) -> None:
        self.cgroup = find_cgroup(proc) if cgroup is None else cgroup
        self.proc = proc
        self.cpus = usable_cpus(self.cgroup)
        self.check_s = LOAD_CHECK_S
        self._looked_s = float("-inf")
        self._throttled = throttled_count(self.cgroup)
        self.busy = False

    def look(self) -> bool:
        """Judge now (see the module's docstring)."""
        throttled = throttled_count(self.cgroup)
        newly_throttled = throttled > self._throttled
        self._throttled = throttled
        pressure = pressure_pct(self.cgroup, self.proc)
        if pressure is not None:
            busy = pressure >= PRESSURE_BUSY_PCT
        else:
            try:
                busy = os.getloadavg()[0] >= self.cpus + 0.5
            except OSError:  # no load average either: judge by the figures alone
                busy = False
        self.busy = busy or newly_throttled
        return self.busy

    def busy_now(self) -> bool:
        now = time.monotonic()
        if now - self._looked_s >= self.check_s:
            self._looked_s = now
            self.look()
        return self.busy


_host: HostLoad | None = None


def host_busy() -> bool:
    """Whether this process's CPUs have none to spare (looked at once a second)."""
    global _host
    if _host is None:
        _host = HostLoad()
    return _host.busy_now()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _ratio(quota: str, period: str) -> float:
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return 0.0
