"""The engines' API-key rules, as sglang 0.5.23 decides them (``sglang/srt/utils/auth.py``,
``decide_request_auth`` with only ``--api-key`` set): open paths and the ``Authorization`` header's parsing."""

from __future__ import annotations

import pytest

from asyncrl.cluster.auth import bearer_matches, open_path

KEY = "k3y"


@pytest.mark.parametrize(
    "method,path",
    [
        ("OPTIONS", "/generate"),
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/ready"),
        ("GET", "/metrics"),
        ("POST", "/metrics/x"),
    ],
)
def test_open_paths(method, path):
    assert open_path(method, path)


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/generate"),
        ("POST", "/pause_generation"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/abort_request"),
        ("POST", "/flush_cache"),
        ("GET", "/server_info"),
        ("GET", "/model_info"),
    ],
)
def test_guarded_paths(method, path):
    assert not open_path(method, path)


@pytest.mark.parametrize(
    "header,ok",
    [
        (f"Bearer {KEY}", True),
        (f"bearer {KEY}", True),
        (f"BEARER {KEY}", True),  # scheme in any case
        (None, False),
        ("", False),
        (KEY, False),
        (f"Basic {KEY}", False),
        (f"Bearer  {KEY}", False),
        (f"Bearer {KEY} ", False),
        (f"Bearer {KEY}x", False),
        ("Bearer", False),
        (f"Bearer\t{KEY}", False),
    ],
)
def test_bearer_header(header, ok):
    assert bearer_matches(header, KEY) is ok


def test_no_key_checks_nothing():
    assert bearer_matches(None, None) and bearer_matches("junk", "")
