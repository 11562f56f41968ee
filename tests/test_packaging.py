"""kvtier is not on the package index: what the docs tell people to install must exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_install_line_asks_the_index_for_kvtier() -> None:
    # `pip install kvtier` / 'kvtier[remote]' fail: only a checkout or a wheel works.
    from_index = re.compile(r"pip install (?:-\S+ )*['\"]?kvtier(?:\[|['\"\s]|$)")
    bad = [
        f"{doc.name}: {line.strip()}"
        for doc in DOCS
        for line in doc.read_text().splitlines()
        if from_index.search(line)
    ]
    assert bad == []


def test_the_wheel_carries_the_generated_code_and_imports(tmp_path: Path) -> None:
    # Offline and in seconds: setuptools from this environment, no dependencies fetched.
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)]
    subprocess.run(
        [sys.executable, "-m", "pip", *build],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("kvtier_pb2.py", "kvtier_pb2_grpc.py", "kvtier_pb2.pyi", "__init__.py"):
        assert f"kvtier/_proto/{name}" in names
    assert "kvtier/py.typed" in names and "kvtier/cli.py" in names
    # The wheel imports as a zip: kvtier from it, not from the checkout. Its C extensions
    # cannot load from a zip, so this is also kvtier without them: the Python order,
    # allocator and directory instead.
    code = (
        "import kvtier, kvtier.client, kvtier._proto.kvtier_pb2 as pb\n"
        "from kvtier.index.dense_native import NATIVE\n"
        "from kvtier.tiers.allocator import NATIVE_ALLOCATOR, extent_allocator\n"
        "from kvtier.engine.directory import NATIVE_DIRECTORY, new_directory\n"
        "print(kvtier.__file__)\nprint(pb.DESCRIPTOR.name)\nprint(NATIVE)\n"
        "print(NATIVE_ALLOCATOR)\nprint(extent_allocator(1 << 20).allocate(1))\n"
        "print(NATIVE_DIRECTORY)\nprint(type(new_directory(1024)).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(wheel)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    ).stdout.splitlines()
    assert out[0].startswith(str(wheel)) and out[1] == "kvtier/v1/kvtier.proto"
    assert out[2] == "None"  # the extension is in the wheel but not loadable from the zip
    assert out[3] == "None" and out[4] == "Extent(offset=0, size_bytes=4096)"
    assert out[5] == "None" and out[6] == "Directory"
    assert "kvtier/index/_arc_native.abi3.so" in names
    assert "kvtier/tiers/_alloc_native.abi3.so" in names
    assert "kvtier/engine/_directory_native.abi3.so" in names
