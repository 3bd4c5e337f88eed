"""How a rank reaches etcd: endpoints, etcd's own auth and TLS from the ``KVLEND_ETCD_*`` variables, and
the TLS client that aetcd lacks."""

from __future__ import annotations

import functools
from typing import Mapping

from ..errors import RegistryError

ETCD_USER_ENV = "KVLEND_ETCD_USER"
ETCD_PASSWORD_ENV = "KVLEND_ETCD_PASSWORD"
ETCD_CA_ENV = "KVLEND_ETCD_CA"
ETCD_CERT_ENV = "KVLEND_ETCD_CERT"
ETCD_KEY_ENV = "KVLEND_ETCD_KEY"


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistryError(f"etcd endpoint {text!r}: expected host:port")
    return host, int(port)


def etcd_security_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``Registry`` keyword arguments for etcd's own auth and TLS from the ``KVLEND_ETCD_*`` variables
    (unset or empty ones left out, so ``Registry`` refuses half a pair)."""
    import os

    env = os.environ if environ is None else environ
    found = {"username": env.get(ETCD_USER_ENV), "password": env.get(ETCD_PASSWORD_ENV),
             "ca_file": env.get(ETCD_CA_ENV), "cert_file": env.get(ETCD_CERT_ENV), "key_file": env.get(ETCD_KEY_ENV)}
    return {name: value for name, value in found.items() if value}


def read_pem(ca_file: str, cert_file: str | None, key_file: str | None) -> tuple[bytes, bytes | None, bytes | None]:
    """The PEM bytes of etcd's CA and our client pair, read once (``RegistryError`` naming a missing one)."""
    out = []
    for name, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        try:
            out.append(None if path is None else open(path, "rb").read())
        except OSError as exc:
            raise RegistryError(f"etcd {name} {path!r}: {exc.strerror or exc}") from None
    return out[0], out[1], out[2]


@functools.lru_cache(maxsize=1)
def tls_client(aetcd):
    """``aetcd.Client`` over TLS: aetcd itself only opens plaintext channels, so ``connect`` is its own,
    the same steps over ``grpc.aio.secure_channel``."""
    import grpc

    class TlsClient(aetcd.Client):
        kvlend_tls: tuple[bytes, bytes | None, bytes | None]

        async def connect(self) -> None:
            if self._connected.is_set():
                return
            ca, cert, key = self.kvlend_tls
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            self.channel = aetcd.rpc.secure_channel(f"{self._host}:{self._port}", credentials,
                                                    options=self._options.items())
            try:
                if self._username is not None:
                    self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                    request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                    reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                    self.metadata = (("token", reply.token),)
            except aetcd.rpc.AioRpcError as exc:
                aetcd.exceptions._handle_exception(exc)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout,
                                                  metadata=self.metadata)
            self._connected.set()

    return TlsClient
