"""The engines' HTTP API, from the caller's side: one package every part that talks to an engine uses.

SGLang servers and the CPU engine speak the same API (``/generate``, ``/pause_generation``, the weight-update
calls, ``/metrics``). This package holds the API's vocabulary and its two transports:

- ``client``   the async client (``SGLangClient``: the agent worker, the evaluator, the eval fleet), the typed
  ``/generate`` answer and its parser, the engines' pause modes (``ENGINE_PAUSE_MODES``; ``rollout.pause_mode``
  adds the trainer's ``drain``, ``asyncrl.config.schema.PAUSE_MODES``), and the one Prometheus reader
  (``parse_prometheus``, ``parse_engine_load``: the metrics scraper and the drain wait);
- ``blocking`` blocking JSON calls fanned out on daemon threads, for code on a thread that must stay free for a
  collective (the weight sync, the metrics scraper, the engine health probes); failures are ``EngineStepError``
  naming the engines and the step.

One error type: ``client.EngineError`` (URL, endpoint, HTTP status, the server's message); the blocking
calls' ``EngineStepError`` is one, carrying every engine of a fanned-out step.

It imports nothing of asyncrl but the config; the engines themselves live in ``asyncrl.rollout``.
"""
