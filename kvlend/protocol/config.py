"""``NodeConfig``: the timeouts and sizes both ends' sessions decide with."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class NodeConfig:
    """Timeouts (seconds) and sizes shared by both ends."""

    ttl: float = 30.0  # lease lifetime without a heartbeat
    heartbeat: float = 1.0  # decode renews leases this often while reading
    handshake_timeout: float = 10.0  # connect, hello and layout exchange
    transfer_timeout: float = 30.0  # one fetch, start to the prefill's done ack
    cancel_grace: float = 5.0  # a cancelled read may take this long to go quiet before its link is torn down
    chunk_pages: int = 256  # remote token pages per posted chunk

    def __post_init__(self) -> None:
        for name in ("ttl", "heartbeat", "handshake_timeout", "transfer_timeout", "cancel_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"NodeConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat >= self.ttl:
            raise ConfigError(f"NodeConfig.heartbeat {self.heartbeat} must be shorter than ttl {self.ttl}")
        if isinstance(self.chunk_pages, bool) or not isinstance(self.chunk_pages, int) or self.chunk_pages < 1:
            raise ConfigError(f"NodeConfig.chunk_pages must be an int >= 1, got {self.chunk_pages!r}")
