"""The static-batch torch.compile peer of bench/steady_decode.py (issue 33): HF's model (its own modules and
attention, nothing written here), a StaticCache of `batch` rows, one decode step compiled. Two ways to compile
the same math, so both can be compared on the GPU:

- "full" (the gpt-fast recipe): torch.compile(m.forward, mode="reduce-overhead", fullgraph=True). Dynamo traces
  every decoder layer unrolled and Inductor generates code for all of them; CUDA graph trees record the step.
- "regional" (PyTorch's regional compilation recipe): each decoder layer compiled on its own (fullgraph,
  dynamic=False). Under inline_inbuilt_nn_modules a layer's parameters are graph inputs, so the N layers share
  one compiled graph: cold start pays for one layer, not N. Embedding, mask, rotary, final norm and lm_head stay
  eager; on CUDA the whole step (argmax and the token fed back included) is captured into one
  torch.cuda.CUDAGraph with static buffers and replayed per step, so the eager parts cost no host time either.

Both initialise the cache before compiling: StaticCache allocates its tensors on the first update, and a
guard on that (layer.is_initialized) made the first two steps compile the whole model twice.
"""
from __future__ import annotations

import inspect

MODES = ("regional", "full")
_CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5.x renames past_key_values to cache


class _OneLayerCache:
    """The cache one decoder layer sees in regional mode: its own StaticLayer, whatever layer_idx the layer
    passes. Handed the model's whole StaticCache, every layer compiled a graph of its own (the layer index it
    looks its cache layer up with is a constant dynamo guards): a recompile per layer, past the recompile limit."""

    is_compileable = True

    def __init__(self, layer):
        self.layer = layer

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.layer.update(key_states, value_states)


def _init_cache(m, batch: int, max_len: int, device):
    """A StaticCache of `batch` rows and `max_len` positions, its tensors allocated now (not on the first
    compiled step: see the module docstring)."""
    import torch
    from transformers import StaticCache

    cfg = m.config
    # max_batch_size/device/dtype: older transformers take them here, newer ones size the cache lazily
    cache = StaticCache(config=cfg, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=m.dtype)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if hasattr(cache, "early_initialization"):
        cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, m.dtype, torch.device(device))
    return cache


def seek(cache, position: int) -> None:
    """Every row's next token goes to `position` (in place: the compiled step holds these tensors' addresses).
    A StaticLayer keeps its length as a device tensor (transformers 5.24 does), which is also what lets a recorded
    step advance the positions by itself; an older cache takes a cache_position argument this peer never passes."""
    import torch

    layers = getattr(cache, "layers", None) or []
    lengths = [getattr(layer, "cumulative_length", None) for layer in layers]
    if not lengths or not all(isinstance(n, torch.Tensor) for n in lengths):
        raise RuntimeError("the static peer needs a transformers whose StaticCache layers keep cumulative_length "
                           "as a tensor (5.x)")
    for length in lengths:
        length.fill_(position)


class StaticPeer:
    """`step()` runs one greedy decode step of all rows: the token in `self.token` [batch, 1] goes in, the
    argmax of its logits comes back into `self.token`. `seek(position)` moves every row to a position."""

    def __init__(self, m, batch: int, max_len: int, mode: str, device: str, note=lambda what: None):
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.m, self.mode, self.device, self.note = m, mode, device, note
        self.cuda = str(device).startswith("cuda")
        m.config._attn_implementation = "sdpa"
        self.cache = _init_cache(m, batch, max_len, device)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.logits = None
        params = inspect.signature(m.forward).parameters
        self.cache_kwarg = next((n for n in _CACHE_KWARGS if n in params), None)
        if self.cache_kwarg is None:
            raise ValueError(f"{type(m).__name__}.forward takes none of {_CACHE_KWARGS}: not an HF causal LM")
        self.graph = None
        if mode == "full":
            self._forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
        else:
            for i, layer in enumerate(m.model.layers):
                layer.compile(fullgraph=True, dynamic=False)
                m.model.layers[i] = _wrap(layer, self.cache.layers[i])
            self._forward = m.forward
        note(f"{mode} peer set up")

    def seek(self, position: int) -> None:
        seek(self.cache, position)

    def _eager_step(self):
        import torch

        with torch.no_grad():
            out = self._forward(self.token, use_cache=True, **{self.cache_kwarg: self.cache})
            self.logits = out.logits[:, -1]
            self.token.copy_(self.logits.argmax(-1, keepdim=True))

    def step(self):
        if self.graph is not None:
            self.graph.replay()
            return
        if self.cuda and self.mode == "full":
            import torch

            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last step's graph outputs may be reused
        self._eager_step()

    def capture(self, position: int, warmup: int = 3) -> None:
        """Compile (the first calls) and, in regional mode on CUDA, record the whole step into one CUDA graph.
        Leaves every row at `position`."""
        import torch

        self.seek(position)
        if not (self.cuda and self.mode == "regional"):  # full mode: compile, then reduce-overhead records
            for i in range(warmup):
                self.step()
                self.note(f"warm-up step {i + 1} done")
            self.seek(position)
            return
        side = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                self._eager_step()
                torch.cuda.synchronize()
                self.note(f"warm-up step {i + 1} done")
        torch.cuda.current_stream().wait_stream(side)
        self.seek(position)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records, runs nothing: the positions stay where seek put them
            self._eager_step()
        torch.cuda.synchronize()
        self.note("CUDA graph recorded")


def _wrap(layer, cache_layer):
    import torch

    class RegionalLayer(torch.nn.Module):
        """An HF decoder layer (compiled) called with its own one-layer cache in place of the model's."""

        def __init__(self):
            super().__init__()
            self.inner = layer
            self.own_cache = _OneLayerCache(cache_layer)

        def forward(self, hidden_states, *args, **kwargs):
            for name in _CACHE_KWARGS:  # the model passes its whole cache under one of these names
                if name in kwargs:
                    kwargs[name] = self.own_cache
            return self.inner(hidden_states, *args, **kwargs)

    return RegionalLayer()
