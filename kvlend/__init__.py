"""kvlend: in-place KV-cache lending for disaggregated LLM serving over NIXL."""

from .errors import (
    AuthError, BackendError, ConfigError, KvlendError, LayoutError, LayoutMismatch, LeaseDenied, LeaseError,
    LeaseExpired, LeaseUnknown, PageRangeError, PeerLost, ProtocolError, TrackerError, TransferTimeout,
    IncompleteFetch, PeerProtocolError, UsageError, LeaseLifetimeExceeded, NegotiationLimit, PromptMismatch, QuotaExceeded, TransferCancelled,
)
from .core.pages import GroupPages
from .core.prompt import prompt_digest
from .core.layout import (
    BufferDesc, HeadGeometry, HeadOrder, LayerGroup, LayerIdentity, LayerKind, MemoryKind,
    MemoryRegion, PageLayout, ReplicaRank, Role, RowSelection, SelectionMode, Sharding,
    layout_from_pools,
)

__version__ = "0.1.0"

__all__ = [
    "AuthError", "BackendError", "ConfigError", "KvlendError", "LayoutError", "LayoutMismatch", "LeaseDenied", "LeaseError",
    "LeaseExpired", "LeaseUnknown", "PageRangeError", "PeerLost", "ProtocolError", "TrackerError", "TransferTimeout",
    "IncompleteFetch", "LeaseLifetimeExceeded", "NegotiationLimit", "PromptMismatch", "QuotaExceeded",
    "TransferCancelled", "PeerProtocolError", "UsageError", "GroupPages", "prompt_digest",
    "BufferDesc", "HeadGeometry", "HeadOrder", "LayerGroup", "LayerIdentity", "LayerKind", "MemoryKind",
    "MemoryRegion", "PageLayout", "ReplicaRank", "Role", "RowSelection", "SelectionMode", "Sharding",
    "layout_from_pools",
]
