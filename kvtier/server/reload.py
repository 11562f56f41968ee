"""What a SIGHUP may change in a running daemon, and what needs a restart.

Settings read per call (log level, limits and per-tenant rate limits, bearer tokens and
certificate mappings, the planner's default model, stop and stall timeouts, the loop's
poll after a reply) change at once. The TLS certificate, key and client CA files are read
again on every reload (so a certificate renewed in place takes effect) as long as TLS
stays on and mTLS stays on or off. Sizes of what was allocated at start (DRAM arenas, the
NVMe tier), where and how the daemon listens and its tiers' I/O set-up need a restart; a
reload keeps their running values and names them in the log, so an operator who edited
one knows it has not taken effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import Config

RELOADABLE = (
    "log.level",
    "limits.",
    "auth.tokens",
    "auth.certificates",
    "planner.default_model",
    "server.stop_timeout_s",
    "server.io_stall_s",
    "server.poll_after_reply_s",
    "policy.admission",
    "policy.min_p_reuse",
)
# Per-tenant keys a reload applies to tenants that exist (a new tenant needs its arena).
RELOADABLE_TENANT_FIELDS = (
    "requests_per_s",
    "request_burst",
    "payload_bytes_per_s",
    "payload_burst_bytes",
)
TLS_FILES = ("server.tls_cert_file", "server.tls_key_file", "server.tls_client_ca_file")


@dataclass(frozen=True, slots=True)
class Reload:
    config: Config  # the running configuration with the reloadable changes applied
    reloaded: list[str]  # dotted keys now in effect
    needs_restart: list[str]  # dotted keys that changed in the file but not in the daemon


def _reloadable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RELOADABLE)


def _tls_swappable(running: Config, fresh: Config) -> bool:
    """New certificate files can replace the running ones only while TLS stays on and
    mTLS stays as it is (gRPC fixes whether it asks for client certificates at start)."""
    old, new = running.server, fresh.server
    return (
        bool(old.tls_cert_file)
        and bool(new.tls_cert_file)
        and bool(old.tls_client_ca_file) == bool(new.tls_client_ca_file)
    )


def _tenant_key(key: str) -> tuple[str, str]:
    """("team.a", "requests_per_s") for "tenants.team.a.requests_per_s" (names may hold dots)."""
    name, _, field = key.removeprefix("tenants.").rpartition(".")
    return name, field


def _flatten(config: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, value in config.model_dump().items():
        if section == "tenants":
            # Rate limits apart: they reload; everything else about tenants needs a restart.
            out[section] = {
                name: {k: v for k, v in t.items() if k not in RELOADABLE_TENANT_FIELDS}
                for name, t in value.items()
            }
            for name, t in value.items():
                for k in RELOADABLE_TENANT_FIELDS:
                    out[f"tenants.{name}.{k}"] = t[k]
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
    tls_swappable = _tls_swappable(running, fresh)

    def applies(key: str) -> bool:
        if key in TLS_FILES:
            return tls_swappable
        if key.startswith("tenants."):
            name = _tenant_key(key)[0]
            return name in running.tenants and name in fresh.tenants
        return _reloadable(key)

    reloaded = [k for k in changed if applies(k)]
    needs_restart = [k for k in changed if not applies(k)]
    data = running.model_dump()
    for key in reloaded:
        if key.startswith("tenants."):
            name, field = _tenant_key(key)
            data["tenants"][name][field] = new[key]
            continue
        section, _, name = key.partition(".")
        data[section][name] = new[key]
    for kind in ("tokens", "certificates"):
        mapping: dict[str, str] = data["auth"][kind]
        waiting = sorted({t for t in mapping.values() if t not in arenas})
        if waiting:
            data["auth"][kind] = {k: t for k, t in mapping.items() if t in arenas}
            needs_restart.append(f"auth.{kind} for tenant(s) {', '.join(waiting)} (no arena yet)")
    return Reload(Config.model_validate(data), reloaded, needs_restart)
