"""Pure pieces of the step loop: the batch-level sample filter, rollout metrics, broker accounting."""

import json
import sys
import types

import pytest

from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.trainer.leader import make_batch_filter, rollout_metrics
from asyncrl.trainer.summary import broker_accounting


def _group(gid, index, rewards):
    trajs = [
        Trajectory(
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            loss_mask=[1, 0, 1],
            rollout_logprobs=[-0.1, 0.0, -0.2],
            reward=r,
            num_turns=2,
            num_tool_calls=1,
        )
        for r in rewards
    ]
    return Group(group_id=gid, item=PromptItem(index=index, prompt="q"), epoch=0, trajectories=trajs)


def test_batch_is_sorted_by_prompt_index_without_a_filter():
    out = make_batch_filter(None)([_group(1, 7, [0]), _group(2, 3, [1]), _group(3, 5, [0])])
    assert [g.item.index for g in out] == [3, 5, 7]


def test_filter_by_import_path_runs_on_the_sorted_batch(monkeypatch):
    mod = types.ModuleType("my_filters")
    seen = []

    def drop_all_zero(groups):
        seen.append([g.item.index for g in groups])
        return [g for g in groups if any(t.reward for t in g.trajectories)]

    mod.drop_all_zero = drop_all_zero
    mod.not_callable = 3
    mod.bad_return = lambda groups: tuple(groups)
    monkeypatch.setitem(sys.modules, "my_filters", mod)
    out = make_batch_filter("my_filters:drop_all_zero")([_group(1, 9, [0, 0]), _group(2, 4, [1, 0])])
    assert seen == [[4, 9]] and [g.group_id for g in out] == [2]
    with pytest.raises(ValueError, match="rollout_buffer.sample_filter_path"):
        make_batch_filter("my_filters:not_callable")
    with pytest.raises(ValueError, match="rollout_buffer.sample_filter_path.*expected a list"):
        make_batch_filter("my_filters:bad_return")([_group(1, 1, [0])])
    with pytest.raises(ValueError, match="rollout_buffer.sample_filter_path"):
        make_batch_filter("no_such_module_xyz:f")


def test_rollout_metrics_of_a_batch():
    m = rollout_metrics([_group(1, 0, [1.0, 0.0]), _group(2, 1, [1.0, 1.0])])
    assert m["reward/mean"] == 0.75
    assert m["rollout/response_length/mean"] == 3
    assert m["rollout/generated_tokens/mean"] == 2
    assert m["rollout/turns/mean"] == 2 and m["rollout/tool_calls/mean"] == 1


def test_broker_accounting_adds_up():
    st = {
        "counters": {"issued": 10, "trained": 4, "dropped": 1, "reissued": 1},
        "num_inflight_groups": 3,
        "num_buffered_groups": 1,
    }
    a = broker_accounting(st)
    assert (
        a["broker/issued_groups"]
        == a["broker/trained_groups"]
        + a["broker/dropped_groups"]
        + a["broker/held_groups"]
        + a["broker/reissued_groups"]
    )


@pytest.mark.parametrize("async_mode", [False, True])
def test_the_batch_wait_is_counted_once_in_the_time_split(async_mode, tmp_path, capsys):
    """The broker's batch metrics carry time/wait_data; in sync mode the wait is time/rollout and only that, so
    the printed split adds up to the step (it added 2.51 s for a 1.62 s step)."""
    from asyncrl.config import load_config
    from asyncrl.trainer.summary import print_summary, wait_split

    m = wait_split({"time/wait_data": 0.9, "rollout/x": 1.0}, 0.9, async_mode=async_mode)
    assert m == {"rollout/x": 1.0, ("time/wait_data" if async_mode else "time/rollout"): 0.9}
    step = {**m, "time/training": 0.6, "time/sync_weights": 0.12, "time/step": 1.62, "reward/mean": 0.0}
    cfg = load_config(None, [f"runner.async_mode={'true' if async_mode else 'false'}"])
    print_summary(cfg, {"steps": [step], "staleness_max": 0.0, "drops": 0.0}, tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    parts = s["time/training"] + s["time/wait_data"] + s["time/rollout"] + s["time/sync_weights"]
    assert parts == pytest.approx(s["time/step"])


@pytest.mark.parametrize(
    ("overrides", "evals", "said"),
    [
        ([], {"eval_before": {"accuracy": 0.0}, "eval_after": {"accuracy": 0.83}}, "before 0.000 -> after 0.830"),
        ([], {"eval_after": {"accuracy": 0.5}}, "before n/a -> after 0.500"),  # a resumed run: no "before"
        (["runner.eval_before_after=false"], {}, "not measured (runner.eval_before_after = false)"),
    ],
)
def test_the_summary_says_held_out_accuracy_in_words_not_none(overrides, evals, said, tmp_path, capsys):
    from asyncrl.config import load_config
    from asyncrl.trainer.summary import print_summary

    step = {"time/training": 0.6, "time/step": 0.7, "reward/mean": 0.0}
    print_summary(
        load_config(None, overrides), {"steps": [step], "staleness_max": 0.0, "drops": 0.0, **evals}, tmp_path
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if "held-out accuracy" in x)
    assert line == f"  held-out accuracy: {said}"


def test_nonfinite_guard_stops_after_consecutive_bad_steps():
    from asyncrl.trainer.guards import NonFiniteGuard

    g = NonFiniteGuard(3)
    skipped = {"train/step_skipped": 1.0, "train/loss": float("nan")}
    assert g.update(dict(skipped)) is None and g.update({"train/step_skipped": 0.0}) is None  # a good step resets
    assert g.update(dict(skipped)) is None
    assert g.update({"rollout/nonfinite_rewards": 4.0}) is None
    m = dict(skipped)
    msg = g.update(m)
    assert msg is not None and "runner.max_nonfinite_steps = 3" in msg and "nan" in msg
    assert m["train/nonfinite_steps"] == 4 and m["train/nonfinite_consecutive"] == 3


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_preemption_flag_takes_sigusr1_and_sigterm_and_restores_the_handlers(sig):
    """Slurm's notice (SIGUSR1) and its time limit / scancel (SIGTERM) both become the step loop's flag; the first
    signal is the one named; outside the loop the previous handlers are back."""
    import os
    import signal

    from asyncrl.trainer.guards import PREEMPT_SIGNALS, Preempted, Preemption

    seen = []
    before = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in PREEMPT_SIGNALS}
    try:
        p = Preemption().install()
        assert not p.requested and p.signame is None
        os.kill(os.getpid(), getattr(signal, sig))
        os.kill(os.getpid(), signal.SIGUSR1 if sig == "SIGTERM" else signal.SIGTERM)  # a second one changes nothing
        assert p.requested and p.signame == sig and seen == []
        p.restore()
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert f"(signal {sig})" in str(Preempted(3, "/ckpt/step_000003", p.signame))
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_engine_figures_for_the_autotuner_are_the_step_mean_without_retracted_requests(monkeypatch):
    """The autotuner gets the mean of the scrapes since the last report, summed over engines, a queue
    without the requests a retract-mode sync put back (its backlog is no saturation), and wall-clock
    tokens/s from the engines' token counters (gen_throughput is the rate while decoding)."""
    import asyncrl.trainer.engine_scraper as engine_scraper
    from asyncrl.cpu_engine.metrics import prometheus_text

    served: dict[str, dict] = {}
    now = [0.0]
    monkeypatch.setattr(
        engine_scraper, "get_text", lambda url, path, **kw: prometheus_text(served[url], model_name="m")
    )
    served["a"] = served["b"] = {"num_running_reqs": 4, "num_queue_reqs": 0, "gen_throughput": 100.0}
    scraper = engine_scraper.EngineScraper(["a", "b"], interval_s=3600, clock=lambda: now[0])
    scraper.close()  # the background thread scraped once (or not at all): the test drives the scrapes
    scraper.autotune_figures()
    assert scraper.autotune_figures() is None  # nothing scraped since the last report
    served["a"] = {
        "num_running_reqs": 24,
        "num_queue_reqs": 30,
        "num_retracted_reqs": 24,
        "gen_throughput": 900.0,
        "generation_tokens_total": 1000,
    }
    served["b"] = {"num_running_reqs": 20, "num_queue_reqs": 0, "gen_throughput": 700.0, "generation_tokens_total": 0}
    scraper._record(scraper.scrape())  # right after a sync: a's queue is its retracted requests + 6; first count
    now[0] = 2.0
    served["a"] = {
        "num_running_reqs": 24,
        "num_queue_reqs": 2,
        "gen_throughput": 1100.0,
        "generation_tokens_total": 2000,
    }  # 1000 tokens in 2 s: 500/s (idle part of it)
    served["b"] = dict(served["b"], generation_tokens_total=1400)  # busy all along: 700/s
    scraper._record(scraper.scrape())
    assert scraper.autotune_figures() == {
        "running_reqs": 44.0,
        "queue_reqs": 4.0,
        "gen_tokens_per_s": (900 + 700 + 500 + 700) / 2,
    }
    assert "engine/0/num_queue_reqs" in scraper.latest() and not any(k.startswith("_") for k in scraper.latest())
