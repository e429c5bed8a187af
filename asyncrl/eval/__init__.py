"""Evaluation during training: Miles' eval backends (``backends``), the dispatcher of external and fleet eval points
on a background thread (``dispatch``), and the dedicated eval fleet (``fleet``: engines of their own, synced from
checkpoints)."""
