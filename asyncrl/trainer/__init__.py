"""The actor ranks' run: the step loop and what actor rank 0 alone does around it.

- ``step_loop``: ``Trainer``, one object per actor rank: get a batch, train, sync weights, log (async and sync).
- ``leader``: the leader's parts on actor rank 0 (broker client, weight sync, writers, scraper, log hooks,
  recovery) as one object, and its null twin on the other actor ranks.
- ``leader_phases``: leader-only phases (rank 0 works, the others wait on the store), heartbeats, the actor watch.
- ``guards`` (bad numbers, preemption), ``resume`` (run identity, which checkpoint), ``summary`` (the step
  records' derived figures), ``writers`` (metrics writers), ``log_hooks`` (Miles' custom logging hooks),
  ``engine_scraper`` (the engines' Prometheus figures).
"""
