"""The embedded default (CPU, tests, CI): the synthetic search-QA data generator (``synth``) and the
supervised warm start (``warm_start``) that ``prepare.*`` runs before a run (``asyncrl.runner.prepare``);
the tiny checkpoint itself is ``asyncrl.models.tiny``."""
