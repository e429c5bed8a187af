"""The process wiring: the torchrun entry (``launcher``), the role bodies (``roles``: actor, rollout, eval-fleet
engine, idle), the broker process entry (``broker_process``) and the embedded default's preparation (``prepare``).
The step loop is ``asyncrl.trainer``; evaluation is ``asyncrl.eval``."""
