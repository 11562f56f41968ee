"""TLS for a TCP listener: check the PEM files at start, serve them, swap them on reload.

A TCP listener needs `server.tls_cert_file` and `server.tls_key_file`, or an explicit
`server.tls_insecure = true`; `server.tls_client_ca_file` adds mTLS (clients must present
a certificate that CA signed). The files are read and checked here, so that a wrong path,
a key that does not match the certificate or an expired certificate stops the start with
the key to fix rather than failing every handshake later. The credentials are gRPC's
dynamic ones: a reload re-reads the files (same paths or new ones) and new connections
get the new certificates; connections already open keep theirs.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtier.config import Config, ServerConfig
from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The checked PEM contents of the server.tls_* files."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None  # None: no client certificates asked for (TLS, not mTLS)

    @property
    def mtls(self) -> bool:
        return self.client_ca is not None


def is_unix(listen: str) -> bool:
    return listen.startswith("unix:")


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"server.{key}: cannot read {path}: {err.strerror or err}") from None


def load_server_tls(server: ServerConfig) -> ServerTLS:
    """Read and check the certificate chain, its key and the client CA; ConfigError names
    the key and the file at fault."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    chain = _read("tls_cert_file", server.tls_cert_file)
    try:
        certs = x509.load_pem_x509_certificates(chain)
    except ValueError:
        raise ConfigError(
            f"server.tls_cert_file: {server.tls_cert_file} holds no PEM certificate"
        ) from None
    key_pem = _read("tls_key_file", server.tls_key_file)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise ConfigError(
            f"server.tls_key_file: {server.tls_key_file} is encrypted; kvtier needs an "
            "unencrypted key (protect the file with its mode and owner)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            f"server.tls_key_file: {server.tls_key_file} holds no PEM private key"
        ) from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != certs[0].public_key().public_bytes(*spki):
        raise ConfigError(
            f"server.tls_key_file: {server.tls_key_file} is not the key of the first "
            f"certificate in server.tls_cert_file ({server.tls_cert_file})"
        )
    now = datetime.datetime.now(datetime.UTC)
    leaf = certs[0]
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ConfigError(
            f"server.tls_cert_file: the certificate in {server.tls_cert_file} is valid "
            f"from {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now: renew it"
        )
    client_ca: bytes | None = None
    if server.tls_client_ca_file:
        client_ca = _read("tls_client_ca_file", server.tls_client_ca_file)
        try:
            x509.load_pem_x509_certificates(client_ca)
        except ValueError:
            raise ConfigError(
                f"server.tls_client_ca_file: {server.tls_client_ca_file} holds no PEM certificate"
            ) from None
    return ServerTLS(chain, key_pem, client_ca)


def listener_tls(config: Config) -> ServerTLS | None:
    """The TLS a resolved configuration's listener needs: None for a UNIX socket or an
    explicitly insecure TCP listener. Raises ConfigError for a TCP listener without TLS
    and without server.tls_insecure, and for certificate mappings without mTLS."""
    server = config.server
    tls: ServerTLS | None = None
    if not is_unix(server.listen):
        # Checked here, on the merged configuration: a file may set one key and an
        # environment variable the other.
        if bool(server.tls_cert_file) != bool(server.tls_key_file):
            raise ConfigError("server.tls_cert_file and server.tls_key_file: set both (or neither)")
        if server.tls_client_ca_file and not server.tls_cert_file:
            raise ConfigError(
                "server.tls_client_ca_file (mTLS) needs server.tls_cert_file and "
                "server.tls_key_file"
            )
        if server.tls_insecure and server.tls_cert_file:
            raise ConfigError(
                "server.tls_insecure = true contradicts server.tls_cert_file: remove one"
            )
        if server.tls_cert_file:
            tls = load_server_tls(server)
        elif not server.tls_insecure:
            raise ConfigError(
                f"server.listen = '{server.listen}' is a TCP address, and kvtier serves TCP "
                "only over TLS: set server.tls_cert_file and server.tls_key_file (PEM "
                "certificate chain and private key; add server.tls_client_ca_file for mTLS), "
                "or set server.tls_insecure = true to serve plain TCP"
            )
    if config.auth.certificates and (tls is None or not tls.mtls):
        raise ConfigError(
            "auth.certificates maps client certificates to tenants, but clients present "
            "certificates only to a TCP listener with mTLS: set server.tls_client_ca_file "
            "(with server.tls_cert_file and server.tls_key_file), or remove auth.certificates"
        )
    return tls


def _certificate_config(tls: ServerTLS) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(tls.key, tls.cert_chain)], root_certificates=tls.client_ca
    )


class ReloadableCredentials:
    """gRPC server credentials whose certificates `update` replaces for new connections.

    Whether clients must present a certificate (mTLS) is fixed at start; `update` may
    change the CA that signs them, not switch mTLS on or off.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self.mtls = tls.mtls
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            _certificate_config(tls),
            self._fetch,  # type: ignore[arg-type]  # the stub omits the None gRPC documents
            require_client_authentication=tls.mtls,
        )

    def update(self, tls: ServerTLS) -> None:
        if tls.mtls != self.mtls:
            raise ConfigError("server.tls_client_ca_file: switching mTLS on or off needs a restart")
        with self._lock:
            self._pending = _certificate_config(tls)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this from its own threads before each handshake; None keeps the
        # current certificates.
        with self._lock:
            pending, self._pending = self._pending, None
        return pending
