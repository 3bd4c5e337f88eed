"""One rank of the cluster loopback (``scripts/multinode-loopback --cluster``): N prefills x M decodes, etcd.

``--role prefill`` publishes its record in etcd (``kvlend.cluster.registry``)
with the address of a small HTTPS API in its ``meta``; ``POST /prefill
{"request": id, "tokens": n}`` fills free page slots with that request's KV
and lends them under a ticket, freed when the lease ends (503 when no slots
are free).  ``--role decode`` finds the prefills through etcd alone (no
address is given), routes each request to the least loaded one
(``kvlend.cluster.router.Router``), redeems the ticket and checks every
byte; a typed failure (a ``KvlendError``, or the API's HTTP or connection
error) is retried once on another prefill.

A request's KV is derived from the request id (and the seed, layer and
K/V), never from which prefill made it or where: bytes from any prefill
verify, and bytes from the wrong pages or the wrong request do not.

Both roles log registry events on stdout as they happen, with the wall
clock (the driver's namespaces share the kernel's): ``REGISTRY JOINED|LEFT
<identity> <t>``, ``REGISTRY DEGRADED|RECOVERED <t>``; a decode also logs
``SERVED`` and ``FAILED`` per request.  Each rank writes one JSON result
(``--report``) before it tears NIXL down.  Credentials: ``$KVLEND_CA``,
``$KVLEND_CERT``, ``$KVLEND_KEY`` (the rank's identity is its certificate's).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from cluster.decode import run_decode  # examples/, this script's folder
from cluster.prefill import run_prefill
from kvlend.demo.workload import run_rank
from kvlend.security.credentials import Credentials


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Environment: KVLEND_CA, KVLEND_CERT, KVLEND_KEY name the cluster CA "
                                       "certificate, this rank's certificate (its identity) and its key.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--etcd", required=True, metavar="HOST:PORT,...", help="etcd client endpoints")
    p.add_argument("--prefix", default="/kvlend/loopback", help="the cluster's registry prefix")
    p.add_argument("--registry-ttl", type=float, default=2.0, help="seconds a dead rank's record outlives it")
    p.add_argument("--registry-timeout", type=float, default=1.0, help="deadline of each etcd call (s)")
    p.add_argument("--host", default="127.0.0.1", help="prefill: address to listen on (control and API)")
    p.add_argument("--port", type=int, default=47000, help="prefill: control port")
    p.add_argument("--api-port", type=int, default=47001, help="prefill: HTTPS API port")
    p.add_argument("--prefills", type=int, default=1, help="decode: prefills to discover before the first request")
    p.add_argument("--concurrency", type=int, default=4, help="decode: requests in flight")
    p.add_argument("--requests", type=int, default=16, help="decode: requests to serve (0: until --stop-file)")
    p.add_argument("--stop-file", help="decode: start no request once this file exists; prefill: stop serving")
    p.add_argument("--pause", type=float, default=0.0, help="decode: seconds each worker waits between requests")
    p.add_argument("--serve", type=float, default=300.0, help="seconds to serve at most")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-page", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=256, help="prefill pages per pool")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="registry, discovery and handshake deadline (s)")
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="one request's deadline, API and fetch (s)")
    p.add_argument("--ttl", type=float, default=10.0, help="lease lifetime without a heartbeat (s)")
    p.add_argument("--report", help="write the JSON result to this file too")
    args = p.parse_args(argv)
    credentials = Credentials.from_env()
    logging.basicConfig(level=os.environ.get("KVLEND_LOG", "WARNING"),
                        format=f"{credentials.identity} %(levelname)s %(name)s: %(message)s")
    return (run_prefill if args.role == "prefill" else run_decode)(args, credentials)


if __name__ == "__main__":
    sys.exit(run_rank(main, "cluster_rank"))
