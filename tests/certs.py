"""Throwaway X.509 material for TLS tests: a CA, a server certificate, client certificates.

EC P-256 keys: generating one takes microseconds, where RSA takes most of a second.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class Pem:
    """A certificate and its key, as PEM bytes and as files."""

    cert: bytes
    key: bytes
    cert_file: Path
    key_file: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into `directory`."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM)
        self.cert_file = directory / f"{name}-ca.pem"
        self.cert_file.write_bytes(self.cert)

    def issue(
        self,
        file_stem: str,
        common_name: str,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        server: bool = False,
    ) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        cert_file = self.directory / f"{file_stem}.pem"
        key_file = self.directory / f"{file_stem}.key"
        cert_file.write_bytes(cert)
        key_file.write_bytes(_key_pem(key))
        key_file.chmod(0o600)
        return Pem(cert, _key_pem(key), cert_file, key_file)

    def server(self, file_stem: str = "server") -> Pem:
        """A server certificate for 127.0.0.1 and localhost."""
        return self.issue(
            file_stem, "localhost", dns=("localhost",), ips=("127.0.0.1",), server=True
        )
