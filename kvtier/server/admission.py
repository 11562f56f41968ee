"""Per-tenant caps on what a tenant holds open: gRPC calls in flight (streams included) and
WatchEvents streams, with one node-wide cap behind them.

A rate limit (kvtier.server.ratelimit) bounds how often a tenant asks; these bound how much
it holds at once. Without them the node has one pool of calls, and one tenant's idle
streams fill it: another tenant's calls were then refused or queued behind them (issue 28).

Pure and single-threaded (the daemon's event loop). `CallSlots.enter` admits a call or
raises ResourceExhausted at once, naming the limit: nothing here waits or queues, so a
tenant at its cap is told so at once and the others never notice. The `Slot` it returns
is given back by `Slot.release`, which the transport calls whenever and however the call
ends (idempotent: a cancelled call may be released from two places).

Reloads (`reconfigure`) apply to calls admitted afterwards: calls in flight keep their
slots, so a lowered cap refuses new calls until enough of the old ones have ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import Config
from kvtier.errors import ResourceExhausted
from kvtier.keys import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class CallCaps:
    calls_per_tenant: int  # limits.max_calls_per_tenant
    watchers_per_tenant: int  # limits.max_watchers_per_tenant
    node_calls: int  # server.max_concurrent_rpcs

    @classmethod
    def of(cls, config: Config) -> CallCaps:
        return cls(
            calls_per_tenant=config.limits.max_calls_per_tenant,
            watchers_per_tenant=config.limits.max_watchers_per_tenant,
            node_calls=config.server.max_concurrent_rpcs,
        )


def tenants_of(config: Config) -> set[str]:
    """The tenants that can authenticate: those of auth.tokens and auth.certificates, or
    'default' alone when neither is configured (every caller is 'default')."""
    named = set(config.auth.tokens.values()) | set(config.auth.certificates.values())
    return named or {DEFAULT_TENANT}


def node_cap_warning(config: Config) -> str | None:
    """Why the node-wide cap could still let tenants starve each other, if it could: the
    per-tenant caps add up to more than server.max_concurrent_rpcs."""
    tenants = len(tenants_of(config))
    caps = CallCaps.of(config)
    needed = tenants * caps.calls_per_tenant
    if needed <= caps.node_calls:
        return None
    return (
        f"server.max_concurrent_rpcs ({caps.node_calls}) is below {tenants} tenants x "
        f"limits.max_calls_per_tenant ({caps.calls_per_tenant}) = {needed}: tenants at their "
        "caps can fill the node's calls and others are refused; raise "
        f"server.max_concurrent_rpcs to {needed} or lower limits.max_calls_per_tenant"
    )


class Slot:
    """One admitted call; `release` gives its place back (once, however often called)."""

    __slots__ = ("_owner", "released", "tenant", "watcher")

    def __init__(self, owner: CallSlots, tenant: str, watcher: bool) -> None:
        self._owner = owner
        self.tenant = tenant
        self.watcher = watcher
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._owner._leave(self)


class CallSlots:
    """Every tenant's calls and watchers in flight, and the node's total."""

    def __init__(self, caps: CallCaps) -> None:
        self._caps = caps
        # Tenants with nothing in flight are dropped: the maps stay as small as what is open.
        self._calls: dict[str, int] = {}
        self._watchers: dict[str, int] = {}
        self.total = 0

    @property
    def caps(self) -> CallCaps:
        return self._caps

    def reconfigure(self, caps: CallCaps) -> None:
        self._caps = caps

    def calls(self, tenant: str) -> int:
        return self._calls.get(tenant, 0)

    def watchers(self, tenant: str) -> int:
        return self._watchers.get(tenant, 0)

    def enter(self, tenant: str, watcher: bool = False) -> Slot:
        """Admit one call of `tenant` (a WatchEvents stream when `watcher`), or raise
        ResourceExhausted naming the cap it would pass; a refused call takes nothing."""
        caps = self._caps
        if watcher and self.watchers(tenant) >= caps.watchers_per_tenant:
            raise ResourceExhausted(
                f"limits.max_watchers_per_tenant ({caps.watchers_per_tenant}) WatchEvents "
                f"streams open for tenant {tenant}: watch once per process and share it, "
                "close the streams nobody reads, or ask the operator to raise "
                "limits.max_watchers_per_tenant"
            )
        if self.calls(tenant) >= caps.calls_per_tenant:
            raise ResourceExhausted(
                f"limits.max_calls_per_tenant ({caps.calls_per_tenant}) calls in flight for "
                f"tenant {tenant}: wait for some to finish (end idle streams, bound the "
                "client's concurrency), or ask the operator to raise "
                "limits.max_calls_per_tenant"
            )
        if self.total >= caps.node_calls:
            raise ResourceExhausted(
                f"server.max_concurrent_rpcs ({caps.node_calls}) calls in flight on this "
                "node, all tenants together: retry shortly, or ask the operator to raise "
                "server.max_concurrent_rpcs"
            )
        self._calls[tenant] = self.calls(tenant) + 1
        if watcher:
            self._watchers[tenant] = self.watchers(tenant) + 1
        self.total += 1
        return Slot(self, tenant, watcher)

    def _leave(self, slot: Slot) -> None:
        self.total -= 1
        _decrement(self._calls, slot.tenant)
        if slot.watcher:
            _decrement(self._watchers, slot.tenant)


def _decrement(counts: dict[str, int], tenant: str) -> None:
    left = counts[tenant] - 1
    if left:
        counts[tenant] = left
    else:
        del counts[tenant]
