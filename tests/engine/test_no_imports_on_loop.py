"""Nothing is imported while the store serves: a module imported on first use runs under
the GIL on the event loop (or a thread beside it) and stalls every request for as long
(numpy 2's `np.unique` importing numpy.ma was 10-45 ms, over issue 22's 20 ms). Run in a
fresh interpreter, since this one has imported everything by now: puts that demote in
batches of 64 records (the NVMe order's bulk insert), gets from both tiers, then a
restart whose recovery indexes them again in the background."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from kvtier.engine.store import Store
    from tests.engine.test_store import get, make_config, put

    SIZE = 4096
    COUNT = 4096  # 16 MiB through an 8 MiB arena: most of it demoted

    def data_of(i):
        return i.to_bytes(8, "little") * (SIZE // 8)

    async def serve(root, first):
        store = Store(make_config(root, 8 << 20, 256 << 20, layout="segments"))
        await store.start()
        before = set(sys.modules)
        if first:
            for i in range(COUNT):
                await put(store, b"k%d" % i, data_of(i))
            await store.flush()
        else:
            await store.recovery.wait()
        wrong = 0
        for i in range(0, COUNT, 97):
            wrong += await get(store, b"k%d" % i) != data_of(i)
        imported = sorted(set(sys.modules) - before)
        await store.close()
        return imported, wrong

    async def main():
        root = Path(sys.argv[1])
        filled = await serve(root, True)
        restarted = await serve(root, False)
        print(json.dumps({"fill": filled, "restart": restarted}))

    asyncio.run(main())
    """
)


def test_serving_and_recovery_import_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for phase in ("fill", "restart"):
        imported, wrong = report[phase]
        assert wrong == 0, f"{phase}: {wrong} blocks read back wrong"
        assert imported == [], f"imported while serving ({phase}): {imported}"
