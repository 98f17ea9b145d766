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
  same addresses (engine/rollout/vmm.py);
- capture runs with every slot idle (kv_len 0), before any prefill of the call: the warm-up decodes
  write K/V into column 0 of the slots only;
- a step's picks are copied out (`copy_out`) before the next replay overwrites them.

Run: python -m pytest -m gpu tests/engine/rollout/test_native_gpu.py
"""

from __future__ import annotations

import torch

from engine.rollout import kernels
from engine.rollout.base import SamplingParams
from engine.rollout.model import KVCache, NativeCausalLM
from engine.rollout.sampling import plain


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
