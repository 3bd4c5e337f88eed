"""What the test modules share; no test module imports from another.

The toy paged KV cache and the in-memory world (sessions over an in-memory network, backend and
fake clock) are public API: ``kvlend.testing``.
In one process: ``certs`` (the tests' CA), ``wire`` (hand-built messages and frames, wire fuzzers),
``layout_fuzz`` (hostile layout encodings), ``strategies`` (hypothesis layouts), ``reference``
(brute-force references), ``profiles`` (hypothesis example counts), ``sessions`` (what the
``test_sessions_*`` files share), ``progressive`` (what the ``test_progressive_sessions*`` files share:
hybrid ends and helpers), ``cluster_view`` (test layouts and records for the ``test_cluster_*`` view,
record and pick files).
Over real NIXL agents: ``agents`` and ``nodes`` (a started prefill and a connected decode).
With other processes or services: ``children`` (how a child is started), ``ranks`` (the parent's
handle on a rank child), ``raw_peer``, ``etcd``, ``registry`` (the ``test_registry*`` files' etcd
fixtures and helpers), ``example_pair`` and ``vllm_rig``.
Child processes, run as ``python -m tests.support.<name>``: ``fault_ranks``, ``chaos_ranks``,
``progressive_rank``; ``quiet_ranks`` holds ``multiprocessing`` targets.
"""
