"""The scenarios ``kvlend bench`` runs, by number; each module holds one and its helpers.

Each ``run(lender, backend, sizes, progress)`` returns that scenario's part of the report.
"""

from . import cold_peer, contiguous, fragmented, inflight_sweep, many_in_flight, progressive, small_requests

SCENARIOS = {1: contiguous.run, 2: fragmented.run, 3: small_requests.run, 4: cold_peer.run,
             5: many_in_flight.run, 6: progressive.run,
             7: inflight_sweep.run}
