"""The lab's hosts, their addresses and the ranks each run places on them.

Pairs (the default): prefill p0 -> decode TP2 on d0, prefill p1 -> decode d1.  Cluster (``--cluster``):
prefills p0 and p1, decodes d0 and d1, etcd on e0.  Addresses 10.77.0.0/24 exist only inside the
namespaces.
"""

from __future__ import annotations

PORT = 47000
HOSTS = ("p0", "p1", "d0", "d1")
ADDR = {h: f"10.77.0.{10 + i}" for i, h in enumerate(HOSTS)}
ADDR["e0"] = "10.77.0.5"
RANKS = ("A-prefill", "B-prefill", "A-decode0", "A-decode1", "B-decode0")

CLUSTER_HOSTS = ("e0", "p0", "p1", "d0", "d1")
PREFILLS = ("p0", "p1")
DECODES = ("d0", "d1")
CLUSTER_RANKS = tuple(f"{h}-prefill" for h in PREFILLS) + tuple(f"{h}-decode" for h in DECODES)
REGISTRY_TTL = 2.0


def rank_of(host: str) -> str:
    return f"{host}-prefill" if host in PREFILLS else f"{host}-decode"


def host_of(identity: str) -> str:
    return identity.split("-", 1)[0]
