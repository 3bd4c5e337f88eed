"""Start and stop etcd members on loopback, for the demo, the scripts and the tests.

Tooling, not library: ``EtcdMembers(n)`` runs ``n`` members of one cluster
on free loopback ports, each in its own session (``setsid``), so a
wrapper's ``timeout`` or a terminal's SIGINT never reaches it, and stops
each by its PID on every exit path (``close`` is idempotent; it also runs
from ``atexit``).  Fast raft timings (heartbeat 10 ms, election 100 ms) make
a single member healthy in about 0.1 s and a leader failover take well
under a second.  The binary is ``$KVLEND_ETCD`` or ``etcd`` on PATH
(Debian's ``etcd-server``, which ``scripts/setup`` installs).

As production etcd runs, members serve clients over TLS only and ask each
for a certificate from the cluster CA (``--client-cert-auth
--trusted-ca-file``): ``authority`` (a throwaway one by default, in
``self.authority``) signs the members' server certificate, a rank connects
with its own rank certificate (``Registry(etcd_credentials=...)``), and
``client_tls`` names the files of a ``router``-role client certificate for
tools.  A client without a certificate from that CA is refused.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from ..errors import RegistryError
from ..ports import spare_ports
from ..security.certs import Authority

START_TIMEOUT = 20.0


def etcd_binary() -> str:
    path = (os.environ.get("KVLEND_ETCD") or shutil.which("etcd")
            or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None))
    if not path:
        raise RegistryError("etcd is not installed: run scripts/setup (it installs Debian's etcd-server) "
                            "or set KVLEND_ETCD to an etcd binary")
    return path


class EtcdMembers:
    """``n`` etcd members of one fresh cluster on 127.0.0.1; ``endpoints`` are their client URLs' host:port."""

    def __init__(self, n: int = 1, workdir: str | None = None, host: str = "127.0.0.1",
                 authority: Authority | None = None) -> None:
        if not 1 <= n <= 7:
            raise RegistryError(f"etcd members: expected 1..7, got {n}")
        self.binary = etcd_binary()
        self.host = host
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvlend-etcd-")
        ports = spare_ports(2 * n, host)
        self.client_ports, self.peer_ports = ports[:n], ports[n:]
        self.names = [f"m{i}" for i in range(n)]
        self.cluster = ",".join(f"{m}=http://{host}:{p}" for m, p in zip(self.names, self.peer_ports))
        self.procs: list[subprocess.Popen | None] = [None] * n
        self._started = [False] * n
        atexit.register(self.close)
        self.client_tls: dict[str, str] = {}  # ca_file, cert_file, key_file for a client
        self._server_tls: list[str] = []
        self.authority = authority
        try:
            self._make_tls()
            for i in range(n):
                self.start(i)
            self.wait_healthy(range(n))
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.client_ports]

    def start(self, i: int) -> None:
        """Start (or restart, with its data intact) member ``i``."""
        if self.procs[i] is not None and self.procs[i].poll() is None:
            return
        name, client, peer = self.names[i], self.client_ports[i], self.peer_ports[i]
        cmd = [self.binary, "--name", name, "--data-dir", os.path.join(self.workdir, name),
               "--listen-client-urls", f"https://{self.host}:{client}",
               "--advertise-client-urls", f"https://{self.host}:{client}", *self._server_tls,
               "--listen-peer-urls", f"http://{self.host}:{peer}",
               "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
               "--initial-cluster", self.cluster,
               "--initial-cluster-state", "existing" if self._started[i] else "new",
               "--heartbeat-interval", "10", "--election-timeout", "100"]
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        try:
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._started[i] = True

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data dir stays, so ``start(i)`` brings it back)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def _get(self, i: int, path: str, body: dict | None = None, timeout: float = 1.0) -> dict:
        context = ssl.create_default_context(cafile=self.client_tls["ca_file"])
        context.load_cert_chain(self.client_tls["cert_file"], self.client_tls["key_file"])
        url = f"https://{self.host}:{self.client_ports[i]}{path}"
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout, context=context) as r:
            return json.loads(r.read())

    def _make_tls(self) -> None:
        """A server certificate for ``host`` and a client one from ``authority``, as PEM files in the work dir."""
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = datetime.datetime.now(datetime.timezone.utc)

        if self.authority is None:
            self.authority = Authority.create("kvlend etcd CA (throwaway)")
        issuer = (x509.load_pem_x509_certificate(self.authority.cert_pem),
                  serialization.load_pem_private_key(self.authority.key_pem, password=None))

        def make(name: str, san):
            key = ec.generate_private_key(ec.SECP256R1())
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
            cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer[0].subject)
                    .public_key(key.public_key()).serial_number(x509.random_serial_number())
                    .not_valid_before(now - datetime.timedelta(hours=1))
                    .not_valid_after(now + datetime.timedelta(days=7))
                    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                    .add_extension(x509.ExtendedKeyUsage(  # client too: etcd's gateway dials its own gRPC with it
                        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                    .add_extension(x509.SubjectAlternativeName(san), critical=False)
                    .sign(issuer[1], hashes.SHA256()))
            return cert, key

        def write(name: str, data: bytes) -> str:
            path = os.path.join(self.workdir, name)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(data)
            return path

        def pem(cert, key, name: str) -> tuple[str, str]:
            return (write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                    write(f"{name}.key", key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption())))

        try:
            address = x509.IPAddress(ipaddress.ip_address(self.host))
        except ValueError:
            address = x509.DNSName(self.host)
        server = pem(*make("etcd", [address, x509.DNSName("localhost")]), "server")
        tool = self.authority.issue("etcd-client", "router")
        client = (write("client.pem", tool.cert_pem), write("client.key", tool.key_pem))
        ca_file = write("ca.pem", self.authority.cert_pem)
        self._server_tls = ["--cert-file", server[0], "--key-file", server[1], "--trusted-ca-file", ca_file,
                            "--client-cert-auth"]
        self.client_tls = {"ca_file": ca_file, "cert_file": client[0], "key_file": client[1]}

    def healthy(self, i: int) -> bool:
        try:
            return self._get(i, "/health").get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, members, timeout: float = START_TIMEOUT) -> None:
        members = list(members)
        deadline = time.monotonic() + timeout
        while not all(self.healthy(i) for i in members):
            for i in members:
                if not self.alive(i):
                    raise RegistryError(f"etcd member {self.names[i]} exited: {self._tail(i)}")
            if time.monotonic() > deadline:
                raise RegistryError(f"etcd members {[self.names[i] for i in members]} not healthy within "
                                    f"{timeout:g} s: {self._tail(members[0])}")
            time.sleep(0.05)

    def leader(self, timeout: float = 5.0) -> int:
        """Index of the member that leads now (waits for an election, up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(len(self.procs)):
                if not self.alive(i):
                    continue
                try:
                    status = self._get(i, "/v3/maintenance/status", {})
                except (OSError, ValueError, urllib.error.URLError):
                    continue
                if status.get("leader") and status.get("leader") == status.get("header", {}).get("member_id"):
                    return i
            if time.monotonic() > deadline:
                raise RegistryError(f"no etcd leader within {timeout:g} s")
            time.sleep(0.05)

    def _tail(self, i: int) -> str:
        try:
            with open(os.path.join(self.workdir, f"{self.names[i]}.log"), "rb") as f:
                return f.read()[-600:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> EtcdMembers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _command(members: EtcdMembers, line: str) -> dict:
    """One stdin command of the command line below, answered as a JSON-able dict."""
    words = line.split()
    verb, rest = (words[0], words[1:]) if words else ("", [])

    def index() -> int:
        if len(rest) != 1 or not rest[0].isdigit() or not 0 <= int(rest[0]) < len(members.procs):
            raise RegistryError(f"{verb}: expected a member index in [0, {len(members.procs)}), got {' '.join(rest)!r}")
        return int(rest[0])

    if verb == "leader":
        return {"leader": members.leader()}
    if verb == "kill":
        i = index()
        members.kill(i)
        return {"killed": i}
    if verb == "start":
        i = index()
        members.start(i)
        return {"started": i, "pid": members.procs[i].pid}
    if verb == "kill-leader":
        i = members.leader()
        members.kill(i)
        return {"killed": i, "leader": i}
    if verb == "status":
        return {"members": [{"index": i, "name": members.names[i], "endpoint": members.endpoints[i],
                             "alive": members.alive(i), "healthy": members.alive(i) and members.healthy(i)}
                            for i in range(len(members.procs))]}
    raise RegistryError(f"unknown command {line.strip()!r}: expected leader, kill I, start I, kill-leader, "
                        "status or quit")


def main(argv=None) -> int:
    """``python -m kvlend.cluster.etcd_members``: run members and take commands on stdin, one per line.

    Prints ``{"endpoints": [...], "pids": [...]}`` once the members are healthy, then one JSON line
    per command (``{"error": ...}`` for a bad one).  ``quit``, end of input, SIGTERM or SIGINT stop
    every member, so a driver that dies takes its etcd with it.  Run it where its ``--host`` is
    reachable (inside the network namespace that holds the address): the health checks run from here.
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m kvlend.cluster.etcd_members", description=main.__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=1, help="members of the cluster, 1..7 (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address every member listens on (default 127.0.0.1)")
    p.add_argument("--workdir", help="data and log directory (default: a fresh temporary one, removed at exit)")
    p.add_argument("--ca", required=True, metavar="DIR", help="the cluster CA (ca.pem, ca.key): it issues the "
                   "members' server certificate, and clients must present one of its certificates")
    args = p.parse_args(argv)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        if args.workdir:
            os.makedirs(args.workdir, exist_ok=True)
        members = EtcdMembers(args.members, workdir=args.workdir, host=args.host, authority=Authority.load(args.ca))
    except (RegistryError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    try:
        print(json.dumps({"endpoints": members.endpoints, "pids": [proc.pid for proc in members.procs]}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            if line.strip() == "quit":
                break
            try:
                answer = _command(members, line)
            except RegistryError as exc:
                answer = {"error": str(exc)}
            print(json.dumps(answer), flush=True)
    finally:
        members.close()
    print(json.dumps({"quit": True}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
