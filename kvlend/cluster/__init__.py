"""The cluster plane: rank records and the live view (pure), and the etcd registry around them.

``records`` and ``view`` are pure, ``router`` only reads a registry's view; ``registry`` (the etcd client, ``aetcd``)
and ``etcd_members`` (local etcd processes) do I/O and are imported on use,
so a rank that never joins a cluster never loads an etcd client.
"""

from .records import RankRecord, ranks_prefix, record_key
from .router import Router
from .view import JOINED, LEFT, UPDATED, Change, ClusterView

__all__ = ["RankRecord", "record_key", "ranks_prefix", "Change", "ClusterView", "JOINED", "LEFT", "UPDATED",
           "Router"]
