"""The control channel over real sockets: confidential, mutually authenticated, identities from certificates.

A relay between the ranks keeps every byte the channel carried: neither
rank's NIXL metadata, nor a lease id, nor a request's name or metadata is in
it.  Each refusal is a real TLS handshake against a real node: no
certificate, one from another CA, an expired one, a prefill the decode cannot
verify, a second connection presenting a live peer's identity.  Handshakes
run on the loop's thread outside the serving lock.  Certificates hold for a
link's whole life: short-lived ones (seconds) expire under live links, which
close and fail their fetches; reloaded credentials (a call, SIGHUP) serve new
links while old ones run out; expiry is warned of ahead, once, and measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import select
import signal
import socket
import ssl
import threading
import time

import numpy as np
import pytest

import kvlend.runtime.certificates
import kvlend.runtime.tls
from kvlend import prompt_digest
from kvlend.errors import AuthError, ConfigError, KvlendError, PeerLost, PromptMismatch
from kvlend.metrics import METRICS
from kvlend.protocol.ticket import Ticket
from kvlend.protocol.wire import Handshake
from kvlend.runtime import DecodeNode, NodeConfig, PrefillNode, reload_on_sighup
from kvlend.runtime.certificates import CertWatch
from kvlend.security.certs import Authority, save_rank
from kvlend.security.credentials import CERT_ENV, KEY_ENV, Credentials
from kvlend.testing.kvcache import SENTINEL, group_layers, make_layout, make_pools, pattern, prefill_request, slots
from tests.support.agents import nixl
from tests.support.certs import CA, creds
from tests.support.nodes import (
    DEADLINE,
    DECODE_CONFIG,
    DST_PAGES,
    SRC_PAGES,
    fetch_and_verify,
    free_lists,
    rig,
    wait_until,
)
from tests.support.wire import decode_all

pytestmark = pytest.mark.nixl

SHORT = NodeConfig(handshake_timeout=3.0)


class Relay:
    """A TCP relay between a decode and a prefill that keeps every byte it forwards."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.target = target
        self.captured = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(DEADLINE)
        a, _ = self.listener.accept()
        b = socket.create_connection(self.target, timeout=DEADLINE)
        with a, b, contextlib.suppress(OSError):  # a reset as the ranks close ends the relay too
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.05)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
                    self.captured += data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE)
        self.listener.close()


@contextlib.contextmanager
def lone_prefill(credentials: Credentials | None = None, pools: list | None = None):
    """A started prefill that no decode has connected to yet."""
    credentials = credentials or creds("prefill", "prefill")
    prefill = PrefillNode(make_layout(pools or make_pools(32)), nixl("prefill"), credentials)
    prefill.start()
    try:
        yield prefill
    finally:
        prefill.close()
        prefill.backend.close()


def _windows(blob: bytes, size: int = 32) -> list[bytes]:
    """Distinctive slices of ``blob``: ``size`` bytes with at least 8 distinct values (no zero runs)."""
    return [w for w in (blob[i:i + size] for i in range(0, len(blob) - size, size)) if len(set(w)) >= 8]


def test_a_capture_of_the_channel_holds_no_metadata_lease_id_or_request_data():
    src, dst = make_pools(SRC_PAGES), make_pools(DST_PAGES)
    with lone_prefill(pools=src) as prefill:
        relay = Relay(prefill.address)
        decode = DecodeNode(make_layout(dst), nixl("decode"), creds("decode", "decode"), config=DECODE_CONFIG)
        try:
            link = decode.connect(*relay.address)  # the decode's only way to the prefill is through the relay
            request, canary = "request-capture-7f3a", "meta-canary-c0ffee-91b2"
            tables = prefill_request(prefill.layout, src, free_lists(prefill.layout, SRC_PAGES, 3), 48, seed=9)
            lease = prefill.offer(prefill.wait_for_peer(DEADLINE), request, 48, tables,
                                  prefill.layout.full_selection(), meta={"seed": 9, "note": canary})
            got, offer = decode.next_offer(DEADLINE)
            assert got.id == link.id and offer.id == lease.id and offer.meta["note"] == canary
            assert fetch_and_verify(decode, got, offer, dst, free_lists(decode.layout, DST_PAGES, 4)).bound == 48
            needles = {"the lease id": lease.id, "the request id": request.encode(),
                       "the request meta": canary.encode()}
            for side, node in (("prefill", prefill), ("decode", decode)):
                needles[f"the {side}'s NIXL agent name"] = node.backend.name.encode()
                needles.update({f"{side} NIXL metadata bytes {i}": w
                                for i, w in enumerate(_windows(node.backend.metadata()))})
        finally:
            decode.close()
            decode.backend.close()
            relay.close()
    wire = bytes(relay.captured)
    assert len(wire) > 2000 and wire[:2] == b"\x16\x03", "the capture holds a TLS session"
    assert len(needles) > 10
    for what, needle in needles.items():
        assert needle not in wire, f"{what} crossed the wire in clear"


# ---------------------------------------------------------------- refusals
def _refused(prefill: PrefillNode, credentials: Credentials, match: str) -> None:
    """A decode with ``credentials`` gets no channel: ``AuthError`` naming why, and no peer on the prefill."""
    decode = DecodeNode(make_layout(make_pools(32)), nixl("decode"), credentials, config=SHORT)
    try:
        with pytest.raises(AuthError, match=match):
            decode.connect(*prefill.address)
        assert decode.links == []
    finally:
        decode.close()
        decode.backend.close()
    assert prefill.ready_peers() == []


def test_a_client_without_a_certificate_is_refused_before_any_message(caplog):
    caplog.set_level(logging.WARNING, "kvlend.session")
    with lone_prefill() as prefill:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(cadata=CA.cert_pem.decode())  # trusts the prefill, presents nothing
        with socket.create_connection(prefill.address, timeout=DEADLINE) as raw:
            with ctx.wrap_socket(raw) as tls:  # TLS 1.3: the client finishes before the server judges it
                with pytest.raises((ssl.SSLError, ConnectionError)) as err:
                    tls.recv(1024)
                assert "CERTIFICATE_REQUIRED" in str(err.value) or isinstance(err.value, ConnectionError)
        # the loop logs the refusal after the alert went out: wait for the record before closing the prefill
        wait_until(lambda: any("certificate" in r.getMessage().lower() for r in list(caplog.records)),
                   "the refusal was never logged")
        assert prefill.ready_peers() == []


def test_a_certificate_from_another_ca_is_refused_by_the_prefill():
    stranger = Authority.create("another cluster").issue("decode", "decode")
    with lone_prefill() as prefill:  # the stranger trusts our CA, but our CA did not issue its certificate
        _refused(prefill, Credentials(CA.cert_pem, stranger.cert_pem, stranger.key_pem), "UNKNOWN_CA|unknown ca")


def test_an_expired_certificate_is_refused():
    then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3)
    expired = CA.issue("decode-expired", "decode", days=1, valid_from=then)
    with pytest.raises(AuthError, match="valid from"):
        expired.check()  # a rank loading it fails at start; a peer presenting it anyway:
    with lone_prefill() as prefill:
        _refused(prefill, expired, "CERTIFICATE_EXPIRED|certificate expired")


def test_a_decode_refuses_a_prefill_it_cannot_verify():
    with lone_prefill(Authority.create("rogue").issue("prefill", "prefill")) as prefill:
        _refused(prefill, creds("decode", "decode"), "CERTIFICATE_VERIFY_FAILED")


def test_a_second_connection_presenting_a_live_peers_identity_is_refused():
    with rig() as r:
        twin = DecodeNode(make_layout(make_pools(DST_PAGES)), nixl("twin"), creds("decode", "decode"),
                          config=DECODE_CONFIG)
        try:
            with pytest.raises(AuthError, match="already connected"):
                twin.connect(*r.prefill.address)
        finally:
            twin.close()
            twin.backend.close()
        assert r.prefill.ready_peers() == ["decode"]
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 5), 16, seed=2)
        r.prefill.offer("decode", "after-twin", 16, tables, r.layout.full_selection(), meta={"seed": 2})
        link, offer = r.decode.next_offer(DEADLINE)  # the live peer kept its link
        assert fetch_and_verify(r.decode, link, offer, r.dst, free_lists(r.decode.layout, DST_PAGES, 6)).bound == 16


def test_identities_are_the_certificates_names_on_both_sides():
    with lone_prefill(creds("prefill-7", "prefill")) as prefill:
        decode = DecodeNode(make_layout(make_pools(32)), nixl("decode"), creds("decode-3", "decode"), config=SHORT)
        try:
            link = decode.connect(*prefill.address)
            assert link.peer == "prefill-7" and decode.name == "decode-3"
            assert prefill.wait_for_peer(DEADLINE) == "decode-3"
        finally:
            decode.close()
            decode.backend.close()


def test_handshakes_run_outside_the_serving_lock(monkeypatch):
    """TLS work (handshake, decryption) never holds the lock engine calls take."""
    owned: list[bool] = []
    nodes: list = []
    receive = kvlend.runtime.tls.TlsChannel.receive

    def watched(self, data):
        owned.extend(node._lock._is_owned() for node in nodes)
        return receive(self, data)

    monkeypatch.setattr(kvlend.runtime.tls.TlsChannel, "receive", watched)
    with lone_prefill() as prefill:
        decode = DecodeNode(make_layout(make_pools(32)), nixl("decode"), creds("decode", "decode"), config=SHORT)
        nodes += [prefill, decode]
        try:
            decode.connect(*prefill.address)
            prefill.wait_for_peer(DEADLINE)
        finally:
            decode.close()
            decode.backend.close()
    assert len(owned) >= 4 and not any(owned), owned


def test_credentials_of_the_wrong_type_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="Credentials"):
        PrefillNode(make_layout(make_pools(8)), None, b"a shared secret of old")


def test_a_ticket_is_read_only_from_the_prefill_it_names():
    """Identities bind tickets too: an endpoint whose certificate names another rank gets no claim."""
    with rig() as r:
        src_free = free_lists(r.layout, SRC_PAGES, 7)
        tables = prefill_request(r.layout, r.src, src_free, 16, seed=3)
        good = r.prefill.lend("ticketed", 16, tables, r.layout.full_selection(), meta={"seed": 3})
        forged = dataclasses.replace(good, prefill="prefill-elsewhere")
        dst = {name: np.arange(4) for name in r.decode.layout.groups}
        with pytest.raises(AuthError, match="prefill-elsewhere"):  # the open link is "prefill": refused at once
            r.decode.start_fetch(forged, dst)
        assert r.decode.in_flight == 0
        fresh = DecodeNode(make_layout(make_pools(DST_PAGES)), nixl("fresh"), creds("decode-fresh", "decode"),
                           config=DECODE_CONFIG)
        try:  # no link yet: the link's certificate is checked against the ticket when it authenticates
            handle = fresh.start_fetch(forged, dst)
            with pytest.raises(AuthError, match="authenticated as 'prefill'"):
                handle.wait(DEADLINE)
            assert fresh.links == []
        finally:
            fresh.close()
            fresh.backend.close()
        handle = r.decode.start_fetch(good, dst)  # the real ticket still reads
        assert handle.wait(DEADLINE).bound == 16


# ---------------------------------------------------------------------- roles
class TlsEndpoint:
    """A bare TLS 1.3 server holding ``credentials`` (any role): it completes the handshake with the one
    client that connects and keeps every plaintext byte it is sent, as a rank posing as a prefill would."""

    def __init__(self, credentials: Credentials) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self._context = credentials.context(server=True)
        self.received = bytearray()
        self.handshaken = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(DEADLINE)
        try:
            raw, _ = self.listener.accept()
            with self._context.wrap_socket(raw, server_side=True) as tls:
                self.handshaken.set()
                tls.settimeout(DEADLINE)
                while chunk := tls.recv(1 << 16):
                    self.received += chunk
        except (OSError, ssl.SSLError):
            pass  # the client hung up: what it sent before is in ``received``
        finally:
            self._done.set()

    def finished(self) -> bytes:
        """What the client sent, once it hung up."""
        assert self._done.wait(DEADLINE), "the client never hung up"
        return bytes(self.received)

    def close(self) -> None:
        self.listener.close()
        self._thread.join(DEADLINE)


def test_a_decode_certificate_posing_as_a_prefill_gets_no_handshake_and_no_node():
    """A rank holding a decode's certificate mints a ticket naming itself: the decode's TLS refuses the
    certificate's role before a byte of kvlend's protocol crosses, and no node runs on the wrong role."""
    poser = creds("decode-poser", "decode")
    _refuses_to_run(PrefillNode, poser, "--role prefill")
    endpoint = TlsEndpoint(poser)
    decode = decode_node(creds("decode-victim", "decode"), config=SHORT)
    try:
        ticket = Ticket(os.urandom(16), *endpoint.address, "decode-poser", 16, decode.layout.layout_id)
        handle = decode.start_fetch(ticket, {name: np.arange(4) for name in decode.layout.groups})
        with pytest.raises(AuthError, match="holds a decode certificate"):
            handle.wait(DEADLINE)
        assert endpoint.finished() == b"", "the decode sent a kvlend frame to a decode posing as a prefill"
        assert decode.links == []
    finally:
        decode.close()
        decode.backend.close()
        endpoint.close()


def test_a_prefill_certificate_cannot_connect_as_a_decode():
    _refuses_to_run(DecodeNode, creds("prefill-as-decode", "prefill"), "--role decode")
    with lone_prefill() as prefill:
        ctx = creds("prefill-as-decode", "prefill").context(server=False)  # and its raw TLS is refused
        with socket.create_connection(prefill.address, timeout=DEADLINE) as raw:
            with ctx.wrap_socket(raw) as tls:
                tls.settimeout(DEADLINE)
                with contextlib.suppress(ssl.SSLError, ConnectionError):
                    tls.sendall(b"x")  # whatever it sends, it only ever reads its end
                assert _closed(tls)
        assert prefill.ready_peers() == []


def _refuses_to_run(node_type, credentials: Credentials, match: str) -> None:
    backend = nixl("wrong-role")
    try:
        with pytest.raises(ConfigError, match=match):
            node_type(make_layout(make_pools(8)), backend, credentials)
    finally:
        backend.close()


def _closed(tls: ssl.SSLSocket) -> bool:
    try:
        return tls.recv(1024) == b""
    except (ssl.SSLError, ConnectionError):
        return True


def test_a_certificate_without_a_role_is_refused_with_how_to_reissue_it():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert = x509.load_pem_x509_certificate(CA.cert_pem)
    ca_key = serialization.load_pem_private_key(CA.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old-rank")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    old = Credentials(CA.cert_pem, cert.public_bytes(serialization.Encoding.PEM),
                      key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
    old.check()  # a valid certificate of the CA's, from before roles
    _refuses_to_run(PrefillNode, old, r"names no role .*kvlend certs issue old-rank --role ROLE")
    with lone_prefill() as prefill:  # presented by a peer: refused at its TLS handshake
        ctx = old.context(server=False)
        with socket.create_connection(prefill.address, timeout=DEADLINE) as raw:
            with ctx.wrap_socket(raw) as tls:
                tls.settimeout(DEADLINE)
                assert _closed(tls)
        assert prefill.ready_peers() == []


def test_the_decodes_handshake_carries_no_agent_metadata_nor_addresses():
    """What a prefill (or anyone holding a prefill's certificate) learns of a decode: its layout to negotiate
    with, never its NIXL agent metadata nor where its pools are."""
    endpoint = TlsEndpoint(creds("prefill-listening", "prefill"))
    decode = decode_node(creds("decode-speaking", "decode"), config=SHORT)
    try:
        with pytest.raises(KvlendError):
            decode.connect(*endpoint.address)  # it never answers: the handshake times out
        decode.close()  # hang up, so the endpoint sees the end of what was sent
        messages = decode_all(endpoint.finished())
        hello = [m for m in messages if isinstance(m, Handshake)]
        assert len(hello) == 1 and hello[0].metadata == b""
        sent = hello[0].page_layout()
        assert sent.layout_id == decode.layout.layout_id
        assert [r.address for r in sent.regions] == [0] * len(sent.regions)
        assert all(r.address for r in decode.layout.regions), "the decode's own layout has its addresses"
        agent = decode.backend.metadata()
        assert agent and agent not in endpoint.received
    finally:
        decode.close()
        decode.backend.close()
        endpoint.close()


# ------------------------------------------------- certificates over a link's life
LIFE = 5.0  # seconds a short-lived certificate lives: long enough for a handshake on a loaded host
PATIENT = NodeConfig(chunk_pages=8, handshake_timeout=DEADLINE, transfer_timeout=60.0)  # no fetch times out first


def brief(identity: str, seconds: float = LIFE) -> Credentials:
    """A certificate of ``identity`` (a prefill if its name says so) that expires ``seconds`` from now."""
    return CA.issue(identity, "prefill" if identity.startswith("prefill") else "decode",
                    expires=datetime.datetime.now(datetime.timezone.utc)
                    + datetime.timedelta(seconds=seconds))


def decode_node(credentials: Credentials, backend=None, dst: list | None = None,
                config: NodeConfig = PATIENT) -> DecodeNode:
    """A started decode over ``dst`` (``backend``: made first, so the credentials do not age while NIXL starts)."""
    dst = make_pools(DST_PAGES) if dst is None else dst
    decode = DecodeNode(make_layout(dst), backend or nixl("decode"), credentials, config=config)
    decode.pools = dst  # registered with NIXL: alive as long as the node
    decode.start()
    return decode


def live_fetch(prefill: PrefillNode, src: list, decode: DecodeNode, link, seed: int):
    """A fetch that stays in flight: a progressive lease of 48 tokens of which only 16 are ready."""
    tables = prefill_request(prefill.layout, src, free_lists(prefill.layout, SRC_PAGES, seed), 48, seed=seed)
    prefill.offer(decode.name, f"live-{seed}", 48, tables, prefill.layout.full_selection(), meta={"seed": seed},
                  ready=16)
    got, offer = decode.next_offer(DEADLINE)
    assert got.id == link.id
    return decode.start_fetch(offer, {name: np.arange(12) for name in decode.layout.groups}, link=got)


def test_a_link_closes_when_the_decodes_certificate_expires_and_its_read_fails():
    src = make_pools(SRC_PAGES)
    with lone_prefill(pools=src) as prefill:
        backend = nixl("decode")
        decode = decode_node(brief("decode-brief"), backend)
        try:
            link = decode.connect(*prefill.address)
            assert prefill.wait_for_peer(DEADLINE) == "decode-brief"
            handle = live_fetch(prefill, src, decode, link, seed=11)
            with pytest.raises(PeerLost):  # the prefill closed the link: the fetch ends, it does not hang
                handle.wait(LIFE + DEADLINE)
            wait_until(lambda: prefill.ready_peers() == [] and decode.links == [], "both ends dropped the link")
        finally:
            decode.close()
            backend.close()


def test_a_decode_closes_its_link_when_the_prefills_certificate_expires():
    src = make_pools(SRC_PAGES)
    decode = decode_node(creds("decode", "decode"))
    backend = nixl("prefill")
    prefill = PrefillNode(make_layout(src), backend, brief("prefill-brief"))
    prefill.start()
    try:
        link = decode.connect(*prefill.address)
        handle = live_fetch(prefill, src, decode, link, seed=12)
        with pytest.raises(AuthError, match="certificate of 'prefill-brief' expired at"):
            handle.wait(LIFE + DEADLINE)
        assert decode.links == []
        wait_until(lambda: prefill.ready_peers() == [], "the prefill dropped the link")
    finally:
        decode.close()
        decode.backend.close()
        prefill.close()
        backend.close()


def test_reloaded_credentials_serve_new_links_while_old_links_run_out_with_their_certificate():
    src, dst = make_pools(SRC_PAGES), make_pools(DST_PAGES)
    before, after = decode_node(creds("decode-before", "decode")), decode_node(creds("decode-after", "decode"), dst=dst)
    backend = nixl("prefill")
    prefill = PrefillNode(make_layout(src), backend, brief("prefill-renewed"))
    prefill.start()
    try:
        old = before.connect(*prefill.address)
        renewed = CA.issue("prefill-renewed", "prefill")
        assert prefill.reload_credentials(renewed) is renewed and prefill.credentials is renewed
        new = after.connect(*prefill.address)
        with pytest.raises(AuthError, match="expired"):  # the link made before runs out with the old certificate
            live_fetch(prefill, src, before, old, seed=13).wait(LIFE + DEADLINE)
        assert after.links == [new], "the link made after the reload presents the new certificate"
        free = free_lists(prefill.layout, SRC_PAGES, 14)
        tables = prefill_request(prefill.layout, src, free, 16, seed=14)
        prefill.offer("decode-after", "after-renewal", 16, tables, prefill.layout.full_selection(), meta={"seed": 14})
        link, offer = after.next_offer(DEADLINE)
        assert fetch_and_verify(after, link, offer, dst, free_lists(after.layout, DST_PAGES, 15)).bound == 16
    finally:
        for node in (before, after):
            node.close()
            node.backend.close()
        prefill.close()
        backend.close()


def test_a_reload_that_fails_its_checks_keeps_the_credentials_in_use():
    then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3)
    stranger = Authority.create("another cluster").issue("prefill", "prefill")
    with lone_prefill(creds("prefill", "prefill")) as prefill:
        before = prefill.credentials
        with pytest.raises(ConfigError, match="a node's identity cannot change"):
            prefill.reload_credentials(creds("prefill-other", "prefill"))
        with pytest.raises(AuthError, match="valid from"):
            prefill.reload_credentials(CA.issue("prefill", "prefill", days=1, valid_from=then))
        with pytest.raises(AuthError, match="not issued by the CA"):
            prefill.reload_credentials(Credentials(CA.cert_pem, stranger.cert_pem, stranger.key_pem))
        with pytest.raises(ConfigError, match="not loaded from files"):
            prefill.reload_credentials()  # nothing to read again
        assert prefill.credentials is before
        decode = decode_node(creds("decode", "decode"))
        try:
            assert decode.connect(*prefill.address).peer == "prefill"
        finally:
            decode.close()
            decode.backend.close()


def test_sighup_makes_a_node_present_its_renewed_certificate_files(tmp_path):
    decode = decode_node(creds("decode", "decode"))
    backend = nixl("prefill")
    env = save_rank(brief("prefill-hup", 3.0), str(tmp_path))
    old = Credentials.from_env(env)
    prefill = PrefillNode(make_layout(make_pools(32)), backend, old)
    prefill.start()
    previous = signal.getsignal(signal.SIGHUP)
    try:
        reload_on_sighup(prefill)
        renewed = CA.issue("prefill-hup", "prefill")
        for name, data in ((CERT_ENV, renewed.cert_pem), (KEY_ENV, renewed.key_pem)):
            (tmp_path / "next").write_bytes(data)
            os.replace(tmp_path / "next", env[name])  # as a renewal job would: the files in place, then SIGHUP
        os.kill(os.getpid(), signal.SIGHUP)
        wait_until(lambda: prefill.credentials.cert_pem == renewed.cert_pem, "the node reloaded its files")
        wait_until(lambda: time.time() > old.expires.timestamp(), "the old certificate expired", DEADLINE)
        assert decode.connect(*prefill.address).peer == "prefill-hup"  # a handshake only the new one passes
    finally:
        signal.signal(signal.SIGHUP, previous)
        decode.close()
        decode.backend.close()
        prefill.close()
        backend.close()


def _checks(monkeypatch) -> list[tuple[str, float]]:
    """Check certificates on every loop turn; each check's (node, wall time just before it)."""
    monkeypatch.setattr(kvlend.runtime.certificates, "CHECK_EVERY", 0.0)
    seen: list[tuple[str, float]] = []
    expired = CertWatch.expired

    def watched(self, channels, warning):
        seen.append((self.name, time.time()))
        return expired(self, channels, warning)

    monkeypatch.setattr(CertWatch, "expired", watched)
    return seen


def _gauge(name: str, node: str) -> float | None:
    return METRICS.snapshot()[name].get((node,))


def test_certificates_near_their_end_are_warned_of_once_and_measured(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvlend.node")
    seen = _checks(monkeypatch)
    warn = NodeConfig(cert_warning=3 * 3600.0)
    with pytest.raises(ConfigError, match="cert_warning"):
        NodeConfig(cert_warning=-1.0)

    def in_hours(identity, hours):
        return CA.issue(identity, "prefill" if identity.startswith("prefill") else "decode",
                        expires=datetime.datetime.now(datetime.timezone.utc)
                        + datetime.timedelta(hours=hours))

    decode = decode_node(in_hours("decode-soon", 1.5), config=warn)
    backend = nixl("prefill")
    prefill = PrefillNode(make_layout(make_pools(32)), backend, in_hours("prefill-soon", 2.5), config=warn)
    prefill.start()
    try:
        decode.connect(*prefill.address)
        prefill.wait_for_peer(DEADLINE)
        wait_until(lambda: 5300 < (_gauge("kvlend_peer_cert_expiry_seconds", "prefill-soon") or 0) <= 5400
                   and 8900 < (_gauge("kvlend_peer_cert_expiry_seconds", "decode-soon") or 0) <= 9000,
                   "each side measures its peer's certificate")
        assert 8900 < _gauge("kvlend_cert_expiry_seconds", "prefill-soon") <= 9000
        assert 5300 < _gauge("kvlend_cert_expiry_seconds", "decode-soon") <= 5400
        done = len(seen)
        wait_until(lambda: all(sum(n == name for n, _ in seen[done:]) >= 5 for name in ("prefill-soon",
                                                                                        "decode-soon")),
                   "five more checks on each side")
    finally:
        decode.close()
        decode.backend.close()
        prefill.close()
        backend.close()
    assert _gauge("kvlend_cert_expiry_seconds", "prefill-soon") is None, "a closed node's gauges go"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "kvlend.node"]
    for text in ("prefill-soon: this rank's certificate expires in 2.5 h",
                 "prefill-soon: the certificate of peer decode-soon expires in 1.5 h",
                 "decode-soon: this rank's certificate expires in 1.5 h",
                 "decode-soon: the certificate of peer prefill-soon expires in 2.5 h"):
        assert sum(m.startswith(text) for m in warnings) == 1, (text, warnings)


def test_a_rank_whose_own_certificate_expired_says_so_loudly(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "kvlend.node")
    seen = _checks(monkeypatch)
    backend = nixl("decode")
    credentials = brief("decode-lapsed", 2.0)
    end = credentials.expires.timestamp()
    decode = decode_node(credentials, backend)
    try:
        wait_until(lambda: sum(n == "decode-lapsed" and t > end for n, t in seen) >= 5, "checks after its expiry")
        assert _gauge("kvlend_cert_expiry_seconds", "decode-lapsed") < 0
    finally:
        decode.close()
        backend.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert sum(m.startswith("decode-lapsed: this rank's certificate expired at") for m in errors) == 1, errors
@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_ticket_for_one_prompt_writes_no_byte_into_another_prompts_pages(read_ahead):
    """Issue 22, finding 4: a ticket put on another prompt (leaked, guessed, sent by a client) is refused
    by the prefill before any read is posted, even by a decode that reads ahead; the lease stays live
    and its own prompt's fetch then reads it byte for byte."""
    tokens, seed = 32, 5
    mine, theirs = prompt_digest(range(tokens)), prompt_digest(range(1000, 1000 + tokens))
    with rig() as r:
        tables = prefill_request(r.layout, r.src, free_lists(r.layout, SRC_PAGES, 8), tokens, seed=seed)
        ticket = r.prefill.lend("prompt-a", tokens, tables, r.layout.full_selection(), prompt_digest=mine)
        assert ticket.pages is None  # a bound lease's ticket names no pages to read ahead from ...
        lease = r.prefill.lender.get(ticket.lease, r.prefill.clock())
        forged = ticket.with_pages(lease.pages)  # ... and a decode bound to its prompt ignores forged ones
        assert forged.pages is not None
        pools = make_pools(DST_PAGES)
        for pool in pools:
            pool[...] = SENTINEL
        decode = DecodeNode(make_layout(pools), nixl("thief"), creds("decode-thief", "decode"),
                            config=dataclasses.replace(DECODE_CONFIG, read_ahead=read_ahead))
        try:
            free = free_lists(decode.layout, DST_PAGES, 9)
            dst = {name: free[name].alloc(tokens // decode.layout.tokens_per_page) for name in decode.layout.groups}
            for digest in (theirs, None):
                handle = decode.start_fetch(forged if digest else ticket, dst, prompt_digest=digest)
                with pytest.raises(PromptMismatch):
                    handle.wait(DEADLINE)
                assert handle.bound == 0
                assert all((pool == SENTINEL).all() for pool in pools), "a refused claim wrote into the pages"
            assert r.released == []  # the lease is still its prompt's to read
            assert decode.start_fetch(ticket, dst, prompt_digest=mine).wait(DEADLINE).bound == tokens
            for name, table in dst.items():
                for layer in group_layers(decode.layout, name):
                    got = slots(pools[layer])[table]
                    np.testing.assert_array_equal(got, pattern(seed, layer, len(table), got.shape[1]))
        finally:
            decode.close()
            decode.backend.close()
