"""The event loop both nodes share: TLS sockets and backend progress in, session actions out.

One loop iteration: wait on every socket (without the lock), progress the
backend, run TLS on what arrived (handshakes, decryption) and decode its
frames (still without the lock: a hostile frame or a large layout costs the
loop, never another thread), hand the session what happened as typed records
(``protocol.inputs``: accepted, connected, authenticated, data, gone) under the
lock, then perform the session's actions and hand its events to the engine
*outside* the lock, so a slow send, a synchronous copy inside a post or an
engine callback never holds up another thread's call.  Only the loop's
thread touches sockets and the backend; engine threads touch the session,
under the lock, and wake the loop.  Without ``start()`` the engine's own
calls drive the loop.  The node's place in the cluster registry is
``Membership``'s (``runtime/membership.py``); the loop gives it a turn.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable

from ..core.text import printable
from ..errors import AuthError, BackendError, ConfigError, KvlendError, TransferTimeout
from ..protocol.actions import AddPeer, Cancel, Close, Connect, Post, RemovePeer, Send
from ..protocol.budget import Share
from ..protocol.config import NodeConfig
from ..protocol.connection import FrameReader
from ..protocol.inputs import Accepted, Authenticated, Connected, Data, Gone, Input
from ..security.credentials import Credentials
from ..transport import Completion, TransferBackend
from .certificates import CertWatch
from .membership import Membership
from .sockets import Sockets
from .tls import TlsChannel

if TYPE_CHECKING:
    from ..cluster.records import RankRecord
    from ..cluster.registry import Registry

log = logging.getLogger("kvlend.node")

IDLE_WAIT = 0.05  # seconds a loop with nothing in flight sleeps between checks
_BACKOFF = (20e-6, 1e-3)  # polling with reads in flight: from 20 us up to 1 ms while nothing completes


class Shell:
    """The loop, the lock and the thread, around a session that takes ``protocol.inputs`` records in its
    ``handle``; a node adds only what differs (the hooks at the end) and its engine-facing calls.

    ``ROLE``: the certificate role a node of the subclass must hold; ``PEER_ROLES``: those its peers may.
    """

    ROLE: str
    PEER_ROLES: tuple[str, ...]

    def __init__(self, session, backend: TransferBackend, credentials: Credentials,
                 clock: Callable[[], float], config: NodeConfig) -> None:
        if not isinstance(credentials, Credentials):
            raise ConfigError(f"expected the rank's Credentials (kvlend.security), got {type(credentials).__name__}")
        self.session = session
        self.backend = backend
        self.credentials = credentials
        self.name = credentials.identity  # who this rank is: what its certificate names
        _check_own_role(credentials, self.ROLE)
        self._contexts = (credentials.context(server=True), credentials.context(server=False))  # bad PEM fails here
        self.clock = clock
        self.config = config
        self._lock = threading.RLock()  # the session's
        self._changed = threading.Condition(self._lock)
        self._turn = threading.RLock()  # one thread at a time runs the loop (sockets and backend)
        self._sockets = Sockets(pause_output=config.output_pause_bytes, max_output=config.max_output_bytes,
                                output_timeout=config.output_stall_timeout)
        self._channels: dict[int, TlsChannel] = {}  # connection -> its TLS; touched only by the loop's turn
        self._readers: weakref.WeakKeyDictionary[TlsChannel, FrameReader] = weakref.WeakKeyDictionary()  # its frames
        self._agents: dict[int, str] = {}  # connection -> backend peer
        self._tags: set[bytes] = set()  # posted, not yet reported
        self._share = config.quotas.share  # what a peer's turn may take (``protocol.budget``) ...
        self._shares: dict[int, Share] = {}  # ... unless the session said less for it (loop's turn only)
        self._backlog: set[int] = set()  # connections whose reader holds whole frames for their next turn
        self._closing: dict[int, str] = {}  # ... and whose socket closed meanwhile: why, said once they are handled
        self._accepted = 0  # connections accepted so far: the last one's id
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._idle = 0.0
        self._closed = False
        self.membership: Membership | None = None  # set by ``_join``
        self._certs = CertWatch(self.name, credentials)
        self._certs.publish()

    # --------------------------------------------------------------- thread
    def start(self) -> None:
        """Run the loop on a background thread (the usual way: engine calls then never do I/O)."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.step(IDLE_WAIT)
                except Exception:  # keep serving the other requests; the engine sees it in the log
                    log.exception("%s: loop iteration failed", self.name)
                    self._stop.wait(0.01)

        self._thread = threading.Thread(target=loop, name=f"kvlend-{self.name}", daemon=True)
        self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @property
    def healthy(self) -> bool:
        """False once the backend could not reset its agent safely (logged, ``kvlend_orphaned_agents_total``):
        fetches still end, each with its error, but drain this rank and restart it."""
        return getattr(self.backend, "healthy", True)

    @property
    def registry(self) -> Registry | None:
        """The cluster registry this node publishes its record in (None: it joined none)."""
        return None if self.membership is None else self.membership.registry

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread ``start()`` runs the loop on (an engine may set its CPU affinity or priority)."""
        return self._thread

    def _wake(self) -> None:
        if self._thread is not None:
            self._sockets.wake()

    # ----------------------------------------------------------------- loop
    def step(self, timeout: float = 0.0) -> None:
        """One iteration: wait up to ``timeout`` s for something to happen, then handle it."""
        with self._turn:
            self._step(timeout)

    def _step(self, timeout: float) -> None:
        self._flush()  # what engine calls queued since the last turn (a connect, a cancel) goes out first
        with self._lock:
            wait = self._wait(timeout)
        accepted, up, data, gone = self._sockets.poll(wait)
        completions = self._progress() if not self._closed else []
        inputs = self._accept(accepted) + self._secure(up, data, gone) + self._expired_links()
        self._prepare(inputs)
        with self._lock:
            now = self.clock()
            for c in completions:  # first: a read that landed before its link died still counts
                self._tags.discard(c.tag)
                self._read_done(c.tag, c.error, now)
            for event in inputs:
                self.session.handle(event, now)
            self.session.tick(now)
            self._shares = self._throttled(now)
        received = any(isinstance(event, Data) for event in inputs)
        self._idle = 0.0 if (completions or received) else min(max(self._idle * 2, _BACKOFF[0]), _BACKOFF[1])
        self._flush()
        if self.membership is not None and self.membership.turn(self.healthy):
            self._flush()

    def _progress(self) -> list[Completion]:
        """The backend's completions.  One that fails and tracks no read any more (closed under
        the node, say) will never report the reads posted to it: they end now, with its error."""
        try:
            return self.backend.poll()
        except KvlendError as exc:
            if not self._tags or getattr(self.backend, "in_flight", None) != 0:
                raise
            log.error("%s: the transfer backend failed and holds no read (%s): failing the %d posted to it",
                      self.name, printable(exc), len(self._tags))
            return [Completion(tag, BackendError(f"read {tag!r}: the transfer backend failed: {exc}"))
                    for tag in self._tags]

    def flush(self) -> None:
        """Perform the session's actions and deliver its events (outside the session's lock)."""
        with self._turn:
            self._flush()

    def _flush(self) -> None:
        while True:
            with self._lock:
                actions = self.session.take_actions()
                events = self.session.take_events()
                if events:
                    self._changed.notify_all()
            if not actions and not events:
                return
            self._deliver(events)  # first: the engine hears of a release before the peer's done ack goes
            for action in actions:
                self._perform(action)

    def _wait(self, timeout: float) -> float:
        """How long the next poll may sleep: ``timeout``, cut short by deadlines and reads in flight."""
        limit = timeout
        deadline = self.session.next_deadline()
        if deadline is not None:
            limit = min(limit, max(0.0, deadline - self.clock()))
        busy = self._busy()
        if busy is not None:
            limit = min(limit, busy)
        return 0.0 if self._backlog else limit

    def _busy(self) -> float | None:
        """How often the backend must be progressed now (None: only on deadlines)."""
        return self._idle if self._tags else None

    # ------------------------------------------------------------------ TLS
    def _accept(self, sockets: list) -> list[Input]:
        """Serve each socket the listener accepted as a new connection: the TLS server side."""
        accepted: list[Input] = []
        for sock in sockets:
            self._accepted += 1
            try:
                source = sock.getpeername()[0]
            except OSError:
                source = None
            self._sockets.adopt(self._accepted, sock)
            self._channels[self._accepted] = TlsChannel(self._contexts[0], server=True, roles=self.PEER_ROLES)
            accepted.append(Accepted(self._accepted, source))
        return accepted

    def _secure(self, up: list[int], data: list[tuple[int, bytes]], ended: list[tuple[int, str]]) -> list[Input]:
        """TLS and framing for what the sockets reported, outside the session's lock: clients start their
        handshakes, ciphertext becomes plaintext and plaintext messages, a peer that fails TLS is closed.

        Returns what the session hears of it, in order: connections up, newly authenticated, what was
        received (messages, then the error that ended the stream if any), and every connection gone.
        """
        gone: list[Input] = []
        for conn, why in ended:
            channel = self._channels.get(conn)
            reader = self._readers.get(channel) if channel is not None else None
            if reader is not None and reader.backlog and self._shares.get(conn, self._share).messages:
                self._closing[conn] = why  # its messages waiting for their turn are handled first
            else:
                self._channels.pop(conn, None)
                self._backlog.discard(conn)
                gone.append(Gone(conn, why))
        for conn in up:
            channel = self._channels.get(conn)
            if channel is not None:
                channel.start()
                self._push(conn, channel)
        authenticated: list[Input] = []
        plain: list[Input] = []
        chunks = dict(data)
        for conn in [c for c in self._backlog if c not in chunks]:
            chunks[conn] = b""  # what it sent before waits in its reader: its turn again
        self._backlog.clear()
        for conn, chunk in chunks.items():
            channel = self._channels.get(conn)
            if channel is None:
                continue  # closed meanwhile
            was = channel.authenticated
            try:
                text = channel.receive(chunk) if chunk else b""
            except KvlendError as exc:
                self._push(conn, channel)  # the alert that tells the peer why
                self._channels.pop(conn)
                self._sockets.close(conn)
                gone.append(Gone(conn, str(exc), isinstance(exc, AuthError)))
                continue
            self._push(conn, channel)
            if channel.authenticated and not was:
                self._sockets.authenticated(conn)
                authenticated.append(Authenticated(conn, channel.identity))
            reader = self._readers.get(channel)
            if text or reader is not None:
                reader = self._readers.setdefault(channel, FrameReader())
                share = self._shares.get(conn, self._share)
                messages, error = reader.read(text, share)
                if messages or error is not None:
                    plain.append(Data(conn, messages, error))
                if reader.backlog and share.messages:  # the rest waits for its next turn (held: none comes)
                    self._backlog.add(conn)
                self._sockets.hold(conn, reader.backlog)  # meanwhile the kernel keeps what it sends
            drained = reader is None or not reader.backlog or not self._shares.get(conn, self._share).messages
            if conn in self._closing and drained:  # its socket closed behind what it sent
                self._channels.pop(conn)
                self._backlog.discard(conn)
                gone.append(Gone(conn, self._closing.pop(conn)))
            elif channel.peer_closed and drained:  # after its last message (a bye)
                self._channels.pop(conn)
                self._sockets.close(conn)
                self._backlog.discard(conn)
                gone.append(Gone(conn, "closed by the peer"))
        connected: list[Input] = [Connected(conn, self._windowed(conn)) for conn in up]
        return connected + authenticated + plain + gone

    def _windowed(self, conn: int) -> bool:
        """Whether the tcp read window applies to ``conn``'s reads: they may go over tcp (the backend
        windows reads between processes on this host too, or the peer is on another host)."""
        return getattr(self.backend, "read_window_local", True) or not self._sockets.same_host(conn)

    def _expired_links(self) -> list[Input]:
        """Close the links whose peer's certificate has expired (a refused peer, as at the handshake)."""
        gone: list[Input] = []
        for conn, why in self._certs.expired(self._channels, self.config.cert_warning):
            channel = self._channels.pop(conn)
            channel.close()
            self._push(conn, channel)
            self._sockets.close(conn)
            gone.append(Gone(conn, why, True))
        return gone

    def reload_credentials(self, credentials: Credentials | None = None) -> Credentials:
        """Present ``credentials`` (default: the current ones' files, read again) on every link made from
        now on; live links keep running until their peer's certificate expires.  They are checked first
        (same identity, issued by their CA, current, key matching): a ``ConfigError`` or ``AuthError``
        leaves the old ones in use."""
        credentials = self.credentials.reload() if credentials is None else credentials
        if not isinstance(credentials, Credentials):
            raise ConfigError(f"expected the rank's Credentials (kvlend.security), got {type(credentials).__name__}")
        if credentials.identity != self.name:
            raise ConfigError(f"new credentials name {credentials.identity!r}, but this node is {self.name!r}: "
                              "a node's identity cannot change")
        _check_own_role(credentials, self.ROLE)
        credentials.check()
        self._contexts = (credentials.context(server=True), credentials.context(server=False))  # one swap
        self.credentials = credentials
        self._certs.renewed(credentials)
        if self.membership is not None:  # its record: signed anew
            self.membership.renewed(credentials)
        log.info("%s: credentials reloaded: new links present a certificate valid until %s", self.name,
                 f"{credentials.expires:%Y-%m-%d %H:%M} UTC")
        return credentials

    def _push(self, conn: int, channel: TlsChannel) -> None:
        out = channel.data_to_send()
        if out:
            self._sockets.send(conn, out)

    def _perform(self, action) -> None:
        """One action.  If it fails (any exception) only what it belongs to fails, typed: its read or its
        link; the actions queued after it still run."""
        try:
            self._act(action)
        except Exception as exc:
            self._action_failed(action, exc)
        self._idle = 0.0

    def _act(self, action) -> None:
        if isinstance(action, Send):
            channel = self._channels.get(action.conn)
            if channel is not None:
                channel.send(action.data)
                self._push(action.conn, channel)
        elif isinstance(action, Close):
            self._closing.pop(action.conn, None)
            channel = self._channels.pop(action.conn, None)
            if channel is not None:
                channel.close()
                self._push(action.conn, channel)
            self._sockets.close(action.conn)
        elif isinstance(action, Connect):
            error = self._sockets.connect(action.conn, action.host, action.port)
            if error is not None:
                self._report_closed(action.conn, error)
            else:
                self._channels[action.conn] = TlsChannel(self._contexts[1], server=False, roles=self.PEER_ROLES)
        elif isinstance(action, AddPeer):
            try:
                self._agents[action.conn] = self.backend.add_peer(action.metadata)
            except KvlendError as exc:
                self._report_closed(action.conn, f"loading its backend metadata failed: {exc}")
        elif isinstance(action, RemovePeer):
            agent = self._agents.pop(action.conn, None)
            if agent is not None:
                self.backend.remove_peer(agent)
        elif isinstance(action, Post):
            self._tags.add(action.tag)
            agent = self._agents.get(action.conn)
            if agent is None:
                raise KvlendError(f"link {action.conn} has no backend peer")
            self.backend.post_read(agent, action.batches, action.tag)
        elif isinstance(action, Cancel):
            if action.tag in self._tags:
                self.backend.cancel(action.tag)

    def _action_failed(self, action, exc: Exception) -> None:
        """``action`` raised: end the read or the link it belongs to (a bug must end them too, not hang them)."""
        what = type(action).__name__.lower()
        why = str(exc) if isinstance(exc, KvlendError) else f"{what} failed: {type(exc).__name__}: {exc}"
        if isinstance(action, Post):  # refused before anything moved: nothing is in flight
            if not isinstance(exc, KvlendError):
                exc = BackendError(f"posting read {action.tag!r}: {type(exc).__name__}: {exc}")
            self._tags.discard(action.tag)
            with self._lock:
                self._read_done(action.tag, _detached(exc), self.clock())
        elif isinstance(action, (Send, Close, Connect, AddPeer)):
            self._channels.pop(action.conn, None)
            self._sockets.close(action.conn)
            if not isinstance(action, Close):
                self._report_closed(action.conn, why)
        else:  # RemovePeer, Cancel: the session's own deadlines end what they were for
            log.info("%s: %r failed: %s", self.name, action, printable(why))

    # ------------------------------------------------------------- registry
    def _join(self, membership: Membership, record: RankRecord) -> None:
        """Publish ``record`` through ``membership`` (signed with this rank's certificate) and give it a turn
        of the loop from now on."""
        membership.join(record, self.credentials)
        self.membership = membership

    def _leave(self) -> None:
        """Withdraw the record (the caller still owns the registry)."""
        if self.membership is not None:
            self.membership.leave()

    def _report_closed(self, conn: int, why: str) -> None:
        with self._lock:
            self.session.handle(Gone(conn, why), self.clock())

    # ------------------------------------------------------------ for waits
    def _wait_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Block until ``done()`` (checked under the lock) or ``TransferTimeout`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if done():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(f"{what} within {timeout:.3g} s")
                if self._thread is not None:
                    self._changed.wait(min(remaining, IDLE_WAIT))
                    continue
            self.step(min(remaining, IDLE_WAIT))

    # ---------------------------------------------------------- subclasses
    def _prepare(self, inputs: list[Input]) -> None:
        """Work on what arrived that the session will want, done before its lock is taken (a negotiation)."""

    def _throttled(self, now: float) -> dict:
        """Connections whose next turns read less than ``Quotas.share`` (under the lock): the session's say."""
        return {}

    def _read_done(self, tag: bytes, error: KvlendError | None, now: float) -> None:
        """A posted read is terminal (under the lock); a node that posts nothing ignores it."""

    def _deliver(self, events: list) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Stop the thread and close every socket (the session said its goodbyes first)."""
        self._stop.set()
        self._sockets.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.flush()
        self._closed = True
        self._channels.clear()
        self._sockets.close_all()
        self._certs.withdraw()


def _detached(error: KvlendError) -> KvlendError:
    """``error`` without the frames it was raised through, to be kept as a fetch's error.

    A traceback keeps every frame's locals alive, the backend's transfer agent among them,
    for as long as the engine holds the failed fetch; an agent kept alive cannot be reset.
    """
    error.__context__ = error.__cause__ = None
    return error.with_traceback(None)


def _check_own_role(credentials: Credentials, role: str) -> None:
    """A node runs only as what its certificate says it is (``ConfigError`` naming how to reissue it)."""
    if credentials.role != role:
        raise ConfigError(f"the certificate of {credentials.identity!r} is a {credentials.role}'s, and a {role} "
                          f"node needs a {role}'s: reissue it with `kvlend certs issue {credentials.identity} "
                          f"--role {role}`")
