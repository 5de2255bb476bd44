"""Throwaway certificates for one run whose workers listen beyond loopback (`multipod local
--netns`): a CA made for the run, a server certificate per worker carrying its IP address as
subject alternative name (gRPC checks it against the address the controller dials), and a client
certificate for the controller (the workers, given the CA, require one: mutual TLS). Keys are EC
P-256, files are private to this user, and remove() deletes them with the run's end: nothing
signed by the CA outlives the run that trusts it.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
import shutil

VALID_FOR = datetime.timedelta(days=2)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""
    cert: pathlib.Path
    key: pathlib.Path


@dataclasses.dataclass(frozen=True)
class RunCertificates:
    """The CA, each server's pair by name, and the controller's client pair."""
    directory: pathlib.Path
    ca: pathlib.Path
    servers: dict[str, Pair]
    client: Pair

    def remove(self) -> None:
        """Delete every file (keys included)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:     # a dependency of multipod; an install without it is broken
        raise RuntimeError(f"the `cryptography` package is needed to make the run's certificates: {exc}") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def make_certificates(directory: pathlib.Path, servers: dict[str, str], client_ip: str,
                      run_name: str = "multipod run") -> RunCertificates:
    """A fresh CA in `directory` (created private), a server pair for each NAME -> IP of `servers`
    (the IP as its subjectAltName), and a client pair for the controller at `client_ip`."""
    x509, hashes, serialization, ec, eku, oid = _crypto()
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + VALID_FOR    # a little slack for clocks

    def name(common: str):
        return x509.Name([x509.NameAttribute(oid.ORGANIZATION_NAME, run_name),
                          x509.NameAttribute(oid.COMMON_NAME, common)])

    def write_key(path: pathlib.Path, key) -> None:
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("multipod throwaway CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def leaf(label: str, ip: str, usage) -> Pair:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(label)).issuer_name(ca_name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        stem = label.replace(" ", "-")
        pair = Pair(directory / f"{stem}.pem", directory / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(pair.key, key)
        return pair

    made = {label: leaf(label, ip, eku.SERVER_AUTH) for label, ip in servers.items()}
    return RunCertificates(directory, ca_path, made, leaf("controller", client_ip, eku.CLIENT_AUTH))
