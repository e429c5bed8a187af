"""Names in asyncrl/ that vulture reports as unused but are not dead: read by vulture (tools/check_dead_code.sh)
beside asyncrl/, never imported. Vulture matches by name, so each line marks a name as used; each says WHY.

Add a name here only with its reason; remove it when its reason goes. Groups: called by a library or by name
(vulture cannot see it), read by the tests or benchmarks (vulture scans asyncrl/ alone), and vulture's false alarms
(a numpy flag set, a list extended in place).
"""

# ruff: noqa: B018  (each line is an expression on purpose: vulture counts it as a use of the name)

from typing import Any

_: Any = None

# ---- called by a library, or looked up by name
_.core_attention  # actor/layer_spec.py: megatron-core's layer spec field, megatron builds the module it names
_.attention_type  # actor/layer_spec.py FusedCoreAttention.__init__: megatron-core passes these by keyword ...
_.cp_comm_type  # ... to the core-attention module it builds (its signature is megatron's)
_.pg_collection  # ... (same)
_.get_default_causal_mask  # cluster/megatron_cpu.py: CPU shim patched into megatron-core, which calls it
_._get_cuda_rng_state  # cluster/megatron_cpu.py: CPU shim patched into megatron-core's tensor_parallel.random
_._set_cuda_rng_state  # (same)
_.maybe_move_tensor_to_cpu  # cluster/megatron_cpu.py: CPU shim 7 patched into megatron-core's token_dispatcher ...
_.record_stream  # ... which passes this keyword to it
_.Stream  # cluster/megatron_cpu.py _HostCuda / _HostStream: what megatron-core's token dispatcher calls of ...
_.current_stream  # ... torch.cuda (streams, events) on CPU (shim 7)
_.stream  # (same)
_.wait_stream  # (same)
_.record_event  # (same)
_.synchronize  # (same)
_.rootRank  # cluster/weight_update_group.py: torch.distributed.BroadcastOptions fields, read by the process group
_.rootTensor  # (same)
_.asyncOp  # (same)
_.data_received  # cpu_engine/scheduler_link.py _Reader: asyncio.Protocol callbacks, called by the event loop
_.connection_lost  # (same)
_.begin_weight_update  # cpu_engine/weight_updates.py WeightUpdates: ops called by name (WEIGHT_ROUTES ->
_.end_weight_update  # scheduler_process getattr(self.weights, op)), one per SGLang weight-update route
_.init_weights_update_group  # (same)
_.destroy_weights_update_group  # (same)
_.update_weights_from_distributed  # (same)
_.update_weights_from_tensor  # (same)
_.load_delta  # sync/delta_loader.py: the engines' --custom-weight-loader, imported by its path (SGLang's dynamic_import)
_.update_weight_version  # (same)
_.pre_tokenizer  # models/tiny.py: tokenizers.Tokenizer properties, set for the library to use
_.decoder  # (same)
_._wait_abandoned_rendezvous  # sync/group.py: registered with @atexit.register, called at interpreter exit
_.input  # eval/backends.py CheckpointEvalFn.evaluate_checkpoint: the parameter name of the user-subclass interface

# ---- read by the tests, benchmarks or tools (public helpers of asyncrl that only they call)
_.density  # sync/delta.py Delta: the changed fraction of one tensor, read by the codec's tests
_.aggregation_weights  # actor/loss.py: the per-token reference of batch.global_agg_weights; tests/unit/test_actor_loss.py
_.compute_logprobs  # actor/megatron_actor.py Actor: tests/integration/test_actor_*.py, benchmarks/gpu_check.py
_.synthetic_groups  # actor/synthetic.py: tests/integration/test_actor_*.py, benchmarks/actor_bench.py
_.tiny_actor_config  # actor/synthetic.py: tests/integration/test_actor_*.py, benchmarks/actor_bench.py
_.in_flight  # agent/engine_handle.py EngineHandle (generate calls in flight): tests/unit/test_agent_loop.py
_.num_waiting  # agent/loop.py TurnGate: tests/unit/test_agent_loop.py waits for a turn to reach the closed gate
_.SearchR1Task  # agent/envs/searchr1.py: the name user subclasses of the Search-R1 task import (docs/environments.md)
_.TASK  # agent/envs/searchr1.py: the module attribute `asyncrl.agent.envs.searchr1:TASK` names for older configs
_.on_evict  # broker/miles_buffer.py DataBufferConstructorInput: Miles' field, read by the user's buffer
_.group_oldest_weight_version  # broker/miles_buffer.py: Miles' helper, for user buffers ported with one import
_.discover  # agent/tools/http_tool.py HttpTool: tests/integration/test_http_tool_server.py (agent wiring: issue 44)
_.num_running  # agent/tools/python_sandbox.py PythonTool: tests/integration/test_python_sandbox.py (concurrency bound)
_.num_retries  # agent/tools/http_retriever.py: tests/integration/test_retriever_bad_answers.py, test_retrieval_server.py
_.num_failures  # (same)
_.remaining_in_epoch  # broker/dataloader.py: tests/unit/test_broker_core_properties.py
_.WorkerConnection  # broker/worker_client.py: the blocking worker, tests/integration/test_broker_*.py
_.running_cpu_engine  # cpu_engine/testing.py: tests/integration/test_engine_*.py, test_sync_*.py, benchmarks/engine_*.py
_.free_rollout_port  # engine/launch.py: tests/integration/proc_helpers.py, benchmarks/harness.py
_.wait_exit  # engine/launch.py EngineSupervisor: tests/integration/test_client_engine.py
_.num_completed  # eval/dispatch.py EvalDispatcher: tests/unit/test_eval_dispatch.py
_.num_pending  # (same)
_.hidden_states_shared_prefix  # models/torch_decoder.py: tests/unit/test_torch_decoder.py, test_warm_start_buckets.py
_.start_broker  # runner/broker_process.py: tests/integration/test_broker_*.py, benchmarks/broker_bench.py
_.unflatten_bucket  # sync/bucketing.py: the inverse of flatten_bucket, tests/unit/test_sync_bucketing.py
_.stage_senders  # sync/shard_plan.py ShardPlan: the senders of one stage, tests/unit/test_sync_shard_plan.py

# ---- in files other engineers own for now (the lead decides)
_.inflight_group_ids  # broker/core.py BrokerCore: tests/unit/test_broker_core*.py, benchmarks/scale.py
_.is_inflight  # broker/core.py BrokerCore: tests/unit/test_broker_core_indexes.py, benchmarks/simulate.py, scale.py
_.writeable  # broker/wire.py: numpy's ndarray.flags.writeable, set to make _NO_VERSIONS read-only
_.pieces  # broker/wire.py _fresh_pieces: the caller's list, extended in place (pieces += ...), not unused
