"""What a cluster rank tells the driver: whole lines on stdout, registry events with wall-clock times."""

from __future__ import annotations

import sys
import threading
import time

from kvlend.cluster.registry import Registry, cluster_ca_from_env, etcd_security_from_env
from kvlend.cluster.view import JOINED, LEFT

_SAY = threading.Lock()


def say(*words) -> None:
    """One whole line on stdout, even from several threads (the driver parses these)."""
    with _SAY:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


class Watch:
    """Registry events with wall-clock times: logged as they come, and kept for the report."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="registry-watch", daemon=True)

    def start(self) -> Watch:
        self.registry.add_listener(self._changes)
        self._thread.start()
        return self

    def _add(self, event: str, identity: str = "") -> None:
        at = time.time()
        with self._lock:
            self.events.append({"event": event, "identity": identity, "at": at})
        say("REGISTRY", event.upper(), identity or "-", f"{at:.3f}")

    def _changes(self, changes) -> None:  # the registry thread: quick, never blocks
        for change in changes:
            if change.kind in (JOINED, LEFT):
                self._add(change.kind, change.record.identity)

    def _poll(self) -> None:
        """Degraded and recovered, as the rank sees them (the registry logs its reason too)."""
        was = False
        while not self._stop.wait(0.05):
            now = self.registry.degraded
            if now != was:
                self._add("degraded" if now else "recovered")
                was = now

    def close(self) -> list[dict]:
        self._stop.set()
        self._thread.join(1.0)
        self.registry.remove_listener(self._changes)
        with self._lock:
            return list(self.events)


def open_registry(args) -> Registry:
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    return Registry(endpoints, args.prefix, cluster_ca=cluster_ca_from_env(), ttl=args.registry_ttl,
                    timeout=args.registry_timeout, **etcd_security_from_env()).start()
