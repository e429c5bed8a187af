"""The engines' HTTP API, from the caller's side: one package every part that talks to an engine uses.

SGLang servers and the CPU engine speak the same API (``/generate``, ``/pause_generation``, the weight-update
calls, ``/metrics``). This package holds the API's vocabulary and its two transports:

- ``client``   the async client (``SGLangClient``: the agent worker, the evaluator, the eval fleet), the typed
  ``/generate`` answer and its parser, the engines' pause modes (``ENGINE_PAUSE_MODES``; ``rollout.pause_mode``
  adds the trainer's ``drain``, ``asyncrl.config.schema.PAUSE_MODES``), and the one Prometheus reader
  (``parse_prometheus``, ``parse_engine_load``: the metrics scraper and the drain wait);
- ``blocking`` blocking JSON calls fanned out on daemon threads, for code on a thread that must stay free for a
  collective (the weight sync, the metrics scraper, the engine health probes); failures are ``EngineStepError``
  naming the engines and the step; ``http1`` the kept-alive HTTP/1.1 connection under them;
- ``liveness`` one liveness check of an engine (a paused engine is live) and the verdict over a stream of them;
- ``launch``   SGLang's launcher and supervisor (or the CPU engine's, started the same way): spawn the server as a
  child, wait until it serves, probe its liveness, restart it.

One error type: ``client.EngineError`` (URL, endpoint, HTTP status, the server's message); the blocking
calls' ``EngineStepError`` is one, carrying every engine of a fanned-out step.

It imports nothing of asyncrl but the config and the cluster; the CPU engine itself is ``asyncrl.cpu_engine``.
"""
