"""Free ports for a child to bind later: below the kernel's ephemeral range, skipping ports in use (real sockets)."""

from __future__ import annotations

import itertools
import random
import socket

import pytest

from asyncrl.cluster import ports


def _first(seed: int, **kw) -> int:
    return next(ports.candidates(random.Random(seed), **kw))


def test_candidates_stay_between_the_floor_and_the_ephemeral_range():
    got = list(itertools.islice(ports.candidates(random.Random(1), ephemeral_low=10050, floor=10000), 2000))
    assert min(got) == 10000 and max(got) == 10049  # both ends are reachable, nothing at or above 10050


def test_a_span_keeps_its_last_port_below_the_range():
    got = list(itertools.islice(ports.candidates(random.Random(2), ephemeral_low=10100, span=4, stride=10), 2000))
    assert max(got) + 3 * 10 == 10099 and min(got) == ports.PORT_FLOOR


def test_no_candidates_when_the_range_starts_at_the_floor():
    assert list(ports.candidates(random.Random(3), ephemeral_low=ports.PORT_FLOOR)) == []
    assert list(ports.candidates(random.Random(3), ephemeral_low=10015, span=3, stride=10)) == []
    with pytest.raises(ValueError, match="span"):
        next(ports.candidates(random.Random(3), ephemeral_low=30000, span=0))


def test_ephemeral_range_reads_the_kernel_file_and_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports.ephemeral_range(str(tmp_path / "absent")) == ports.DEFAULT_EPHEMERAL
    f.write_text("garbage\n")
    assert ports.ephemeral_range(str(f)) == ports.DEFAULT_EPHEMERAL


def test_free_port_is_below_what_the_kernel_hands_to_a_bind_to_zero():
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        p = ports.free_port()
        assert ports.PORT_FLOOR <= p < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # what the old helper returned, and what gloo's listeners get
            assert s.getsockname()[1] >= low


def test_a_port_someone_listens_on_is_skipped():
    seed = 12345
    low, _ = ports.ephemeral_range()
    taken = _first(seed, ephemeral_low=low)  # the port free_port(rng=Random(seed)) tries first
    with socket.create_server(("127.0.0.1", taken)) as listener:
        assert listener.getsockname()[1] == taken
        p = ports.free_port(rng=random.Random(seed))
        assert p != taken
        with socket.create_server(("127.0.0.1", p)):  # and the port it gave is really free
            pass


def test_a_span_with_one_taken_port_is_skipped():
    seed = 777
    low, _ = ports.ephemeral_range()
    first = _first(seed, ephemeral_low=low, span=3, stride=10)
    with socket.create_server(("127.0.0.1", first + 10)):  # the middle one of the first candidate span
        p = ports.free_port(span=3, stride=10, rng=random.Random(seed))
        assert p != first
        for k in range(3):
            with socket.create_server(("127.0.0.1", p + 10 * k)):
                pass
