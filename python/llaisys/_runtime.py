"""Build info, devices, memory statistics, streams and events."""
from __future__ import annotations

from . import _core

Stream = _core.Stream
Event = _core.Event
cuda_device_count = _core.cuda_device_count
set_current_stream = _core.set_current_stream


def build_info() -> dict:
    """What this build contains: version, CUDA (and its version/architectures), compiler, OpenMP."""
    return dict(_core.build_info())


def cuda_is_available() -> bool:
    """True when this build has the CUDA backend and a GPU is visible."""
    return bool(_core.build_info()["cuda"]) and _core.cuda_device_count() > 0


def _dev(device) -> str:
    return str(device)


def memory_stats(device: str = "cpu") -> dict:
    """Bytes ``allocated``/``reserved``/``peak`` and counts of ``device_mallocs``/``device_frees``."""
    return dict(_core.memory_stats(_dev(device)))


def reset_peak_memory_stats(device: str = "cpu") -> None:
    _core.reset_peak_memory_stats(_dev(device))


def empty_cache(device: str = "cuda") -> None:
    """Return cached, unused device blocks to the driver."""
    _core.empty_cache(_dev(device))


def synchronize(device: str = "cuda") -> None:
    """Wait for all queued work on ``device``; errors raised by kernels surface here."""
    _core.synchronize(_dev(device))


def current_stream(device: str = "cuda") -> Stream:
    return _core.current_stream(_dev(device))


def new_stream(device: str = "cuda") -> Stream:
    return _core.new_stream(_dev(device))
