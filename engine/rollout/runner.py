"""The native engine's model runner: the device side of what the scheduler (engine/rollout/scheduler.py)
decides. It holds the model, the slot KV cache and each slot's decode inputs on the device, lays
out and runs prefill (chunk by chunk where a prompt is long), runs decode steps eagerly or as CUDA
graphs (engine/rollout/graphs.py), and copies K/V between slots.

Invariants:
- each slot's next decode input (its last token, `ids`) and cached count (`kv_lens`) stay on the
  device: every step writes them from its samples, so a decode step copies nothing in. A decode runs
  rows 0..R-1 with row i on slot i; an idle row (kv_len 0) is computed and dropped, writing its K/V
  to column 0 only, which `col0` keeps for a slot that holds a history (`keep`, `restore`);
- with `memory_fraction` > 0 on CUDA, the KV cache takes at most that fraction of the device's
  free memory, and `max_slots` shrinks to what fits (the minimum over tensor-parallel ranks);
- on CUDA, the only place graphs exist, a released cache comes back at the same addresses
  (engine/vmm.py), so the graphs that point into it are kept.

Run: the tests in tests/engine/rollout/test_native.py and, on a GPU, test_native_gpu.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.graphs import DecodeGraphs, PrefillGraphs
from rlflow.engine.rollout.model import KVCache, NativeCausalLM, head_dim
from rlflow.engine.rollout.scheduler import Move, Seq, row_sizes
from rlflow.engine.tensors import to_device


@dataclass
class Prefill:
    """A prefill under way: one row per distinct prompt, right-padded; its chunks go in one an engine step."""
    batch: list[Seq]
    owner: torch.Tensor  # [B] each sequence's row
    ids: torch.Tensor  # [P, S]
    positions: torch.Tensor  # [P, S]
    slots: torch.Tensor  # [P]
    cached: torch.Tensor  # [P] tokens each row's slot already holds (a continued history)
    lens: list[int]  # what each row prefills
    continued: bool
    reach: int  # the most any row's slot already holds
    graphed: bool  # whether it runs as a prefill graph (then in one step)
    chunk: int  # columns an engine step takes in
    done: int = 0  # columns of `ids` already in


class ModelRunner:
    def __init__(self, model: NativeCausalLM, max_slots: int, max_len: int, max_prefill_tokens: int,
                 cuda_graphs: bool, memory_fraction: float) -> None:
        self.model = model
        weight = model.model.embed_tokens.weight
        self.device, cfg = weight.device, model.config
        if memory_fraction > 0 and self.device.type == "cuda":
            per_slot = 2 * cfg.num_hidden_layers * model.kv_heads * max_len * head_dim(cfg) * weight.itemsize
            max_slots = min(max_slots, int(torch.cuda.mem_get_info(self.device)[0] * memory_fraction) // per_slot)
            if model.tp.size > 1:  # TP ranks schedule in lockstep: the same slots on every one
                agreed = torch.tensor([max_slots], device=self.device)
                torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=model.tp.group)
                max_slots = int(agreed.item())
            if max_slots < 1:
                raise ValueError(f"memory_fraction {memory_fraction} leaves no room for one {max_len}-token slot")
        self.max_slots, self.max_len = max_slots, max_len
        self.row_sizes = row_sizes(max_slots)
        self.cache = KVCache(cfg.num_hidden_layers, max_slots, max_len, model.kv_heads, head_dim(cfg),
                             weight.dtype, self.device)
        # an idle slot's column 0 as it was cached: idle decode rows scribble there (see `decode`)
        self.col0 = torch.zeros(2, cfg.num_hidden_layers, max_slots, model.kv_heads, head_dim(cfg),
                                dtype=weight.dtype, device=self.device)
        self.ids = torch.zeros(max_slots, dtype=torch.long, device=self.device)  # each slot's last token
        self.kv_lens = torch.zeros(max_slots, dtype=torch.long, device=self.device)  # and tokens cached
        self.padded = 0  # prefill's tokens computed, padding included
        self.graphs: DecodeGraphs | None = None  # decode as CUDA graphs; None = eager, as on CPU
        self.prefills: PrefillGraphs | None = None  # small prefill steps as graphs too
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.cache, self.ids, self.kv_lens, max_len, self.row_sizes)
            if model.tp.size == 1:
                self.prefills = PrefillGraphs(model, self.cache, max_prefill_tokens)  # its pool: one such step

    def begin(self, params: SamplingParams) -> bool:
        """A call begins with every slot idle; returns whether its decode steps sample inside the graphs."""
        self.ids.zero_()
        self.kv_lens.zero_()
        if self.graphs is None:
            return False
        in_graph = self.graphs.samples(params)
        with torch.inference_mode():  # before any prefill: warm-up decodes scribble on the slots'
            self.graphs.capture(in_graph)  # column 0 only, which a kept history gets back from `col0`
        if in_graph:
            self.graphs.inv_t.fill_(1.0 / params.temperature)
        return in_graph

    def slots(self, seqs: list[Seq]) -> torch.Tensor:
        return to_device(torch.tensor([s.slot for s in seqs]), self.device)

    def place(self, seqs: list[Seq], sources: list[int] | None = None) -> None:
        """Ready `seqs`, each in its slot with its first `cached` prompt tokens there, for decode
        steps to feed the rest: a continued history's column 0 back where idle rows wrote, or, from
        `sources` (one slot each), a copy of that slot's first `cached` positions."""
        if not seqs:
            return
        slots = self.slots(seqs)
        self.kv_lens[slots] = to_device(torch.tensor([s.cached for s in seqs]), self.device)
        if sources is None:
            self.restore(slots)
        else:
            self.share(to_device(torch.tensor(sources), self.device), slots, max(s.cached for s in seqs))

    def feed(self, pairs: list[tuple[int, int]]) -> None:
        """Set the next decode's input of each (slot, token) pair."""
        if pairs:
            slots, tokens = to_device(torch.tensor(pairs).T, self.device)
            self.ids[slots] = tokens

    def advance(self, slots: torch.Tensor, tokens: torch.Tensor, admitted: list[Seq]) -> None:
        """The next decode's inputs, on the device: each stepped slot's new token, and its cached
        count (the prompt after a prefill, one more after a decode)."""
        self.ids[slots] = tokens
        if admitted:
            self.kv_lens[slots] = torch.tensor([len(s.prompt) for s in admitted], device=self.device)
        else:
            self.kv_lens[slots] += 1

    def retire(self, slots: list[int], moves: list[Move]) -> None:
        """Idle `slots`, keeping their column 0 (what they hold stays: a later prompt may continue
        it); then swap what each move's two slots hold: K/V columns, decode inputs and a step's picks
        still to be read (a step launched ahead books them by slot). The copies queue behind any
        step in flight."""
        assert self.cache.k is not None and self.cache.v is not None
        if slots:
            idle = to_device(torch.tensor(slots), self.device)
            self.col0[0][:, idle], self.col0[1][:, idle] = self.cache.k[:, idle, :, 0], self.cache.v[:, idle, :, 0]
            self.kv_lens.index_fill_(0, idle, 0)  # a Python scalar assigned by index would be copied in, waiting
        if not moves:
            return
        src, dst = to_device(torch.tensor([(a, b) for a, b, _ in moves]).T, self.device)
        start = 0
        for width, n in sorted(Counter(w for _, _, w in moves).items()):  # `moves` come ordered by width
            at = slice(start, start + n)
            both, swapped = torch.cat([src[at], dst[at]]), torch.cat([dst[at], src[at]])
            for kv in (self.cache.k, self.cache.v):
                kv[:, both, :, :width] = kv[:, swapped, :, :width]  # the right side is gathered first
            start += n
        both, swapped = torch.cat([src, dst]), torch.cat([dst, src])
        self.col0[:, :, both] = self.col0[:, :, swapped]
        for buffer in (self.ids, self.kv_lens):
            buffer[both] = buffer[swapped]
        if self.graphs is not None:
            self.graphs.picked[:, both] = self.graphs.picked[:, swapped]

    def restore(self, slots: torch.Tensor) -> None:
        """The histories' column 0 back into `slots`, over what idle decode rows wrote there."""
        assert self.cache.k is not None and self.cache.v is not None
        self.cache.k[:, slots, :, 0] = self.col0[0][:, slots]
        self.cache.v[:, slots, :, 0] = self.col0[1][:, slots]

    def share(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Copy the first `width` cached positions of slots `src` into slots `dst` (all layers)."""
        assert self.cache.k is not None and self.cache.v is not None
        copy = src != dst
        if copy.any():
            src, dst = src[copy], dst[copy]
            self.cache.k[:, dst, :, :width] = self.cache.k[:, src, :, :width]
            self.cache.v[:, dst, :, :width] = self.cache.v[:, src, :, :width]

    def start_prefill(self, batch: list[Seq], budget: int) -> Prefill:
        """Lay out the prompts of `batch` for prefill, in chunks of `budget` columns (the scheduler's
        prefill budget): a prompt's samples share one row, whose K/V is copied to their slots once it is in."""
        first: dict[int, int] = {}  # id(prompt) -> row of its prefill
        rows: list[Seq] = []  # one sequence per distinct prompt
        for s in batch:
            if id(s.prompt) not in first:
                first[id(s.prompt)] = len(rows)
                rows.append(s)
        lens = [len(s.prompt) - s.cached for s in rows]  # what each row prefills
        continued = any(s.cached for s in rows)
        width = None  # a prefill graph's columns, where the step is one (fresh prompts only)
        if self.prefills is not None and not continued:
            width = self.prefills.columns(len(rows), max(lens), budget)
        ids = torch.zeros(len(rows), width or max(lens), dtype=torch.long)  # right-padded; pads never attended
        for i, s in enumerate(rows):
            ids[i, :lens[i]] = torch.tensor(s.prompt[s.cached:])
        slots = torch.tensor([s.slot for s in rows], device=self.device)
        cached = torch.tensor([s.cached for s in rows], device=self.device)
        if continued:
            self.restore(slots)
        self.padded += ids.numel()
        return Prefill(batch, torch.tensor([first[id(s.prompt)] for s in batch], device=self.device),
                       ids.to(self.device), cached[:, None] + torch.arange(ids.shape[1], device=self.device),
                       slots, cached, lens, continued, max(s.cached for s in rows), width is not None, budget)

    def prefill_chunk(self, p: Prefill) -> torch.Tensor | None:
        """Write the next `p.chunk` columns of `p` into its slots (a prompt over that budget
        comes alone and goes in over several engine steps: bounded activations, and the running
        sequences decode between two chunks). The last chunk shares each row with its samples'
        slots and returns logits [B, V] at each prompt's last token; the others None."""
        start = p.done
        p.done = end = min(start + p.chunk, p.ids.shape[1])
        last = torch.tensor(p.lens, device=self.device) - 1 - start  # each row's last column in this chunk
        picked = None  # [P, H] the hidden state there
        if p.graphed:
            assert self.prefills is not None
            picked = self.prefills.run(p.ids, p.positions, p.slots, last)
        if picked is None:
            hidden = self.model(p.ids[:, start:end], p.positions[:, start:end], self.cache, p.slots,
                                p.cached + start if p.continued else start, p.reach + end)  # [P, S, H]
            if end < p.ids.shape[1]:  # to a decode step in between, the rows look live: it writes at the
                self.kv_lens[p.slots] = p.cached + end  # column the next chunk starts at, not column 0
                return None
            picked = hidden[torch.arange(len(p.lens), device=self.device), last]
        width = max(len(s.prompt) for s in p.batch)
        self.share(p.slots[p.owner], self.slots(p.batch), width)
        return self.model.logits(picked)[p.owner]

    def decode(self, busy: int, rows: int, slots: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the next token of the sequences in `slots` [B] (on the device), from a
        decode over slots 0..busy-1 (eager), or the `rows` graph covering them."""
        if self.graphs is None:
            kv_lens = self.kv_lens[:busy]
            hidden = self.model.decode(self.ids[:busy], kv_lens, self.cache, int(kv_lens.max()) + 1)
        else:
            hidden = self.graphs.decode(rows)
        return self.model.logits(hidden[slots])

    def release(self) -> None:
        """Give the KV cache's memory back."""
        if self.cache.k is None:
            return
        self.cache.free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
