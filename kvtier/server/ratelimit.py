"""Per-tenant rate limits: token buckets for requests and for block payload bytes.

Pure logic with an injected clock: the servicer asks `admit_request` before it starts a
request's work and `admit_bytes` before it moves a block's bytes, and turns a `Refusal`
into RESOURCE_EXHAUSTED (kvtier.errors.RateLimited). Nothing here sleeps or queues: a
refused request is not served, and the refusal says how long until it would be.

Limits come from `limits.*` (every tenant) and `tenants.NAME.*` (one tenant); 0 means
unlimited. Buckets are created on a tenant's first request; the set of tenants is bounded
by the configuration (only a configured token or certificate yields a tenant).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from kvtier.config import Config
from kvtier.sizes import human_size

Kind = Literal["requests", "payload_bytes"]


class Clock(Protocol):
    """Monotonic seconds (time.monotonic in the daemon, a fake in tests)."""

    def __call__(self) -> float: ...


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` saved; starts full.

    Over any window of t seconds it admits at most `rate_per_s * t + burst` tokens, and it
    admits every demand that stays inside that envelope. A refused take takes nothing.
    """

    __slots__ = ("_last_s", "_tokens", "burst", "rate_per_s")

    def __init__(self, rate_per_s: float, burst: float, now_s: float) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst > 0")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = burst
        self._last_s = now_s

    def _refill(self, now_s: float) -> None:
        # A clock that steps back (a fake in a test) must not drain the bucket.
        elapsed_s = max(0.0, now_s - self._last_s)
        self._tokens = min(self.burst, self._tokens + elapsed_s * self.rate_per_s)
        self._last_s = max(self._last_s, now_s)

    def take(self, amount: float, now_s: float) -> float:
        """Take `amount` (at most `burst`): 0.0 if admitted, else the seconds until it would be."""
        if amount > self.burst:
            raise ValueError(f"cannot take {amount} from a bucket of burst {self.burst}")
        self._refill(now_s)
        if self._tokens >= amount:
            self._tokens -= amount
            return 0.0
        return (amount - self._tokens) / self.rate_per_s

    def retune(self, rate_per_s: float, burst: float, now_s: float) -> None:
        """New limits, keeping what is saved (capped to the new burst): a reload neither
        hands every tenant a fresh burst nor takes away what it has not used."""
        if rate_per_s <= 0 or burst <= 0:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst > 0")
        self._refill(now_s)
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = min(self._tokens, burst)


@dataclass(frozen=True, slots=True)
class Rate:
    """One limit as configured for one tenant: `per_s` 0 means unlimited."""

    per_s: float
    burst: float
    key: str  # the config key that sets per_s for this tenant, for the refusal message


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request over its tenant's limit; `message` says which limit and what to change."""

    tenant: str
    kind: Kind
    rate: Rate
    retry_after_s: float

    @property
    def message(self) -> str:
        if self.kind == "requests":
            what = "request rate"
            limit = f"{self.rate.per_s:g} requests/s, burst {self.rate.burst:g}"
        else:
            what = "block payload rate"
            limit = f"{human_size(self.rate.per_s)}/s, burst {human_size(self.rate.burst)}"
        retry_ms = max(1, math.ceil(self.retry_after_s * 1000))
        fix = self.rate.key
        if fix.startswith("limits."):
            fix += f" (or set tenants.{self.tenant}.{fix.removeprefix('limits.')})"
        return (
            f"tenant '{self.tenant}' is over its {what} ({limit}): retry in {retry_ms} ms, "
            f"or raise {fix}"
        )


@dataclass(frozen=True, slots=True)
class TenantRates:
    requests: Rate
    payload_bytes: Rate


def tenant_rates(config: Config, tenant: str) -> TenantRates:
    """The limits that apply to `tenant`: its own section's overrides, else `limits.*`."""
    limits = config.limits
    own = config.tenants.get(tenant)
    req_per_s, req_burst = limits.requests_per_s, limits.request_burst
    req_key = "limits.requests_per_s"
    byte_per_s, byte_burst = float(limits.payload_bytes_per_s), limits.payload_burst_bytes
    byte_key = "limits.payload_bytes_per_s"
    if own is not None:
        if own.requests_per_s is not None:
            req_per_s, req_key = own.requests_per_s, f"tenants.{tenant}.requests_per_s"
        if own.request_burst is not None:
            req_burst = own.request_burst
        if own.payload_bytes_per_s is not None:
            byte_per_s = float(own.payload_bytes_per_s)
            byte_key = f"tenants.{tenant}.payload_bytes_per_s"
        if own.payload_burst_bytes is not None:
            byte_burst = own.payload_burst_bytes
    return TenantRates(
        requests=Rate(req_per_s, float(req_burst or max(1, math.ceil(req_per_s))), req_key),
        # Never below the largest block: a block bigger than the burst could never pass.
        payload_bytes=Rate(
            byte_per_s,
            float(max(byte_burst or math.ceil(byte_per_s), limits.max_block_bytes)),
            byte_key,
        ),
    )


class RateLimiter:
    """Every tenant's buckets. Single-threaded: the daemon calls it from its event loop."""

    def __init__(self, config: Config, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._config = config
        self._rates: dict[str, TenantRates] = {}
        self._buckets: dict[tuple[str, Kind], TokenBucket] = {}

    def reconfigure(self, config: Config) -> None:
        """Apply reloaded limits; buckets keep what they have saved (see TokenBucket.retune)."""
        self._config = config
        self._rates.clear()
        now_s = self._clock()
        for (tenant, kind), bucket in list(self._buckets.items()):
            rate = self._rate(tenant, kind)
            if rate.per_s <= 0:
                del self._buckets[(tenant, kind)]
            elif (rate.per_s, rate.burst) != (bucket.rate_per_s, bucket.burst):
                bucket.retune(rate.per_s, rate.burst, now_s)

    def _rate(self, tenant: str, kind: Kind) -> Rate:
        rates = self._rates.get(tenant)
        if rates is None:
            rates = self._rates[tenant] = tenant_rates(self._config, tenant)
        return rates.requests if kind == "requests" else rates.payload_bytes

    def _take(self, tenant: str, kind: Kind, amount: float) -> Refusal | None:
        rate = self._rate(tenant, kind)
        if rate.per_s <= 0:
            return None
        now_s = self._clock()
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = self._buckets[(tenant, kind)] = TokenBucket(rate.per_s, rate.burst, now_s)
        # A block larger than the burst (max_block_bytes lowered by a reload) empties the
        # bucket rather than being refused for ever.
        wait_s = bucket.take(min(amount, bucket.burst), now_s)
        return Refusal(tenant, kind, rate, wait_s) if wait_s > 0 else None

    def admit_request(self, tenant: str) -> Refusal | None:
        """Charge one request to `tenant`; None if admitted."""
        return self._take(tenant, "requests", 1.0)

    def admit_bytes(self, tenant: str, size_bytes: int) -> Refusal | None:
        """Charge `size_bytes` of block payload to `tenant`; None if admitted."""
        if size_bytes <= 0:
            return None
        return self._take(tenant, "payload_bytes", float(size_bytes))
