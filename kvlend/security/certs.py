"""A cluster's certificate authority and the rank certificates it issues (``cryptography``).

Keys are EC P-256: a TLS 1.3 handshake then costs each side one signature
and one verification, microseconds.  A rank certificate names the rank's
identity in its subject's common name and its role in the one organizational
unit; that name and role, and never what a peer claims, are who the peer is.
``Authority.create()`` with ``issue()`` is also how the demo and the tests get throwaway ("ephemeral") credentials.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..core.names import ROLES, check_identity
from ..errors import ConfigError
from .credentials import CA_ENV, CERT_ENV, KEY_ENV, Credentials

CA_DAYS = 3650
RANK_DAYS = 365
def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True, repr=False)
class Authority:
    """A cluster CA: its certificate and private key (PEM).  Keep the key off the ranks."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def create(cls, name: str = "kvlend cluster CA", days: int = CA_DAYS) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start = _now() - datetime.timedelta(minutes=5)  # tolerate clocks a little apart
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    @classmethod
    def load(cls, directory: str) -> Authority:
        """The CA saved in ``directory`` (``ca.pem``, ``ca.key``)."""
        return cls(_read(os.path.join(directory, "ca.pem")), _read(os.path.join(directory, "ca.key")))

    def issue(self, identity: str, role: str, days: float = RANK_DAYS, *,
              valid_from: datetime.datetime | None = None, expires: datetime.datetime | None = None) -> Credentials:
        """A certificate for rank ``identity`` in ``role`` (one of ``ROLES``), valid ``days`` from
        ``valid_from`` (default now), or until ``expires`` exactly (short-lived certificates: the tests'
        expiring links)."""
        check_identity(identity)
        if role not in ROLES:
            raise ConfigError(f"role {role!r}: a rank is one of {', '.join(ROLES)}")
        try:
            ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
            ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        except ValueError as exc:
            raise ConfigError(f"the CA's certificate or key is not valid PEM: {exc}") from None
        key = ec.generate_private_key(ec.SECP256R1())
        start = (valid_from or _now()) - datetime.timedelta(minutes=5)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity),
                                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(expires or start + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        return Credentials(self.cert_pem, cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def save(self, directory: str) -> list[str]:
        """Write ``ca.pem`` and ``ca.key`` (0600) into ``directory``; never over existing files."""
        _refuse_existing(directory, "ca.pem", "ca.key")
        return [_write(directory, "ca.pem", self.cert_pem, 0o644), _write(directory, "ca.key", self.key_pem, 0o600)]


def save_rank(credentials: Credentials, directory: str) -> dict[str, str]:
    """Write ``<identity>.pem`` and ``<identity>.key`` (0600) into ``directory``, and ``ca.pem`` if absent;
    never over an existing certificate or key, nor beside the CA's key: a rank's directory is what gets
    copied to the rank, and ``ca.key`` mints identities.  Returns the environment a rank loads them from."""
    name = credentials.identity
    if os.path.exists(os.path.join(directory, "ca.key")):
        raise ConfigError(f"{directory} holds the CA's key (ca.key): write rank credentials into another "
                          "directory, so the key that mints identities never travels with them")
    _refuse_existing(directory, f"{name}.pem", f"{name}.key")  # both or neither
    ca = os.path.join(directory, "ca.pem")
    if not os.path.exists(ca):
        _write(directory, "ca.pem", credentials.ca_pem, 0o644)
    elif _read(ca) != credentials.ca_pem:
        raise ConfigError(f"{ca} holds another CA than the one that issued {name!r}")
    return {CA_ENV: ca, CERT_ENV: _write(directory, f"{name}.pem", credentials.cert_pem, 0o644),
            KEY_ENV: _write(directory, f"{name}.key", credentials.key_pem, 0o600)}


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _refuse_existing(directory: str, *names: str) -> None:
    for name in names:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            raise ConfigError(f"{path} exists: kvlend certs never overwrites a certificate or key")


def _private_dirs(directory: str) -> None:
    """Create ``directory`` and its missing parents 0700, whatever the umask; existing ones stay as they are."""
    missing = []
    path = os.path.abspath(directory)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode passed through the umask
        except FileExistsError:
            continue  # made meanwhile, by someone else: theirs
        except OSError as exc:
            raise ConfigError(f"cannot create {path}: {exc.strerror}") from None


def _write(directory: str, name: str, data: bytes, mode: int) -> str:
    """Write a new file of exactly ``mode`` (not the umask's) in ``directory``, created 0700 if missing."""
    _private_dirs(directory)
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(f"{path} exists: kvlend certs never overwrites a certificate or key") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)
        f.write(data)
    return path
