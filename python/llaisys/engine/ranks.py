"""Tensor parallelism on one host (issue 30): a model split over N ranks, each a model share, KV pool and
runner on its own device, driven as one by `_core.RankGroup` (one thread per rank, in C++).

Why one process with a driver thread per GPU, not a process per GPU with the step's arrays broadcast: the
scheduler, block manager and detokenizer stay single (one Python step loop, as at N = 1), nothing is
serialised or sent per step, and a rank's host work (uploads, graph replay) runs beside the others' without
the GIL. The cost: the ranks share one process, so a rank cannot die alone; a rank that fails or stalls breaks
the group (RankGroup aborts the communicators) and the engine fails with that error within the timeout.

On the CPU the ranks are threads with an in-process group: what CI runs to check that a split model computes
what the whole one does.
"""
from __future__ import annotations

import ctypes
import logging
import sys

import numpy as np

from .. import _core, quant
from .._tensor import _wrap
from ..loader.shard import Cut, check_tensor_parallel, cut_dense, rank_cut, shard_blocks


def rank_devices(device: str, world: int) -> list[str]:
    """The devices of `world` ranks starting at `device` (cuda:i .. cuda:i + world - 1; the CPU: world
    times 'cpu'); ValueError where the machine has fewer GPUs."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world!r}")
    if not device.startswith("cuda"):
        return [device] * world
    first = int(device.split(":")[1]) if ":" in device else 0
    count = _core.cuda_device_count()
    if first + world > count:
        raise ValueError(f"tensor_parallel_size {world} from {device} needs GPUs {first}..{first + world - 1}, but "
                         f"this machine shows {count} (CUDA_VISIBLE_DEVICES decides which)")
    kinds = sorted({_core.cuda_device_name(first + r) for r in range(world)})
    if len(kinds) > 1:  # a split runs at the slowest GPU's pace and each rank's memory differs: refused
        raise ValueError(f"tensor_parallel_size {world} from {device} would mix GPU kinds ({', '.join(kinds)}): "
                         f"choose GPUs of one kind with --device / CUDA_VISIBLE_DEVICES")
    if world > 1 and not _core.build_info()["nccl"]:
        raise RuntimeError("tensor_parallel_size > 1 on CUDA needs NCCL, and this build of llaisys has none: install "
                           "the nvidia-nccl-cu13 wheel (pip install .[cuda]) and rebuild; "
                           "llaisys.build_info()['nccl'] says what a build has")
    return [f"cuda:{first + r}" for r in range(world)]


def make_models(config, dtype: str, devices: list[str], fused, timeout_s: float, node=None) -> list:
    """One model per rank of this process: the whole model for one rank, else each rank's share (checked
    before any weight is read: check_tensor_parallel names everything that does not divide). node: this
    process's end of a group spanning processes (engine/nodes.py), whose communicators join the others'."""
    world = node.world if node is not None else len(devices)
    check_tensor_parallel(config, world)
    if world == 1:
        return [_core.create_model(config.core, dtype, devices[0], fused=fused)]
    comms = node.make_comms(devices) if node is not None else _core.local_group(devices[0], world, timeout_s)
    return [_core.create_model(config.core, dtype, d, fused=fused, comm=c) for d, c in zip(devices, comms)]


def load_weights(models: list, config, weights, quantized: bool, progress: bool, source: str,
                 first_rank: int = 0, world: int | None = None) -> None:
    """Uploads every weight to every rank of this process (global ranks first_rank.. of `world`, default
    all of them), each rank's cut (a slice of the one tensor the mapping holds at a time: no rank, and not
    the host, ever holds the whole model); progress per rank when done."""
    from tqdm import tqdm

    world = world or len(models)
    table = {e[0]: e for e in _core.weight_table(config.core)}
    names = list(weights)
    remade = {}  # {name: (file format, a rank's columns, what its part became)}: cuts inside the file's blocks
    devices = ", ".join(dict.fromkeys(m.device for m in models))
    # a terminal gets a bar, erased when done; a log gets one line per rank at the end instead of the redraws
    bar = progress and getattr(sys.stderr, "isatty", lambda: False)()
    for name in tqdm(names, desc=f"uploading to {devices}", unit="tensor", disable=not bar, file=sys.stderr,
                     leave=False):
        entry = table.get(name)  # None: a name the model does not know, which it rejects (load_weight raises)
        raw = weights.pop_raw(name) if quantized else None
        dense = None if raw is not None else weights.pop(name)
        for rank, model in enumerate(models, first_rank):
            cut = rank_cut(entry, config, world, rank) if entry is not None else Cut(-1)
            if raw is not None:
                _load_blocks(model, name, raw, cut, remade)
            else:  # weights may be read-only views of the mapped checkpoint: the model never writes them
                model.load_weight(name, _wrap(np.ascontiguousarray(cut_dense(dense, cut))))
        if raw is not None and entry is not None and _copied(models, raw[0], raw[2], entry, config):
            weights.release_raw(name)
    missing = models[0].missing_weights()
    if missing:
        raise ValueError(f"{source}: missing weights, e.g. {missing[:3]}")
    for line in _remade_lines(remade, models[0].dtype, world):
        _say(line, progress)
    if progress and not bar:
        again = f", {len(remade)} of them re-made from blocks the split cuts" if remade else ""
        for rank, model in enumerate(models, first_rank):
            who = f"rank {rank}/{world} " if world > 1 else ""
            print(f"llaisys: {who}uploaded {len(names)} tensors to {model.device} "
                  f"({model.weight_bytes / 2**20:.1f} MiB){again}", file=sys.stderr, flush=True)


def _load_blocks(model, name: str, raw: tuple, cut: Cut, remade: dict) -> None:
    """A GGUF-block weight's part: the file's blocks as stored (a view of the mapped file) where the cut falls
    on whole blocks, else re-made (shard_blocks says how; noted in `remade`)."""
    part = shard_blocks(name, *raw, cut)
    if part.remade:
        remade[name] = (raw[0], cut.stop - cut.start, part.remade)
    if part.dense is not None:
        model.load_weight(name, _wrap(part.dense))
    else:
        model.load_quant_weight(name, quant.from_numpy(*part.blocks))


def _copied(models: list, fmt: str, cols: int, entry: tuple, config) -> bool:
    """Whether every model keeps its own copy of a block weight, so that the file's pages of it can be dropped:
    CPU models hold the projections of a format in the split layout where quant.cpu_layout says so (a host
    copy; Decoder::load_quant_weight), all but an untied embedding, which they read from the file's blocks."""
    lookup_only = entry[5] == "embed" and not config.tie_word_embeddings
    return not lookup_only and all(str(m.device) == "cpu" for m in models) and quant.cpu_layout(fmt, cols) != "file"


def _remade_lines(remade: dict, dtype: str, world: int) -> list[str]:
    """One line per tensor whose parts were re-made because the split cuts the file's blocks."""
    lines = []
    for name, (fmt, width, target) in remade.items():
        elems = quant.format_info(fmt)["block_elems"]
        kept = f"kept dense in {dtype}" if target == "dense" else f"re-quantized to {target.upper()}"
        lines.append(f"{name}: {fmt.upper()} rows cut into {width} columns a rank (tensor_parallel_size {world}) do "
                     f"not fall on its {elems}-column blocks: {kept} on every rank")
    return lines


def _say(line: str, progress: bool) -> None:
    """A load note: on stderr with the progress lines, else to the llaisys.engine logger."""
    if progress:
        print(f"llaisys: {line}", file=sys.stderr, flush=True)
    else:
        logging.getLogger("llaisys.engine").info(line)


_LEFT_BEHIND: list = []  # what a broken group's left-behind ranks may still use: never freed (keep_if_left_behind)


def keep_if_left_behind(core, *owners) -> None:
    """At close: a rank of a broken group that never returned from its last call (a driver call or collective the
    abort did not end) may return into its runner, model and KV pool at any time, so they are kept for the
    process's life (with a line saying so) instead of being freed under it."""
    runner = getattr(getattr(core, "runner", None), "runner", None)
    group = getattr(runner, "_runner", runner)  # node 0's NodeProxy wraps its runner
    stuck = getattr(group, "left_behind", 0)
    if not stuck:
        return
    if not _LEFT_BEHIND:  # one reference more, so not even the interpreter's finalization frees the list
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_LEFT_BEHIND))
        _core.set_leak_warnings(False)  # they are kept on purpose: no list of "leaked" instances at exit
    _LEFT_BEHIND.append((core, *owners))
    _say(f"{stuck} rank(s) of the broken tensor-parallel group never returned from their last call; their model "
         f"and KV cache stay allocated until the process exits", progress=True)
