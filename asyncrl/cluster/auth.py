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
  SGLang's ``--api-key``, answers 401 ``{"error": "Unauthorized"}`` without it, except ``/health*``,
  ``/metrics`` and ``OPTIONS``.
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


def bearer_matches(header: str | None, expected: str | None) -> bool:
    if not expected:
        return True
    prefix = "Bearer "
    if not isinstance(header, str) or not header.startswith(prefix):
        return False
    return secret_matches(header[len(prefix):], expected)
