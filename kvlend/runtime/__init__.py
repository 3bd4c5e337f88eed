"""The I/O shell: sockets, the event loop and the engine-facing prefill and decode nodes."""

from ..protocol.config import NodeConfig
from ..protocol.decode import FetchState
from ..protocol.ticket import Ticket
from .certificates import reload_on_sighup
from .decode import DecodeNode, FetchHandle, FetchResult, Link
from .prefill import PrefillNode

__all__ = ["DecodeNode", "FetchHandle", "FetchResult", "FetchState", "Link", "NodeConfig", "PrefillNode", "Ticket",
           "reload_on_sighup"]
