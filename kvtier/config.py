"""Typed configuration: defaults < TOML file < drop-ins < `KVTIER_*` environment < flags.

Every field has a type, a constraint, a default and a one-line doc (the doc is what
`kvtier config default` prints). Unknown keys are errors that name the key and where it
came from. Paths left empty are resolved at start from systemd's directories
(`$RUNTIME_DIRECTORY`, `$CACHE_DIRECTORY`, `$STATE_DIRECTORY`) or the per-user XDG ones.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import tomli_w
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.env import ENV_CONFIG_FILE, ENV_PREFIX, default_listen
from kvtier.errors import ConfigError
from kvtier.sizes import format_size, parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size)]
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CERT_IDENTITY_KINDS = ("cn", "dns", "uri")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    listen: str = Field(
        "",
        description="where to listen: unix:///path or host:port; empty = <runtime dir>/kvtier.sock",
    )
    metrics_listen: str = Field(
        "", description="Prometheus /metrics address host:port; empty = no metrics endpoint"
    )
    reflection: bool = Field(False, description="serve gRPC reflection (for grpcurl)")
    max_concurrent_rpcs: int = Field(
        256,
        gt=0,
        description="gRPC calls in flight on the node, all tenants together (more: "
        "RESOURCE_EXHAUSTED at once); keep it >= tenants x limits.max_calls_per_tenant",
    )
    max_streams_per_connection: int = Field(
        128,
        gt=0,
        description="HTTP/2 streams one client connection may have open at once (more wait "
        "in the client)",
    )
    chunk_bytes: ByteSize = Field(
        1 << 20, ge=4096, le=1 << 30, description="size of data chunks in Put/Get streams"
    )
    stop_timeout_s: float = Field(
        20.0, gt=0, description="SIGTERM: longest wait for in-flight calls and the NVMe flush"
    )
    poll_after_reply_s: float = Field(
        200e-6,
        ge=0,
        le=0.001,
        description="after a zero-copy reply the loop polls this long, not asleep (off on a "
        "busy host; 0: never)",
    )
    io_stall_s: float = Field(
        30.0,
        gt=0,
        description="a disk I/O still running after this long means a stuck worker: the "
        "systemd watchdog ping stops, so systemd restarts kvtier",
    )
    tls_cert_file: str = Field(
        "",
        description="TCP listener: PEM certificate chain the daemon presents (server first); "
        "required with a host:port listen unless tls_insecure",
    )
    tls_key_file: str = Field("", description="TCP listener: PEM private key of tls_cert_file")
    tls_client_ca_file: str = Field(
        "",
        description="TCP listener: PEM CA certificate(s); when set (mTLS), every client must "
        "present a certificate they signed, and auth.certificates maps it to a tenant",
    )
    tls_insecure: bool = Field(
        False,
        description="serve a host:port listen as plain TCP, without TLS: tokens and blocks "
        "cross the network in clear (UNIX sockets never use TLS)",
    )


class LimitsConfig(_Section):
    max_key_bytes: int = Field(128, gt=0, le=4096, description="longest block key accepted")
    max_namespace_chars: int = Field(256, gt=0, le=4096, description="longest namespace accepted")
    max_block_bytes: ByteSize = Field(
        64 << 20, gt=0, description="largest block accepted (also capped by the DRAM capacity)"
    )
    lease_ttl_s: float = Field(
        30.0, gt=0, description="zero-copy leases not released in this time are reclaimed"
    )
    reserve_wait_s: float = Field(
        5.0, ge=0, description="how long a put waits for DRAM held by blocks in use to free up"
    )
    max_leases_per_session: int = Field(
        1024,
        gt=0,
        description="zero-copy leases one client session may hold at once (each pins DRAM)",
    )
    max_plan_blocks: int = Field(
        65536,
        gt=0,
        description="most blocks one Plan may cover (prompt_tokens / tokens_per_block): the "
        "plan is computed on the event loop and answered in one message",
    )
    event_history: int = Field(
        65536,
        gt=0,
        description="residency events kept, so a watcher that reconnects gets the ones it "
        "missed (older: it resyncs from a snapshot)",
    )
    event_backlog: int = Field(
        16384,
        gt=0,
        description="events a watcher may fall behind before it is told to resync",
    )
    requests_per_s: float = Field(
        0.0,
        ge=0,
        description="requests one tenant may make per second, gRPC calls and zero-copy "
        "session ops alike (0: unlimited); tenants.NAME.requests_per_s overrides it",
    )
    request_burst: int = Field(
        0,
        ge=0,
        description="requests a tenant may make at once on top of its rate "
        "(0: one second's worth, at least 1)",
    )
    payload_bytes_per_s: ByteSize = Field(
        0,
        ge=0,
        description="block bytes one tenant may put and get per second, over gRPC and "
        "zero-copy alike (0: unlimited); tenants.NAME.payload_bytes_per_s overrides it",
    )
    payload_burst_bytes: ByteSize = Field(
        0,
        ge=0,
        description="block bytes a tenant may move at once on top of its rate (0: one "
        "second's worth); never less than max_block_bytes, so any block can pass",
    )
    # Per-tenant caps on what a tenant holds open: a rate limit bounds how often a tenant
    # asks, these bound how much it can hold at once (idle streams, sessions, buffers), so
    # one tenant cannot queue another's calls behind its own.
    max_calls_per_tenant: int = Field(
        64,
        gt=0,
        description="gRPC calls one tenant may have in flight at once, streams included "
        "(more: RESOURCE_EXHAUSTED at once, never queued behind other tenants)",
    )
    max_watchers_per_tenant: int = Field(
        8, gt=0, description="WatchEvents streams one tenant may have open at once"
    )
    max_sessions_per_tenant: int = Field(
        64,
        gt=0,
        description="zero-copy sessions (attached clients) one tenant may have at once",
    )
    stream_idle_s: float = Field(
        10.0,
        gt=0,
        description="a Put stream that sends nothing for this long is ended "
        "(DEADLINE_EXCEEDED) and the DRAM it reserved is freed",
    )
    session_buffer_bytes: ByteSize = Field(
        8 << 20,
        ge=64 << 10,
        description="requests and unsent replies one zero-copy session may have buffered; "
        "past it the daemon stops reading that session until its client catches up",
    )
    # Queue prefetch (the Prefetch RPC, kvtier/engine/prefetch.py): what one tenant's
    # announced chains may hold, so a client that announces and never loads cannot keep
    # the arena for itself or grow the daemon's tables.
    prefetch_hints_per_tenant: int = Field(
        1024,
        gt=0,
        description="announced requests (chains) one tenant's prefetch hints may cover at "
        "once; past it the oldest are forgotten",
    )
    prefetch_blocks_per_tenant: int = Field(
        65536,
        gt=0,
        description="blocks one tenant's prefetch hints may name at once; past it the "
        "oldest hints are forgotten",
    )
    prefetch_ttl_s: float = Field(
        30.0, gt=0, description="how long an announced chain is kept, when the call sets none"
    )
    max_prefetch_ttl_s: float = Field(
        600.0, gt=0, description="longest TTL a Prefetch call may ask for"
    )
    prefetch_dram_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="most of a tenant's DRAM arena its prefetch may fill with protected "
        "blocks; the rest stays for puts and other reads",
    )


class DramConfig(_Section):
    capacity_bytes: ByteSize = Field(
        1 << 30, ge=1 << 20, description="size of the DRAM arena, allocated once at start"
    )
    prefault: bool = Field(
        True, description="fault the whole arena in at start (slower start, faster puts)"
    )
    demote_free_fraction: float = Field(
        0.125,
        ge=0,
        le=0.5,
        description="share of each DRAM arena the demoter keeps free by writing the "
        "policy's victims to NVMe in batches ahead of puts (0: only when a put finds no "
        "room); with no NVMe tier nothing is dropped ahead",
    )
    direct_reads: bool = Field(
        True,
        description="publish each tenant's DRAM blocks in a read-only directory its "
        "same-node sessions map, so a get copies without a round trip (false: every get "
        "acquires a lease)",
    )


class NvmeConfig(_Section):
    enabled: bool = Field(True, description="keep a persistent tier on disk")
    path: str = Field(
        "",
        description="directory of record files; empty = $CACHE_DIRECTORY/nvme under systemd, "
        "else <state dir>/nvme",
    )
    capacity_bytes: ByteSize = Field(
        8 << 30, ge=1 << 20, description="most bytes the NVMe tier may hold on disk"
    )
    io_threads: int = Field(
        4, gt=0, le=256, description="disk I/O threads (reads/writes in flight)"
    )
    direct_io: bool = Field(True, description="use O_DIRECT where the filesystem supports it")
    sync_writes: bool = Field(
        False, description="fdatasync each record before it becomes visible (power-loss safe)"
    )
    flush_on_stop: bool = Field(
        True, description="on SIGTERM, write DRAM-only blocks to NVMe so a restart keeps them"
    )
    offline_after_errors: int = Field(
        5,
        gt=0,
        description="consecutive I/O errors that take the NVMe tier offline (the daemon "
        "keeps serving from DRAM)",
    )
    offline_retry_s: float = Field(
        30.0, gt=0, description="while offline, how often a probe record checks the disk again"
    )
    encryption_key_file: str = Field(
        "",
        description="file of a 256-bit key (64 hex digits, mode 0600; make one: kvtier keygen "
        "PATH): records are encrypted and authenticated with AES-256-GCM; empty = plaintext",
    )
    layout: Literal["files", "segments"] = Field(
        "files",
        description="files: one record file per block; segments: records appended to large "
        "preallocated segment files (no encryption yet); a tier in the other layout is "
        "refused at start",
    )


class RemoteConfig(_Section):
    backend: Literal["none", "redis", "mooncake"] = Field(
        "none",
        description="a store shared by the cluster's nodes, below NVMe: any node fetches what "
        "another stored (none: no remote tier)",
    )
    url: str = Field(
        "",
        description="redis: redis://host:port/db or unix:///path.sock; mooncake: the master "
        "host:port",
    )
    metadata_server: str = Field(
        "", description="mooncake: its metadata server (http://host:port/metadata)"
    )
    local_hostname: str = Field(
        "127.0.0.1", description="mooncake: this node's address as the store's peers reach it"
    )
    protocol: str = Field("tcp", description="mooncake: transfer protocol (tcp or rdma)")
    buffer_bytes: ByteSize = Field(
        64 << 20, ge=1 << 20, description="mooncake: this client's transfer buffer"
    )
    segment_bytes: ByteSize = Field(
        0,
        ge=0,
        description="mooncake: memory this node lends the store (0: the store's own "
        "servers hold everything)",
    )
    admission: Literal["write_through", "on_evict"] = Field(
        "write_through",
        description="write_through: every new block is also put remotely (others can fetch "
        "it at once); on_evict: a block is put remotely when it leaves this node's DRAM",
    )
    io_threads: int = Field(4, gt=0, le=256, description="remote requests in flight")
    max_pending_bytes: ByteSize = Field(
        256 << 20,
        ge=1 << 20,
        description="values waiting to be put remotely, at most (beyond it a block is not "
        "put: a slow store must not hold up this node's DRAM or memory)",
    )
    timeout_s: float = Field(2.0, gt=0, description="one remote request's deadline")
    max_probe_blocks: int = Field(
        256,
        ge=0,
        description="blocks a Plan may ask the remote store about after the local prefix "
        "(one round trip for all of them)",
    )
    auth_key_file: str = Field(
        "",
        description="file of a 256-bit key the cluster's nodes share (kvtier keygen PATH): "
        "every remote record is signed (keyed BLAKE2b) and only records signed with it are "
        "served; empty = unsigned (checksummed only: isolate the store)",
    )
    codec: Literal["auto", "on", "off"] = Field(
        "auto",
        description="byte-shuffle + lz4 on remote records: auto = only while measured codec "
        "speed and ratio make a fetch faster than sending the bytes as they are",
    )
    codec_element_bytes: int = Field(
        2, ge=1, le=8, description="element size the shuffle groups bytes by (2: fp16/bf16)"
    )
    offline_after_errors: int = Field(
        5, gt=0, description="consecutive errors that take the remote tier offline"
    )
    offline_retry_s: float = Field(
        10.0, gt=0, description="while offline, how often the remote store is tried again"
    )


class GpuConfig(_Section):
    device: int = Field(
        -1,
        ge=-1,
        description="CUDA device the daemon serves (its pinned arena, its movers); -1: none "
        "(torch is then never imported)",
    )
    pin_arena: bool = Field(
        True,
        description="page-lock each DRAM arena with one cudaHostRegister after a parallel "
        "first touch, so copies to and from the GPU run at full bandwidth",
    )
    touch_threads: int = Field(
        8, gt=0, le=256, description="threads faulting the arena in before it is registered"
    )
    streams_per_direction: int = Field(
        2, gt=0, le=32, description="CUDA streams for each of H2D, D2H and D2D copies"
    )
    hbm_capacity_bytes: ByteSize = Field(
        0,
        ge=0,
        description="GPU memory the daemon keeps copies of hot blocks in, for device-to-"
        "device reads by engines (0: none)",
    )
    emulate: bool = Field(
        False,
        description="run the GPU path on a CPU stand-in (tests, demos): a CUDA IPC handle is "
        "then the path of a shared-memory file; never on a GPU node",
    )


class PlannerConfig(_Section):
    default_model: str = Field(
        "llama3-8b",
        description="prefill profile for namespaces whose first segment names no known model",
    )
    dram_bandwidth_bytes_per_s: float = Field(
        10e9, gt=0, description="seed for DRAM -> engine transfer bandwidth (bytes/s)"
    )
    dram_latency_s: float = Field(20e-6, ge=0, description="seed for DRAM -> engine latency")
    nvme_bandwidth_bytes_per_s: float = Field(
        2e9, gt=0, description="seed for NVMe -> engine bandwidth, refined from real reads"
    )
    nvme_latency_s: float = Field(200e-6, ge=0, description="seed for NVMe -> engine latency")
    hbm_bandwidth_bytes_per_s: float = Field(
        1e12,
        gt=0,
        description="seed for the daemon's HBM copies -> engine (device to device) bandwidth",
    )
    hbm_latency_s: float = Field(
        20e-6, ge=0, description="seed for HBM copy -> engine latency per call"
    )
    remote_bandwidth_bytes_per_s: float = Field(
        1e9, gt=0, description="seed for remote store -> DRAM bandwidth, refined from real reads"
    )
    remote_latency_s: float = Field(
        500e-6, ge=0, description="seed for remote store -> DRAM latency per request"
    )
    calibration_s: float = Field(
        0.5,
        ge=0,
        le=30,
        description="at start, time DRAM copies and NVMe record reads for at most this long "
        "to seed the estimates above from this machine (0: use the seeds as given)",
    )

    @field_validator("default_model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        from kvtier.profiles import MODELS

        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
        return name


class PolicyConfig(_Section):
    name: Literal["kvtier", "lru", "s3fifo"] = Field(
        "kvtier",
        description="eviction order: kvtier (by value: reuse x prefill saved per byte, "
        "leaves first), lru, or s3fifo",
    )
    admission: Literal["write_back", "selective", "write_through"] = Field(
        "write_back",
        description="NVMe writes: write_back (blocks leaving DRAM), selective (only blocks "
        "likely to recur), write_through (every put)",
    )
    min_p_reuse: float = Field(
        0.1, ge=0, le=1, description="selective admission: least estimated chance of reuse"
    )
    ghost_blocks: int = Field(
        100_000,
        ge=0,
        description="recently dropped keys remembered to count lost reuse; also the "
        "horizon of selective admission's P(reuse) (a block not used again within this "
        "many other keys counts as not reused): about the blocks the tiers hold",
    )


class AuthConfig(_Section):
    tokens: dict[str, str] = Field(
        default_factory=dict,
        description="sha256 hex of a bearer token -> tenant (make one: kvtier token); "
        "empty = no tokens, every caller is tenant 'default'",
    )
    certificates: dict[str, str] = Field(
        default_factory=dict,
        description="mTLS client certificate identity -> tenant: 'cn:<subject CN>', "
        "'dns:<SAN DNS name>' or 'uri:<SAN URI>'; needs server.tls_client_ca_file",
    )

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, tokens: dict[str, str]) -> dict[str, str]:
        for digest, tenant in tokens.items():
            if not _SHA256_RE.match(digest):
                raise ValueError(
                    "keys must be the sha256 hex digest of a token (64 lowercase hex "
                    f"characters), not the token itself: {digest[:8]}..."
                )
            if not _TENANT_RE.match(tenant):
                raise ValueError(f"tenant name {tenant!r} must match {_TENANT_RE.pattern}")
        return tokens

    @field_validator("certificates")
    @classmethod
    def _check_certificates(cls, certificates: dict[str, str]) -> dict[str, str]:
        out = {}
        for identity, tenant in certificates.items():
            kind, sep, value = identity.partition(":")
            if not sep or kind not in CERT_IDENTITY_KINDS or not value:
                raise ValueError(
                    f"certificate identity {identity!r} must be 'cn:<common name>', "
                    "'dns:<DNS name>' or 'uri:<URI>' (from the client certificate)"
                )
            if not _TENANT_RE.match(tenant):
                raise ValueError(f"tenant name {tenant!r} must match {_TENANT_RE.pattern}")
            # DNS names compare case-insensitively; CNs and URIs exactly as written.
            out[f"dns:{value.lower()}" if kind == "dns" else identity] = tenant
        return out

    def tenants(self) -> set[str]:
        """Every tenant a token or a certificate names."""
        return set(self.tokens.values()) | set(self.certificates.values())


class TenantConfig(_Section):
    dram_capacity_bytes: ByteSize = Field(
        ge=1 << 20, description="size of this tenant's own DRAM arena (its quota)"
    )
    nvme_capacity_bytes: ByteSize = Field(
        0,
        ge=0,
        description="most of the shared NVMe tier this tenant's blocks may hold; past it "
        "they evict their own (0: no quota of its own)",
    )
    requests_per_s: float | None = Field(
        None, ge=0, description="this tenant's request rate (unset: limits.requests_per_s)"
    )
    request_burst: int | None = Field(
        None, ge=0, description="this tenant's request burst (unset: limits.request_burst)"
    )
    payload_bytes_per_s: Annotated[int, BeforeValidator(parse_size)] | None = Field(
        None,
        ge=0,
        description="this tenant's block bytes per second (unset: limits.payload_bytes_per_s)",
    )
    payload_burst_bytes: Annotated[int, BeforeValidator(parse_size)] | None = Field(
        None,
        ge=0,
        description="this tenant's block-byte burst (unset: limits.payload_burst_bytes)",
    )


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")


class Config(_Section):
    server: ServerConfig = Field(default_factory=lambda: ServerConfig())
    limits: LimitsConfig = Field(default_factory=lambda: LimitsConfig())
    dram: DramConfig = Field(default_factory=lambda: DramConfig())
    nvme: NvmeConfig = Field(default_factory=lambda: NvmeConfig())
    remote: RemoteConfig = Field(default_factory=lambda: RemoteConfig())
    gpu: GpuConfig = Field(default_factory=lambda: GpuConfig())
    log: LogConfig = Field(default_factory=lambda: LogConfig())
    planner: PlannerConfig = Field(default_factory=lambda: PlannerConfig())
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig())
    auth: AuthConfig = Field(default_factory=lambda: AuthConfig())
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description="per-tenant settings; every tenant named in auth.tokens or "
        "auth.certificates needs one (except 'default', whose arena is dram.capacity_bytes)",
    )

    @model_validator(mode="after")
    def _tenants_have_arenas(self) -> Config:
        for key, mapping in (
            ("tokens", self.auth.tokens),
            ("certificates", self.auth.certificates),
        ):
            for tenant in sorted(set(mapping.values()) - {"default"}):
                if tenant not in self.tenants:
                    what = "a token" if key == "tokens" else "a certificate"
                    raise ValueError(
                        f"auth.{key} maps {what} to tenant '{tenant}', which has no "
                        f"[tenants.{tenant}] section: give it dram_capacity_bytes"
                    )
        return self

    def tenant_arenas(self) -> dict[str, int]:
        """Tenant -> its DRAM arena's size. 'default' exists unless only tokens or
        certificates name tenants (then no caller can be 'default' unless one maps to it)."""
        arenas = {name: t.dram_capacity_bytes for name, t in self.tenants.items()}
        named = self.auth.tenants()
        if not named or "default" in named:
            arenas["default"] = self.dram.capacity_bytes
        return arenas

    def resolved(self) -> Config:
        """A copy with empty paths filled in from the environment (systemd or XDG)."""
        out = self.model_copy(deep=True)
        if not out.server.listen:
            out.server.listen = default_listen()
        if not out.nvme.path:
            out.nvme.path = str(nvme_dir())
        return out


def state_dir() -> Path:
    """Where persistent state lives: systemd's StateDirectory, else the XDG state dir."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "kvtier"


def nvme_dir() -> Path:
    """The NVMe tier's default directory. Blocks are a cache (an engine can always recompute
    them), so under systemd they live in CacheDirectory: `systemctl clean --what=cache`
    empties the tier, and a plain restart or upgrade keeps it."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "nvme"
    return state_dir() / "nvme"


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _keys_at(loc: tuple[int | str, ...]) -> list[str]:
    """The keys a section at `loc` accepts (the names "did you mean" chooses from)."""
    model: Any = Config
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is not None:
            if part not in fields:
                return []
            model = fields[part].annotation
        elif get_origin(model) is dict:
            model = get_args(model)[1]  # [tenants.NAME]: any name, then a section
        else:
            return []
    fields = getattr(model, "model_fields", None)
    return list(fields) if fields is not None else []


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            name = str(item["loc"][-1])
            close = difflib.get_close_matches(name, _keys_at(item["loc"][:-1]), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{source}: unknown key '{key}'{hint}")
            continue
        msg = item["msg"]
        if item["type"] == "value_error":
            # Our validators' own words; pydantic prefixes them with "Value error, ".
            msg = str(item.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
        lines.append(f"{source}: invalid value for '{key}': {msg}" if key else f"{source}: {msg}")
    return "\n".join(lines)


def _check(data: Mapping[str, Any], source: str) -> None:
    try:
        Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def read_toml(path: Path) -> dict[str, Any]:
    """The checked contents of one TOML file; ConfigError names the file and the key."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file: {err.strerror}") from None
    _check(data, str(path))
    return data


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config from `KVTIER_<SECTION>__<FIELD>` variables (other KVTIER_* names are not config)."""
    out: dict[str, Any] = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, field = name[len(ENV_PREFIX) :].lower().partition("__")
        entry = {section: {field: value}}
        try:
            Config.model_validate(entry)
        except ValidationError as err:
            raise ConfigError(_describe(err, f"environment variable {name}")) from None
        out = _deep_merge(out, entry)
    return out


def default_config_file(environ: Mapping[str, str]) -> Path | None:
    """The file to read when no --config is given: $KVTIER_CONFIG, or systemd's config dir."""
    if environ.get(ENV_CONFIG_FILE):
        return Path(environ[ENV_CONFIG_FILE])
    if environ.get("CONFIGURATION_DIRECTORY"):
        candidate = Path(environ["CONFIGURATION_DIRECTORY"].split(":")[0]) / "kvtier.toml"
        if candidate.exists():
            return candidate
    return None


def load_config(
    path: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults < file (`path`, then `<path>.d/*.toml` drop-ins) < environment < flags."""
    environ = os.environ if environ is None else environ
    path = path or default_config_file(environ)
    merged: dict[str, Any] = {}
    if path is not None:
        merged = read_toml(path)
        dropins = Path(f"{path}.d")
        if dropins.is_dir():
            for dropin in sorted(dropins.glob("*.toml")):
                merged = _deep_merge(merged, read_toml(dropin))
    merged = _deep_merge(merged, env_overrides(environ))
    if flags:
        _check(flags, "command line")
        merged = _deep_merge(merged, flags)
    try:
        return Config.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_describe(err, str(path) if path else "configuration")) from None


def _toml_value(model: type[BaseModel], name: str, value: Any) -> Any:
    """Sizes as IEC strings (what people write), everything else as it is."""
    is_size = any(isinstance(m, BeforeValidator) for m in model.model_fields[name].metadata)
    return format_size(value) if is_size else value


def _section_dict(model: BaseModel) -> dict[str, Any]:
    # TOML has no null: an unset optional key (a tenant's override) is left out.
    return {
        name: _toml_value(type(model), name, value)
        for name, value in model.model_dump(exclude_none=True).items()
    }


def dump_toml(config: Config) -> str:
    """The configuration as TOML that `load_config` reads back to the same values."""
    data: dict[str, Any] = {}
    for section in Config.model_fields:
        value = getattr(config, section)
        if isinstance(value, BaseModel):
            data[section] = _section_dict(value)
        else:  # tenants: name -> TenantConfig
            data[section] = {name: _section_dict(t) for name, t in value.items()}
    return tomli_w.dumps(data)


def _toml_line(name: str, value: Any) -> str:
    if isinstance(value, dict) and not value:
        return f"{name} = {{}}"
    return tomli_w.dumps({name: value}).strip()


def default_toml() -> str:
    """The embedded default configuration, each key preceded by its one-line doc."""
    lines = ["# kvtier configuration (defaults). Sizes are IEC strings such as '512MiB'.", ""]
    defaults = Config()
    for section, section_field in Config.model_fields.items():
        model = getattr(defaults, section)
        if not isinstance(model, BaseModel):
            lines.append(f"# [{section}.NAME]: {section_field.description}")
            lines.append(f"# [{section}.team-a]")
            lines.append('# dram_capacity_bytes = "4GiB"')
            lines.append("")
            continue
        lines.append(f"[{section}]")
        for name, field in type(model).model_fields.items():
            value = _toml_value(type(model), name, getattr(model, name))
            lines.append(f"# {field.description}")
            lines.append(_toml_line(name, value))
        lines.append("")
    return "\n".join(lines)
