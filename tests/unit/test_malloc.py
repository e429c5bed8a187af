"""asyncrl.cluster.malloc: freed memory stays in the process for the next step (no page faults to get it back),
and the user's own glibc malloc settings win. Each case runs in a fresh interpreter (malloc settings are
process-wide)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cluster.malloc import _glibc, user_chose_malloc_settings

REPO = Path(__file__).resolve().parents[2]

# Allocate, touch and free 20 MiB twice with libc's own malloc (no threads: the counts are exact), and report the
# minor page faults of the second time: zero when the first time's memory was kept for reuse.
TOUCH_TWICE = """
import ctypes, json, resource, sys
from asyncrl.cluster.malloc import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "apply" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
N = 20 << 20
def touch():
    p = libc.malloc(N)
    ctypes.memset(p, 1, N)
    libc.free(p)
touch()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""

needs_glibc = pytest.mark.skipif(_glibc() is None, reason="mallopt settings are glibc's")


def _touch_twice(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", TOUCH_TWICE, mode],
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_retained_memory_is_reused_without_page_faults_where_the_default_faults_it_back_in():
    pages = (20 << 20) // os.sysconf("SC_PAGE_SIZE")
    default = _touch_twice("default")
    applied = _touch_twice("apply")
    assert default["faults"] >= pages // 2, default  # glibc's default gave the first 20 MiB back to the kernel
    assert applied["applied"] == {"mmap_threshold": 32 << 20, "trim_threshold": 1 << 30, "top_pad": 64 << 20}
    assert applied["faults"] < pages // 20, applied


@needs_glibc
def test_the_users_own_malloc_settings_win():
    r = _touch_twice("apply", MALLOC_TRIM_THRESHOLD_="0")
    assert r["applied"] == {}
    assert r["faults"] >= (20 << 20) // os.sysconf("SC_PAGE_SIZE") // 2, r  # their trim-everything setting held
    assert _touch_twice("apply", GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")["applied"] == {}


def test_only_glibc_malloc_settings_count_as_the_users_choice():
    assert user_chose_malloc_settings({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.top_pad=0"})
    assert not user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"})
    assert not user_chose_malloc_settings({"MALLOC_ARENA_MAX": "2", "PATH": "/bin"})
