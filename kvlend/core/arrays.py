"""Address, size and placement of an engine's pool arrays (numpy or torch), without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import LayoutError
from .layout_parts import MemoryKind


@dataclass(frozen=True)
class ArrayInfo:
    address: int
    nbytes: int
    kind: MemoryKind
    device_id: int
    shape: tuple[int, ...]
    itemsize: int
    dtype: str


def array_info(arr: Any) -> ArrayInfo:
    """Address, size and placement of a numpy array or torch tensor (CPU or CUDA).

    Duck-typed so the core never imports torch.
    """
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise LayoutError("pool array must be C-contiguous")
        return ArrayInfo(arr.ctypes.data, arr.nbytes, MemoryKind.HOST, 0, tuple(arr.shape), arr.itemsize,
                         str(arr.dtype))
    if hasattr(arr, "data_ptr") and hasattr(arr, "element_size"):
        if not arr.is_contiguous():
            raise LayoutError("pool tensor must be contiguous")
        dev = arr.device
        kind = MemoryKind.DEVICE if dev.type == "cuda" else MemoryKind.HOST
        return ArrayInfo(
            arr.data_ptr(), arr.numel() * arr.element_size(), kind, dev.index or 0,
            tuple(arr.shape), arr.element_size(), str(arr.dtype).removeprefix("torch."),
        )
    raise LayoutError(f"pool must be a numpy array or a torch tensor, got {type(arr).__name__}")
