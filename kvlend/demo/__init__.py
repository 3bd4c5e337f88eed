"""``kvlend demo``: prefill ranks and a decode rank moving a real KV cache over NIXL on loopback.

``pair`` launches the ranks as processes (``python -m kvlend.demo.prefill``, ``python -m
kvlend.demo.decode``) and reports; ``workload`` holds the options they share (no torch, so
``kvlend --help`` stays fast); ``toy_engine`` is the seeded toy transformer whose tokens prove the
bytes right.  The ranks need torch and a transfer backend (the NIXL plugin brings both); they reach
the backend through the registry, as an engine would.
"""
