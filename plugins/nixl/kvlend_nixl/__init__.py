"""NIXL (UCX) transfer backend for kvlend, found through the ``nixl`` entry point."""

from .backend import NixlBackend

__all__ = ["NixlBackend"]
