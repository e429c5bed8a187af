"""Loading a custom data buffer: which contract a class meets, and the buffer the core runs.

``rollout_buffer.custom_data_buffer_path = "module:Class"`` names either a subclass of the batched
``asyncrl.broker.buffer.DataBuffer`` or a class written to Miles' contract (``asyncrl.broker.miles_buffer``).
``buffer_interface`` tells them apart without constructing anything and names what a class meeting neither
lacks; ``check_custom_buffer`` is that check on a config (the launcher runs it, dry run or not, as a
``ConfigError`` naming the key); ``make_data_buffer`` builds the buffer the core runs.

    kind = buffer_interface(MyBuffer)          # "batched" or "miles"; ValueError naming what is missing
    buf = make_data_buffer(settings, "my_pkg.buffers:MyBuffer")
"""

from __future__ import annotations

import inspect
from typing import Literal, Optional

from asyncrl.broker.buffer import BufferSettings, DataBuffer, DefaultDataBuffer
from asyncrl.broker.miles_buffer import MilesBufferAdapter
from asyncrl.config.checks import ConfigError
from asyncrl.config.validate import resolve_hook as import_path  # the one module:attr resolver

KEY = "rollout_buffer.custom_data_buffer_path"


def buffer_interface(cls: object) -> Literal["batched", "miles"]:
    """Which of the two accepted buffer contracts ``cls`` meets: ``batched`` (a ``DataBuffer`` subclass) or ``miles``
    (Miles' ``async def put(input)``, ``async def get()``, ``get_metrics()``, constructed with one argument, the
    ``DataBufferConstructorInput``). ``ValueError`` naming what is missing otherwise (no import, no construction)."""
    if not isinstance(cls, type):
        raise ValueError(f"is a {type(cls).__name__}, not a class")
    if issubclass(cls, DataBuffer):
        if cls.__abstractmethods__:
            raise ValueError(f"is a DataBuffer subclass that leaves {sorted(cls.__abstractmethods__)} abstract")
        return "batched"
    problems = []
    for m in ("put", "get", "get_metrics"):
        f = getattr(cls, m, None)
        if not callable(f):
            problems.append(f"no {m}()")
        elif m != "get_metrics" and not inspect.iscoroutinefunction(f):
            problems.append(f"{m}() is not 'async def'")
    if getattr(cls, "__abstractmethods__", None):
        problems.append(f"{sorted(cls.__abstractmethods__)} left abstract")
    try:
        inspect.signature(cls).bind(None)
    except TypeError:
        problems.append("the constructor does not take the one argument DataBufferConstructorInput(args, on_evict)")
    except ValueError:  # no signature to read (a builtin): constructing it will tell
        pass
    if problems:
        raise ValueError(
            f"meets neither buffer contract: as Miles' DataBuffer (asyncrl.broker.miles_buffer): {'; '.join(problems)}"
            f"; and it is not a subclass of asyncrl.broker.buffer.DataBuffer"
        )
    return "miles"


def make_data_buffer(settings: BufferSettings, custom_path: Optional[str]) -> DataBuffer:
    """The built-in buffer, a ``DataBuffer`` subclass, or a Miles-contract class wrapped in ``MilesBufferAdapter``."""
    if custom_path is None:
        return DefaultDataBuffer(settings)
    cls = import_path(custom_path, KEY)
    try:
        kind = buffer_interface(cls)
    except ValueError as e:
        raise ValueError(f"{KEY}: {custom_path!r} {e}") from None
    if kind == "batched":
        return cls(settings)
    return MilesBufferAdapter(settings, cls, name=custom_path)


def check_custom_buffer(cfg) -> list[str]:
    """The config's custom buffer (if any) imports and meets a contract (``ConfigError`` naming the key and what is
    missing, before anything starts); the dry run's line saying which contract it meets."""
    spec = cfg.rollout_buffer.custom_data_buffer_path
    if not spec:
        return []
    try:
        kind = buffer_interface(import_path(spec, KEY))
    except ValueError as e:
        raise ConfigError(f"{KEY}: {spec!r} {e}") from None
    what = (
        "Miles' DataBuffer contract (async put/get; evictions through on_evict), run by MilesBufferAdapter"
        if kind == "miles"
        else "a batched asyncrl.broker.buffer.DataBuffer subclass"
    )
    return [f"{KEY} = {spec!r}: {what}"]
