"""The multi-node loopback lab (``scripts/multinode-loopback``): hosts as network namespaces, ranks as
processes in them, faults, and the checks on what the ranks report.  Standard library only: the
driver may run under any Python 3, the ranks under the project's."""
