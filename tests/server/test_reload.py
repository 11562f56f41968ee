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
