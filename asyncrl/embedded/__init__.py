"""The embedded default (CPU, tests, CI): what ``prepare.*`` makes before a run, beyond the data and the
tiny checkpoint: the supervised warm start (``warm_start``)."""
