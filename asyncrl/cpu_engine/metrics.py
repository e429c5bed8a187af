"""The CPU engine's ``/metrics`` page: SGLang's Prometheus series, written from the scheduler's counters.

    prometheus_text(scheduler.metrics(), model_name="runs/tiny/model")  # -> "# HELP sglang:num_running_reqs ..."

Pure (no I/O). The reader of these pages is ``asyncrl.engine.client.parse_prometheus``.
"""

from __future__ import annotations

# SGLang's series (name, type, help); counters are exposed with their ``_total`` name.
_SERIES = (
    ("num_running_reqs", "gauge", "The number of running requests."),
    ("num_queue_reqs", "gauge", "The number of requests in the waiting queue."),
    ("num_paused_reqs", "gauge", "The number of requests paused in place."),
    ("num_retracted_reqs", "gauge", "The number of retracted requests waiting to be re-run."),
    ("token_usage", "gauge", "The token usage of the KV cache."),
    ("cache_hit_rate", "gauge", "The prefix cache hit rate."),
    ("gen_throughput", "gauge", "The generation throughput (token/s)."),
    ("prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("cached_tokens_total", "counter", "Number of cached prompt tokens."),
    ("num_requests_total", "counter", "Number of requests processed."),
    ("num_aborted_requests_total", "counter", "Number of requests aborted."),
    ("num_retractions_total", "counter", "Number of request retractions."),
    # ours: sglang 0.5.23 counts these only inside num_aborted_requests_total (``TokenizerManager.abort_request``
    # on a disconnect, ``srt/managers/tokenizer_manager.py``); named after its ``num_grammar_aborted_total``
    (
        "num_disconnect_aborted_requests_total",
        "counter",
        "Number of requests aborted because their HTTP client disconnected (timed out or gone) before the answer.",
    ),
    # ours: SGLang holds a /generate that arrives during a pause in its HTTP process (not in num_queue_reqs) and
    # shows no count of them; this one lets a caller (a test) see that the request arrived
    ("num_held_by_pause_requests", "gauge", "Requests received while paused, waiting for the continue."),
)
DISCONNECT_SERIES = "num_disconnect_aborted_requests_total"
HELD_SERIES = "num_held_by_pause_requests"


def prometheus_text(values: dict[str, float], *, model_name: str) -> str:
    name_ = model_name.replace('"', "'")
    label = f'{{model_name="{name_}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
    lines = []
    for name, kind, help_ in _SERIES:
        full = f"sglang:{name}"
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        lines.append(f"{full}{label} {float(values.get(name, 0.0))!r}")
    return "\n".join(lines) + "\n"
