"""Signed rank records: a rank signs what it publishes with its certificate's key, readers check it.

Anyone who can write to etcd can write any key, so a record's bytes prove
nothing by themselves.  A rank's value is its record's JSON plus two fields:
``cert``, the PEM of the rank certificate that signs it, and ``sig``, an
ECDSA/SHA-256 signature (base64, DER) by that certificate's key over
``DOMAIN`` and the canonical JSON (sorted keys, no whitespace) of every other
field, ``cert`` included.  A reader (``RecordVerifier``) accepts a value only
if the certificate is issued by the cluster CA and valid now, the signature
holds, and the certificate's common name and role are the record's
``identity`` and ``role``: a decode certificate cannot publish a prefill, nor
one rank another's record.  ``capacity``, ``load`` and the endpoint are then
the rank's own word, as a link's messages are.

Checking costs an ECDSA verification (about 0.1 ms), so results are kept by
the SHA-256 of the value (``VERIFIED_KEPT`` of them) and certificates by their
PEM (``CERTS_KEPT``): a value seen again, or a record whose load moved under
the same certificate, costs a dictionary look-up and one signature check at
most.  No I/O here; the wall clock is a parameter (certificate validity).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..errors import AuthError, RegistryError
from ..security.credentials import Credentials, certificate_role
from .records import MAX_RECORD_BYTES, RankRecord

DOMAIN = b"kvlend rank record v3\n"  # signatures over records are never valid as anything else
VERIFIED_KEPT = 4096  # record values whose check is remembered (about 100 bytes each)
CERTS_KEPT = 1024  # certificates whose issuance is remembered
_MAX_CERT = 8 << 10


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class RecordSigner:
    """Signs this rank's records with its certificate key (loaded once)."""

    def __init__(self, credentials: Credentials) -> None:
        if not isinstance(credentials, Credentials):
            raise RegistryError(f"expected the rank's Credentials, got {type(credentials).__name__}")
        self.identity, self.role = credentials.identity, credentials.role
        self._cert = credentials.cert_pem.decode("ascii")
        self._key = serialization.load_pem_private_key(credentials.key_pem, password=None)
        if not isinstance(self._key, ec.EllipticCurvePrivateKey):
            raise RegistryError(f"the key of {self.identity!r} is not an EC key")

    def sign(self, record: RankRecord) -> bytes:
        """The value to put for ``record``: ``RegistryError`` unless it is this certificate's identity and role."""
        if (record.identity, record.role) != (self.identity, self.role):
            raise RegistryError(f"a {self.role} certificate for {self.identity!r} cannot sign the {record.role} "
                                f"record of {record.identity!r}")
        body = json.loads(record.encode())
        body["cert"] = self._cert
        signature = self._key.sign(DOMAIN + _canonical(body), ec.ECDSA(hashes.SHA256()))
        body["sig"] = base64.b64encode(signature).decode("ascii")
        data = _canonical(body)
        if len(data) > MAX_RECORD_BYTES:
            raise RegistryError(f"record: {len(data)} bytes signed, over the cap of {MAX_RECORD_BYTES}")
        return data


@dataclass(frozen=True)
class _Signer:
    identity: str
    role: str
    key: ec.EllipticCurvePublicKey
    not_before: datetime.datetime
    not_after: datetime.datetime


class RecordVerifier:
    """Checks signed record values against the cluster CA (``ca_pem``); ``clock``: the wall time, UTC."""

    def __init__(self, ca_pem: bytes, clock: Callable[[], datetime.datetime] = _utcnow) -> None:
        try:
            self._ca = x509.load_pem_x509_certificate(ca_pem)
        except (ValueError, TypeError) as exc:
            raise RegistryError(f"cluster CA: not a PEM certificate ({exc}): readers need it to check records") \
                from None
        self._clock = clock
        self._certs: OrderedDict[bytes, _Signer | str] = OrderedDict()  # PEM -> signer, or why refused
        self._done: OrderedDict[bytes, _Signer | str] = OrderedDict()  # SHA-256 of a value -> signer, or why
        self.checks = 0  # signatures actually verified (the rest came from the cache)

    def verify(self, value: bytes) -> None:
        """``RegistryError`` naming why unless ``value`` is a record signed by its own rank's valid certificate."""
        digest = hashlib.sha256(value).digest() if isinstance(value, (bytes, bytearray)) else b""
        signer = self._done.get(digest) if digest else None
        if signer is None:
            signer = self._check(value)
            if digest:
                _keep(self._done, digest, signer, VERIFIED_KEPT)
        else:
            self._done.move_to_end(digest)
        if isinstance(signer, str):
            raise RegistryError(signer)
        now = self._clock()
        if not signer.not_before <= now <= signer.not_after:
            raise RegistryError(f"record.cert: the certificate of {signer.identity!r} is valid from "
                                f"{signer.not_before:%Y-%m-%d %H:%M} to {signer.not_after:%Y-%m-%d %H:%M} UTC, not now")

    def _check(self, value) -> _Signer | str:
        """The signer of ``value``, or why it is refused (a str: refusals are cached as well)."""
        if not isinstance(value, (bytes, bytearray)) or not 0 < len(value) <= MAX_RECORD_BYTES:
            return f"record: expected 1..{MAX_RECORD_BYTES} bytes"
        try:
            obj = json.loads(bytes(value))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return "record: not JSON"
        if not isinstance(obj, dict):
            return "record: not a JSON object"
        cert, sig = obj.pop("cert", None), obj.pop("sig", None)
        if not isinstance(cert, str) or not isinstance(sig, str):
            return "record: not signed (no cert and sig): only a rank's own certificate may publish its record"
        signer = self._signer(cert)
        if isinstance(signer, str):
            return signer
        if (obj.get("identity"), obj.get("role")) != (signer.identity, signer.role):
            return (f"record: signed by the {signer.role} certificate of {signer.identity!r}, but it names the "
                    f"{str(obj.get('role'))[:16]} {str(obj.get('identity'))[:64]!r}")
        try:
            raw = base64.b64decode(sig, validate=True)
        except (binascii.Error, ValueError):
            return "record.sig: not base64"
        obj["cert"] = cert
        self.checks += 1
        try:
            signer.key.verify(raw, DOMAIN + _canonical(obj), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return f"record.sig: the signature does not match the record and the certificate of {signer.identity!r}"
        return signer

    def _signer(self, pem: str) -> _Signer | str:
        data = pem.encode("utf-8", "replace")
        found = self._certs.get(data)
        if found is None:
            found = self._issued(data)
            _keep(self._certs, data, found, CERTS_KEPT)
        return found

    def _issued(self, data: bytes) -> _Signer | str:
        if len(data) > _MAX_CERT:
            return f"record.cert: over {_MAX_CERT} bytes"
        try:
            cert = x509.load_pem_x509_certificate(data)
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            return f"record.cert: not issued by the cluster CA ({type(exc).__name__})"
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        key = cert.public_key()
        if len(names) != 1 or not isinstance(key, ec.EllipticCurvePublicKey):
            return "record.cert: a rank certificate names one common name and holds an EC key"
        try:
            role = certificate_role(cert)
        except AuthError as exc:
            return f"record.cert: {exc}"
        return _Signer(str(names[0].value), role, key, cert.not_valid_before_utc, cert.not_valid_after_utc)


def _keep(cache: OrderedDict, key: bytes, value, cap: int) -> None:
    cache[key] = value
    while len(cache) > cap:
        cache.popitem(last=False)
