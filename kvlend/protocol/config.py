"""``NodeConfig``: the timeouts and sizes both ends' sessions decide with; ``Quotas``: what one peer may take."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.lender import LeaseLimits
from ..core.negotiate import MAX_PAGE_RATIO, MAX_PIECES
from ..errors import ConfigError
from .budget import Share

BEATS_PER_TTL = 4  # heartbeats a decode sends per lease ttl at least, when its own heartbeat is slower
MIN_BEAT = 0.01  # seconds: no lease, however short a prefill makes it, is heartbeated more often


@dataclass(frozen=True)
class Quotas:
    """Per authenticated decode rank, what a prefill lets it take.  Each is refused with a
    ``QuotaExceeded`` (``.limit`` is the field's name) before any state changes.

    The defaults are far above what real models need (a request's lease, pages and page pieces
    stay orders of magnitude below them) and exist to bound a faulty or hostile peer, not to
    shape load; tune the per-peer ones to your pool.

    - ``max_leases_per_peer`` (4096): live leases bound to one decode, pushed (``offer``,
      ``lend(peer=...)``) or claimed through a ticket.  A lend over it raises; a claim over it
      is answered with an ``Abort`` naming the limit, and the ticket's lease stays claimable.
    - ``max_locked_pages_per_peer`` (1 << 20 = 1,048,576): token pages (rows, summed over
      groups: ``Lease.num_pages``) that one decode's leases hold locked.  With 16 tokens per
      page that is 256 requests of 64K tokens of a one-group model.
    - ``max_lease_lifetime`` (600 s): a lease is never renewed past lend time + this, however
      often it is heartbeated (a renewal past it is refused with ``LeaseLifetimeExceeded``), so
      it expires by then.  Must be at least ``NodeConfig.ttl``; 20 default TTLs and
      transfer timeouts.
    - ``max_heartbeat_ids`` (16384): lease ids one heartbeat may name.  A heartbeat naming more
      renews nothing (it is answered with an empty ``Renewed``, so the peer's leases run out
      on schedule) and is logged; the link stays up, so the peer can still say done or abort.
      Keep it above ``max_leases_per_peer`` plus the claims a decode may have in flight.
    - ``max_num_tokens`` (1 << 24 = 16,777,216): tokens in one lease, offered or lent;
      covers 10M-token contexts.
    - ``max_page_ratio`` (64): tokens-per-page ratio between the two layouts a negotiation
      will map (e.g. pages of 1 token against pages of 64); refused before any work.
    - ``max_pieces`` (1 << 18 = 262,144): byte runs per page a negotiation may generate
      (before merging); 128 layers x K and V x ratio 64 x 16 heads per rank.  Estimated from
      the layouts and refused before any is built.

    What one decode may cost per loop turn, in wasted messages and in handshakes (``kvlend.protocol.budget``):

    - ``messages_per_turn`` (64): messages of one peer handled per loop turn; what it sent beyond waits,
      unread, for its next turn (nothing is lost), so one peer cannot hold the node's lock for long.
    - ``work_per_turn`` (4096): lookups of one peer per loop turn (a heartbeat costs one per lease id it
      names, any other message one); its turn ends after the message that reaches it.
    - ``throttled_messages`` (4): ``messages_per_turn`` of a peer while strikes are held against it.
    - ``max_strikes`` (32): wasted messages a peer may send before it is dropped (``QuotaExceeded``): a
      claim of a lease id nobody lent that cannot wait (``NodeConfig.claim_wait`` off, or
      ``max_leases_per_peer`` claims of its waiting already), a heartbeat naming such an id, an empty
      heartbeat.  No honest decode sends one, bar a heartbeat racing its claim's refusal; a claim of a
      lease that expired or was released is no strike.
    - ``strike_forgiven`` (1 s): one strike is forgiven this often.
    - ``handshake_backoff`` (1 s): an identity dropped for cause (strikes, a protocol error, a quota), or
      that connected more than 4 times at once (it regains one connection per backoff), is held unread at its
      next connections and then refused until its backoff passes; one whose handshake needed a
      negotiation not cached (by the layout's ``layout_id``) may not ask for another before it either.
      Each backoff doubles, and starts over once the identity kept quiet for ``max_handshake_backoff``.
      A decode reconnecting with a layout already negotiated (or refused) costs a lookup.
    - ``max_handshake_backoff`` (60 s): the longest backoff.
    """

    max_leases_per_peer: int = 4096
    max_locked_pages_per_peer: int = 1 << 20
    max_lease_lifetime: float = 600.0
    max_heartbeat_ids: int = 16384
    max_num_tokens: int = 1 << 24
    max_page_ratio: int = MAX_PAGE_RATIO
    max_pieces: int = MAX_PIECES
    messages_per_turn: int = 64
    work_per_turn: int = 4096
    throttled_messages: int = 4
    max_strikes: int = 32
    strike_forgiven: float = 1.0
    handshake_backoff: float = 1.0
    max_handshake_backoff: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_leases_per_peer", "max_locked_pages_per_peer", "max_heartbeat_ids", "max_num_tokens",
                     "max_page_ratio", "max_pieces", "messages_per_turn", "work_per_turn", "throttled_messages",
                     "max_strikes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Quotas.{name} must be an int >= 1, got {value!r}")
        for name in ("max_lease_lifetime", "strike_forgiven", "handshake_backoff", "max_handshake_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"Quotas.{name} must be a positive number of seconds, got {value!r}")
        if self.max_handshake_backoff < self.handshake_backoff:
            raise ConfigError(f"Quotas.max_handshake_backoff {self.max_handshake_backoff} must be at least "
                              f"handshake_backoff {self.handshake_backoff}")

    @property
    def lease_limits(self) -> LeaseLimits:
        """What the lender enforces."""
        return LeaseLimits(self.max_leases_per_peer, self.max_locked_pages_per_peer, float(self.max_lease_lifetime),
                           self.max_num_tokens)

    @property
    def share(self) -> Share:
        """A peer's share of a loop turn."""
        return Share(self.messages_per_turn, self.work_per_turn)

    @property
    def throttled_share(self) -> Share:
        """... while strikes are held against it."""
        return Share(min(self.throttled_messages, self.messages_per_turn), self.work_per_turn)


@dataclass(frozen=True)
class NodeConfig:
    """Timeouts (seconds) and sizes shared by both ends."""

    ttl: float = 30.0  # lease lifetime without a heartbeat
    heartbeat: float = 1.0  # decode renews leases this often while reading (and a shorter lease's ttl / 4)
    # Prefill: the TTL of a lease lent progressively (``ready``), None: ``ttl``.  An engine that takes such a
    # lease's pages back mid-prefill (vLLM's preemption) waits for its reader to be quiet or for the lease to
    # expire: this bounds that wait against a reader that ignores the end of the lease.  Its reader counts
    # reads only within it of a renewal and heartbeats it every quarter of it (``beat_for``).  Until claimed,
    # a ticket's lease waits ``ttl`` for its reader.
    progressive_ttl: float | None = None
    # Connect, TLS handshake and layout exchange; a prefill drops a decode that authenticated but sent no
    # layout by then (it would hold its identity's slot).
    handshake_timeout: float = 10.0
    transfer_timeout: float = 30.0  # one fetch, start to done (its reads in the lease's life) or the done ack
    cancel_grace: float = 5.0  # a cancelled read may take this long to go quiet before its link is torn down
    chunk_pages: int = 256  # remote token pages per posted chunk
    # A claim of a lease not yet lent waits this long for the lend (0: refused at once).  For
    # tickets minted before the lend, as a vLLM scheduler does while its worker lends a step later.
    claim_wait: float = 0.0
    # Decode: a ticket carrying its page table is read as the claim goes out, saving the claim's round
    # trip; what is read counts only once the answer confirms the same pages.  On by default (protocol 6):
    # with the claim's answer inside the lease's life the fetch is done at once.  Until the answer the
    # reader holds no lease, so it may be reading pages the prefill has already reused (for it, garbage
    # that it then discards; the prefill is never written).
    read_ahead: bool = True
    # A certificate, this rank's or a connected peer's, that expires within this is warned of (once, in the
    # log; kvlend_cert_expiry_seconds always says how long is left): time to renew and reload it.
    cert_warning: float = 7 * 86400.0
    # What a peer that does not read what it is sent may cost (both ends, per connection): past
    # ``output_pause_bytes`` unsent, nothing more is read from it until that drains; past ``max_output_bytes``,
    # or backed up for longer than ``output_stall_timeout``, its connection is dropped.
    output_pause_bytes: int = 4 << 20
    max_output_bytes: int = 64 << 20  # above the largest frame (16 MiB): one message never passes it alone
    output_stall_timeout: float = 30.0
    quotas: Quotas = Quotas()  # what one peer may take (enforced by the prefill)

    def __post_init__(self) -> None:
        for name in ("ttl", "heartbeat", "handshake_timeout", "transfer_timeout", "cancel_grace",
                     "output_stall_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"NodeConfig.{name} must be a positive number of seconds, got {value!r}")
        wait = self.claim_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < self.ttl:
            raise ConfigError(f"NodeConfig.claim_wait must be a number of seconds in [0, ttl), got {wait!r}")
        short = self.progressive_ttl
        if short is not None and (isinstance(short, bool) or not isinstance(short, (int, float))
                                  or not 0 < short <= self.ttl):
            raise ConfigError(f"NodeConfig.progressive_ttl must be None or a number of seconds in (0, ttl], "
                              f"got {short!r}")
        if self.heartbeat >= self.ttl:
            raise ConfigError(f"NodeConfig.heartbeat {self.heartbeat} must be shorter than ttl {self.ttl}")
        if isinstance(self.chunk_pages, bool) or not isinstance(self.chunk_pages, int) or self.chunk_pages < 1:
            raise ConfigError(f"NodeConfig.chunk_pages must be an int >= 1, got {self.chunk_pages!r}")
        warning = self.cert_warning
        if isinstance(warning, bool) or not isinstance(warning, (int, float)) or not 0 <= warning < math.inf:
            raise ConfigError(f"NodeConfig.cert_warning must be a number of seconds >= 0, got {warning!r}")
        for name in ("output_pause_bytes", "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"NodeConfig.{name} must be an int >= 1, got {value!r}")
        if self.max_output_bytes <= self.output_pause_bytes:
            raise ConfigError(f"NodeConfig.max_output_bytes {self.max_output_bytes} must exceed output_pause_bytes "
                              f"{self.output_pause_bytes}")
        if not isinstance(self.read_ahead, bool):
            raise ConfigError(f"NodeConfig.read_ahead must be a bool, got {self.read_ahead!r}")
        if not isinstance(self.quotas, Quotas):
            raise ConfigError(f"NodeConfig.quotas must be a Quotas, got {type(self.quotas).__name__}")
        if self.quotas.max_lease_lifetime < self.ttl:
            raise ConfigError(f"NodeConfig.quotas.max_lease_lifetime {self.quotas.max_lease_lifetime} must be at "
                              f"least ttl {self.ttl}")

    def lease_ttl(self, progressive: bool) -> float:
        """The TTL a prefill lends a lease with (``progressive``: lent with ``ready``)."""
        return self.progressive_ttl if progressive and self.progressive_ttl is not None else self.ttl

    def beat_for(self, ttl: float) -> float:
        """How often a decode renews a lease of ``ttl`` (the prefill's, from its offer): ``heartbeat``, or
        ``BEATS_PER_TTL`` times per ``ttl`` if that is more often, never more often than ``MIN_BEAT``.  A read
        counts for the bound without the done ack only if it landed ``ttl - beat_for(ttl)`` after a renewal
        was asked for: the lease's own ttl, so a short one shortens that window too."""
        return max(min(self.heartbeat, ttl / BEATS_PER_TTL), MIN_BEAT)
