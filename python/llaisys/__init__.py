"""llaisys: an LLM inference engine (Qwen2, Qwen3, Llama, Mistral, GPT-NeoX, Gemma 3).

Tensors, memory and streams come from the C++ core (``llaisys._core``); the engine, loaders,
tokenizer, chat templates, sampling policy and CLI live here in Python.
"""
from __future__ import annotations

import os as _os

# Developers may point at a CMake build directory holding _core*.so instead of reinstalling
# (README.md, "Building with CUDA", has the commands). Installed wheels never set this.
if _os.environ.get("LLAISYS_BUILD_DIR"):
    __path__.insert(0, _os.path.abspath(_os.environ["LLAISYS_BUILD_DIR"]))

from . import _core  # noqa: E402
from ._tensor import Tensor, empty, from_dlpack, tensor, zeros  # noqa: E402
from ._runtime import (  # noqa: E402
    Event,
    Stream,
    build_info,
    cuda_device_count,
    cuda_is_available,
    current_stream,
    empty_cache,
    memory_stats,
    new_stream,
    reset_peak_memory_stats,
    set_current_stream,
    synchronize,
)
from . import ops, functional  # noqa: E402

__version__ = build_info()["version"]


def __getattr__(name):  # the engine pulls in tokenizers/jinja2: import it on first use
    if name in ("Engine", "EngineConfig", "GenerationResult", "StreamChunk"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'llaisys' has no attribute {name!r}")


__all__ = [
    "Tensor", "tensor", "empty", "zeros", "from_dlpack", "ops", "functional", "build_info",
    "memory_stats", "reset_peak_memory_stats", "empty_cache", "synchronize", "current_stream",
    "new_stream", "set_current_stream", "Stream", "Event", "cuda_device_count", "cuda_is_available",
    "Engine", "EngineConfig", "GenerationResult", "StreamChunk",
]
