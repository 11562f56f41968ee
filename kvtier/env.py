"""The environment a client reads for its defaults, without the daemon's configuration
models (pydantic): environment variable names and the default socket's path. The daemon's
`kvtier.config` builds on the same functions, so both agree where the socket is."""

from __future__ import annotations

import os
from pathlib import Path

ENV_PREFIX = "KVTIER_"
ENV_CONFIG_FILE = "KVTIER_CONFIG"
ENV_TARGET = "KVTIER_TARGET"
ENV_TOKEN = "KVTIER_TOKEN"
ENV_TLS_CA = "KVTIER_TLS_CA"
ENV_TLS_CERT = "KVTIER_TLS_CERT"
ENV_TLS_KEY = "KVTIER_TLS_KEY"
# "0": the Python twins of the native pieces (the index's DRAM orders, the arena's extent
# allocator, a tenant's directory) even where the C extensions were built (A/B measurements).
ENV_NATIVE = "KVTIER_NATIVE"


def python_twins_asked_for() -> bool:
    """True where `KVTIER_NATIVE=0` asks for the Python twins of the native pieces."""
    return os.environ.get(ENV_NATIVE, "1") == "0"


def runtime_dir() -> Path:
    """Where the socket lives: systemd's RuntimeDirectory, else the per-user runtime dir."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.getuid()}")


def default_listen() -> str:
    """The daemon's listen address when none is configured: the socket in the runtime dir."""
    return f"unix://{runtime_dir() / 'kvtier.sock'}"


def default_target() -> str:
    """The address clients use when none is given: `$KVTIER_TARGET`, else the default socket."""
    return os.environ.get(ENV_TARGET) or default_listen()
