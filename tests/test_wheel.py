"""The wheel and sdist that `python -m build` makes, and the README's install lines.

Offline, in seconds (every run): the build, PyPI's metadata check, and what each archive
carries. Marker `wheel` (`make wheel-check`, in CI; it installs from the package index):
the wheel in a fresh venv with each extra, and the README's install lines run as written
in an unpacked sdist, each then importing kvtier and answering `kvtier --version`.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

import kvtier

ROOT = Path(__file__).resolve().parents[1]
VERSION = kvtier.__version__
# What each extra is for, imported from a venv holding only the wheel and that extra.
# An extra added to pyproject.toml without a row here fails the table test below.
EXTRA_IMPORTS: dict[str, list[str]] = {
    "": [
        "kvtier",
        "kvtier.client",
        "kvtier.server.daemon",
        "kvtier.tiers.nvme",
        "kvtier.index._arc_native",  # the C extensions the wheel carries, built
        "kvtier.tiers._alloc_native",
        "kvtier.engine._directory_native",
        "kvtier.tiers._batch_native",
    ],
    "remote": ["redis", "hiredis", "numpy", "kvtier.tiers.remote"],
    "mooncake": ["mooncake.store"],
    "bench": ["redis", "matplotlib", "libaio", "kvtier.bench.nvme"],
    "gpu": ["torch", "cupy"],
    "dev": ["torch", "numpy", "pytest", "hypothesis", "grpc_tools", "mypy", "build", "twine"],
}
# The one torch build an extra may bring: the CPU wheel (an open range pulls CUDA's).
TORCH_VERSION = "2.13.0+cpu"


def _run(
    cmd: list[str], cwd: Path, timeout_s: float = 600, env: dict[str, str] | None = None
) -> str:
    done = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env if env is not None else _clean_env(),
    )
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _clean_env() -> dict[str, str]:
    # The checkout must not leak in: kvtier comes from what was installed, or not at all.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # --no-isolation: this venv's setuptools, offline. Without --sdist/--wheel, build makes
    # the sdist first and the wheel from the unpacked sdist, so the sdist must rebuild.
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "-o", str(out), str(ROOT)], ROOT)
    return out


def _wheel(dist: Path) -> Path:
    """The one wheel: CPython's stable ABI from 3.11 (the C extension), for this platform."""
    (wheel,) = dist.glob(f"kvtier-{VERSION}-cp311-abi3-*.whl")
    return wheel


def _sdist(dist: Path) -> Path:
    return dist / f"kvtier-{VERSION}.tar.gz"


def test_build_makes_a_wheel_and_an_sdist_that_twine_accepts(dist: Path) -> None:
    assert sorted(p.name for p in dist.iterdir()) == sorted([_wheel(dist).name, _sdist(dist).name])
    out = _run(
        [sys.executable, "-m", "twine", "check", "--strict", str(_wheel(dist)), str(_sdist(dist))],
        ROOT,
    )
    assert out.count("PASSED") == 2


def test_wheel_metadata_names_the_entry_point_license_and_every_extra(dist: Path) -> None:
    with zipfile.ZipFile(_wheel(dist)) as whl:
        names = whl.namelist()
        info = f"kvtier-{VERSION}.dist-info"
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    # Only the package: no tests, no build leftovers at the top of site-packages.
    assert {n.split("/", 1)[0] for n in names} == {"kvtier", info}
    # The optional extensions were built (a failed compile would only warn), in the stable
    # ABI, with their stubs.
    assert "kvtier/index/_arc_native.abi3.so" in names
    assert "kvtier/tiers/_alloc_native.abi3.so" in names
    assert "kvtier/tiers/_alloc_native.pyi" in names
    assert "kvtier/engine/_directory_native.abi3.so" in names
    assert "kvtier/engine/_directory_native.pyi" in names
    assert "kvtier/tiers/_batch_native.abi3.so" in names
    assert "kvtier/tiers/_batch_native.pyi" in names
    assert "kvtier/_vendor/xxhash.LICENSE" in names  # the vendored header's licence
    assert "kvtier = kvtier.cli:main" in entry_points
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert set(meta.get_all("Provides-Extra") or []) == set(EXTRA_IMPORTS) - {""}
    torch_pins = [r for r in meta.get_all("Requires-Dist") or [] if r.startswith("torch")]
    assert torch_pins and all(r.startswith("torch==2.13.0") for r in torch_pins), torch_pins


def test_every_extra_in_pyproject_has_an_import_check() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras) == set(EXTRA_IMPORTS) - {""}


def test_sdist_carries_what_rebuilds_and_retests_it(dist: Path) -> None:
    with tarfile.open(_sdist(dist)) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for needed in (
        "pyproject.toml",
        "MANIFEST.in",
        "README.md",
        "Makefile",
        "proto/kvtier/v1/kvtier.proto",  # what kvtier/_proto is generated from
        "kvtier/_proto/kvtier_pb2.py",
        "kvtier/py.typed",
        "tests/conftest.py",
        "tests/test_wheel.py",
        "scripts/gen_proto.py",
        "kvtier/index/_arc_native.c",  # the extensions rebuild from the sdist
        "kvtier/index/_native_tables.h",
        "kvtier/tiers/_alloc_native.c",
        "kvtier/engine/_directory_native.c",
        "kvtier/_native_u64map.h",
        "kvtier/tiers/_batch_native.c",
        "kvtier/_vendor/xxhash.h",
        "kvtier/_vendor/xxh_x86dispatch.c",
        "kvtier/_vendor/xxhash.LICENSE",
        "systemd/kvtier.service",
        "deploy/kubernetes/base/kustomization.yaml",
    ):
        assert needed in names, f"{needed} missing from the sdist"
    assert not [n for n in names if n.endswith((".pyc", ".pyo"))]


def _install_lines() -> list[str]:
    """The indented commands under the README's "not on the package index" paragraph."""
    text = (ROOT / "README.md").read_text()
    start = text.index("kvtier is not on the package index")
    lines: list[str] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("    "):
            lines.append(line.split(" #", 1)[0].strip())
        elif lines and line.strip():
            break
    return lines


def test_readme_builds_with_python_m_build_and_installs_the_wheel_it_names() -> None:
    lines = _install_lines()
    assert "python -m build" in " ".join(lines), lines
    wheel_lines = [line for line in lines if ".whl" in line]
    # The README names the wheel this project's machines (x86_64 Linux) build.
    named = f"kvtier-{VERSION}-cp311-abi3-linux_x86_64.whl"
    assert wheel_lines and all(named in w for w in wheel_lines)


@dataclass
class Install:
    bin_dir: Path
    proc: subprocess.Popen[bytes]
    log: IO[str]


def _venv(path: Path, with_pip: bool) -> Path:
    # The base interpreter, not this venv's: a fresh venv sees none of this one's packages.
    # Without pip of its own (this venv's pip installs into it with --python) it takes a
    # second instead of ten.
    base = Path(sys.base_prefix) / "bin" / "python3"
    flags = [] if with_pip else ["--without-pip"]
    _run([str(base), "-m", "venv", *flags, str(path)], path.parent, timeout_s=120)
    return path / "bin"


_LIST = (
    "import importlib.metadata as m\n"
    "for d in m.distributions():\n"
    "    print(f\"{d.metadata['Name']}=={d.version}\")\n"
)


def _check_installed(bin_dir: Path, modules: list[str], cwd: Path) -> None:
    venv = bin_dir.parent
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "import kvtier\n"
        "print(kvtier.__file__)\n"
    )
    where = _run([str(bin_dir / "python"), "-c", code], cwd).strip()
    assert Path(where).is_relative_to(venv), f"kvtier came from {where}, not the venv"
    version = _run([str(bin_dir / "kvtier"), "--version"], cwd).strip()
    assert version == f"kvtier {VERSION}"
    installed = _run([str(bin_dir / "python"), "-c", _LIST], cwd)
    assert not re.search(r"(?im)^nvidia-", installed), "an extra pulled CUDA libraries"
    torch = re.search(r"(?im)^torch==(\S+)$", installed)
    assert torch is None or torch.group(1) == TORCH_VERSION, installed


@pytest.fixture(scope="module")
def installs(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Install]]:
    """Every extra's fresh venv, installing at once (their downloads overlap: about half
    the time of one after another); each test below waits for its own."""
    root = tmp_path_factory.mktemp("venvs")
    started: dict[str, Install] = {}
    for extra in EXTRA_IMPORTS:
        bin_dir = _venv(root / (extra or "base"), with_pip=False)
        spec = f"{_wheel(dist)}[{extra}]" if extra else str(_wheel(dist))
        log = (root / f"{extra or 'base'}.log").open("w+")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(bin_dir / "python"),
                "install",
                "-q",
                spec,
            ],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
        )
        started[extra] = Install(bin_dir, proc, log)
    yield started
    for install in started.values():
        if install.proc.poll() is None:
            install.proc.kill()
        install.proc.wait()
        install.log.close()


@pytest.mark.wheel
@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", list(EXTRA_IMPORTS), ids=lambda e: f"extra-{e or 'none'}")
def test_wheel_installs_in_a_fresh_venv_with_each_extra(
    installs: dict[str, Install], extra: str, tmp_path: Path
) -> None:
    # Ids are "extra-gpu", never "gpu": that keyword would skip the test without CUDA.
    install = installs[extra]
    code = install.proc.wait(timeout=900)
    install.log.seek(0)
    assert code == 0, f"pip install of the wheel with [{extra}] failed:\n{install.log.read()}"
    _check_installed(install.bin_dir, EXTRA_IMPORTS[extra], tmp_path)


@pytest.mark.wheel
@pytest.mark.timeout(900)
def test_readme_install_lines_work_as_written_in_an_unpacked_sdist(
    dist: Path, tmp_path: Path
) -> None:
    with tarfile.open(_sdist(dist)) as sdist:
        sdist.extractall(tmp_path, filter="data")
    checkout = tmp_path / f"kvtier-{VERSION}"
    bin_dir = _venv(tmp_path / "venv", with_pip=True)  # as a person makes one
    env = _clean_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    for line in _install_lines():
        # As a person types them, in the venv (its pip, its python), from the checkout.
        done = subprocess.run(
            ["bash", "-c", line], cwd=checkout, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, f"README line {line!r} failed:\n{done.stdout}\n{done.stderr}"
    _check_installed(bin_dir, EXTRA_IMPORTS["remote"], tmp_path)


def test_version_flag_prints_the_package_version() -> None:
    out = _run([sys.executable, "-m", "kvtier", "--version"], ROOT, env=dict(os.environ))
    assert out.strip() == f"kvtier {VERSION}"
