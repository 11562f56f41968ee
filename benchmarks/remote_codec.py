"""Does byte-shuffle + lz4 make remote fetches faster? Measured over a real network path.

A Redis server runs in a network namespace of its own, reached over a veth pair whose
server side is rate-limited with tc's token bucket (the bandwidth of a cluster link); the
client is kvtier's own RemoteTier (record format, verification, codec) with its Redis
backend. For each link rate it stores the same blocks plain and encoded and times the
verified fetch of each (`fetch` + `fill`: what a node's promotion into DRAM costs), then
says what `remote.codec = auto` would choose from the codec figures it measured and the
plain fetch bandwidth — the decision the daemon makes.

Blocks are bf16 values drawn from a normal distribution (scale 0.5), the shape of real
K/V activations (a sign/exponent byte with little entropy, a mantissa byte with a lot);
a model with random weights would give no more realistic KV than this.

    sudo python benchmarks/remote_codec.py [--rates 0,10000,1000,300] [--blocks 48]
        [--block-bytes 1MiB] [--json FILE]

Needs root (ip netns, tc) and redis-server. Rates in Mbit/s; 0 = no limit (the veth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtier.sizes import parse_size
from kvtier.tiers.remote import RedisBackend, RemoteTier

HOST_IP, SERVER_IP, PORT = "10.77.0.1", "10.77.0.2", 6399


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class LinkedRedis:
    """redis-server behind a veth pair in its own namespace; `rate_mbit` limits what it
    sends (the fetch direction)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.netns, self.host_dev, self.peer_dev = f"kvtb-{tag}", f"kvh{tag}", f"kvp{tag}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LinkedRedis:
        _sh("ip", "netns", "add", self.netns)
        _sh("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.peer_dev)
        _sh("ip", "link", "set", self.peer_dev, "netns", self.netns)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", self.host_dev)
        _sh("ip", "link", "set", self.host_dev, "up")
        inside = ("ip", "netns", "exec", self.netns)
        _sh(*inside, "ip", "addr", "add", f"{SERVER_IP}/24", "dev", self.peer_dev)
        _sh(*inside, "ip", "link", "set", self.peer_dev, "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        self.proc = subprocess.Popen(
            [*inside, "redis-server", "--bind", SERVER_IP, "--port", str(PORT), "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(0.5)
        return self

    def limit(self, rate_mbit: int) -> None:
        # A small bucket: a burst as large as a block would let each fetch ride on the
        # credit the previous one's decode time refilled, flattering the codec.
        inside = ("ip", "netns", "exec", self.netns)
        subprocess.run([*inside, "tc", "qdisc", "del", "dev", self.peer_dev, "root"],
                       capture_output=True)  # fmt: skip
        if rate_mbit:
            _sh(*inside, "tc", "qdisc", "add", "dev", self.peer_dev, "root", "tbf", "rate",
                f"{rate_mbit}mbit", "burst", "32kb", "latency", "200ms")  # fmt: skip

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)


def kv_block(size_bytes: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(size_bytes // 2, generator=gen) * 0.5
    return values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def measure(tier: RemoteTier, blocks: list[bytes], encoded: bool, tag: str) -> dict[str, Any]:
    ns = "bench|llama3-8b/codec"
    for i, payload in enumerate(blocks):
        key = f"{tag}{i}".encode()
        digest = xxhash.xxh3_64_intdigest(payload)
        tier.send(ns, key, tier.encode(ns, key, 1, memoryview(payload), digest, encoded))
    out = bytearray(len(blocks[0]))
    times_s = []
    for i, payload in enumerate(blocks):
        started = time.perf_counter()
        fetched = tier.fetch(ns, f"{tag}{i}".encode(), len(payload))
        assert fetched is not None
        tier.fill(fetched, memoryview(out))
        times_s.append(time.perf_counter() - started)
        assert out == payload
        tier.delete(ns, f"{tag}{i}".encode())
    median_s = statistics.median(times_s)
    return {"median_s": median_s, "gbps": len(blocks[0]) / median_s / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0,10000,1000,300", help="link rates, Mbit/s (0: none)")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--block-bytes", default="1MiB")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: it makes a network namespace and rate-limits a veth link")
    size = parse_size(args.block_bytes)
    blocks = [kv_block(size, seed) for seed in range(args.blocks)]
    rows = []
    with LinkedRedis() as link:
        tier = RemoteTier(RedisBackend(f"redis://{SERVER_IP}:{PORT}/0", 30.0, 2), "off")
        for i in range(8):  # the codec's own figures, as the daemon's trial writes make them
            tier.meter.observe(*_trial(tier, blocks[i]))
        fig = tier.meter.figures
        assert fig is not None
        for rate in (int(r) for r in args.rates.split(",")):
            link.limit(rate)
            plain = measure(tier, blocks, False, f"p{rate}-")
            coded = measure(tier, blocks, True, f"c{rate}-")
            rows.append(
                {
                    "link_mbit": rate,
                    "plain_gbps": plain["gbps"],
                    "encoded_gbps": coded["gbps"],
                    "plain_median_s": plain["median_s"],
                    "encoded_median_s": coded["median_s"],
                    "speedup": plain["median_s"] / coded["median_s"],
                    "auto_uses_codec": tier.meter.worth_it(plain["gbps"] * 1e9),
                }
            )
        tier.close()
    report = {
        "block_bytes": size,
        "blocks": args.blocks,
        "codec": {
            "ratio": fig.ratio,
            "encode_gbps": fig.encode_bytes_per_s / 1e9,
            "decode_gbps": fig.decode_bytes_per_s / 1e9,
            "break_even_gbps": tier.meter.break_even_bytes_per_s() / 1e9,
        },
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _trial(tier: RemoteTier, payload: bytes) -> tuple[int, int, float, float]:
    from kvtier.tiers import codec

    blob, encode_s, decode_s = codec.trial(payload, tier.element_bytes)
    return len(payload), len(blob), encode_s, decode_s


if __name__ == "__main__":
    main()
