"""How many KV blocks a pool gets (EngineCore sizes every rank's pool with it; the Engine checks a CPU budget with
it before any weight is uploaded)."""
from __future__ import annotations

import math

from .. import _core
from .config import EngineConfig

_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def kv_blocks_for(config: EngineConfig, mc, dtype: str, device: str, max_seq_len: int) -> int:
    """Blocks the pool gets: EngineConfig.num_kv_blocks, else the CPU byte budget, else the CUDA
    memory fraction minus what is in use and an estimate of the step's activations and graphs; at most
    what max_num_seqs sequences of max_seq_len tokens can use."""
    block = _core.KVPool.block_bytes(mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim,
                                     dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if not device.startswith("cuda"):
        budget = config.cpu_kv_cache_bytes
    else:
        _core.empty_cache(device)  # blocks our allocator caches count as used in the driver's figure
        free, total = _core.device_memory_info(device)
        dsize = _DTYPE_BYTES[dtype]
        per_row = (mc.vocab_size + 4 * mc.intermediate_size + 8 * mc.hidden_size) * dsize
        graphs = sum(config.graph_sizes) * per_row if config.cuda_graphs else 0
        prefill = config.max_num_batched_tokens * per_row // 4 + config.max_num_seqs * mc.vocab_size * 4
        budget = int(config.gpu_memory_utilization * total) - (total - free) - graphs - prefill - (256 << 20)
    per_seq = math.ceil(max_seq_len / config.block_size)
    need = per_seq + 1
    # More than every sequence at full length (plus block 0) is never used at once: don't take it from
    # the device (or from other models sharing it). The prefix cache keeps what fits in this.
    blocks = min(budget // block, config.max_num_seqs * per_seq + 1)
    if blocks < need:
        raise ValueError(f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {max(blocks, 0)} blocks of "
                         f"{config.block_size} tokens; one sequence of max_seq_len {max_seq_len} needs {need}: "
                         f"raise the budget (EngineConfig.cpu_kv_cache_bytes / gpu_memory_utilization) "
                         f"or lower max_seq_len")
    return int(blocks)
