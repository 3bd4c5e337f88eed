"""``RankRecord``: what a rank publishes about itself in the cluster registry.

Pure: encoding, decoding and validation only.  A record is JSON (readable
with ``etcdctl get``), at most ``MAX_RECORD_BYTES``, stored under
``<prefix>/ranks/<identity>``; the identity is the rank's certificate
identity, so the channel's authentication (not the record) decides who a
peer is, and a record only says where to find it and how loaded it is.
The layout travels whole (``PageLayout.encode``, base64), so a router or a
decode can run ``negotiate`` against it before opening any connection.
Decoding another rank's record is strict: a bad one raises
``RegistryError`` naming the field, and readers skip it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Mapping

from ..core.layout import PageLayout
from ..errors import ConfigError, KvlendError, RegistryError
from ..core.names import check_identity

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 10
ROLES = ("prefill", "decode", "router")
_MAX_HOST = 255
_FIELDS = ("version", "identity", "role", "host", "port", "layout", "tp_size", "tp_rank", "pp_size", "pp_rank",
           "capacity", "load", "meta")
_MAX_META, _MAX_META_TEXT = 16, 256


@lru_cache(maxsize=256)
def _layout(data: bytes) -> PageLayout:
    """Decoded once per distinct layout: a record's load changes often, its layout never."""
    try:
        return PageLayout.decode(data)
    except KvlendError as exc:
        raise RegistryError(f"record.layout: {exc}") from None


def ranks_prefix(prefix: str) -> str:
    """The key prefix every rank record lives under (``prefix`` is the cluster's, e.g. ``/kvlend/prod``)."""
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/") or len(prefix) > 200:
        raise ConfigError(f"registry prefix {prefix!r}: expected a path like '/kvlend/prod' (no trailing '/')")
    return prefix + "/ranks/"


def record_key(prefix: str, identity: str) -> str:
    return ranks_prefix(prefix) + check_identity(identity)


@dataclass(frozen=True)
class RankRecord:
    """One rank as the registry sees it.

    ``host``/``port``: the control endpoint a peer dials (a decode that only
    dials out publishes port 0).  ``capacity``: how much work the rank takes
    at once (leases for a prefill, fetches for a decode); ``load``: how much
    it holds now.  ``layout``: its ``PageLayout`` encoded, empty for a router.
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
                                ("tp_rank", 0, 1 << 16), ("pp_rank", 0, 1 << 16), ("capacity", 1, 1 << 40),
                                ("load", 0, 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise RegistryError(f"record.{name}: expected an int in [{low}, {high}], got {value!r}")
        if self.tp_rank >= self.tp_size or self.pp_rank >= self.pp_size:
            raise RegistryError(f"record: tp_rank {self.tp_rank}/{self.tp_size} or pp_rank "
                                f"{self.pp_rank}/{self.pp_size} is out of range")
        if not isinstance(self.layout, bytes):
            raise RegistryError(f"record.layout: expected bytes, got {type(self.layout).__name__}")
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
        return hash((self.identity, self.role, self.host, self.port, self.load))

    @cached_property
    def page_layout(self) -> PageLayout | None:
        return _layout(self.layout) if self.layout else None

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
        body["layout"] = base64.b64encode(self.layout).decode("ascii")
        body["meta"] = dict(self.meta)
        data = json.dumps({"version": RECORD_VERSION, **body}, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise RegistryError(f"record: {len(data)} bytes encoded, over the cap of {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> RankRecord:
        if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_RECORD_BYTES:
            raise RegistryError(f"record: expected 1..{MAX_RECORD_BYTES} bytes")
        try:
            obj = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError, RecursionError):  # a hostile record may nest deep
            raise RegistryError("record: not JSON") from None
        if not isinstance(obj, dict) or type(obj.get("version")) is not int or obj["version"] != RECORD_VERSION:
            raise RegistryError(f"record: expected a JSON object of version {RECORD_VERSION}")
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise RegistryError(f"record: missing fields {missing}")
        layout = obj["layout"]
        if not isinstance(layout, str):
            raise RegistryError("record.layout: expected base64 text")
        try:
            raw = base64.b64decode(layout, validate=True)
        except (binascii.Error, ValueError):
            raise RegistryError("record.layout: not base64") from None
        return cls(**{f: obj[f] for f in _FIELDS if f not in ("version", "layout")}, layout=raw)
