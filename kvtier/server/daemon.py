"""`kvtier serve`: start the tiers, serve gRPC, drain on SIGTERM, reload on SIGHUP.

Under systemd (Type=notify) it reports readiness once it serves and health is SERVING:
with DRAM at once, while the NVMe index still fills in the background (the `kvtier.nvme`
health name is NOT_SERVING until it is complete, and STATUS= counts its records). It keeps
STATUS= current, pings the watchdog only while the I/O workers make progress, asks for
more start-up time while a large arena is faulted in, and says STOPPING=1 on SIGTERM (see
kvtier/server/sdnotify.py and systemd/).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from kvtier import __version__, failpoints
from kvtier._malloc import limit_arenas, raise_thresholds
from kvtier._wire import INLINE_HEADROOM_BYTES, INLINE_MAX_BYTES
from kvtier.config import Config, load_config
from kvtier.engine.cuda_path import CudaPath, EmulatedOpener, TorchOpener
from kvtier.engine.store import Store
from kvtier.errors import ConfigError
from kvtier.movers.cuda import Mover, TorchDevice
from kvtier.server import looplag, stalltrace
from kvtier.server.arena_socket import ArenaSocket
from kvtier.server.metrics import StoreCollector
from kvtier.server.reload import plan_reload
from kvtier.server.sdnotify import Notifier
from kvtier.server.service import SERVICE_NAME, KVTierService, add_to_server
from kvtier.server.tls import ReloadableCredentials, listener_tls, load_server_tls
from kvtier.sizes import human_size

logger = logging.getLogger("kvtier")


def message_limit_bytes(config: Config) -> int:
    """Largest gRPC message either side accepts: a chunk, or a header with the longest key,
    or a PutBlock / GetBlock of the largest block they carry (INLINE_MAX_BYTES)."""
    chunked = max(4 << 20, 2 * config.server.chunk_bytes + (64 << 10))
    return max(chunked, INLINE_MAX_BYTES + INLINE_HEADROOM_BYTES)


def grpc_options(config: Config) -> list[tuple[str, int]]:
    limit = message_limit_bytes(config)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.max_concurrent_streams", config.server.max_streams_per_connection),
    ]


DAEMON_MALLOC_ARENAS = 2
# How long a thread that wants the GIL waits before it asks the holder to let go (Python's
# default is 5 ms). The loop shares the GIL with the I/O threads, the recovery's scan and
# load threads and start-up's calibration: woken by a request, it waited a default interval
# per busy thread, so the restart's longest stalls (~23 ms at 300 k records) were the loop
# idle, waiting for the GIL (stalltrace kind "other-threads"). 1 ms bounds that wait by a
# fifth, at the cost of more frequent handoffs between busy threads.
GIL_SWITCH_INTERVAL_S = 0.001


def tune_malloc() -> None:
    """Keep freed message buffers in the heap instead of returning them to the kernel.

    gRPC allocates a fresh buffer per 1 MiB chunk; with glibc's defaults each one is a new
    mmap whose pages fault in on first touch, which halves Get throughput (measured:
    0.25 -> 0.5 GB/s for 4 MiB blocks over UDS). Raising the mmap and trim thresholds
    lets malloc reuse warm pages. No effect (and no error) on a libc without mallopt.
    Two arenas for every thread (`limit_arenas` says why): a 300 k-block segment restart
    held 193 B a block of RssAnon two seconds after its index was in, against 292-307 B
    with glibc's default (BENCHMARKS.md, "Two malloc arenas").
    """
    raise_thresholds(64 << 20, 1 << 30)
    limit_arenas(DAEMON_MALLOC_ARENAS)


def setup_logging(level: str) -> None:
    # Under systemd stderr goes to the journal, which stamps each line itself.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=stamp + "%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger().setLevel(level.upper())


def _prepare_unix_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # a stale socket left by a daemon that did not stop cleanly
        return
    finally:
        probe.close()
    raise ConfigError(f"another kvtier daemon is already serving on {path}")


def _unix_path(listen: str) -> Path | None:
    if listen.startswith("unix://"):
        return Path(listen[len("unix://") :])
    if listen.startswith("unix:"):
        return Path(listen[len("unix:") :])
    return None


# Faulting in an arena runs at a few GB/s; ask systemd for time at a pessimistic 1 GiB/s.
PREFAULT_BYTES_PER_S = 1 << 30
STATUS_EVERY_S = 10.0
RECOVERY_STATUS_EVERY_S = 1.0
# gRPC health name of the NVMe tier: NOT_SERVING while its index fills (the daemon, "",
# is SERVING: DRAM works and NVMe blocks not indexed yet are misses).
NVME_HEALTH = "kvtier.nvme"


class Daemon:
    def __init__(
        self,
        config: Config,
        config_path: Path | None,
        flags: dict[str, Any] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config.resolved()
        self.config_path = config_path
        self.flags = flags or {}
        self.notifier = notifier or Notifier.from_env()
        self.draining = False
        self._stop = asyncio.Event()
        self._store: Store | None = None
        self._service: KVTierService | None = None
        self._tls: ReloadableCredentials | None = None
        self._arena: ArenaSocket | None = None

    async def run(self) -> int:
        lag = looplag.start()  # first, so that the stalls of start-up work are measured too
        stalltrace.start_from_env(lag)  # KVTIER_STALL_TRACE=path: who made each stall
        cfg = self.config
        listen = cfg.server.listen
        sock_path = _unix_path(listen)
        if sock_path is not None:
            _prepare_unix_socket(sock_path)  # before touching the NVMe tier another may own
            if cfg.server.tls_cert_file or cfg.server.tls_client_ca_file:
                logger.warning(
                    "server.tls_* apply to TCP listeners: %s is a UNIX socket, served without "
                    "TLS (its permissions are the access control)",
                    listen,
                )
        tls = listener_tls(cfg)  # before allocating anything: a TCP listener needs TLS
        arena_bytes = sum(cfg.tenant_arenas().values())
        if cfg.dram.prefault:
            self.notifier.extend_timeout(60 + arena_bytes / PREFAULT_BYTES_PER_S)
        self.notifier.send(STATUS=f"allocating {human_size(arena_bytes)} of DRAM")
        try:
            store = Store(cfg)
        except OSError as err:
            raise ConfigError(
                f"dram.capacity_bytes: cannot map a {human_size(cfg.dram.capacity_bytes)} "
                f"arena: {err.strerror or err}"
            ) from None
        self._store = store
        # The NVMe index fills in the background, after READY; only a tier an older kvtier
        # wrote is recovered first (reading every record header: time unknown here).
        self.notifier.extend_timeout(300)
        self.notifier.send(STATUS="opening the NVMe tier")
        try:
            await store.start(recover_in_background=True)
        except OSError as err:
            raise ConfigError(
                f"nvme.path: cannot use {cfg.nvme.path}: {err.strerror or err}"
            ) from None
        self.notifier.extend_timeout(60 + cfg.planner.calibration_s)
        self.notifier.send(STATUS="calibrating fetch paths")
        await store.calibrate()
        # No maximum_concurrent_rpcs: grpc.aio's is one pool for every caller (and older
        # grpcio queued past it); the service refuses past per-tenant caps and
        # server.max_concurrent_rpcs itself (kvtier/server/admission.py).
        server = grpc.aio.server(options=grpc_options(cfg))
        cuda = cuda_path(store, cfg)

        def session_ended(session_id: int) -> None:
            store.release_session(session_id)
            if cuda is not None:
                cuda.end_session(session_id)

        arena: ArenaSocket | None = None
        if sock_path is not None:
            arena = ArenaSocket(
                sock_path.with_name(sock_path.name + ".arena"),
                lambda tenant: (store.arena(tenant).fd, store.arena(tenant).capacity_bytes),
                session_ended,
            )
            arena.reconfigure(cfg)
            await arena.start()
            self._arena = arena
        service = KVTierService(
            store, cfg, lambda: self.draining, arena, mtls=tls is not None and tls.mtls, cuda=cuda
        )
        self._service = service
        if arena is not None:
            arena.set_handler(service.session_call, store.afterwards)
        add_to_server(service, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if cfg.server.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
        if sock_path is not None:
            old_umask = os.umask(0o007)  # the socket's group is the access control
        elif tls is None:
            logger.warning(
                "listening on TCP %s WITHOUT TLS (server.tls_insecure = true): anyone who can "
                "reach the port can connect, and bearer tokens and blocks cross the network "
                "in clear",
                listen,
            )
        else:
            logger.info("listening on TCP %s with %s", listen, "mTLS" if tls.mtls else "TLS")
        try:
            if tls is not None:
                self._tls = ReloadableCredentials(tls)
                port = server.add_secure_port(listen, self._tls.credentials)
            else:
                port = server.add_insecure_port(listen)
        except RuntimeError as err:
            raise ConfigError(f"server.listen: cannot listen on {listen}: {err}") from None
        finally:
            if sock_path is not None:
                os.umask(old_umask)
        if sock_path is None and port == 0:
            raise ConfigError(f"server.listen: cannot listen on {listen}")
        await server.start()
        if sock_path is None and listen.rsplit(":", 1)[-1] == "0":
            listen = f"{listen.rsplit(':', 1)[0]}:{port}"
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        if store.nvme is not None:
            await health_servicer.set(
                NVME_HEALTH,
                health_pb2.HealthCheckResponse.NOT_SERVING
                if store.nvme_recovering
                else health_pb2.HealthCheckResponse.SERVING,
            )
        if cfg.server.metrics_listen:
            registry = CollectorRegistry()
            registry.register(StoreCollector(store, arena.counters if arena else None))
            host, _, mport = cfg.server.metrics_listen.rpartition(":")
            try:
                # On a thread: it waits for its server thread to start, and binding looks
                # the host's name up (`socket.getfqdn`), which held the loop ~10 ms of a
                # restart's stalls while recovery's loaders ran beside it.
                await asyncio.to_thread(
                    start_http_server, int(mport), addr=host or "127.0.0.1", registry=registry
                )
            except (OSError, ValueError) as err:
                raise ConfigError(
                    f"server.metrics_listen: cannot listen on {cfg.server.metrics_listen}: {err}"
                ) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        nvme = (
            f"nvme {human_size(store.nvme.capacity_bytes)} at {store.nvme.tier.root}"
            if store.nvme
            else "nvme off"
        )
        recovering = "; recovering its index" if store.nvme_recovering else ""
        print(
            f"kvtier {__version__} serving on {listen} "
            f"(dram {human_size(sum(a.capacity_bytes for a in store.arenas.values()))}, "
            f"{nvme}{recovering})",
            flush=True,
        )
        # What start-up made (modules, gRPC's and pydantic's machinery: 50-70 k objects)
        # lives as long as the daemon; every full collection would walk it again, holding
        # the GIL 40-60 ms each time a fill triggers one. Out of the collector's sight now
        # (gc.freeze is O(1); recovery freezes what each of its fans adds the same way).
        # Only the young generations are collected first: a full pass here was itself the
        # restart's longest stall (35 ms, for ~300 garbage objects, which stay frozen).
        gc.collect(1)
        gc.freeze()
        self.notifier.send(READY=1, STATUS=status_line(store))
        heartbeat = asyncio.ensure_future(self._heartbeat(store))
        recovery = asyncio.ensure_future(self._report_recovery(store, health_servicer))
        await self._stop.wait()
        logger.info("stopping: draining in-flight calls")
        self.notifier.send(STOPPING=1, STATUS="stopping: draining in-flight calls")
        heartbeat.cancel()
        recovery.cancel()
        self.draining = True
        store.events.close()  # event streams never end by themselves: end them now
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=cfg.server.stop_timeout_s / 2)
        if arena is not None:
            await arena.close()  # ends every session: their leases are released
        if cuda is not None:
            await cuda.close()
        if cfg.nvme.flush_on_stop:
            try:
                written = await asyncio.wait_for(store.flush(), cfg.server.stop_timeout_s / 2)
                logger.info("flushed %d DRAM-only blocks to NVMe", written)
            except TimeoutError:
                logger.warning("NVMe flush did not finish in time; some DRAM blocks are lost")
        self.notifier.send(STATUS="stopping: syncing the NVMe tier")
        await store.close()
        if sock_path is not None:
            with contextlib.suppress(FileNotFoundError):
                sock_path.unlink()
        logger.info("stopped")
        return 0

    async def _report_recovery(
        self, store: Store, health_servicer: health.aio.HealthServicer
    ) -> None:
        """While the NVMe index fills: STATUS= every second. Then the tier's health name
        SERVING, and a line on stdout (after the banner) that says the index is complete
        (or that its recovery failed)."""
        if store.recovery is None:
            return
        while True:
            try:
                complete = await asyncio.wait_for(store.nvme_recovered(), RECOVERY_STATUS_EVERY_S)
                break
            except TimeoutError:
                self.notifier.send(STATUS=status_line(store))
        recovery = store.recovery
        if complete:
            await health_servicer.set(NVME_HEALTH, health_pb2.HealthCheckResponse.SERVING)
            print(
                f"kvtier NVMe index recovered: {recovery.indexed} records in "
                f"{recovery.elapsed_s:.1f} s",
                flush=True,
            )
        else:
            print(
                f"kvtier NVMe index incomplete: recovery failed after {recovery.indexed} "
                "records (see the log)",
                flush=True,
            )
        self.notifier.send(STATUS=status_line(store))

    async def _heartbeat(self, store: Store) -> None:
        """STATUS= now and then; WATCHDOG=1 at half the watchdog timeout, but only while no
        I/O has been stuck for longer than server.io_stall_s: this loop running proves the
        event loop is alive, the I/O pool's job ages prove the disk workers are."""
        interval_s = self.notifier.watchdog_interval_s or STATUS_EVERY_S
        since_status_s = 0.0
        withheld = False
        while True:
            await asyncio.sleep(interval_s)
            since_status_s += interval_s
            if self.notifier.watchdog_interval_s:
                stuck = store.io.longest_running()
                if stuck is not None and stuck[0] > self.config.server.io_stall_s:
                    if not withheld:
                        logger.error(
                            "an I/O worker has been stuck for %.0f s in %s: withholding the "
                            "watchdog ping so that systemd restarts kvtier",
                            stuck[0],
                            stuck[1],
                        )
                        self.notifier.send(STATUS=f"I/O stuck for {stuck[0]:.0f} s in {stuck[1]}")
                    withheld = True
                    continue
                if withheld:
                    logger.warning("I/O workers are making progress again")
                withheld = False
                self.notifier.send(WATCHDOG=1)
            if since_status_s >= STATUS_EVERY_S:
                since_status_s = 0.0
                self.notifier.send(STATUS=status_line(store))

    def _reload(self) -> None:
        self.notifier.send(RELOADING=1, STATUS="reloading the configuration")
        try:
            self._apply_reload()
        finally:
            self.notifier.send(READY=1, STATUS=status_line(self._store) if self._store else "")

    def _apply_reload(self) -> None:
        try:
            fresh = load_config(self.config_path, self.flags).resolved()
        except ConfigError as err:
            logger.error("reload refused, keeping the running configuration: %s", err)
            return
        arenas = set(self._store.arenas) if self._store else set()
        result = plan_reload(self.config, fresh, arenas)
        self.config = result.config
        setup_logging(result.config.log.level)
        if self._store is not None:
            self._store.reconfigure(result.config)
        if self._service is not None:
            self._service.reconfigure(result.config)
        if self._arena is not None:
            self._arena.reconfigure(result.config)
        if self._tls is not None:
            try:  # read again even at the same paths: a renewed certificate replaces the file
                self._tls.update(load_server_tls(result.config.server))
            except ConfigError as err:
                logger.error("reload: keeping the running TLS certificates: %s", err)
        if result.config.auth.certificates and (self._tls is None or not self._tls.mtls):
            logger.warning("auth.certificates has no effect: this listener does not use mTLS")
        logger.info(
            "reloaded %s%s",
            ", ".join(result.reloaded) if result.reloaded else "nothing (no reloadable change)",
            f"; needs a restart to take effect: {', '.join(result.needs_restart)}"
            if result.needs_restart
            else "",
        )


def cuda_path(store: Store, config: Config) -> CudaPath | None:
    """The GPU path for engines' CUDA IPC calls, when the daemon serves a GPU."""
    gpu = config.gpu
    if gpu.emulate:
        from kvtier.movers.fake import FakeDevice

        logger.warning("gpu.emulate: the GPU path runs on a CPU stand-in (tests and demos)")
        # Each poll may run everything queued (streams still interleaved at random), as a
        # GPU would have by then: the unit tests' few steps per poll would make emulated
        # timings measure the stand-in's pace rather than the daemon's.
        mover = Mover(FakeDevice(max_steps_per_query=1 << 20), gpu.streams_per_direction)
        return CudaPath(store, mover, EmulatedOpener(), max(gpu.device, 0), gpu.hbm_capacity_bytes)
    if gpu.device < 0:
        return None
    try:
        path = CudaPath(
            store,
            Mover(TorchDevice(gpu.device), gpu.streams_per_direction),
            TorchOpener(),
            gpu.device,
            gpu.hbm_capacity_bytes,
        )
    except (ImportError, RuntimeError) as err:
        raise ConfigError(
            f"gpu.device = {gpu.device}: the GPU path needs torch and cupy with CUDA "
            f"(pip install 'kvtier[gpu]'): {err}"
        ) from None
    logger.info("GPU path on device %d: CUDA IPC put/get, %d streams per direction",
                gpu.device, gpu.streams_per_direction)  # fmt: skip
    return path


def status_line(store: Store) -> str:
    """One line for `systemctl status`: tier usage, blocks, hit ratio, leases."""
    s = store.stats()
    tiers = ", ".join(
        f"{t.name} {human_size(t.used_bytes)}/{human_size(t.capacity_bytes)}" for t in s.tiers
    )
    blocks = sum(t.blocks for t in s.tiers)
    looked = s.hits + s.misses
    ratio = f"{s.hits / looked:.1%}" if looked else "n/a"
    line = f"serving: {tiers}; {blocks} blocks; hit ratio {ratio}; {s.leases} leases"
    recovery = store.recovery
    if recovery is None or recovery.complete:
        return line
    state = "recovering the NVMe index" if recovery.running else "NVMe index incomplete"
    return f"{state}: {recovery.indexed} records; {line}"


def serve(config: Config, config_path: Path | None, flags: dict[str, Any] | None = None) -> int:
    setup_logging(config.log.level)
    tune_malloc()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    notifier = Notifier.from_env()
    try:
        failpoints.configure()
        return asyncio.run(Daemon(config, config_path, flags, notifier).run())
    except ConfigError as err:
        print(f"kvtier: {err}", file=sys.stderr)
        notifier.send(STATUS=f"failed: {err}", ERRNO=22)  # EINVAL: a configuration error
        return 2
    finally:
        notifier.close()
