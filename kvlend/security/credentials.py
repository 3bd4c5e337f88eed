"""A rank's credentials (cluster CA, its certificate and key) and the TLS 1.3 contexts they make.

Both sides present a certificate and require one from the cluster CA
(mutual TLS); the peer's identity is the common name of the certificate it
proved it holds, and its role (``prefill``, ``decode``, ``router``) the
certificate's one organizational unit: what a peer may do depends on the
role the CA gave it, never on what it says.  A rank loads its files from ``$KVLEND_CA``,
``$KVLEND_CERT`` and ``$KVLEND_KEY`` (``kvlend certs`` writes them), with
``{rank}`` in the last two when several ranks share an environment.
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import ssl
import tempfile
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from ..core.names import ROLES
from ..errors import AuthError, ConfigError

CA_ENV = "KVLEND_CA"  # the cluster CA certificate (PEM file)
CERT_ENV = "KVLEND_CERT"  # this rank's certificate
KEY_ENV = "KVLEND_KEY"  # its private key
RANK = "{rank}"  # in the certificate and key paths: the rank's index when several share an environment


@dataclass(frozen=True, repr=False)
class Credentials:
    """PEM bytes of the cluster CA certificate, this rank's certificate and its private key, and the files
    they were loaded from (``load``), which ``reload`` reads again."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    files: tuple[str, str, str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._cert  # noqa: B018 -- parses, so a bad certificate fails here rather than at the first handshake

    @functools.cached_property
    def _cert(self) -> x509.Certificate:
        try:
            return x509.load_pem_x509_certificate(self.cert_pem)
        except ValueError as exc:
            raise ConfigError(f"rank certificate is not a valid PEM certificate: {exc}") from None

    @property
    def identity(self) -> str:
        """Who this rank is: its certificate's common name."""
        names = self._cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(names) != 1:
            raise ConfigError(f"rank certificate must name exactly one common name, has {len(names)}")
        return str(names[0].value)

    @property
    def role(self) -> str:
        """What this rank is allowed to be: its certificate's role (``ConfigError`` if it has none)."""
        try:
            return certificate_role(self._cert)
        except AuthError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def expires(self) -> datetime.datetime:
        return self._cert.not_valid_after_utc

    def __repr__(self) -> str:
        return f"Credentials({self.identity!r}, expires {self.expires:%Y-%m-%d})"

    @classmethod
    def load(cls, ca: str, cert: str, key: str) -> Credentials:
        """Read and check the three PEM files: the certificate must be the CA's, current, and match the key."""
        creds = cls(_read(ca, "CA certificate"), _read(cert, "rank certificate"), _read(key, "rank key"),
                    (ca, cert, key))
        creds.check()
        return creds

    def reload(self) -> Credentials:
        """The files these were loaded from, read and checked again: a renewed certificate, without a restart."""
        if self.files is None:
            raise ConfigError(f"the credentials of {self.identity!r} were not loaded from files: pass new ones")
        return Credentials.load(*self.files)

    @classmethod
    def from_env(cls, environ=os.environ, *, rank: int = 0, ranks: int = 1) -> Credentials:
        """``load`` the files named by ``$KVLEND_CA``, ``$KVLEND_CERT`` and ``$KVLEND_KEY``.

        For one of ``ranks`` ranks sharing an environment (tensor-parallel workers of one engine),
        ``{rank}`` in the certificate and key paths becomes ``rank``: each needs its own identity,
        since a prefill refuses a second connection from one already connected.
        """
        missing = [name for name in (CA_ENV, CERT_ENV, KEY_ENV) if not environ.get(name)]
        if missing:
            raise ConfigError(f"no TLS credentials: set {', '.join('$' + m for m in missing)} "
                              "(kvlend certs ca / kvlend certs issue write them)")
        cert, key = environ[CERT_ENV], environ[KEY_ENV]
        if ranks > 1 and not (RANK in cert and RANK in key):
            raise ConfigError(f"{ranks} ranks share this environment and each needs its own certificate, but "
                              f"${CERT_ENV} ({cert}) and ${KEY_ENV} ({key}) do not both contain {RANK}")
        return cls.load(environ[CA_ENV], cert.replace(RANK, str(rank)), key.replace(RANK, str(rank)))

    def check(self, now: datetime.datetime | None = None) -> None:
        """``AuthError`` unless the certificate is issued by the CA, current, and matches the key."""
        try:
            ca = x509.load_pem_x509_certificate(self.ca_pem)
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"CA certificate or rank key is not valid PEM: {exc}") from None
        try:
            self._cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise AuthError(f"the certificate of {self.identity!r} is not issued by the CA "
                            f"{ca.subject.rfc4514_string()}: {type(exc).__name__}") from None
        now = now or datetime.datetime.now(datetime.timezone.utc)
        if not self._cert.not_valid_before_utc <= now <= self._cert.not_valid_after_utc:
            raise AuthError(f"the certificate of {self.identity!r} is valid from {self._cert.not_valid_before_utc} "
                            f"to {self._cert.not_valid_after_utc}, not now ({now:%Y-%m-%d %H:%M} UTC)")
        if key.public_key().public_numbers() != self._cert.public_key().public_numbers():
            raise AuthError(f"the key does not match the certificate of {self.identity!r}")

    def context(self, server: bool) -> ssl.SSLContext:
        """A TLS 1.3-only context that presents this rank's certificate and requires one from the CA."""
        return self._server_context if server else self._client_context

    @functools.cached_property
    def _server_context(self) -> ssl.SSLContext:
        ctx = self._base(ssl.PROTOCOL_TLS_SERVER)
        ctx.num_tickets = 0  # no resumption: every connection proves its certificate again
        return ctx

    @functools.cached_property
    def _client_context(self) -> ssl.SSLContext:
        ctx = self._base(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # a rank is who its certificate names, not the host it was found at
        return ctx

    def _base(self, protocol: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cadata=self.ca_pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"CA certificate is not a valid PEM certificate: {exc}") from None
        # ssl loads a chain only from files: a private directory that lives for the call.
        tmp = tempfile.mkdtemp(prefix="kvlend-tls-")
        try:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            for path, data in ((cert, self.cert_pem), (key, self.key_pem)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ConfigError(f"rank certificate and key of {self.identity!r} do not load: {exc.reason}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return ctx


def peer_identity(cert: dict) -> str:
    """The identity in a verified peer certificate (``getpeercert()``): its one common name."""
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if len(names) != 1:
        raise AuthError(f"peer certificate names {len(names)} common names, not one")
    return names[0]


def peer_role(cert: dict) -> str:
    """The role in a verified peer certificate (``getpeercert()``): its one organizational unit."""
    units = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "organizationalUnitName"]
    return _role(units, peer_identity(cert))


def certificate_role(cert: x509.Certificate) -> str:
    """The role a certificate was issued for (``AuthError`` if it names none, or another)."""
    units = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return _role(units, str(names[0].value) if len(names) == 1 else "?")


def check_role(identity: str, role: str, allowed: tuple[str, ...], where: str) -> None:
    """``AuthError`` unless a peer's certificate role is one of ``allowed``."""
    if role not in allowed:
        raise AuthError(f"{identity!r} holds a {role} certificate, and only {' or '.join(allowed)} ranks may "
                        f"{where}")


def _role(units: list[str], identity: str) -> str:
    if len(units) != 1 or units[0] not in ROLES:
        found = ", ".join(units) or "no organizational unit"
        raise AuthError(f"the certificate of {identity!r} names no role ({found}), and a rank's certificate must "
                        f"say one of {', '.join(ROLES)}: reissue it with `kvlend certs issue {identity} --role ROLE`")
    return units[0]


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
