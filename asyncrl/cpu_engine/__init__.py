"""The CPU engine: a real engine that speaks SGLang 0.5.23's HTTP API, two processes as SGLang's.

Started the way SGLang is (``python -m asyncrl.cpu_engine.server --model-path ... --port ...``), it answers what
an RL trainer calls, with SGLang's status codes, paused behaviour, sessions and errors
(``docs/sglang_differences.md`` lists what differs and why).

- The HTTP process: ``server`` (the handlers, the entry point), ``args`` (SGLang's flags, start-up, its own
  torch.distributed world), ``http_shapes`` (the ``/generate`` body checks, SGLang's answer shapes),
  ``sampling_params`` (SGLang's sampling fields, checked), ``scheduler_link`` (its side of the scheduler
  process), ``frames`` (the two processes' messages).
- The scheduler process: ``scheduler_process`` (its body), ``scheduler`` (continuous batching, pause modes), with
  ``request`` (one request and its ``/generate`` JSON), ``sampler`` (one token per request), ``prefix_cache``;
  ``model`` (fp32 decoder with HF-named weights), ``experts`` (Qwen3-MoE's router and experts), ``kv_pool`` (the KV
  rows, and the routing of each cached token); ``weight_updates`` (the weight-update group, the
  atomic receive, loads from disk); ``metrics`` (the ``/metrics`` page).
- ``testing`` starts a real CPU engine for tests and benchmarks.

The callers' side of the same API, and SGLang's launcher and supervisor, are ``asyncrl.engine``.
"""
