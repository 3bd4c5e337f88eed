"""NIXL transfer backend for kvlend (work in progress)."""
