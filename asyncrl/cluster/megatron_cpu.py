"""Run megatron-core (local layer spec, fp32, gloo) on a machine without CUDA.

Contract
- ``apply_cpu_shims()`` is idempotent and does nothing when ``torch.cuda.is_available()``: on a
  GPU machine megatron-core runs unpatched. Call it before building any Megatron object (the
  actor does). It checks the megatron-core version first, because the shims touch private names
  that are only known to be right for ``SUPPORTED_MEGATRON_CORE``.
- ``cuda_as_cpu()`` is a context manager for the few Megatron calls that create tensors on
  ``"cuda"`` (optimizer construction, ``optimizer.step()``, grad-norm/clip, the grad scaler and
  optimizer state loading). It is a no-op with CUDA. It is *scoped*, not global, because a
  ``TorchFunctionMode`` costs a Python call per torch op: forward/backward run outside of it.

What is patched (process-wide, CPU only), and why:
1. ``torch.cuda.current_device()`` returns ``"cpu"``: RoPE, the global memory buffer and the DDP
   grad buffers pass it as ``device=``.
2. The model-parallel RNG tracker stores "CUDA" generator states: ``torch.cuda.get_rng_state``,
   ``torch.cuda.manual_seed`` and Megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
   are mapped to the CPU default generator. CPU dropout draws from that generator, so
   ``tracker.fork()`` keeps its meaning. ``model_parallel_cuda_manual_seed(seed)`` must still be
   called after ``initialize_model_parallel``.
3. ``transformer.utils.get_default_causal_mask`` (used when ``attention_mask=None``) builds its
   mask on CPU instead of ``device="cuda"``.
4. Pipeline parallelism: ``pipeline_parallel.schedules`` allocates its token counter with
   ``torch.zeros(..., device="cuda")`` (``forward_backward_pipelining_without_interleaving``);
   that module's ``torch`` name is replaced by a proxy of torch whose ``zeros``/``ones``/
   ``empty``/``tensor`` map a CUDA device to CPU (everything else is torch itself). The p2p
   receive buffers use ``torch.cuda.current_device()`` (shim 1); the actor turns Megatron's
   ``torch.cuda.synchronize()`` after batched p2p off with ``batch_p2p_sync=False`` on CPU.
   ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings at PP > 1) calls
   ``weight.data.cuda()``: build such a model inside ``cuda_as_cpu()``.
5. Inside ``cuda_as_cpu()``: factory calls with ``device="cuda"`` get ``device="cpu"``;
   ``Tensor.cuda()`` returns the tensor; ``Tensor.type()`` on a CPU tensor reports the CUDA type
   name (Megatron asserts ``grad.type() == "torch.cuda.FloatTensor"``); ``Tensor.is_cuda`` is
   True (so the optimizer's offload/reload helpers leave CPU tensors alone).

6. RoPE on packed ``thd`` sequences (context parallelism 1): ``rope_utils._apply_rotary_pos_emb_thd``
   gathers the frequencies of all segments at once (``freqs_of_packed_positions``) instead of slicing
   them per segment in Python, computes their ``cos``/``sin`` once per packed batch (not per layer, q
   and k), and applies them with Megatron's formula: the same values, bit for bit.

7. Mixture of experts (the alltoall token dispatcher, as on GPUs): the dispatcher's device-to-host copy
   stream (``torch.cuda.Stream``, ``current_stream``, ``stream``, events) is a synchronous stand-in
   (``token_dispatcher``'s ``torch`` is a proxy of torch with that ``cuda``), and its split sizes become
   numpy arrays as its device-to-host copy makes them on GPUs (``maybe_move_tensor_to_cpu`` leaves CPU
   tensors as tensors, which ``all_to_all_single`` refuses). gloo runs the variable-size all-to-all.
   ``bind_router_gemm_fallback`` (also needed on a GPU without TransformerEngine, so public) binds the
   router's ``te_general_gemm``, which megatron-core 0.16.1 defines only when TransformerEngine imports
   (without it every MoE forward raised NameError), to None: its own ``torch.mm`` fallback.

Not supported on CPU: ``sequence_parallel=True`` (needs TE/apex LayerNorm), the TE layer spec,
fp16/bf16 mixed precision in the optimizer.

Example::

    from asyncrl.cluster.megatron_cpu import apply_cpu_shims, cuda_as_cpu
    apply_cpu_shims()
    with cuda_as_cpu():
        opt = get_megatron_optimizer(opt_cfg, [ddp_model])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.

SUPPORTED_MEGATRON_CORE = "0.16.1"
"""The shims patch private megatron-core names; they are checked against this exact version."""

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def check_megatron_version(version: str | None = None) -> str:
    """Return the installed megatron-core version; raise if it is not the supported one."""
    if version is None:
        import megatron.core

        version = getattr(megatron.core, "__version__", "unknown")
    if version != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron-core=={version} is installed but asyncrl's CPU shims "
            f"(asyncrl/cluster/megatron_cpu.py) are written for megatron-core=={SUPPORTED_MEGATRON_CORE}: "
            f"`pip install megatron-core=={SUPPORTED_MEGATRON_CORE}`"
        )
    return version


def apply_cpu_shims() -> bool:
    """Patch torch.cuda / megatron-core for CPU. Returns True if the shims are (now) active."""
    global _APPLIED
    if cuda_available():
        return False
    if _APPLIED:
        return True
    check_megatron_version()

    # 1. current_device: used as a `device=` argument.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    # 2. RNG: the "CUDA" generator is the CPU default generator.
    _patch_rng()

    # 3. The default causal mask (attention_mask=None) on CPU.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def _causal_mask_cpu(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = _causal_mask_cpu
    fused_softmax.get_default_causal_mask = _causal_mask_cpu

    # 4. The pipeline schedules' `device="cuda"` token counter.
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchWithCpuFactories()

    # 6. RoPE on packed (thd) sequences without a Python loop over the segments (5 is cuda_as_cpu).
    _patch_packed_rope()

    # 7. The MoE layer's token dispatcher and router.
    _patch_moe()

    _APPLIED = True
    return True


def _patch_rng() -> None:
    """Shim 2: ``torch.cuda``'s and Megatron's "CUDA" RNG state calls use the CPU default generator."""

    def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def _set_rng_state(new_state: torch.Tensor, device: Any = -1) -> None:
        torch.set_rng_state(new_state)

    def _manual_seed(seed: int) -> None:
        # The generator itself, not torch.manual_seed (which calls torch.cuda.manual_seed_all).
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = _get_rng_state  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = _manual_seed  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom

    def _mg_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        assert not graph_safe, "CUDA-graph-safe RNG is not available on CPU"
        return torch.get_rng_state()

    def _mg_set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        assert not graph_safe, "CUDA-graph-safe RNG is not available on CPU"
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _mg_get_cuda_rng_state
    mrandom._set_cuda_rng_state = _mg_set_cuda_rng_state


def bind_router_gemm_fallback() -> None:
    """Shim 7, router: megatron-core's router gating reads ``moe_utils.te_general_gemm``, bound only when
    TransformerEngine imports; bind it to None (the ``torch.mm`` branch) where it is missing. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe() -> None:
    """Shim 7: the alltoall token dispatcher's CUDA streams and split sizes on CPU, the router's gemm."""
    from megatron.core.transformer.moe import token_dispatcher

    bind_router_gemm_fallback()
    token_dispatcher.torch = _TorchWithHostStreams()

    def splits_as_on_gpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = splits_as_on_gpu


class _HostStream:
    """The dispatcher's copy stream, its events and the current stream on CPU: everything is already done."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


class _HostCuda:
    """What ``token_dispatcher`` uses of ``torch.cuda``: one synchronous stream."""

    def __init__(self) -> None:
        self._stream = _HostStream()

    def Stream(self) -> _HostStream:  # torch.cuda's name
        return self._stream

    def current_stream(self) -> _HostStream:
        return self._stream

    def stream(self, stream: _HostStream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _TorchWithHostStreams:
    """``torch`` for megatron-core's token dispatcher: ``torch.cuda`` is ``_HostCuda``, the rest is torch."""

    cuda = _HostCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_packed_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_thd = packed_rope_thd(rope_utils._apply_rotary_pos_emb_thd)


def packed_rope_thd(megatron_thd):
    """A drop-in for megatron-core's unfused ``_apply_rotary_pos_emb_thd`` (``megatron_thd``, kept as
    ``.megatron``). Megatron slices the frequencies segment by segment (a slice per sequence and a ``cat``,
    then ``cos``/``sin``, for every layer, for q and for k); this gathers them once per packed batch
    (``freqs_of_packed_positions``), keeps their ``cos``/``sin`` for the calls that follow with the same
    ``cu_seqlens`` and ``freqs``, and applies them with Megatron's formula. Context parallelism (cp > 1),
    interleaved RoPE, MLA and partial rotary dimensions go to Megatron's function."""
    last: dict[str, Any] = {}

    def cos_sin(cu_seqlens, freqs, mscale, dtype):
        meta = (cu_seqlens._version, freqs._version, mscale, dtype)
        if not (last and last["cu"] is cu_seqlens and last["freqs"] is freqs and last["meta"] == meta):
            packed = freqs_of_packed_positions(cu_seqlens, freqs)  # [t, 1, 1, d]
            cs = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
            last.update(cu=cu_seqlens, freqs=freqs, meta=meta, value=cs)
        return last["value"]

    def packed_thd(
        t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
    ):
        if (
            cp_group is None
            or cp_group.size() != 1
            or rotary_interleaved
            or multi_latent_attention
            or freqs.shape[-1] != t.shape[-1]
        ):
            return megatron_thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        cos_, sin_ = cos_sin(cu_seqlens, freqs, mscale, t.dtype)
        x = t.unsqueeze(1)  # [t, 1, heads, d], as Megatron applies it
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return ((x * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)).squeeze(1)

    packed_thd.megatron = megatron_thd
    return packed_thd


def freqs_of_packed_positions(cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The RoPE frequencies of each packed token: ``freqs[j]`` for the j-th token of its segment, or, when
    ``freqs`` has one row per packed token (megatron-core's "exact mapping"), ``freqs`` itself."""
    total = int(cu_seqlens[-1])
    if freqs.size(0) == total:
        return freqs
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    pos = torch.arange(total, device=freqs.device) - torch.repeat_interleave(cu_seqlens[:-1].long(), lens.long())
    return freqs.index_select(0, pos)


def _cpuify_device(dev: Any) -> Any:
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    if isinstance(dev, int):  # an int device means a CUDA ordinal to torch factories
        return "cpu"
    return dev


class _TorchWithCpuFactories:
    """``torch`` for one Megatron module: its tensor factories put ``device="cuda"`` on CPU."""

    _FACTORIES = frozenset({"zeros", "ones", "empty", "tensor", "full"})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpuify_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


_IS_CUDA_GET = torch.Tensor.is_cuda.__get__  # compared with ==: each access makes a new method-wrapper


class _CudaAsCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            name = func(*args, **kwargs)
            if isinstance(name, str) and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if func == _IS_CUDA_GET:
            return True
        if "device" in kwargs:
            kwargs["device"] = _cpuify_device(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpuify_device(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """Scope in which Megatron's ``device="cuda"`` tensors land on CPU (no-op with CUDA)."""
    if cuda_available():
        yield
        return
    assert _APPLIED, "call apply_cpu_shims() first"
    with _CudaAsCpuMode():
        yield
