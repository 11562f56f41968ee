"""TCP listeners: TLS required (or explicitly insecure), mTLS certificates as tenant identities."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier
from kvtier.errors import PermissionDenied, Unauthenticated, Unavailable
from kvtier.keys import hash_token
from tests.certs import CertificateAuthority, Pem
from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
TOKENS = {"a": "token-of-tenant-a", "b": "token-of-tenant-b"}
TCP = "127.0.0.1:0"


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Pem
    client_a: Pem  # CN engine-a
    client_b: Pem  # CN engine-b-host, SAN DNS engine-b.local
    stranger: Pem  # signed by the CA, mapped to no tenant
    foreign: Pem  # CN engine-a, signed by another CA
    other_ca: CertificateAuthority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "kvtier-test")
    other = CertificateAuthority(directory, "intruder")
    return Pki(
        ca=ca,
        server=ca.server(),
        client_a=ca.issue("client-a", "engine-a"),
        client_b=ca.issue("client-b", "engine-b-host", dns=("Engine-B.local",)),
        stranger=ca.issue("stranger", "stranger"),
        foreign=other.issue("foreign", "engine-a"),
        other_ca=other,
    )


def _write_config(workdir: Path, text: str) -> Path:
    path = workdir / "kvtier.toml"
    path.write_text(text)
    return path


def _tls_section(pki: Pki, mtls: bool) -> str:
    text = (
        "[server]\n"
        f'tls_cert_file = "{pki.server.cert_file}"\n'
        f'tls_key_file = "{pki.server.key_file}"\n'
    )
    if mtls:
        text += f'tls_client_ca_file = "{pki.ca.cert_file}"\n'
    return text


def _tenant_sections() -> str:
    return (
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(tok)}" = "{tenant}"\n' for tenant, tok in TOKENS.items())
        + '[auth.certificates]\n"cn:engine-a" = "a"\n"dns:engine-b.local" = "b"\n'
        + '[tenants.a]\ndram_capacity_bytes = "16MiB"\n'
        + '[tenants.b]\ndram_capacity_bytes = "8MiB"\n'
    )


@pytest.fixture
def tls_daemon(start_daemon: StartDaemon, workdir: Path, pki: Pki) -> DaemonProcess:
    config = _write_config(workdir, _tls_section(pki, mtls=False))
    return start_daemon(dram="16MiB", nvme="64MiB", listen=TCP, extra=["--config", str(config)])


@pytest.fixture
def mtls_daemon(start_daemon: StartDaemon, workdir: Path, pki: Pki) -> DaemonProcess:
    config = _write_config(workdir, _tls_section(pki, mtls=True) + _tenant_sections())
    return start_daemon(dram="16MiB", nvme="64MiB", listen=TCP, extra=["--config", str(config)])


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVTIER_TOKEN", "KVTIER_TLS_CA", "KVTIER_TLS_CERT", "KVTIER_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)


def _mtls_client(daemon: DaemonProcess, pki: Pki, cert: Pem, **kwargs: object) -> kvtier.Client:
    return kvtier.Client(
        daemon.target,
        timeout_s=10,
        tls_ca=pki.ca.cert_file,
        tls_cert=cert.cert_file,
        tls_key=cert.key,
        **kwargs,  # type: ignore[arg-type]
    )


# ---- TLS ----------------------------------------------------------------------------------
def test_a_tls_client_round_trips_put_and_get(tls_daemon: DaemonProcess, pki: Pki) -> None:
    assert not tls_daemon.target.startswith("unix:")
    data = os.urandom(3 << 20)  # several chunks each way
    with kvtier.Client(tls_daemon.target, timeout_s=10, tls_ca=pki.ca.cert) as client:
        assert client.put(NS, "k", data) is True
        assert client.get(NS, "k") == data
        assert client.get(NS, "absent") is None
    # The CA as a path, and the name checked given explicitly.
    with kvtier.Client(
        tls_daemon.target, timeout_s=10, tls_ca=str(pki.ca.cert_file), tls_server_name="localhost"
    ) as client:
        assert client.stat(NS, "k") is not None
    assert "with TLS" in tls_daemon.log()


async def test_the_asyncio_client_speaks_tls_too(tls_daemon: DaemonProcess, pki: Pki) -> None:
    async with kvtier.AsyncClient(tls_daemon.target, timeout_s=10, tls_ca=pki.ca.cert) as client:
        assert await client.put(NS, "async", b"over tls") is True
        assert await client.get(NS, "async") == b"over tls"


def test_a_plain_text_client_cannot_talk_to_a_tls_listener(
    tls_daemon: DaemonProcess, pki: Pki
) -> None:
    with kvtier.Client(tls_daemon.target, timeout_s=10) as plain, pytest.raises(Unavailable):
        plain.put(NS, "k", b"v")
    # Nor one that trusts another CA: the daemon's certificate does not verify.
    wrong = kvtier.Client(tls_daemon.target, timeout_s=10, tls_ca=pki.other_ca.cert)
    with wrong, pytest.raises(Unavailable):
        wrong.get(NS, "k")
    with kvtier.Client(tls_daemon.target, timeout_s=10, tls_ca=pki.ca.cert) as good:
        assert good.put(NS, "k", b"v") is True  # the listener itself is fine


def test_a_tcp_listener_without_certificates_refuses_to_start(workdir: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--listen",
            TCP,
            "--dram-capacity",
            "8MiB",
            "--nvme-path",
            str(workdir / "nvme"),
            "--nvme-capacity",
            "32MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "serving on" not in out.stdout
    for words in ("TCP", "server.tls_cert_file", "server.tls_key_file", "server.tls_insecure"):
        assert words in out.stderr, out.stderr
    assert not (workdir / "nvme").exists()  # refused before touching the tiers


def test_insecure_true_serves_plain_tcp_and_says_so(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(
        dram="8MiB", nvme="32MiB", listen=TCP, env={"KVTIER_SERVER__TLS_INSECURE": "true"}
    )
    with kvtier.Client(daemon.target, timeout_s=10) as client:
        assert client.put(NS, "k", b"plain") is True
        assert client.get(NS, "k") == b"plain"
    assert "WITHOUT TLS (server.tls_insecure = true)" in daemon.log()


def test_a_reload_serves_a_renewed_certificate(
    start_daemon: StartDaemon, workdir: Path, pki: Pki, tmp_path: Path
) -> None:
    cert_file, key_file = workdir / "server.pem", workdir / "server.key"
    cert_file.write_bytes(pki.server.cert)
    key_file.write_bytes(pki.server.key)
    config = _write_config(
        workdir, f'[server]\ntls_cert_file = "{cert_file}"\ntls_key_file = "{key_file}"\n'
    )
    daemon = start_daemon(dram="8MiB", nvme="32MiB", listen=TCP, extra=["--config", str(config)])
    with kvtier.Client(daemon.target, timeout_s=10, tls_ca=pki.ca.cert) as client:
        assert client.put(NS, "k", b"v") is True
    renewed_ca = CertificateAuthority(tmp_path, "renewed")
    renewed = renewed_ca.server("renewed-server")
    cert_file.write_bytes(renewed.cert)  # renewed in place, same paths
    key_file.write_bytes(renewed.key)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "reloaded" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "reloaded" in daemon.log() and "keeping the running TLS" not in daemon.log()
    with kvtier.Client(daemon.target, timeout_s=10, tls_ca=renewed_ca.cert) as client:
        assert client.get(NS, "k") == b"v"
    stale = kvtier.Client(daemon.target, timeout_s=10, tls_ca=pki.ca.cert)
    with stale, pytest.raises(Unavailable):
        stale.get(NS, "k")


# ---- mTLS ---------------------------------------------------------------------------------
def test_mtls_refuses_a_client_without_a_certificate(mtls_daemon: DaemonProcess, pki: Pki) -> None:
    # Even with a valid token: the handshake fails before any call is made.
    with (
        kvtier.Client(
            mtls_daemon.target, timeout_s=10, token=TOKENS["a"], tls_ca=pki.ca.cert
        ) as client,
        pytest.raises(Unavailable),
    ):
        client.put(NS, "k", b"v")
    with _mtls_client(mtls_daemon, pki, pki.client_a) as good:
        assert good.put(NS, "k", b"v") is True


def test_mtls_refuses_a_certificate_from_another_ca(mtls_daemon: DaemonProcess, pki: Pki) -> None:
    # Same CN as a mapped certificate, but not signed by server.tls_client_ca_file.
    client = _mtls_client(mtls_daemon, pki, pki.foreign, token=TOKENS["a"])
    with client, pytest.raises(Unavailable):
        client.get(NS, "k")


def test_a_certificate_is_its_tenant_and_sees_only_that_tenant(
    mtls_daemon: DaemonProcess, pki: Pki
) -> None:
    secret = b"SECRET-OF-A" + os.urandom(1 << 16)
    with (
        _mtls_client(mtls_daemon, pki, pki.client_a) as a,
        _mtls_client(mtls_daemon, pki, pki.client_b) as b,  # mapped by its SAN DNS name
    ):
        assert a.put(NS, "k", secret) is True
        assert a.get(NS, "k") == secret
        assert b.get(NS, "k") is None  # a miss, as for any absent key
        assert b.stat(NS, "k") is None
        assert list(b.list()) == []
        assert b.delete(NS, "k") is False
        assert b.put(NS, "k", b"b's own") is True
        assert a.get(NS, "k") == secret and b.get(NS, "k") == b"b's own"
        assert [s.key for s in a.list(NS)] == [b"k"]
    # The token of tenant a reaches a's block over the same mTLS listener.
    with _mtls_client(mtls_daemon, pki, pki.stranger, token=TOKENS["a"]) as by_token:
        assert by_token.get(NS, "k") == secret


def test_a_token_of_another_tenant_than_the_certificate_is_permission_denied(
    mtls_daemon: DaemonProcess, pki: Pki
) -> None:
    with _mtls_client(mtls_daemon, pki, pki.client_a, token=TOKENS["b"]) as mixed:
        for call in (lambda: mixed.put(NS, "k", b"v"), lambda: mixed.get(NS, "k")):
            with pytest.raises(PermissionDenied, match="different tenants"):
                call()
    unknown = _mtls_client(mtls_daemon, pki, pki.client_a, token="not-a-token")
    with unknown, pytest.raises(Unauthenticated, match="unknown bearer token"):
        unknown.get(NS, "k")
    with _mtls_client(mtls_daemon, pki, pki.client_a, token=TOKENS["a"]) as same:
        assert same.put(NS, "k", b"v") is True  # both name tenant a: fine


def test_a_certificate_mapped_to_no_tenant_needs_a_token(
    mtls_daemon: DaemonProcess, pki: Pki
) -> None:
    stranger = _mtls_client(mtls_daemon, pki, pki.stranger)
    with stranger, pytest.raises(Unauthenticated, match="maps to no tenant"):
        stranger.put(NS, "k", b"v")
    with _mtls_client(mtls_daemon, pki, pki.stranger, token=TOKENS["b"]) as with_token:
        assert with_token.put(NS, "k", b"b via token") is True
    with _mtls_client(mtls_daemon, pki, pki.client_b) as b:
        assert b.get(NS, "k") == b"b via token"


def test_certificate_mappings_without_mtls_refuse_to_start(
    workdir: Path, pki: Pki, start_daemon: StartDaemon
) -> None:
    config = _write_config(workdir, _tls_section(pki, mtls=False) + _tenant_sections())
    with pytest.raises(AssertionError, match=r"auth\.certificates"):
        start_daemon(dram="8MiB", nvme="32MiB", listen=TCP, extra=["--config", str(config)])
