"""Signed registry records (``kvlend.cluster.signing``): what a reader accepts, and what it refuses before
fetching anything a record names.

Each refusal is one way an etcd writer could try to pass a record off as a rank's: no signature, a
certificate from another CA, a decode certificate signing a prefill record, a valid certificate of
another identity, a field changed after signing, a certificate out of its validity.
"""

from __future__ import annotations

import base64
import datetime
import json

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvlend.cluster import JOINED, Change, ClusterView, RankRecord, record_key
from kvlend.cluster.records import layout_digest
from kvlend.cluster.signing import DOMAIN, VERIFIED_KEPT, RecordSigner, RecordVerifier
from kvlend.errors import RegistryError
from kvlend.security.certs import Authority
from kvlend.testing.kvcache import make_layout, make_pools

pytestmark = pytest.mark.unit

PREFIX = "/kvlend/sign"
CA = Authority.create()
OTHER_CA = Authority.create("another cluster's CA")
P0 = CA.issue("p0", "prefill")
P1 = CA.issue("p1", "prefill")
D0 = CA.issue("d0", "decode")
LAYOUT = make_layout(make_pools(4)).encode()
DIGEST = layout_digest(LAYOUT)


def rec(identity: str = "p0", role: str = "prefill", **kw) -> RankRecord:
    return RankRecord(identity, role, "10.0.0.1", 7000 if role == "prefill" else 0, layout=LAYOUT, **kw)


def forge(body: dict, credentials) -> bytes:
    """A value signed as ``RecordSigner`` signs, over any body, with any key: what a forger can make."""
    body = {**body, "cert": credentials.cert_pem.decode()}
    key = serialization.load_pem_private_key(credentials.key_pem, password=None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    body["sig"] = base64.b64encode(key.sign(DOMAIN + canonical, ec.ECDSA(hashes.SHA256()))).decode()
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def body(record: RankRecord, **fields) -> dict:
    return {**json.loads(record.encode()), **fields}


def view() -> ClusterView:
    v = ClusterView(PREFIX, RecordVerifier(CA.cert_pem))
    v.learn_layout(DIGEST, LAYOUT)
    return v


def key(identity: str) -> bytes:
    return record_key(PREFIX, identity).encode()


def test_a_rank_signed_record_is_accepted_and_reads_back_as_published():
    value = RecordSigner(P0).sign(rec(capacity=8, load=3))
    v = view()
    assert v.put(1, key("p0"), value) == [Change(JOINED, rec(capacity=8, load=3))]
    assert "cert" in json.loads(value) and "sig" in json.loads(value)  # readable with etcdctl, as before


@pytest.mark.parametrize("value, why", [
    (rec().encode(), "not signed"),
    (forge(body(rec()), OTHER_CA.issue("p0", "prefill")), "not issued by the cluster CA"),
    (forge(body(rec()), D0), "signed by the decode certificate of 'd0'"),  # a decode posing as a prefill
    (forge(body(rec(), identity="p0", role="prefill"), CA.issue("p0", "decode")), "signed by the decode"),
    (forge(body(rec()), P1), "signed by the prefill certificate of 'p1'"),  # another identity's valid cert
    (json.dumps({**json.loads(forge(body(rec()), P0)), "sig": json.loads(forge(body(rec(load=1)), P0))["sig"]})
     .encode(), "signature does not match"),  # P0's own signature, of another record
    (forge(body(rec()), P0).replace(b'"capacity":1', b'"capacity":65536'), "signature does not match"),
    (json.dumps({**json.loads(forge(body(rec()), P0)), "cert": "x"}).encode(), "not issued"),
    (json.dumps({**json.loads(forge(body(rec()), P0)), "sig": "!!"}).encode(), "not base64"),
    (b"\xff" * 10, "not JSON"),
    (b"[1]", "not a JSON object"),
])
def test_forged_unsigned_or_wrongly_signed_records_are_refused_naming_why(value, why):
    v = view()
    assert v.put(1, key("p0"), value) == [] and v.get("p0") is None
    assert why in v.rejected[record_key(PREFIX, "p0")]
    assert v.wanted_layout(value.replace(DIGEST.encode(), b"a" * 64)) is None  # its layout is never fetched


def test_a_signer_refuses_a_record_that_is_not_its_own():
    with pytest.raises(RegistryError, match="cannot sign"):
        RecordSigner(D0).sign(rec("p0"))
    with pytest.raises(RegistryError, match="cannot sign"):
        RecordSigner(P0).sign(rec("p1"))


def test_a_forged_write_over_a_live_rank_keeps_its_signed_record_and_its_capacity():
    v = view()
    v.put(1, key("p0"), RecordSigner(P0).sign(rec(capacity=2)))
    forged = rec(capacity=65536).encode()  # the filer's 5-of-6 router picks
    assert v.put(2, key("p0"), forged) == [] and v.get("p0").capacity == 2
    assert v.put(3, key("p9"), forged.replace(b'"p0"', b'"p9"')) == [] and v.get("p9") is None
    assert [r.identity for r in v.ranks("prefill")] == ["p0"]


def test_certificates_are_checked_against_the_wall_clock_given():
    now = [datetime.datetime.now(datetime.timezone.utc)]
    verifier = RecordVerifier(CA.cert_pem, clock=lambda: now[0])
    short = CA.issue("p0", "prefill", expires=now[0] + datetime.timedelta(hours=1))
    value = RecordSigner(short).sign(rec())
    verifier.verify(value)
    now[0] += datetime.timedelta(hours=2)  # lapsed: refused even though its check is cached
    with pytest.raises(RegistryError, match="not now"):
        verifier.verify(value)
    future = CA.issue("p0", "prefill", valid_from=now[0] + datetime.timedelta(days=1))
    with pytest.raises(RegistryError, match="not now"):
        verifier.verify(RecordSigner(future).sign(rec()))


def test_each_distinct_value_is_verified_once_and_the_cache_is_bounded():
    verifier = RecordVerifier(CA.cert_pem)
    value, forged = RecordSigner(P0).sign(rec()), rec().encode()
    for _ in range(50):
        verifier.verify(value)
        with pytest.raises(RegistryError):
            verifier.verify(forged)
    assert verifier.checks == 1  # the forged one never reaches a signature check: it has none
    signer = RecordSigner(P0)
    for load in range(VERIFIED_KEPT + 10):
        verifier.verify(signer.sign(rec(load=load % 1000, capacity=1000 + load // 1000)))
    assert len(verifier._done) == VERIFIED_KEPT and len(verifier._certs) == 1


def test_a_reader_needs_a_cluster_ca():
    with pytest.raises(RegistryError, match="cluster CA"):
        RecordVerifier(b"not a certificate")
