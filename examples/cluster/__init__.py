"""The cluster loopback rank's parts; ``examples/cluster_rank.py`` runs them."""
