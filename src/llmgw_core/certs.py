"""The fleet's own certificate authority: the control plane's certificate and one per node.

`python -m llmgw_server certs init DIR` makes the CA and the control plane's
certificate; `certs issue NODE DIR` makes a node's. The node name is the
certificate's common name: the control plane accepts a registration only
under the name its certificate carries.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 825


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'} is not the key this tool makes")
    return cert, key


def _sans(names: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def _leaf(
    subject: str,
    sans: Sequence[str],
    usage: x509.ObjectIdentifier,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.SubjectAlternativeName(_sans(sans)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def init_ca(directory: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1")) -> None:
    """Make ca.crt/ca.key and the control plane's server.crt/server.key for `hosts`."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "ca.key").exists():
        raise FileExistsError(f"{directory / 'ca.key'} exists: a CA is never replaced by accident")
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("llmgw fleet CA"))
        .issuer_name(_name("llmgw fleet CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(directory / "ca.key", key)
    _write_cert(directory / "ca.crt", ca)
    cert, server_key = _leaf(hosts[0], hosts, ExtendedKeyUsageOID.SERVER_AUTH, ca, key)
    _write_key(directory / "server.key", server_key)
    _write_cert(directory / "server.crt", cert)


def issue_node(directory: Path, node: str) -> tuple[Path, Path, int]:
    """Make nodes/NODE.crt and nodes/NODE.key; returns their paths and the serial."""
    ca_cert, ca_key = _load_ca(directory)
    cert, key = _leaf(node, [node], ExtendedKeyUsageOID.CLIENT_AUTH, ca_cert, ca_key)
    nodes = directory / "nodes"
    nodes.mkdir(exist_ok=True)
    crt_path, key_path = nodes / f"{node}.crt", nodes / f"{node}.key"
    _write_key(key_path, key)
    _write_cert(crt_path, cert)
    return crt_path, key_path, cert.serial_number
