from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import (
    Config,
    default_toml,
    dump_toml,
    env_overrides,
    load_config,
)
from kvtier.env import default_target
from kvtier.errors import ConfigError


def test_embedded_default_parses_back_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "default.toml"
    path.write_text(default_toml())
    assert load_config(path, environ={}) == Config()


def test_dump_round_trips(tmp_path: Path) -> None:
    config = load_config(
        None, {"dram": {"capacity_bytes": "3GiB"}, "nvme": {"io_threads": 7}}, environ={}
    )
    path = tmp_path / "dump.toml"
    path.write_text(dump_toml(config))
    assert load_config(path, environ={}) == config


def test_precedence_defaults_file_dropins_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        '[dram]\ncapacity_bytes = "2GiB"\n[nvme]\nio_threads = 2\n[log]\nlevel = "warning"\n'
    )
    dropins = tmp_path / "kvtier.toml.d"
    dropins.mkdir()
    (dropins / "10-nvme.toml").write_text("[nvme]\nio_threads = 3\nsync_writes = true\n")
    env = {"KVTIER_NVME__IO_THREADS": "5", "KVTIER_TARGET": "ignored-not-config"}
    config = load_config(path, {"nvme": {"io_threads": 9}}, environ=env)
    assert config.dram.capacity_bytes == 2 << 30  # file
    assert config.nvme.sync_writes is True  # drop-in
    assert config.nvme.io_threads == 9  # flag beats env beats drop-in beats file
    assert config.log.level == "warning"
    assert load_config(path, environ=env).nvme.io_threads == 5


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[dram]\ncapacity = 1\n", "unknown key 'dram.capacity'"),
        ("[nvme]\nio_threads = 0\n", "invalid value for 'nvme.io_threads'"),
        ('[dram]\ncapacity_bytes = "many"\n', "cannot read size"),
        ("[log]\nlevel = 'chatty'\n", "log.level"),
        ("nonsense = 1\n", "unknown key 'nonsense'"),
    ],
)
def test_bad_file_names_key_and_file(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(path) in str(info.value) and words in str(info.value)


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVTIER_DRAM__CAPACITY_BYTS"):
        env_overrides({"KVTIER_DRAM__CAPACITY_BYTS": "1GiB"})
    with pytest.raises(ConfigError, match="KVTIER_NVME__IO_THREADS"):
        env_overrides({"KVTIER_NVME__IO_THREADS": "-3"})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml", environ={})


def test_paths_resolve_from_systemd_then_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvtier")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kvtier")
    resolved = Config().resolved()
    assert resolved.server.listen == "unix:///run/kvtier/kvtier.sock"
    assert resolved.nvme.path == "/var/lib/kvtier/nvme"
    # Blocks are a cache: under systemd's CacheDirectory when the unit gives one.
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/kvtier")
    assert Config().resolved().nvme.path == "/var/cache/kvtier/nvme"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert Config().resolved().server.listen == "unix:///run/user/1000/kvtier/kvtier.sock"
    monkeypatch.setenv("KVTIER_TARGET", "127.0.0.1:5000")
    assert default_target() == "127.0.0.1:5000"


def test_config_file_from_systemd_configuration_directory(tmp_path: Path) -> None:
    (tmp_path / "kvtier.toml").write_text("[nvme]\nio_threads = 11\n")
    config = load_config(None, environ={"CONFIGURATION_DIRECTORY": str(tmp_path)})
    assert config.nvme.io_threads == 11


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "[dram]\ncapacity_byts = 1\n",
            "unknown key 'dram.capacity_byts' (did you mean 'capacity_bytes'?)",
        ),
        ("[servr]\nlisten = 'x'\n", "unknown key 'servr' (did you mean 'server'?)"),
        (
            '[tenants.a]\ndram_capacity_bytes = "1GiB"\ndram_capacity_byts = 1\n',
            "unknown key 'tenants.a.dram_capacity_byts' (did you mean 'dram_capacity_bytes'?)",
        ),
        ("[auth]\ntokenz = {}\n", "(did you mean 'tokens'?)"),
    ],
)
def test_an_unknown_key_suggests_the_nearest_one(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert words in str(info.value)


def test_a_key_nothing_resembles_gets_no_guess(tmp_path: Path) -> None:
    path = tmp_path / "odd.toml"
    path.write_text("[dram]\nzzz = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "unknown key 'dram.zzz'" in str(info.value) and "did you mean" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[auth.tokens]\n"abc" = "team-a"\n', "invalid value for 'auth.tokens': keys must be"),
        (
            f'[auth.tokens]\n"{"a" * 64}" = "team-a"\n',
            f"{'team-a'!r}, which has no [tenants.team-a] section",
        ),
    ],
)
def test_our_validators_speak_without_pydantics_prefix(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert words in message and "Value error" not in message
    assert message.startswith(f"{path}: ")
