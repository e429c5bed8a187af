"""The actor ranks import the step loop (megatron-core) on a thread while start-up waits (``roles``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from asyncrl.runner import roles


def test_background_import_leaves_the_module_imported(tmp_path, monkeypatch):
    (tmp_path / "asyncrl_bg_ok.py").write_text("import threading\nWHO = threading.current_thread().name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "asyncrl_bg_ok", raising=False)
    t = roles._import_in_background("asyncrl_bg_ok")
    t.join(timeout=30)
    assert not t.is_alive()
    assert "asyncrl_bg_ok" in sys.modules
    assert importlib.import_module("asyncrl_bg_ok").WHO == "import asyncrl_bg_ok"  # it ran on the thread


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's own report
def test_a_failed_background_import_fails_again_where_the_module_is_used(tmp_path, monkeypatch):
    (tmp_path / "asyncrl_bg_bad.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "asyncrl_bg_bad", raising=False)
    t = roles._import_in_background("asyncrl_bg_bad")
    t.join(timeout=30)
    assert "asyncrl_bg_bad" not in sys.modules
    with pytest.raises(RuntimeError, match="broken on purpose"):
        importlib.import_module("asyncrl_bg_bad")


def test_the_trainer_module_is_the_one_run_actor_uses():
    assert roles.TRAINER_MODULE == "asyncrl.trainer.step_loop"
    assert importlib.util.find_spec(roles.TRAINER_MODULE) is not None
