"""Certificates over a node's life: a link closes when its peer's certificate expires, warnings come ahead.

The TLS handshake checks a certificate once; the link then lives on.  So on
the loop's turn, about once a second, the node compares each live link's
peer certificate and its own against the wall clock (certificates carry
wall-clock times, the sessions a monotonic clock): a link whose peer's
certificate has expired is closed as a refused one (``AuthError``), and a
certificate within ``NodeConfig.cert_warning`` of its end is logged once.
Renewed credentials take over without a restart (``reload_credentials``, or
SIGHUP where the process installed ``reload_on_sighup``): new links present
them, live ones keep theirs until the peer's certificate expires.
"""

from __future__ import annotations

import datetime
import logging
import math
import signal
import threading
import time
from typing import Mapping

from ..core.text import printable
from ..errors import KvlendError
from ..metrics import METRICS
from ..security.credentials import Credentials
from .tls import TlsChannel

log = logging.getLogger("kvlend.node")

CHECK_EVERY = 1.0  # seconds between checks: a link outlives its peer's certificate by about this much
EXPIRED_REPEAT = 3600.0  # seconds between the errors a rank whose own certificate expired logs


class CertWatch:
    """One node's view of the certificates it holds and faces, and the gauges that report it."""

    def __init__(self, name: str, credentials: Credentials) -> None:
        self.name = name
        self.own = credentials.expires.timestamp()
        self.peers = math.inf  # the first peer certificate to expire among live links, at the last check
        self._next_check = 0.0  # monotonic
        self._own_warned = False
        self._own_error_at = 0.0  # monotonic: when the next "expired" error may be logged
        self._warned: set[int] = set()  # links whose peer's coming expiry was logged

    def publish(self) -> None:
        METRICS.gauge("kvlend_cert_expiry_seconds", lambda: self.own - time.time(), self.name)
        METRICS.gauge("kvlend_peer_cert_expiry_seconds", lambda: self.peers - time.time(), self.name)

    def withdraw(self) -> None:
        METRICS.remove_gauge("kvlend_cert_expiry_seconds", self.name)
        METRICS.remove_gauge("kvlend_peer_cert_expiry_seconds", self.name)

    def renewed(self, credentials: Credentials) -> None:
        """This rank presents ``credentials`` from now on: warn of their end afresh."""
        self.own = credentials.expires.timestamp()
        self._own_warned = False
        self._own_error_at = 0.0
        self._next_check = 0.0

    def expired(self, channels: Mapping[int, TlsChannel], warning: float) -> list[tuple[int, str]]:
        """The links whose peer's certificate has expired, each with why (checked at most once a second);
        logs the certificates, own and peers', that expire within ``warning`` seconds."""
        tick = time.monotonic()
        if tick < self._next_check:
            return []
        self._next_check = tick + CHECK_EVERY
        now = time.time()
        self._check_own(now, tick, warning)
        self._warned.intersection_update(channels)
        gone, first = [], math.inf
        for conn, channel in channels.items():
            if channel.expires is None:
                continue  # still in its handshake
            if channel.expires <= now:
                gone.append((conn, f"the certificate of {channel.identity!r} expired at {_utc(channel.expires)}"))
                continue
            first = min(first, channel.expires)
            if channel.expires - now <= warning and conn not in self._warned:
                self._warned.add(conn)
                log.warning("%s: the certificate of peer %s expires in %s (%s): its link closes then",
                            self.name, printable(channel.identity), _span(channel.expires - now),
                            _utc(channel.expires))
        self.peers = first
        return gone

    def _check_own(self, now: float, tick: float, warning: float) -> None:
        left = self.own - now
        if left <= 0:
            if tick >= self._own_error_at:
                self._own_error_at = tick + EXPIRED_REPEAT
                log.error("%s: this rank's certificate expired at %s: peers refuse every new link and close "
                          "live ones; renew it and reload (reload_credentials, or SIGHUP)", self.name,
                          _utc(self.own))
        elif left <= warning and not self._own_warned:
            self._own_warned = True
            log.warning("%s: this rank's certificate expires in %s (%s): renew it and reload "
                        "(reload_credentials, or SIGHUP)", self.name, _span(left), _utc(self.own))


def reload_on_sighup(*nodes) -> None:
    """On SIGHUP, reload each node's credentials from their files (``reload_credentials()``).

    For a process that owns its signals (a rank's ``main``), called from its main thread; kvlend
    itself never installs a handler.  The reload runs on a thread of its own, so the handler takes
    no lock; credentials that fail their checks are logged and the old ones stay in use.
    """

    def reload() -> None:
        for node in nodes:
            try:
                node.reload_credentials()
            except KvlendError as exc:
                log.error("%s: credentials not reloaded, the current ones stay: %s", node.name, printable(exc))

    signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(target=reload, name="kvlend-reload",
                                                                         daemon=True).start())


def _utc(epoch: float) -> str:
    return f"{datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def _span(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"
