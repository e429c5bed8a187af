"""The seeds' spellings: every Miles flag named on its fully-async page, and the project key it maps to. Pure.

A Miles flag written as a config key (``max_weight_staleness``, ``max-weight-staleness``,
``--max-weight-staleness``, at any level) is not guessed at by string distance: the loader answers with
the project's key (``did you mean 'agentloop.max_actor_accept_staleness'?``). RLinf's keys are the
project's own. ``docs/seed_mapping.md`` is the same table for people.

    seed_hint("--async-data-buffer-capacity-factor")  # -> "... did you mean 'rollout_buffer....'?"
"""

from __future__ import annotations

from typing import Optional

MILES_FLAGS: dict[str, str] = {
    "fully_async": "runner.async_mode",
    "rollout_batch_size": "data.rollout_batch_size",
    "n_samples_per_prompt": "algorithm.group_size",
    "async_max_concurrent_samples": "rollout_buffer.max_concurrent_samples",
    "rollout_submission_granularity": "rollout_buffer.submission_granularity",
    "update_weights_interval": "rollout.update_weights_interval",
    "pause_generation_mode": "rollout.pause_mode",
    "async_data_buffer_capacity_factor": "rollout_buffer.async_data_buffer_capacity_factor",
    "max_weight_staleness": "agentloop.max_actor_accept_staleness",
    "async_unused_samples_handler": "rollout_buffer.unused_groups",
    "custom_async_data_buffer_path": "rollout_buffer.custom_data_buffer_path",
    "dynamic_sampling_filter_path": "rollout_buffer.dynamic_sampling_filter_path",
    "rollout_sample_filter_path": "rollout_buffer.sample_filter_path",
    "eval_num_gpus": "eval.eval_num_gpus",
    "eval_num_gpus_per_engine": "eval.eval_num_gpus_per_engine",
    "eval_function_path": "eval.eval_function_path",
    "eval_interval": "eval.eval_interval",
    "eval_hf_dir": "eval.eval_hf_dir",
    "eval_prompt_data": "eval.eval_prompt_data",
    "eval_overflow_policy": "eval.eval_overflow_policy",
    "eval_keep_snapshots": "eval.eval_keep_snapshots",
    "eval_max_in_flight": "eval.eval_max_in_flight",
    "eval_backend": "eval.eval_num_gpus (fleet) or eval.eval_function_path (external)",
    "save_hf": "runner.save_hf",
    "save_interval": "runner.checkpoint_interval",
    "custom_rollout_log_function_path": "logging.custom_rollout_log_function_path",
    "custom_eval_rollout_log_function_path": "logging.custom_eval_rollout_log_function_path",
    "sglang_mem_fraction_static": "rollout.sglang.mem_fraction_static",
}
"""Miles flag (dashes as underscores, no leading ``--``) -> project key."""


def project_key(name: str) -> Optional[str]:
    """The project key of a Miles flag spelled any of the ways above, or None when it is not one."""
    k = name.strip().lstrip("-").replace("-", "_")
    if k in MILES_FLAGS:
        return MILES_FLAGS[k]
    bare = k[3:] if k.startswith("no_") else k  # booleans' --no- form
    if bare.startswith("eval_sglang_") and len(bare) > len("eval_sglang_"):
        return f"eval.eval_sglang.{bare[len('eval_sglang_') :]}"
    if bare.startswith("sglang_") and len(bare) > len("sglang_"):  # any other SGLang flag: passed through verbatim
        return f'rollout.sglang.extra_args ("--{bare[len("sglang_") :].replace("_", "-")}")'
    return None


def seed_hint(name: str) -> Optional[str]:
    """``"Miles' --x-y; did you mean 'a.b'?"`` for a Miles flag, else None."""
    key = project_key(name)
    if key is None:
        return None
    flag = "--" + name.strip().lstrip("-").replace("_", "-")
    return f"this is Miles' {flag}; did you mean '{key}'?"
