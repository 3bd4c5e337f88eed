"""kvlend: in-place KV-cache lending for disaggregated LLM serving over NIXL."""

from .core.layout import (
    BufferDesc,
    HeadGeometry,
    HeadOrder,
    LayerGroup,
    LayerIdentity,
    LayerKind,
    MemoryKind,
    MemoryRegion,
    PageLayout,
    ReplicaRank,
    Role,
    RowSelection,
    SelectionMode,
    Sharding,
    layout_from_pools,
)
from .core.pages import GroupPages
from .core.prompt import prompt_digest
from .errors import (
    AuthError,
    BackendError,
    ConfigError,
    IncompleteFetch,
    KvlendError,
    LayoutError,
    LayoutMismatch,
    LeaseDenied,
    LeaseError,
    LeaseExpired,
    LeaseLifetimeExceeded,
    LeaseUnknown,
    NegotiationLimit,
    PageRangeError,
    PeerLost,
    PeerProtocolError,
    PromptMismatch,
    ProtocolError,
    QuotaExceeded,
    TrackerError,
    TransferCancelled,
    TransferTimeout,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "AuthError", "BackendError", "ConfigError", "KvlendError", "LayoutError", "LayoutMismatch", "LeaseDenied",
    "LeaseError",
    "LeaseExpired", "LeaseUnknown", "PageRangeError", "PeerLost", "ProtocolError", "TrackerError", "TransferTimeout",
    "IncompleteFetch", "LeaseLifetimeExceeded", "NegotiationLimit", "PromptMismatch", "QuotaExceeded",
    "TransferCancelled", "PeerProtocolError", "UsageError", "GroupPages", "prompt_digest",
    "BufferDesc", "HeadGeometry", "HeadOrder", "LayerGroup", "LayerIdentity", "LayerKind", "MemoryKind",
    "MemoryRegion", "PageLayout", "ReplicaRank", "Role", "RowSelection", "SelectionMode", "Sharding",
    "layout_from_pools",
]
