"""``RankRecord``: what a rank publishes about itself in the cluster registry.

Pure: encoding, decoding and validation only.  A record is JSON (readable
with ``etcdctl get``), at most ``MAX_RECORD_BYTES``, stored under
``<prefix>/ranks/<identity>``; the identity is the rank's certificate
identity, and the rank signs the record with that certificate
(``signing``: readers refuse anything else), so a record says where to find
a rank and how loaded it is in the rank's own words; the channel's
authentication still decides who a peer is.
A record names its layout by digest (the SHA-256 of ``PageLayout.encode``);
the layout itself lives once under ``<prefix>/layouts/<digest>``, written by
the rank that publishes it and read by others on first use (and checked
against its digest), so a record stays a few hundred bytes whatever the
model's depth and a router or a decode can still run ``negotiate`` before
opening any connection.  Decoding another rank's record is strict: a bad
one raises ``RegistryError`` naming the field, and readers keep the last
valid record instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Mapping

from ..core.layout import PageLayout
from ..core.names import check_identity
from ..errors import ConfigError, KvlendError, RegistryError

RECORD_VERSION = 3  # 2: the layout by digest (version 1 carried it whole); 3: signed (``signing``)
MAX_RECORD_BYTES = 16 << 10  # a record is a few hundred bytes (its layout is a digest); meta takes the rest
MAX_LAYOUT_BYTES = 1 << 20  # a layout key's value: under etcd's default request cap (1.5 MiB)
MAX_CAPACITY = MAX_LOAD = 1 << 16  # leases or fetches at once: more is a broken or lying record
ROLES = ("prefill", "decode", "router")
_MAX_HOST = 255
_FIELDS = ("version", "identity", "role", "host", "port", "layout", "tp_size", "tp_rank", "pp_size", "pp_rank",
           "capacity", "load", "healthy", "meta")
_MAX_META, _MAX_META_TEXT = 16, 256
_DIGEST = re.compile(r"[0-9a-f]{64}")


@lru_cache(maxsize=256)
def _layout(data: bytes) -> PageLayout:
    """Decoded once per distinct layout: a record's load changes often, its layout never."""
    try:
        return PageLayout.decode(data)
    except KvlendError as exc:
        raise RegistryError(f"record.layout: {exc}") from None


def layout_digest(data: bytes) -> str:
    """The name a layout's encoding goes by in records and in its ``layouts/`` key."""
    return hashlib.sha256(data).hexdigest()


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/") or len(prefix) > 200:
        raise ConfigError(f"registry prefix {prefix!r}: expected a path like '/kvlend/prod' (no trailing '/')")
    return prefix


def ranks_prefix(prefix: str) -> str:
    """The key prefix every rank record lives under (``prefix`` is the cluster's, e.g. ``/kvlend/prod``)."""
    return _check_prefix(prefix) + "/ranks/"


def layout_key(prefix: str, digest: str) -> str:
    """Where the layout named ``digest`` is stored (written once, by any rank that has it)."""
    return _check_prefix(prefix) + "/layouts/" + digest


def record_key(prefix: str, identity: str) -> str:
    return ranks_prefix(prefix) + check_identity(identity)


@dataclass(frozen=True)
class RankRecord:
    """One rank as the registry sees it.

    ``host``/``port``: the control endpoint a peer dials (a decode that only
    dials out publishes port 0).  ``capacity``: how much work the rank takes
    at once (leases for a prefill, fetches for a decode); ``load``: how much
    it holds now.  ``healthy``: False once its transfer backend could not reset
    safely (the node's ``healthy``): it still ends every fetch, but routers send
    it no new work and it should be drained and restarted.  ``layout``: its ``PageLayout`` encoded, empty for a router.
    ``meta``: a few engine-specific strings (say, the engine's own API address).
    """

    identity: str
    role: str
    host: str
    port: int
    layout: bytes = field(default=b"", repr=False)
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    capacity: int = 1
    load: int = 0
    meta: Mapping[str, str] = field(default_factory=dict)
    healthy: bool = True

    def __post_init__(self) -> None:
        try:
            check_identity(self.identity)
        except ConfigError as exc:
            raise RegistryError(f"record.identity: {exc}") from None
        if self.role not in ROLES:
            raise RegistryError(f"record.role: expected one of {ROLES}, got {self.role!r}")
        if not isinstance(self.host, str) or not 0 < len(self.host) <= _MAX_HOST:
            raise RegistryError(f"record.host: expected a str of 1..{_MAX_HOST} characters, got {self.host!r}")
        for name, low, high in (("port", 0, 65535), ("tp_size", 1, 1 << 16), ("pp_size", 1, 1 << 16),
                                ("tp_rank", 0, 1 << 16), ("pp_rank", 0, 1 << 16), ("capacity", 1, MAX_CAPACITY),
                                ("load", 0, MAX_LOAD)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise RegistryError(f"record.{name}: expected an int in [{low}, {high}], got {value!r}")
        if not isinstance(self.healthy, bool):
            raise RegistryError(f"record.healthy: expected true or false, got {self.healthy!r}")
        if self.tp_rank >= self.tp_size or self.pp_rank >= self.pp_size:
            raise RegistryError(f"record: tp_rank {self.tp_rank}/{self.tp_size} or pp_rank "
                                f"{self.pp_rank}/{self.pp_size} is out of range")
        if not isinstance(self.layout, bytes) or len(self.layout) > MAX_LAYOUT_BYTES:
            raise RegistryError(f"record.layout: expected bytes, at most {MAX_LAYOUT_BYTES}")
        if (self.role == "router") != (not self.layout):
            raise RegistryError(f"record.layout: a {self.role} rank {'has no' if self.role == 'router' else 'needs a'} "
                                "layout")
        if self.role == "prefill" and self.port == 0:
            raise RegistryError("record.port: a prefill rank must publish the port decodes dial")
        meta = self.meta
        if (not isinstance(meta, Mapping) or len(meta) > _MAX_META
                or not all(isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 64 and len(v) <= _MAX_META_TEXT
                           for k, v in meta.items())):
            raise RegistryError(f"record.meta: expected at most {_MAX_META} str keys (1..64 characters) with str "
                                f"values of at most {_MAX_META_TEXT}")
        object.__setattr__(self, "meta", MappingProxyType(dict(meta)))
        if self.layout:
            self.page_layout  # noqa: B018 -- decodes it: a record never carries a layout nobody can read

    def __hash__(self) -> int:  # ``meta`` is a read-only mapping, which does not hash
        return hash((self.identity, self.role, self.host, self.port, self.load, self.healthy))

    @cached_property
    def page_layout(self) -> PageLayout | None:
        return _layout(self.layout) if self.layout else None

    @cached_property
    def layout_digest(self) -> str:
        return layout_digest(self.layout) if self.layout else ""

    @property
    def layout_id(self) -> str:
        return self.page_layout.layout_id if self.layout else ""

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def utilisation(self) -> float:
        return self.load / self.capacity

    def encode(self) -> bytes:
        body = {name: getattr(self, name) for name in _FIELDS if name != "version"}
        body["layout"] = self.layout_digest
        body["meta"] = dict(self.meta)
        data = json.dumps({"version": RECORD_VERSION, **body}, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise RegistryError(f"record: {len(data)} bytes encoded, over the cap of {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes, layouts: Mapping[str, bytes] = MappingProxyType({})) -> RankRecord:
        """The record ``data`` encodes; ``layouts`` maps digests to the layouts already fetched."""
        obj = _object(data)
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise RegistryError(f"record: missing fields {missing}")
        digest = obj["layout"]
        if not isinstance(digest, str):
            raise RegistryError("record.layout: expected a layout digest")
        layout = layouts.get(digest) if digest else b""
        if layout is None:
            raise RegistryError(f"record.layout: layout {digest[:64]!r} is not known (not stored, or not fetched)")
        return cls(**{f: obj[f] for f in _FIELDS if f not in ("version", "layout")}, layout=layout)


def wanted_layout(data: bytes) -> str | None:
    """The layout digest a record's value names (for the reader to fetch first), or None."""
    try:
        digest = _object(data).get("layout")
    except RegistryError:
        return None
    return digest if isinstance(digest, str) and _DIGEST.fullmatch(digest) else None


def _object(data: bytes) -> dict:
    """A record's JSON object, of the current version."""
    if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_RECORD_BYTES:
        raise RegistryError(f"record: expected 1..{MAX_RECORD_BYTES} bytes")
    try:
        obj = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError, RecursionError):  # a hostile record may nest deep
        raise RegistryError("record: not JSON") from None
    if not isinstance(obj, dict) or type(obj.get("version")) is not int or obj["version"] != RECORD_VERSION:
        raise RegistryError(f"record: expected a JSON object of version {RECORD_VERSION}")
    return obj
