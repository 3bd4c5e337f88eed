"""The pure core: layouts, negotiation, planning, locks, leases and the delivery tracker.

No sockets, threads, clocks or NIXL: time is always a parameter.
"""
