"""State tables and the one function that moves a state by them, for the core's tables and the sessions'.

As h11's ``_state.py``: each table maps ``(state, event)`` to the next state, and every change of a state
field goes through ``transition``, which refuses a pair the table lacks (``IllegalTransition``: a bug in
kvlend, never a peer's doing).  ``None`` as a state is "not yet created": the events from it are the ways an
object begins.  Each table is registered here by the module that defines it (``register``), so one
function sees every move (the stateful tests record them by replacing it).
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, TypeVar


class IllegalTransition(RuntimeError):
    """A move its table does not have: a bug in kvlend (not a ``KvlendError``, so no handler mistakes it
    for a peer's failure)."""


TABLES: dict[str, Mapping] = {}  # name -> its table, in the order registered

_State = TypeVar("_State", bound=Enum)


def register(name: str, table: Mapping) -> None:
    """Add table ``name``, or move it last: the order the docs render them in."""
    TABLES.pop(name, None)
    TABLES[name] = table


def transition(name: str, state: _State | None, event: Enum) -> _State:
    """The state ``event`` moves an object of table ``name`` to from ``state``; ``IllegalTransition``
    if the table has no such move."""
    try:
        return TABLES[name][state, event]
    except KeyError:
        raise IllegalTransition(f"{name}: no transition from {label(state)} on {label(event)}") from None


def label(value: Enum | None) -> str:
    return "(new)" if value is None else f"`{value.value}`"
