"""The broker: owns the dataloader, the two admission limits and the buffer of finished groups.

- ``types``      the seam dataclasses (Trajectory, PromptItem, Group)
- ``core``       the pure decision core (``BrokerCore``; injected clock, no I/O)
- ``buffer``     the ``DataBuffer`` plug-in interface and ``DefaultDataBuffer``; ``miles_buffer`` Miles' own async
  contract (``DataBuffer``, ``DataBufferInput``, ``DataBufferConstructorInput``) and its adapter;
  ``buffer_plugin`` which contract a custom buffer meets, and the buffer the core runs
- ``dataloader`` epochs, seeded shuffle, resumable position
- ``protocol``   the wire protocol: every message (msgpack headers + raw token frames), used by both ends
- ``record``     the one declaration of the trajectory record's fields (name, per token or per trajectory,
  dtype, whether the actor trains on it); the wire and the actor's per-rank scatter are derived from it
- ``wire``       the one wire shape of trajectories (a table of typed columns + token frames, zero-copy)
- ``server``     the ZeroMQ shell around the core; ``serve`` the process body (``run_broker``: given its
  prompts, serves until shutdown); ``client`` the worker/actor clients. The process entry point, which loads the prompts with the agent's loader, is
  ``asyncrl.runner.broker_process`` (the broker never imports the agent).

Nothing is imported here, so ``import asyncrl.broker.types`` stays light (no zmq, no numpy).
"""
