"""What a SIGHUP may change in a running daemon, and what needs a restart.

Settings read per call (log level, limits, bearer tokens, the planner's default model,
stop and stall timeouts) change at once. Sizes of what was allocated at start (DRAM
arenas, the NVMe tier), where the daemon listens and its tiers' I/O set-up need a
restart; a reload keeps their running values and names them in the log, so an operator
who edited one knows it has not taken effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import Config

RELOADABLE = (
    "log.level",
    "limits.",
    "auth.tokens",
    "planner.default_model",
    "server.stop_timeout_s",
    "server.io_stall_s",
    "policy.admission",
    "policy.min_p_reuse",
)


@dataclass(frozen=True, slots=True)
class Reload:
    config: Config  # the running configuration with the reloadable changes applied
    reloaded: list[str]  # dotted keys now in effect
    needs_restart: list[str]  # dotted keys that changed in the file but not in the daemon


def _reloadable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RELOADABLE)


def _flatten(config: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, value in config.model_dump().items():
        if section == "tenants":
            out[section] = value
            continue
        for name, field_value in value.items():
            out[f"{section}.{name}"] = field_value
    return out


def plan_reload(running: Config, fresh: Config, arenas: set[str]) -> Reload:
    """Merge `fresh` (resolved) into `running` as far as a running daemon can.

    `arenas` are the tenants with a DRAM arena now: a token for any other tenant waits for
    the restart that creates its arena.
    """
    old, new = _flatten(running), _flatten(fresh)
    changed = sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))
    reloaded = [k for k in changed if _reloadable(k)]
    needs_restart = [k for k in changed if not _reloadable(k)]
    data = running.model_dump()
    for key in reloaded:
        section, _, name = key.partition(".")
        data[section][name] = new[key]
    tokens: dict[str, str] = data["auth"]["tokens"]
    waiting = sorted({t for t in tokens.values() if t not in arenas})
    if waiting:
        data["auth"]["tokens"] = {h: t for h, t in tokens.items() if t in arenas}
        needs_restart.append(f"auth.tokens for tenant(s) {', '.join(waiting)} (no arena yet)")
    return Reload(Config.model_validate(data), reloaded, needs_restart)
