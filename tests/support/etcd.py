"""etcd as a foreign writer sees it: a plain aetcd client, no ``Registry`` between."""

from __future__ import annotations

import asyncio

import aetcd

from kvlend.cluster.etcd_client import read_pem, tls_client
from kvlend.cluster.etcd_members import EtcdMembers
from kvlend.cluster.records import RankRecord, layout_key, record_key

WAIT = 5.0  # the most any single call may take


class Raw:
    """A plain aetcd client: what a foreign writer, a broken rank or ``etcdctl`` does, no ``Registry`` between.

    ``etcd``: the members (``member``'s endpoint, with their client certificate: an etcd writer, who
    need not be a rank), or one endpoint (plaintext)."""

    def __init__(self, etcd: EtcdMembers | str, member: int = 0) -> None:
        endpoint = etcd if isinstance(etcd, str) else etcd.endpoints[member]
        tls = None if isinstance(etcd, str) else etcd.client_tls
        self.tls = None if tls is None else read_pem(tls["ca_file"], tls["cert_file"], tls["key_file"])
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host, int(port)

    def run(self, fn, timeout: float = WAIT):
        async def go():
            kind = aetcd.Client if self.tls is None else tls_client(aetcd)
            client = kind(self.host, self.port, timeout=2, connect_wait_timeout=2)
            client.kvlend_tls = self.tls
            await client.connect()
            try:
                return await fn(client)
            finally:
                await client.close()
        return asyncio.run(asyncio.wait_for(go(), timeout))

    def put(self, key: str, value: bytes) -> None:
        self.run(lambda c: c.put(key.encode(), value))

    def put_record(self, prefix: str, record: RankRecord, value: bytes | None = None) -> None:
        """A record as a rank writes it: its layout under ``layouts/<digest>``, then ``value`` (default the
        record unsigned: a forgery)."""
        self.put(layout_key(prefix, record.layout_digest), record.layout)
        self.put(record_key(prefix, record.identity), record.encode() if value is None else value)

    def delete(self, key: str) -> None:
        self.run(lambda c: c.delete(key.encode()))

    def get(self, key: str):
        return self.run(lambda c: c.get(key.encode()))

    def revoke(self, lease: int) -> None:
        self.run(lambda c: c.revoke_lease(lease))

    def lease_alive(self, lease: int) -> bool:
        """etcd answers TTL -1 for a lease it does not hold (remaining seconds round down: 0 is alive)."""
        return self.run(lambda c: c.get_lease_info(lease, keys=False)).TTL >= 0
