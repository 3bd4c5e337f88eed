"""Test kvlend's sessions, and code built on them, without NIXL, sockets, threads or waiting.

``World`` runs real ``PrefillSession``s and ``DecodeSession``s in one process:
an in-memory network carries their bytes, ``MemoryBackend`` copies real bytes
between numpy pools (``kvcache``, a toy paged KV cache), and time is a
``FakeClock`` the test moves.  Every step is checked against the contract the
sessions and their shell rely on (``ContractError``).  Faults are one call:
``World.cut``, ``kill_prefill``, ``kill_decode``, ``jump``, and a read's
``MemoryBackend.fail`` or ``late``.  ``FakeClock`` also drives the nodes'
lease time (``PrefillNode(clock=)``, ``DecodeNode(clock=)``).

The names below are the stable API; docs/integration.md shows a run.
"""

from .backend import KIND, ContractError, Memory, MemoryBackend, Read
from .clock import FakeClock
from .ends import SCRIBBLE, UNCOMPUTED, DecodeEnd, Lent, PrefillEnd, Record
from .world import Wire, World, connected, finish_all, rig

__all__ = [
    "KIND", "SCRIBBLE", "UNCOMPUTED", "ContractError", "DecodeEnd", "FakeClock", "Lent", "Memory", "MemoryBackend",
    "PrefillEnd", "Read", "Record", "Wire", "World", "connected", "finish_all", "rig",
]
