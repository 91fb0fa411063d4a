"""TLS for the master's gRPC endpoint: server credentials, node-side channel credentials, and a
per-job self-signed certificate authority for `dlrover submit --tls`."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

ENV_CA_FILE = "DLROVER_MASTER_CA_FILE"
ENV_CLIENT_CERT_FILE = "DLROVER_CLIENT_CERT_FILE"
ENV_CLIENT_KEY_FILE = "DLROVER_CLIENT_KEY_FILE"
CERT_DAYS = 30


class TLSError(ValueError):
    """A certificate or key file cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class ServerTLS:
    """The master's certificate and key, and (for mutual TLS) the CA client certs must chain to."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert")
        if self.client_ca_file:
            return grpc.ssl_server_credentials(
                [(key, cert)],
                root_certificates=_read(self.client_ca_file, "--tls-client-ca"),
                require_client_auth=True,
            )
        return grpc.ssl_server_credentials([(key, cert)])


@dataclass(frozen=True)
class ClientTLS:
    """What a node needs to dial a TLS master: the CA to trust, and its own cert for mTLS."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ClientTLS | None:
        """The node's TLS settings from DLROVER_MASTER_CA_FILE (and the client cert vars)."""
        ca = env.get(ENV_CA_FILE, "")
        if not ca:
            return None
        return cls(ca, env.get(ENV_CLIENT_CERT_FILE, ""), env.get(ENV_CLIENT_KEY_FILE, ""))

    def env(self) -> dict[str, str]:
        """The variables from_env reads, for the master to hand to its nodes."""
        out = {ENV_CA_FILE: self.ca_file}
        if self.cert_file:
            out.update({ENV_CLIENT_CERT_FILE: self.cert_file, ENV_CLIENT_KEY_FILE: self.key_file})
        return out

    def credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca_file, ENV_CA_FILE)
        if self.cert_file:
            return grpc.ssl_channel_credentials(
                ca,
                private_key=_read(self.key_file, ENV_CLIENT_KEY_FILE),
                certificate_chain=_read(self.cert_file, ENV_CLIENT_CERT_FILE),
            )
        return grpc.ssl_channel_credentials(ca)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TLSError(f"{what} {path!r}: cannot read it ({e.strerror}); check the path") from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"{what} {path!r}: not a PEM file (no '-----BEGIN' line)")
    return data


def make_job_certificates(out_dir: str, hosts: Sequence[str]) -> tuple[ServerTLS, ClientTLS]:
    """A fresh CA, a server certificate for `hosts`, and a client certificate, all in out_dir.

    For `dlrover submit --tls`: the master gets the server pair and requires client certs
    signed by the CA; nodes get the CA and the client pair. Keys are written 0600.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("dlrover job CA"))
        .issuer_name(name("dlrover job CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(cn: str, usage, sans: list) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    sans = []
    for host in dict.fromkeys([*hosts, "localhost", "127.0.0.1"]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_cert, server_key = issue("dlrover master", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = issue("dlrover node", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def write(file: str, data: bytes, mode: int = 0o644) -> str:
        path = os.path.join(out_dir, file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    ca_file = write("ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    server = ServerTLS(
        write("master.pem", server_cert), write("master.key", server_key, 0o600), ca_file
    )
    client_key_file = write("node.key", client_key, 0o600)
    client = ClientTLS(ca_file, write("node.pem", client_cert), client_key_file)
    return server, client
