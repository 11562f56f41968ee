"""What a SIGHUP applies to a running daemon and what it leaves for a restart."""

from __future__ import annotations

from kvtier.config import Config
from kvtier.keys import hash_token
from kvtier.server.reload import plan_reload


def _config(**sections: object) -> Config:
    return Config.model_validate(sections).resolved()


def test_reloadable_settings_apply_and_the_rest_keep_their_running_values() -> None:
    running = _config(log={"level": "info"}, dram={"capacity_bytes": "1GiB"})
    fresh = _config(
        log={"level": "debug"},
        limits={"max_key_bytes": 64, "lease_ttl_s": 5},
        dram={"capacity_bytes": "2GiB"},
        nvme={"io_threads": 8},
    )
    result = plan_reload(running, fresh, {"default"})
    assert result.reloaded == ["limits.lease_ttl_s", "limits.max_key_bytes", "log.level"]
    assert result.needs_restart == ["dram.capacity_bytes", "nvme.io_threads"]
    assert result.config.log.level == "debug" and result.config.limits.max_key_bytes == 64
    assert result.config.dram.capacity_bytes == 1 << 30 and result.config.nvme.io_threads == 4


def test_unchanged_file_reloads_nothing() -> None:
    running = _config(limits={"max_key_bytes": 64})
    result = plan_reload(running, _config(limits={"max_key_bytes": 64}), {"default"})
    assert (result.reloaded, result.needs_restart) == ([], [])
    assert result.config == running


def test_a_token_for_a_tenant_without_an_arena_waits_for_the_restart() -> None:
    team_a, team_b = hash_token("token-a"), hash_token("token-b")
    running = _config(
        auth={"tokens": {team_a: "team-a"}},
        tenants={"team-a": {"dram_capacity_bytes": "64MiB"}},
    )
    fresh = _config(
        auth={"tokens": {team_a: "team-a", team_b: "team-b", hash_token("c"): "team-a"}},
        tenants={
            "team-a": {"dram_capacity_bytes": "64MiB"},
            "team-b": {"dram_capacity_bytes": "64MiB"},
        },
    )
    result = plan_reload(running, fresh, {"team-a"})
    assert result.config.auth.tokens == {team_a: "team-a", hash_token("c"): "team-a"}
    assert "auth.tokens" in result.reloaded
    assert "tenants" in result.needs_restart
    assert any("team-b" in item for item in result.needs_restart)


def test_tenant_rate_limits_and_certificate_mappings_reload() -> None:
    tenants = {"a": {"dram_capacity_bytes": "64MiB", "requests_per_s": 10}}
    running = _config(tenants=tenants, auth={"tokens": {hash_token("t"): "a"}})
    fresh = _config(
        tenants={
            "a": {"dram_capacity_bytes": "128MiB", "requests_per_s": 0, "request_burst": 5},
            "b": {"dram_capacity_bytes": "64MiB", "requests_per_s": 1},
        },
        auth={
            "tokens": {hash_token("t"): "a"},
            "certificates": {"cn:engine-a": "a", "cn:engine-b": "b"},
        },
        limits={"requests_per_s": 100},
    )
    result = plan_reload(running, fresh, {"a"})
    assert result.reloaded == [
        "auth.certificates",
        "limits.requests_per_s",
        "tenants.a.request_burst",
        "tenants.a.requests_per_s",
    ]
    assert result.config.tenants["a"].requests_per_s == 0
    assert result.config.tenants["a"].request_burst == 5
    assert result.config.tenants["a"].dram_capacity_bytes == 64 << 20  # an arena's size
    assert "b" not in result.config.tenants
    assert result.config.auth.certificates == {"cn:engine-a": "a"}
    assert "tenants" in result.needs_restart and "tenants.b.requests_per_s" in result.needs_restart
    assert any("auth.certificates" in item and "b" in item for item in result.needs_restart)


def test_certificate_files_reload_only_while_tls_stays_as_it_is() -> None:
    tls = {"tls_cert_file": "/c1", "tls_key_file": "/k1"}
    renewed = {"tls_cert_file": "/c2", "tls_key_file": "/k2"}
    result = plan_reload(_config(server=tls), _config(server=renewed), {"default"})
    assert result.reloaded == ["server.tls_cert_file", "server.tls_key_file"]
    assert result.config.server.tls_cert_file == "/c2"
    # Turning mTLS on changes what the handshake asks for: a restart.
    mtls = {**renewed, "tls_client_ca_file": "/ca"}
    result = plan_reload(_config(server=tls), _config(server=mtls), {"default"})
    assert result.reloaded == []
    assert result.needs_restart == [
        "server.tls_cert_file",
        "server.tls_client_ca_file",
        "server.tls_key_file",
    ]
    assert result.config.server.tls_cert_file == "/c1"
    # So does turning TLS on for a listener that had none.
    result = plan_reload(_config(server={"tls_insecure": True}), _config(server=tls), {"default"})
    assert result.reloaded == [] and "server.tls_insecure" in result.needs_restart


def test_the_loops_poll_after_a_reply_reloads() -> None:
    result = plan_reload(_config(), _config(server={"poll_after_reply_s": 0}), {"default"})
    assert result.reloaded == ["server.poll_after_reply_s"]
    assert result.config.server.poll_after_reply_s == 0
