"""The engines' side: SGLang's launcher and supervisor, and the CPU engine that speaks SGLang's HTTP API.

- ``sglang_launcher``  spawns an SGLang server (or the CPU engine) as a child, waits until it serves, probes its
  health, restarts it; ``testing`` starts a real CPU engine for tests and benchmarks.
- The CPU engine, by part: ``cpu_engine`` (the engine object, its HTTP handlers, ``python -m`` entry point),
  ``engine_args`` (SGLang's flags, its own torch.distributed world), ``engine_http`` (the ``/generate`` body
  checks, SGLang's answer shapes), ``weight_updates`` (the weight-update group, the atomic receive, loads from
  disk), ``engine_metrics`` (the ``/metrics`` page); the engine thread's ``cpu_scheduler`` (continuous batching,
  pause modes), with ``request`` (one request and its ``/generate`` JSON), ``sampling_params`` (SGLang's
  sampling fields, checked), ``sampler`` (one token per request), ``prefix_cache``; the model, ``cpu_model``
  (fp32 decoder with HF-named weights, the KV pool).

The callers' side of the same API is ``asyncrl.engine``.
"""
