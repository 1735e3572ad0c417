"""The batched engine: API (engine.py), step loop and requests (loop.py, request.py), scheduler, block
manager with prefix caching, model runner and EngineConfig. docs/ARCHITECTURE.md has the map."""
from .config import EngineConfig
from .engine import DEFAULT_MAX_SEQ_LEN, Engine
from .request import GenerationResult, Request, StreamChunk

__all__ = ["Engine", "EngineConfig", "GenerationResult", "Request", "StreamChunk", "DEFAULT_MAX_SEQ_LEN"]
