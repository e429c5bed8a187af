"""The broker: owns the dataloader, the two admission limits and the buffer of finished groups.

- ``types``      the seam dataclasses (Trajectory, PromptItem, Group)
- ``core``       the pure decision core (``BrokerCore``; injected clock, no I/O)
- ``buffer``     the ``DataBuffer`` plug-in interface and ``DefaultDataBuffer``
- ``dataloader`` epochs, seeded shuffle, resumable position
- ``protocol``   the wire protocol (msgpack headers + raw token blobs), used by both ends
- ``server``     the ZeroMQ shell (``python -m asyncrl.broker``), ``client`` the worker/actor clients,
  ``launch``     start the broker process and wait for its address

Nothing is imported here, so ``import asyncrl.broker.types`` stays light (no zmq, no numpy).
"""
