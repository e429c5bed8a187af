"""The run's secret: who may talk to the broker and the engines.

Contract
- One secret per run, in the environment variable ``ASYNCRL_API_KEY`` of every process of the job: global
  rank 0 generates it at start (``secrets.token_urlsafe``; a value already in the environment is kept, e.g.
  to reach external SGLang engines started with that ``--api-key``) and publishes it in the rendezvous store;
  the other ranks read it there (``share_secret``). Children (broker, engines) inherit the environment, so
  the secret never appears on a command line of ours (SGLang engines get ``--api-key``: its only way).
- Broker: every message header carries ``k`` (``protocol.encode`` adds it); the broker refuses a message
  whose ``k`` does not match (counted in ``stats["unauthenticated"]``, answered with an error, never fatal).
- HTTP engines: ``Authorization: Bearer <secret>`` on every request (``auth_headers``); the CPU engine, like
  SGLang's ``--api-key``, answers 401 ``{"error": "Unauthorized"}`` without it (``open_path``, ``bearer_matches``).
  Read from sglang 0.5.23 (the wheel on PyPI), ``sglang/srt/utils/auth.py`` (``decide_request_auth``) and
  ``sglang/srt/entrypoints/http_server.py`` (``add_api_key_middleware`` is installed when ``--api-key`` is set,
  in single-tokenizer mode only: ``--tokenizer-worker-num`` > 1 checks nothing): OPTIONS and any path starting
  with ``/health``, ``/ready`` or ``/metrics`` are open; every other endpoint (``/generate``, the pause and
  weight-update calls, ``/abort_request``, ``/flush_cache``, ``/server_info``, ...; "NORMAL" and
  "ADMIN_OPTIONAL" levels alike when only ``--api-key`` is given) needs the header; it is split at its first
  space, the scheme compared case-insensitively to ``bearer`` and the token in constant time.
- ``secret_matches`` compares in constant time. No secret in the environment (tests, a bare engine): nothing
  is checked and nothing is sent.

    share_secret(disc, rank=ctx.rank); headers = auth_headers()
"""

from __future__ import annotations

import hmac
import os
import secrets

ENV = "ASYNCRL_API_KEY"
_STORE_KEY = "run_secret"


def current() -> str | None:
    return os.environ.get(ENV) or None


def share_secret(disc, *, rank: int) -> str:
    """Rank 0 generates (or keeps) the secret and publishes it; the others read it. Sets ``ASYNCRL_API_KEY``."""
    if rank == 0:
        key = current() or secrets.token_urlsafe(32)
        disc.publish(_STORE_KEY, key)
    else:
        key = disc.lookup(_STORE_KEY)
    os.environ[ENV] = key
    return key


def auth_headers() -> dict[str, str]:
    key = current()
    return {"Authorization": f"Bearer {key}"} if key else {}


def secret_matches(given, expected: str | None) -> bool:
    if not expected:
        return True
    if isinstance(given, str):
        given = given.encode()
    if not isinstance(given, bytes):
        return False
    return hmac.compare_digest(given, expected.encode())


OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths SGLang serves without the key (probes and Prometheus scrapes; matched as prefixes, as SGLang does)."""


def open_path(method: str, path: str) -> bool:
    """True when SGLang's ``--api-key`` check lets the request through without a key."""
    return method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES)


def bearer_matches(header: str | None, expected: str | None) -> bool:
    """``Authorization`` header carries ``expected`` (SGLang: ``<scheme> <token>``, scheme ``bearer`` in any case)."""
    if not expected:
        return True
    if not isinstance(header, str):
        return False
    scheme, sep, token = header.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return False
    return secret_matches(token, expected)


API_KEY_FLAG = "--api-key"


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` (``--api-key=K`` or ``--api-key K``) replaced, for log lines."""
    out, hide_next = [], False
    for a in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif a.startswith(API_KEY_FLAG + "="):
            out.append(API_KEY_FLAG + "=<redacted>")
        else:
            out.append(a)
            hide_next = a == API_KEY_FLAG
    return out
