"""The `kvtier` command: serve, config, and redis-cli-like block commands."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, InvalidArgument, KVTierError

if TYPE_CHECKING:
    from kvtier.client import Client

EXIT_MISS = 1
EXIT_ERROR = 2


def _key(text: str, hex_key: bool) -> bytes:
    """A key from the command line: UTF-8 text, or hex with --hex or a 'hex:' prefix."""
    if hex_key or text.startswith("hex:"):
        try:
            return bytes.fromhex(text.removeprefix("hex:"))
        except ValueError:
            raise InvalidArgument(f"not a hex key: {text!r}") from None
    try:
        return text.encode()
    except UnicodeEncodeError:
        # argv holds undecodable bytes as surrogates; os.fsencode gives the bytes back.
        raw = os.fsencode(text)
        raise InvalidArgument(
            f"key {raw!r} is not UTF-8 text: pass it in hex, as hex:{raw.hex()} or "
            f"--hex {raw.hex()}"
        ) from None


def _check_namespace(args: argparse.Namespace) -> None:
    namespace = getattr(args, "namespace", None)
    if namespace is None:
        return
    try:
        namespace.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(
            f"namespace {os.fsencode(namespace)!r} is not UTF-8 text (namespaces are text, "
            "such as llama3-8b/bf16-b16)"
        ) from None


def _show_key(key: bytes) -> str:
    try:
        text = key.decode()
    except UnicodeDecodeError:
        return "hex:" + key.hex()
    return text if text.isprintable() and not text.startswith("hex:") else "hex:" + key.hex()


def _serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    flags: dict[str, dict[str, Any]] = {}
    pairs = [
        ("server", "listen", args.listen),
        ("server", "metrics_listen", args.metrics_listen),
        ("dram", "capacity_bytes", args.dram_capacity),
        ("nvme", "path", args.nvme_path),
        ("nvme", "capacity_bytes", args.nvme_capacity),
        ("log", "level", args.log_level),
    ]
    for section, name, value in pairs:
        if value is not None:
            flags.setdefault(section, {})[name] = value
    return flags


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtier.config import load_config
    from kvtier.server.daemon import serve

    flags = _serve_flags(args)
    config = load_config(args.config, flags)
    return serve(config, args.config, flags)


def cmd_config(args: argparse.Namespace) -> int:
    from kvtier.config import default_toml, dump_toml, load_config

    if args.action == "default":
        sys.stdout.write(default_toml())
        return 0
    config = load_config(args.config)
    if args.action == "dump":
        sys.stdout.write(dump_toml(config.resolved()))
    else:
        print(f"{args.config or 'configuration'}: valid")
    return 0


def _client(args: argparse.Namespace) -> Client:
    from kvtier.client import Client

    return Client(args.target, token=args.token)


def cmd_put(args: argparse.Namespace) -> int:
    if args.value is not None:
        data = args.value.encode()
    elif args.file in (None, "-"):
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(args.file).read_bytes()
        except OSError as err:
            raise InvalidArgument(
                f"cannot read {args.file}: {err.strerror or err}; pass a file that exists, "
                "'-' for stdin, or --value TEXT"
            ) from None
    with _client(args) as client:
        stored = client.put(args.namespace, _key(args.key, args.hex), data, args.overwrite)
    print("OK" if stored else "OK (already present)")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.get(args.namespace, _key(args.key, args.hex))
    if data is None:
        print("(nil)", file=sys.stderr)
        return EXIT_MISS
    if args.output and args.output != "-":
        Path(args.output).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        deleted = client.delete(args.namespace, _key(args.key, args.hex))
    print(1 if deleted else 0)
    return 0


def _stat_dict(stat: Any) -> dict[str, Any]:
    return {
        "namespace": stat.namespace,
        "key": _show_key(stat.key),
        "size_bytes": stat.size_bytes,
        "tiers": stat.tiers,
        "xxh3_64": f"{stat.xxh3_64:016x}",
        "generation": stat.generation,
    }


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = [_stat_dict(s) for s in client.list(args.namespace or "", args.limit)]
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        for s in stats:
            print(f"{s['namespace']}\t{s['key']}\t{s['size_bytes']}\t{','.join(s['tiers'])}")
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stat = client.stat(args.namespace, _key(args.key, args.hex))
    if stat is None:
        print("(nil)", file=sys.stderr)
        return EXIT_MISS
    info = _stat_dict(stat)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for name, value in info.items():
            print(f"{name}: {','.join(value) if isinstance(value, list) else value}")
    return 0


def cmd_lookup(args: argparse.Namespace) -> int:
    with _client(args) as client:
        result = client.lookup(args.namespace, [_key(k, args.hex) for k in args.keys])
    if args.json:
        print(json.dumps({"prefix_blocks": result.prefix_blocks, "tiers": result.tiers}))
    else:
        print(f"prefix_blocks: {result.prefix_blocks}")
        for key, tier in zip(args.keys, result.tiers, strict=True):
            print(f"{key}\t{tier or '-'}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvtier.sizes import human_size

    with _client(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(dataclasses.asdict(stats), indent=2))
        return 0
    print(f"kvtier {stats.version}  up {stats.uptime_s:.0f} s")
    for name, tier in stats.tiers.items():
        cap = tier.capacity_bytes or 1
        print(
            f"  {name:5s} {human_size(tier.used_bytes):>10s} / "
            f"{human_size(tier.capacity_bytes):<10s} ({100 * tier.used_bytes / cap:5.1f} %)"
            f"  {tier.blocks} blocks, {tier.hits} hits, {tier.evictions} evictions"
            + (
                f"; index filling: {tier.recovered_records} records so far"
                if tier.recovering
                else ""
            )
        )
    lookups = stats.hits + stats.misses
    ratio = stats.hits / lookups if lookups else 0.0
    print(f"  gets: {stats.hits} hits, {stats.misses} misses (hit ratio {ratio:.1%})")
    print(
        f"  puts: {stats.puts}, demotions: {stats.demotions}, "
        f"dropped: {stats.dropped_blocks}, checksum failures: {stats.checksum_failures}"
    )
    print(
        f"  policy {stats.policy}: lost reuse {stats.lost_reuse}, NVMe admissions "
        f"{stats.nvme_admitted} written / {stats.nvme_not_admitted} skipped, "
        f"promotions {stats.promotions}"
    )
    print(
        f"  prefill avoided {stats.recompute_avoided_s:.2f} s, fetch regret "
        f"{stats.fetch_regret_s:.2f} s"
    )
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """The daemon's gRPC health status, for probes that cannot speak gRPC over a UNIX socket
    (a Kubernetes exec probe): exit 0 while SERVING, 1 otherwise (NOT_SERVING: draining),
    2 when nothing answers (starting, stopped)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvtier.client._common import channel_security, normalize_target

    target = normalize_target(args.target)
    security = channel_security(target, None, None, None, None, None)
    channel = (
        grpc.insecure_channel(target, options=security.options)
        if security.credentials is None
        else grpc.secure_channel(target, security.credentials, options=security.options)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as err:
            print(f"kvtier: {target}: {err.code().name}: {err.details()}", file=sys.stderr)
            return EXIT_ERROR
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_MISS


def cmd_events(args: argparse.Namespace) -> int:
    """Residency events as JSON lines (what a router's index follows), until --count."""
    epoch, _, seq = (args.resume or "").partition(":")
    seen = 0
    with _client(args) as client:
        for batch in client.watch_events(args.namespace or "", epoch, int(seq or 0)):
            if batch.resync:
                print(json.dumps({"epoch": batch.epoch, "resync": True}), flush=True)
                return 0
            for event in batch.events:
                line = {
                    "epoch": batch.epoch,
                    "seq": event.seq,
                    "namespace": event.namespace,
                    "key": _show_key(event.key),
                    "tiers": event.tiers,
                }
                print(json.dumps(line), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    return 0
            if not batch.events and not seen:
                print(json.dumps({"epoch": batch.epoch, "watching": True}), flush=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvtier.bench import plan_cli

    try:
        return plan_cli.run(args)
    except ValueError as err:
        print(f"kvtier plan: {err}", file=sys.stderr)
        return EXIT_ERROR


def cmd_token(args: argparse.Namespace) -> int:
    """A new bearer token for a tenant, and the config line that admits it."""
    import secrets

    from kvtier.keys import check_tenant, hash_token

    tenant = check_tenant(args.tenant)
    token = args.value or secrets.token_urlsafe(32)
    print(f"token:  {token}")
    print("config: add under [auth.tokens] (the file keeps only the hash):")
    print(f'        "{hash_token(token)}" = "{tenant}"')
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """A new AES-256 key file for nvme.encryption_key_file (mode 0600, never replaced)."""
    from kvtier.tiers.crypto import write_key_file

    write_key_file(args.path)
    print(f"wrote a new 256-bit key to {args.path} (mode 0600)")
    print("config: under [nvme] (the file must belong to the user kvtier runs as):")
    print(f'        encryption_key_file = "{args.path.resolve()}"')
    print("keep a copy only where the tier's disk is not: losing the key empties the tier")
    return 0


def cmd_wipe(args: argparse.Namespace) -> int:
    """Overwrite and remove a tenant's NVMe records (and every recyclable/temporary file)."""
    from kvtier.config import load_config
    from kvtier.keys import check_tenant
    from kvtier.sizes import human_size
    from kvtier.tiers.wipe import wipe

    tenant = None if args.all else check_tenant(args.tenant)
    flags = {"nvme": {"path": args.nvme_path}} if args.nvme_path else None
    root = Path(load_config(args.config, flags).resolved().nvme.path)
    report = wipe(root, tenant)
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(report.root),
                    "tenant": report.tenant,
                    "records": report.records,
                    "record_bytes": report.record_bytes,
                    "unreadable_records": report.unreadable_records,
                    "recyclable_files": report.recyclable_files,
                    "temporary_files": report.temporary_files,
                    "overwritten_bytes": report.overwritten_bytes,
                    "tombstones_dropped": report.tombstones_dropped,
                    "segments_rewritten": report.segments_rewritten,
                },
                indent=2,
            )
        )
        return 0
    whose = "every tenant" if tenant is None else f"tenant {tenant!r}"
    print(
        f"wiped {report.records} records ({human_size(report.record_bytes)}) of {whose} "
        f"from {report.root}"
    )
    print(
        f"  also overwritten and removed: {report.unreadable_records} unreadable records, "
        f"{report.recyclable_files} recyclable and {report.temporary_files} temporary files; "
        f"{human_size(report.overwritten_bytes)} overwritten with zeros in all"
    )
    print("  (on an SSD, only full-disk encryption or a destroyed key reaches every copy)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvtier.bench.replay_cli import main as replay_main

    return replay_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.kind == "daemon":
        from kvtier.bench.daemon import main as bench_daemon

        return bench_daemon(args.rest)
    if args.kind == "planner":
        from kvtier.bench.planner import main as bench_planner

        return bench_planner(args.rest)
    from kvtier.bench.nvme import main as bench_nvme

    return bench_nvme(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    from kvtier import __version__

    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (embedded defaults without --config)")
    serve.add_argument("--config", type=Path, help="TOML configuration file")
    serve.add_argument("--listen", help="unix:///path or host:port")
    serve.add_argument("--dram-capacity", help="DRAM arena size, e.g. 2GiB")
    serve.add_argument("--nvme-path", help="directory of the NVMe tier")
    serve.add_argument("--nvme-capacity", help="NVMe tier size, e.g. 100GiB")
    serve.add_argument("--metrics-listen", help="Prometheus endpoint host:port")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    plan = sub.add_parser("plan", help="fetch-or-recompute plan (--what-if: no daemon)")
    from kvtier.bench.plan_cli import add_arguments as plan_arguments

    plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    replay = sub.add_parser(
        "replay", help="replay a request trace through the tiers' policy (no daemon)"
    )
    from kvtier.bench.replay_cli import add_arguments as replay_arguments

    replay_arguments(replay)
    replay.set_defaults(func=cmd_replay)

    token = sub.add_parser("token", help="make a bearer token for a tenant")
    token.add_argument("tenant")
    token.add_argument("--value", help="hash this token instead of making a new one")
    token.set_defaults(func=cmd_token)

    keygen = sub.add_parser("keygen", help="make a key file for nvme.encryption_key_file")
    keygen.add_argument("path", type=Path, help="file to create (mode 0600; must not exist)")
    keygen.set_defaults(func=cmd_keygen)

    wipe = sub.add_parser(
        "wipe",
        help="overwrite and remove a tenant's blocks from the NVMe tier (daemon stopped)",
    )
    whom = wipe.add_mutually_exclusive_group(required=True)
    whom.add_argument("--tenant", help="the tenant whose records to wipe")
    whom.add_argument("--all", action="store_true", help="every tenant's records")
    wipe.add_argument("--config", type=Path, help="TOML configuration file (for nvme.path)")
    wipe.add_argument("--nvme-path", help="directory of the NVMe tier (overrides the config)")
    wipe.add_argument("--json", action="store_true")
    wipe.set_defaults(func=cmd_wipe)

    bench = sub.add_parser(
        "bench", help="benchmarks: kvtier bench daemon|nvme|planner --help", add_help=False
    )
    bench.add_argument("kind", choices=["daemon", "nvme", "planner"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    config = sub.add_parser("config", help="print or check configuration")
    config.add_argument("action", choices=["default", "dump", "validate"])
    config.add_argument("--config", type=Path, help="TOML configuration file")
    config.set_defaults(func=cmd_config)

    def client_cmd(name: str, help_text: str, with_key: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--target", help="daemon address (default: the default socket)")
        p.add_argument("--token", help="bearer token (default: $KVTIER_TOKEN)")
        p.add_argument("--hex", action="store_true", help="keys are hex")
        if with_key:
            p.add_argument("namespace")
            p.add_argument("key", help="UTF-8 text, or hex with --hex or a 'hex:' prefix")
        return p

    put = client_cmd("put", "store a block from a file, stdin or --value")
    put.add_argument("file", nargs="?", help="file to read (default: stdin)")
    put.add_argument("--value", help="store this string instead of a file")
    put.add_argument("--overwrite", action="store_true", help="replace different bytes")
    put.set_defaults(func=cmd_put)

    get = client_cmd("get", "write a block's bytes to stdout (exit 1 on a miss)")
    get.add_argument("-o", "--output", help="write to this file instead of stdout")
    get.set_defaults(func=cmd_get)

    client_cmd("rm", "delete a block (prints 1 if deleted, 0 if absent)").set_defaults(func=cmd_rm)

    stat = client_cmd("stat", "show a block's metadata (exit 1 on a miss)")
    stat.add_argument("--json", action="store_true")
    stat.set_defaults(func=cmd_stat)

    ls = client_cmd("ls", "list blocks", with_key=False)
    ls.add_argument("namespace", nargs="?", help="only this namespace")
    ls.add_argument("--limit", type=int, default=0)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    lookup = client_cmd("lookup", "cached prefix of a chain of keys", with_key=False)
    lookup.add_argument("namespace")
    lookup.add_argument("keys", nargs="+")
    lookup.add_argument("--json", action="store_true")
    lookup.set_defaults(func=cmd_lookup)

    events = client_cmd("events", "follow residency events (JSON lines)", with_key=False)
    events.add_argument("namespace", nargs="?", help="only this namespace")
    events.add_argument("--count", type=int, default=0, help="exit after this many events")
    events.add_argument("--resume", help="EPOCH:SEQ of the last event seen: resume after it")
    events.set_defaults(func=cmd_events)

    stats = client_cmd("stats", "daemon and tier statistics", with_key=False)
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=cmd_stats)

    health = sub.add_parser("health", help="gRPC health status (exit 0 while SERVING)")
    health.add_argument("--target", help="daemon address (default: the default socket)")
    health.add_argument("--service", default="", help="service name ('' = the whole daemon)")
    health.add_argument("--timeout-s", type=float, default=5.0, help="give up after this long")
    health.set_defaults(func=cmd_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_namespace(args)
        result: int = args.func(args)
        return result
    except ConfigError as err:
        print(f"kvtier: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KVTierError as err:
        print(f"kvtier: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return 0
    except OSError as err:
        # A file a command was given or writes (-o, --plot, a key file): the path and the
        # system's reason say what to fix; a traceback would only bury them.
        where = f"{err.filename}: " if err.filename else ""
        print(f"kvtier: {where}{err.strerror or err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
