"""The native engine's decode step as CUDA graphs: one per (row count, whether sampling runs inside),
captured when a call first needs them, all in one memory pool.

A graph over rows 0..R-1 decodes those rows (row i is cache slot i, so attention reads the cache in
place) from inputs the engine keeps on the device, each slot's last token and cached count, and
writes their hidden states to `hidden`. With sampling inside, it goes on through the lm_head and the
Triton sampler (engine/rollout/kernels.py) to `picked`, each row's (token, logprob), then writes the
next step's inputs: the token, and the cached count up by one unless the row is idle at 0. A
sampling step is then one uniform draw, one replay and one copy of `picked` to the host.

Invariants:
- a graph reads its inputs (`ids`, `kv_lens`, `uniform`, `inv_t`) and the KV cache at the addresses
  they had at capture: the engine writes into them in place, and a released cache comes back at the
  same addresses (engine/vmm.py);
- capture runs with every slot idle (kv_len 0), before any prefill of the call: the warm-up decodes
  write K/V into column 0 of the slots only;
- a step's picks are copied out (`copy_out`) before the next replay overwrites them.

`PrefillGraphs` does the same for a small prefill step of fresh prompts, one graph per (rows,
columns), so that it costs its device time, not its kernels' launches on the host.

Run: python -m pytest -m gpu tests/engine/rollout/test_native_gpu.py
"""

from __future__ import annotations

import torch

from rlflow.engine.rollout import kernels
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.model import KVCache, NativeCausalLM
from rlflow.engine.rollout.sampling import plain


class DecodeGraphs:
    def __init__(self, model: NativeCausalLM, cache: KVCache, ids: torch.Tensor, kv_lens: torch.Tensor,
                 max_len: int, row_sizes: list[int]) -> None:
        self.model, self.cache, self.max_len, self.row_sizes = model, cache, max_len, row_sizes
        self.ids, self.kv_lens = ids, kv_lens  # [slots] each slot's last token and tokens cached: the engine's
        slots, device = len(ids), ids.device
        self.captured: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (rows, sampled)
        self.hidden = torch.zeros(slots, model.config.hidden_size, dtype=model.model.embed_tokens.weight.dtype,
                                  device=device)
        self.uniform = torch.zeros(slots, device=device)  # each row's draw for the sampler
        self.inv_t = torch.ones(1, device=device)  # 1 / temperature
        self.picked = torch.zeros(2, slots, device=device)  # [2, slots] (token, logprob) by row, float32
        self._host = torch.zeros(2, slots, pin_memory=True)  # `picked`, copied out step by step
        self._copied = torch.cuda.Event()

    def samples(self, params: SamplingParams) -> bool:
        """Whether decode steps with `params` sample inside the graphs: plain sampling, Triton at hand."""
        return plain(params) and kernels.available(self.hidden)

    def capture(self, sampled: bool) -> None:
        """Capture the graphs of every row count, largest first (the smaller ones fit in its pool), unless
        they exist. Call it with every slot idle and under inference mode."""
        if (self.row_sizes[-1], sampled) in self.captured:
            return
        pool = None
        for rows in reversed(self.row_sizes):
            self._body(rows, sampled)  # warm-up outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(rows, sampled)
            pool = graph.pool()
            self.captured[(rows, sampled)] = graph
        torch.cuda.synchronize()

    def decode(self, rows: int) -> torch.Tensor:
        """Replay the decode of rows 0..rows-1; their hidden states [rows, H]."""
        self.captured[(rows, False)].replay()
        return self.hidden[:rows]

    def launch_sampled(self, rows: int, generator: torch.Generator) -> None:
        """Queue a decode of rows 0..rows-1 that samples too: their draws, then one replay; the
        (token, logprob) pairs land in `picked`."""
        self.uniform[:rows].uniform_(generator=generator)
        self.captured[(rows, True)].replay()

    def copy_out(self) -> None:
        """Queue the copy of the last sampling step's picks to the host, behind that step."""
        self._host.copy_(self.picked, non_blocking=True)
        self._copied.record()

    def picks(self) -> tuple[list[float], list[float]]:
        """(tokens, logprobs) by row, as `copy_out` took them; waits for that copy only."""
        self._copied.synchronize()
        tokens, logprobs = self._host.tolist()
        return tokens, logprobs

    def _body(self, rows: int, sampled: bool) -> None:
        hidden = self.model.decode(self.ids[:rows], self.kv_lens[:rows], self.cache, self.max_len)
        if not sampled:
            self.hidden[:rows] = hidden
            return
        tokens, logprobs = kernels.categorical_sample(self.model.logits(hidden), self.inv_t, self.uniform[:rows])
        self.picked[0, :rows], self.picked[1, :rows] = tokens, logprobs
        self.ids[:rows] = tokens
        self.kv_lens[:rows] += self.kv_lens[:rows] > 0


class PrefillGraphs:
    """The prefill of P fresh prompts, right-padded to S columns, as a CUDA graph per (P, S), captured
    when first needed, all in one memory pool. A small prefill step is bound by the host: some 330
    kernel launches (at 0.5B), each costing the host more than the device its work. Columns are
    padded to four widths an octave (`width`), so that few graphs serve prompts of any length.

    Invariants:
    - a graph writes its rows' K/V into the slots its `slots` input names, at columns 0..S-1, and
      leaves each row's hidden state at column `last` in its output [P, H], valid until its next replay;
    - a step runs as a graph where `columns` gives it a width: at most `tokens` tokens (the pool holds
      about one such forward's activations), at most `MOST` graphs; other steps run eagerly."""

    MOST = 256  # graphs kept: each (rows, width) pair met is one, and serving meets many
    # steps whose matmuls (2 x parameters FLOPs a token) come under this: about what the device does at
    # ~1 PFLOP/s while the host launches a prefill forward eagerly (~10 ms), so such a step is bound
    # by the host. With the default budget: steps of up to 8,192 tokens at 0.5B, ~4,000 at 1.5B, ~800 at 7B.
    FLOPS = 1.25e13

    def __init__(self, model: NativeCausalLM, cache: KVCache, budget: int) -> None:
        self.model, self.cache = model, cache
        self.tokens = min(budget, int(self.FLOPS // (2 * sum(p.numel() for p in model.parameters()))))
        self.captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def width(n: int) -> int:
        """n columns rounded up to a multiple of a quarter of the octave below n (16 at least)."""
        step = max(16, 1 << max(0, n.bit_length() - 3))
        return -(-n // step) * step

    def columns(self, rows: int, longest: int, room: int) -> int | None:
        """The columns of a graph for a step of `rows` fresh prompts of at most `longest` tokens, within
        `room` tokens a step and the slot's length alike; None where the step is not one for a graph."""
        width = self.width(longest)
        return width if rows * width <= min(self.tokens, room) and width <= self.cache.shape[3] else None

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            last: torch.Tensor) -> torch.Tensor | None:
        """The prefill of `ids` and `positions` [P, S] (S from `columns`) into `slots` [P] as a graph
        replay: each row's hidden state at its column `last` [P], [P, H]; None once `MOST` are kept."""
        P, S = ids.shape
        if (P, S) not in self.captured:
            if len(self.captured) == self.MOST:
                return None
            self._capture(ids, positions, slots, last)
        graph, inputs, out = self.captured[P, S]
        for static, given in zip(inputs, (ids, positions, slots, last)):
            static.copy_(given)
        graph.replay()
        return out

    def _capture(self, *given: torch.Tensor) -> None:
        inputs = [x.clone() for x in given]
        self._body(*inputs)  # warm-up outside capture: it writes what the replay will
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(*inputs)
        self.captured[given[0].shape[0], given[0].shape[1]] = graph, inputs, out

    def _body(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              last: torch.Tensor) -> torch.Tensor:
        hidden = self.model(ids, positions, self.cache, slots)  # [P, S, H]
        return hidden[torch.arange(len(ids), device=ids.device), last]
