"""TLS settings: what a TCP listener needs, and the errors that name the key to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config, load_config
from kvtier.errors import ConfigError, InvalidArgument
from kvtier.server.tls import ReloadableCredentials, listener_tls, load_server_tls
from tests.certs import CertificateAuthority


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority(tmp_path_factory.mktemp("ca"), "unit")


def _config(**server: object) -> Config:
    return Config.model_validate({"server": {"listen": "127.0.0.1:7070", **server}})


def test_tcp_needs_certificates_or_an_explicit_insecure() -> None:
    with pytest.raises(ConfigError) as info:
        listener_tls(_config())
    message = str(info.value)
    for key in ("server.tls_cert_file", "server.tls_key_file", "server.tls_insecure"):
        assert key in message
    assert listener_tls(_config(tls_insecure=True)) is None
    assert listener_tls(_config(listen="unix:///tmp/x.sock")) is None


def test_tls_and_mtls_load(ca: CertificateAuthority) -> None:
    server = ca.server("unit-server")
    tls = listener_tls(
        _config(tls_cert_file=str(server.cert_file), tls_key_file=str(server.key_file))
    )
    assert tls is not None and not tls.mtls and tls.cert_chain == server.cert
    mtls = listener_tls(
        _config(
            tls_cert_file=str(server.cert_file),
            tls_key_file=str(server.key_file),
            tls_client_ca_file=str(ca.cert_file),
        )
    )
    assert mtls is not None and mtls.mtls and mtls.client_ca == ca.cert
    creds = ReloadableCredentials(mtls)
    creds.update(mtls)
    with pytest.raises(ConfigError, match="restart"):
        creds.update(tls)  # mTLS off: gRPC fixed that at start


def test_bad_files_name_the_key(ca: CertificateAuthority, tmp_path: Path) -> None:
    server = ca.server("unit-server-2")
    other = ca.issue("unit-other", "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        (dict(tls_cert_file=str(tmp_path / "absent.pem"), tls_key_file=str(server.key_file)),
         "server.tls_cert_file: cannot read"),
        (dict(tls_cert_file=str(garbage), tls_key_file=str(server.key_file)),
         "server.tls_cert_file"),
        (dict(tls_cert_file=str(server.cert_file), tls_key_file=str(garbage)),
         "server.tls_key_file"),
        (dict(tls_cert_file=str(server.cert_file), tls_key_file=str(other.key_file)),
         "is not the key of the first certificate"),
        (
            dict(
                tls_cert_file=str(server.cert_file),
                tls_key_file=str(server.key_file),
                tls_client_ca_file=str(garbage),
            ),
            "server.tls_client_ca_file",
        ),
    ]  # fmt: skip
    for fields, words in cases:
        with pytest.raises(ConfigError, match=words):
            load_server_tls(_config(**fields).server)


@pytest.mark.parametrize(
    ("server", "words"),
    [
        ({"tls_cert_file": "/c.pem"}, "set both"),
        ({"tls_key_file": "/k.pem"}, "set both"),
        ({"tls_client_ca_file": "/ca.pem"}, "needs server.tls_cert_file"),
        ({"tls_cert_file": "/c", "tls_key_file": "/k", "tls_insecure": True}, "contradicts"),
    ],
)
def test_inconsistent_tls_settings_are_refused(server: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        listener_tls(_config(**server))


def test_one_tls_key_per_source_merges(ca: CertificateAuthority, tmp_path: Path) -> None:
    """A file may set the certificate and the environment the key (checked once merged)."""
    server = ca.server("unit-server-3")
    path = tmp_path / "kvtier.toml"
    path.write_text(f'[server]\nlisten = "127.0.0.1:7070"\ntls_cert_file = "{server.cert_file}"\n')
    config = load_config(path, environ={"KVTIER_SERVER__TLS_KEY_FILE": str(server.key_file)})
    tls = listener_tls(config)
    assert tls is not None and tls.key == server.key


def test_certificate_mappings_are_checked_and_need_mtls(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[auth.certificates]\n"engine-a" = "a"\n')
    with pytest.raises(ConfigError, match="'cn:<common name>'"):
        load_config(path, environ={})
    path.write_text('[auth.certificates]\n"cn:engine-a" = "ghost"\n')
    with pytest.raises(ConfigError, match=r"\[tenants.ghost\]"):
        load_config(path, environ={})
    path.write_text(
        '[auth.certificates]\n"cn:engine-a" = "a"\n"DNS:x" = "a"\n'
        '[tenants.a]\ndram_capacity_bytes = "16MiB"\n'
    )
    with pytest.raises(ConfigError, match="'dns:<DNS name>'"):
        load_config(path, environ={})  # kinds are lowercase
    path.write_text(
        '[server]\nlisten = "unix:///tmp/k.sock"\n'
        '[auth.certificates]\n"cn:engine-a" = "a"\n"dns:Engine-A.Example" = "a"\n'
        '[tenants.a]\ndram_capacity_bytes = "16MiB"\n'
    )
    config = load_config(path, environ={})
    assert config.auth.certificates == {"cn:engine-a": "a", "dns:engine-a.example": "a"}
    assert "default" not in config.tenant_arenas()  # only certificates name tenants
    with pytest.raises(ConfigError, match=r"server\.tls_client_ca_file"):
        listener_tls(config)


def test_client_tls_options(ca: CertificateAuthority, tmp_path: Path) -> None:
    from kvtier.client._common import channel_security

    client = ca.issue("unit-client", "engine")
    plain = channel_security("127.0.0.1:1", None, None, None, None, None)
    assert plain.credentials is None
    assert channel_security("127.0.0.1:1", True, None, None, None, None).credentials is not None
    secure = channel_security(
        "127.0.0.1:1", None, ca.cert_file, client.cert, str(client.key_file), "kvtier.internal"
    )
    assert secure.credentials is not None
    assert ("grpc.ssl_target_name_override", "kvtier.internal") in secure.options
    with pytest.raises(InvalidArgument, match="together"):
        channel_security("127.0.0.1:1", None, None, client.cert, None, None)
    with pytest.raises(InvalidArgument, match="UNIX socket"):
        channel_security("unix:///tmp/k.sock", None, ca.cert, None, None, None)
    with pytest.raises(InvalidArgument, match="cannot read"):
        channel_security("127.0.0.1:1", None, tmp_path / "absent.pem", None, None, None)
