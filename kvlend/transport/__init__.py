"""The transport plane: the backend contract and the registry of installed backends."""

from ..core.reads import ReadBatch
from .contract import Completion, TransferBackend
from .registry import ENTRY_POINT_GROUP, available_backends, load_backend

__all__ = ["ENTRY_POINT_GROUP", "Completion", "ReadBatch", "TransferBackend", "available_backends", "load_backend"]
