#!/usr/bin/env python3
"""Render the fault suite's rows (build/reliability.json, written by `make test`) into the
table of RELIABILITY.md, between its `faults:begin` and `faults:end` markers.

    python scripts/reliability_table.py [build/reliability.json] [RELIABILITY.md]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| fault | how it is injected | injected | gets checked | wrong bytes served "
        "| lost / had to survive | kept serving |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['fault']} | {r['injected_by']} | {r['injected']} | {r['gets_checked']} "
            f"| **{r['wrong_bytes']}** | **{r['lost']}** / {r['must_survive']} "
            f"| {'yes' if r['serving'] else '**no**'} |"
        )
    return "\n".join(lines)


def main() -> int:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "build/reliability.json")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "RELIABILITY.md")
    rows = json.loads(source.read_text())
    text = target.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    target.write_text(f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}")
    print(f"{len(rows)} rows written to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
