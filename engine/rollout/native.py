"""The native rollout engine: our compact model (engine/rollout/model.py) behind `RolloutEngine`.

Continuous batching over a fixed-slot KV cache. `generate` queues (prompt, sample) requests
(`serve` takes them as they come, from a feed), fresh ones shortest prompt first (a prefill step
pads its prompts to the longest it holds), and by sample first while they outnumber the slots;
each engine step either prefills newly admitted requests (when slots are free) or decodes one
token for every running sequence, then samples on the model's device and retires finished
sequences, whose slots go to waiting requests; while none wait, the sequences still running
move down to the lowest slots as others retire, so decode steps (over rows 0 to the highest busy
slot) shrink with them. Two kinds of request skip prefill and join the decode steps at once, fed
their last tokens one a step: one that continues a history kept in an idle slot by at most FOLD
tokens, and a sample whose prompt a running sibling holds, whose K/V it copies (so while slots are
scarce a prompt is prefilled once, not once a sample). A prompt over the prefill budget
(`max_prefill_tokens`) goes in chunk by chunk, and the running sequences decode a step between two
chunks, so a long prompt does not hold them for its whole prefill.

On CUDA, decode replays a CUDA graph captured per row count (engine/rollout/graphs.py), whose
inputs (each slot's last token and cached count) stay on the device: every step's sampling writes
them, so a decode step copies nothing in. In half precision, attention and sampling use the Triton
kernels of engine/rollout/kernels.py, and plain sampling (temperature only) runs inside the decode
graph too. While no request waits for a slot, the next such step is launched before the host reads
the last one, so the device decodes while the host books tokens and retires sequences (a sequence
that retires rides along in the step already launched; that token is dropped). Prefill, and
sampling with top-k/top-p or greedy, run eagerly.
On CPU all of it is eager.

Invariants (those of engine/rollout/base.py, plus):
- at most `max_slots` sequences run at once; prompt + max_new_tokens must fit in `max_len`;
- with `memory_fraction` > 0 on CUDA, the KV cache takes at most that fraction of the device's
  free memory, and `max_slots` shrinks to what fits;
- a call's randomness comes only from a torch.Generator seeded with `params.seed`, and the step
  schedule is deterministic, so the same seed gives the same samples (from the same histories
  kept, below: the schedule depends on what prefill can skip);
- a retired sequence's slot keeps its history (the prompt and every sampled token but the last)
  until the slot is taken or the weights are written: a later prompt that continues a history
  exactly (an episode's next turn: history + sampled token + observation) takes that slot and
  takes in only what is new;
- with `swap` set (partial rollouts), weights may land between two engine steps: the sequences in
  flight go on from the K/V their earlier tokens left in the cache, and each token records the
  version that sampled it (`Completion.versions`). Nothing is recomputed: a prefill of every
  sequence in flight at every update would cost what generating ahead is meant to hide, and the
  logprob booked with each token is the one it was drawn with, all the importance weights need;
- with tensor parallelism (`model.tp`), every rank of the TP group must call `generate` with the
  same prompts and params: logits are identical on every rank (the all-reduce's result is), so
  sampling and scheduling stay in lockstep, and `max_slots` is agreed on (the minimum);
- `release_memory` gives the KV cache's memory back (with `weights=True` the weights' too: on
  CUDA their values are then lost, and `generate` refuses to run until they are written again);
  `generate` refuses to run until `resume_memory`. On CUDA, the only place decode graphs exist,
  both return at the same addresses (engine/vmm.py), so the graphs that point into them are kept.

Run: the tests in tests/engine/rollout/test_native.py (CPU, fp32, the tiny embedded model).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlflow.engine import progress
from rlflow.engine.rollout.base import Completion, Feed, Request, SamplingParams, limits_of, stop_ids
from rlflow.engine.rollout.graphs import DecodeGraphs, PrefillGraphs
from rlflow.engine.rollout.histories import Histories
from rlflow.engine.rollout.model import KVCache, NativeCausalLM, head_dim
from rlflow.engine.rollout.sampling import sample
from rlflow.engine.tensors import to_device


@dataclass(slots=True)
class _Seq:
    prompt: list[int]
    key: Any  # handed back with its completion
    sample: int = 0  # its index among its request's samples
    slot: int = -1
    cached: int = 0  # the prompt's first tokens already in the slot's cache (a continued sequence)
    limit: int = 0  # max new tokens
    feeding: list[int] = field(default_factory=list)  # prompt tokens still to go in through decode steps
    void: int = 0  # results of steps launched on a fed token that is not the prompt's last: dropped
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token, the weights version of its step
    finish: str = ""  # "" while running, then "stop" | "length"


@dataclass
class _Prefill:
    """A prefill under way: one row per distinct prompt, right-padded; its chunks go in one an engine step."""
    batch: list[_Seq]
    owner: torch.Tensor  # [B] each sequence's row
    ids: torch.Tensor  # [P, S]
    positions: torch.Tensor  # [P, S]
    slots: torch.Tensor  # [P]
    cached: torch.Tensor  # [P] tokens each row's slot already holds (a continued history)
    lens: list[int]  # what each row prefills
    continued: bool
    reach: int  # the most any row's slot already holds
    graphed: bool  # whether it runs as a prefill graph (then in one step)
    done: int = 0  # columns of `ids` already in


class NativeRollout:
    """Continuous-batching generation with our own model; implements `RolloutEngine`."""

    def __init__(self, model_or_path: NativeCausalLM | str | Path, tokenizer: Any, max_slots: int = 256,
                 max_len: int = 2048, max_prefill_tokens: int = 8192, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cuda_graphs: bool = True, memory_fraction: float = 0.0) -> None:
        if isinstance(model_or_path, (str, Path)):
            model_or_path = NativeCausalLM.from_pretrained(model_or_path, dtype, device or "cpu")
        self.model = model_or_path.eval()
        self.tokenizer = tokenizer
        weight = self.model.model.embed_tokens.weight
        self.device = weight.device
        cfg = self.model.config
        if memory_fraction > 0 and self.device.type == "cuda":
            per_slot = 2 * cfg.num_hidden_layers * self.model.kv_heads * max_len * head_dim(cfg) * weight.itemsize
            max_slots = min(max_slots, int(torch.cuda.mem_get_info(self.device)[0] * memory_fraction) // per_slot)
            if self.model.tp.size > 1:  # TP ranks schedule in lockstep: the same slots on every one
                agreed = torch.tensor([max_slots], device=self.device)
                torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=self.model.tp.group)
                max_slots = int(agreed.item())
            if max_slots < 1:
                raise ValueError(f"memory_fraction {memory_fraction} leaves no room for one {max_len}-token slot")
        self.max_slots, self.max_len, self.max_prefill_tokens = max_slots, max_len, max_prefill_tokens
        self.cache = KVCache(cfg.num_hidden_layers, max_slots, max_len, self.model.kv_heads, head_dim(cfg),
                             weight.dtype, self.device)
        # what each idle slot's cache still holds, under the weights of `_writes`: a prompt that
        # continues one prefills the rest only
        self.histories = Histories()
        self._writes = self.model.writes
        # an idle slot's column 0 as it was cached: idle decode rows scribble there (see `decode`)
        self._col0 = torch.zeros(2, cfg.num_hidden_layers, max_slots, self.model.kv_heads, head_dim(cfg),
                                 dtype=weight.dtype, device=self.device)
        self.prefilled = self.reused = 0  # prompt tokens run through prefill, and found cached instead
        self.padded = 0  # prefill's tokens computed, padding included
        self.fanned = 0  # samples that copied a running sibling's prompt instead of a prefill (`_fan_out`)
        # partial rollouts: called between engine steps, it may load new weights (`load_weights`) and
        # names the version now held, which the tokens of the steps launched after it carry
        self.swap: Callable[[], int] | None = None
        self.version = 0
        self.phase_s: dict[str, float] | None = None  # set to {} to profile generate (see _lap)
        self._lap_start = 0.0
        # the next decode's inputs per slot, kept on the device (the graphs' static inputs): each
        # step writes them from its samples, so decode needs no host-built tensors
        self._ids = torch.zeros(max_slots, dtype=torch.long, device=self.device)  # last token
        self._kv_lens = torch.zeros(max_slots, dtype=torch.long, device=self.device)  # tokens cached
        # the row counts a decode step runs (on CUDA, one graph each): the smallest that covers the
        # highest busy slot; `_compact` moves sequences down as others retire, so it shrinks with them
        self.row_sizes = sorted({b for b in (1, 2, 4, 8, 16, 32) if b < max_slots}
                                | set(range(64, max_slots, 64)) | {max_slots})
        self.moved = 0  # sequences moved to a lower slot mid-decode (`_compact`)
        self.between = 0  # decode steps run between two chunks of a long prefill
        # decode as CUDA graphs (engine/rollout/graphs.py); None = eager, as on CPU
        self.graphs: DecodeGraphs | None = None
        self.prefills: PrefillGraphs | None = None  # small prefill steps as graphs too
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, self.cache, self._ids, self._kv_lens, max_len, self.row_sizes)
            if self.model.tp.size == 1:
                self.prefills = PrefillGraphs(self.model, self.cache, max_prefill_tokens)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check(prompts, params)
        limits = limits_of(prompts, params)
        out: dict[tuple[int, int], Completion] = {}  # by (prompt, sample)
        requests: list[Request] | None = [Request(p, [(i, j) for j in range(params.n)], limits[i])
                                          for i, p in enumerate(prompts)]

        def feed(finished: list[tuple[Any, Completion]], wait: bool) -> list[Request] | None:
            nonlocal requests
            out.update(finished)
            given, requests = requests, None
            return given

        self._run(params, feed, spare=False)
        return [[out[i, j] for j in range(params.n)] for i in range(len(prompts))]

    @property
    def streams(self) -> bool:
        """Whether `serve` can run: one rank alone (TP ranks must see the same requests at the same steps)."""
        return self.model.tp.size == 1

    @property
    def swaps(self) -> bool:
        """Whether a `swap` may load weights mid-generation: one rank alone (TP ranks would each
        take a push at a step of their own)."""
        return self.model.tp.size == 1

    def serve(self, params: SamplingParams, feed: Feed) -> None:
        """Generate for requests as they come: `feed(finished, wait)` gets the completions finished
        since its last call, with their keys, and gives new requests, or None once no more will
        come; `wait` says the engine has nothing left to run, so it may block until it has some.
        It is called between engine steps, so a request's completion is handed back at once and
        a follow-up (an episode's next turn) is admitted while the others decode.

        A free slot that holds no history is taken before one that does, so a history stays while
        its episode's next turn may come. Samples depend on the order requests arrive in."""
        self._ready()
        if not self.streams:
            raise RuntimeError("serve needs one rank: tensor-parallel ranks must generate in lockstep")
        self._run(params, feed, spare=True)

    # serving, fresh requests that trickle in wait until they are 1/FRACTION of those running, or for
    # PATIENCE steps: each admission is a prefill step that holds every running sequence for one step
    FRACTION, PATIENCE = 8, 8

    def _run(self, params: SamplingParams, feed: Feed, spare: bool) -> None:
        """The engine's loop: see `serve`. With `spare` (serving), free slots without a kept history
        go first, and admissions are gathered (FRACTION, PATIENCE)."""
        self._ids.zero_()  # every slot idle
        self._kv_lens.zero_()
        in_graph = self.graphs is not None and self.graphs.samples(params)  # decode steps sample inside
        if self.model.writes != self._writes:  # new weights: what the cache holds is another policy's
            self._forget_all()
        if self.graphs is not None:
            with torch.inference_mode():  # before any prefill: warm-up decodes scribble on the slots'
                self.graphs.capture(in_graph)  # column 0 only, which a kept history gets back from `_col0`
            if in_graph:
                self.graphs.inv_t.fill_(1.0 / params.temperature)
        stops = set(stop_ids(self.tokenizer, params))
        generator = torch.Generator(self.device).manual_seed(params.seed)
        waiting: deque[_Seq] = deque()
        # the end goes first: slot 0, then a slot just retired, so busy slots stay low (decode runs
        # rows 0..the highest busy one) and a call's schedule does not depend on the histories kept
        free = list(range(self.max_slots - 1, -1, -1))
        reserved: dict[int, _Seq] = {}
        stalled = 0  # steps since requests last were admitted, while some wait
        running: list[_Seq] = []
        finished: list[tuple[Any, Completion]] = []
        more = True  # whether feed may give more requests
        rows: torch.Tensor | None = None  # running's slots on the device, while running is unchanged
        ahead: list[_Seq] | None = None  # the sequences of a sampling decode launched before the last was read
        ahead_version = self.version  # the weights version that step was launched with
        filling: _Prefill | None = None  # a prefill whose chunks alternate with the running ones' decode steps
        chunked = False  # whether the last step ran a chunk of it
        with torch.inference_mode():
            self._lap("")
            while True:
                progress.tick()
                if more:
                    more = self._take(feed(finished, not (waiting or running or filling)), params, waiting, reserved)
                    finished = []
                if self.swap is not None:  # new weights land between steps; a step launched ahead keeps
                    self.version = self.swap()  # the old ones (the copy queues behind it on the stream)
                if not (waiting or running or filling):
                    if more:
                        continue
                    break
                # schedule: join continued sequences to decode, admit what fits, else decode
                # everyone; run; sample; retire
                joined = self._join(waiting, free, reserved) + self._fan_out(waiting, free, reserved, running, spare)
                if joined:
                    running, rows = running + joined, None
                due = bool(waiting and free) and (not spare or not running or stalled >= self.PATIENCE
                                                 or len(waiting) * self.FRACTION >= len(running))
                admitted = self._admit(waiting, free, reserved, spare) if ahead is None and due and not filling else []
                stalled = 0 if admitted or not waiting else stalled + 1
                if admitted:
                    filling = self._start_prefill(admitted)
                self._lap("schedule")
                entered: list[_Seq] = []  # the sequences whose prefill ends this step
                if filling is not None and not (running and chunked):  # a chunk, else the running decode first
                    logits, chunked = self._prefill_chunk(filling), True
                    if logits is None:  # more chunks to go
                        self._lap("prefill")
                        continue
                    entered, filling = filling.batch, None
                else:
                    self.between += chunked and filling is not None
                    chunked = False
                stepped = entered or running
                # the weights version of the step whose tokens are booked below: one launched ahead keeps its own
                version = self.version if ahead is None else ahead_version
                if in_graph and not entered:  # one replay: decode, sample, next inputs
                    # the next step is a decode too unless a prefill is due or under way
                    stepped, ahead, tokens_list, logprobs_list = self._sampled_step(
                        running, ahead, generator, then_decode=bool(running) and not due and filling is None)
                    ahead_version = self.version
                    self._lap("decode")
                else:
                    if entered:
                        assert logits is not None
                        slots = self._slots(entered)
                    else:
                        rows = self._slots(running) if rows is None else rows
                        slots, logits = rows, self._decode(running, rows)
                    self._lap("prefill" if entered else "decode")
                    tokens, logprobs = sample(logits, params, generator)
                    self._advance(slots, tokens, entered)
                    tokens_list, logprobs_list = tokens.tolist(), logprobs.tolist()
                    self._lap("sample")
                retired = self._book(stepped, tokens_list, logprobs_list, version, stops, params, finished)
                if entered or retired:
                    running, rows = [s for s in running + entered if not s.finish], None
                if retired:
                    self._retire(retired, running, bool(waiting), free, reserved)
                self._lap("schedule")
        if finished:
            feed(finished, False)

    def _book(self, stepped: list[_Seq], tokens: list[int], logprobs: list[float], version: int, stops: set[int],
              params: SamplingParams, finished: list[tuple[Any, Completion]]) -> list[_Seq]:
        """Append a step's token, logprob and weights version to each sequence it stepped (not to one
        retired before the step was read, nor for a fed prompt token); returns the sequences that
        finished, whose completions go to `finished`."""
        if math.isnan(sum(logprobs)):  # NaN: sampling from it would be noise (a logprob is never +inf)
            raise FloatingPointError("the policy's logits are NaN: its weights hold non-finite values")
        retired: list[_Seq] = []
        versions = self.swap is not None  # a sequence's versions are handed back only then
        for seq, tok, lp in zip(stepped, tokens, logprobs):  # per sequence and step: kept lean
            if seq.finish:  # retired after a step launched ahead of it: that step's token is void
                continue
            if seq.void:  # the step fed a prompt token: its sample is the next prompt token's place
                seq.void -= 1
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if versions:
                seq.versions.append(version)
            if tok in stops or params.stop_strings and self.tokenizer.decode(seq.tokens).endswith(
                    tuple(params.stop_strings)):
                seq.finish = "stop"
            elif len(seq.tokens) >= seq.limit:
                seq.finish = "length"
            else:
                continue
            retired.append(seq)
            finished.append((seq.key, Completion(seq.tokens, seq.logprobs, seq.finish, seq.versions)))
        return retired

    def _retire(self, retired: list[_Seq], running: list[_Seq], waiting: bool, free: list[int],
                reserved: dict[int, _Seq]) -> None:
        """Free the retired sequences' slots, keeping what they hold (`_keep`); their rows decode on
        idle, with kv_len 0, scribbling on column 0 only. While no request waits, the sequences still
        `running` move down into freed slots (`_compact`)."""
        slots = to_device(torch.tensor([s.slot for s in retired]), self.device)
        self._keep(retired, slots)
        self._kv_lens.index_fill_(0, slots, 0)  # a Python scalar assigned by index would be copied in, waiting
        free.extend(s.slot for s in retired)
        if running and not waiting and self.MOVE:
            self._compact(running, free, reserved)

    def _take(self, requests: list[Request] | None, params: SamplingParams, waiting: deque[_Seq],
              reserved: dict[int, _Seq]) -> bool:
        """Queue `requests` (a request's samples share one prompt list, so one prefill); False for None."""
        if requests is None:
            return False
        seqs = []
        for r in requests:
            limit = r.limit or params.max_new_tokens
            if not r.prompt or len(r.prompt) + limit > self.max_len:
                raise ValueError(f"a request of {len(r.prompt)} prompt tokens and {limit} new ones does not fit "
                                 f"max_len={self.max_len} (or its prompt is empty)")
            seqs += [_Seq(r.prompt, key, j, limit=limit) for j, key in enumerate(r.keys)]
        continuing = self._reserve(seqs, reserved)  # to the front: fresh prompts must not take their slots
        waiting.extendleft(reversed(continuing))
        fresh = [s for s in seqs if reserved.get(s.slot) is not s]
        if self.SORT:  # shortest first: a prefill step pads its prompts to the longest it holds; with more
            # sequences than slots, first samples first: each prompt is prefilled once, early, and its
            # other samples copy it as slots free (`_fan_out`)
            scarce = len(waiting) + len(fresh) > self.max_slots
            fresh.sort(key=lambda s: (s.sample if scarce else 0, len(s.prompt)))
        waiting.extend(fresh)
        return True

    SORT = True  # whether fresh requests queue by prompt length (and sample, `_take`); off only to measure it

    def _slots(self, seqs: list[_Seq]) -> torch.Tensor:
        return to_device(torch.tensor([s.slot for s in seqs]), self.device)

    def _graph_rows(self, batch: list[_Seq]) -> int:
        """The captured row count a decode over `batch` replays: the smallest covering its highest slot."""
        return self._rows_for(max(s.slot for s in batch) + 1)

    def _rows_for(self, busy: int) -> int:
        return next(b for b in self.row_sizes if b >= busy)

    def _advance(self, slots: torch.Tensor, tokens: torch.Tensor, admitted: list[_Seq]) -> None:
        """The next decode's inputs, on the device: each stepped slot's new token, and its cached
        count (the prompt after a prefill, one more after a decode)."""
        self._ids[slots] = tokens
        if admitted:
            self._kv_lens[slots] = torch.tensor([len(s.prompt) for s in admitted], device=self.device)
        else:
            self._kv_lens[slots] += 1

    def _lap(self, phase: str) -> None:
        """With `phase_s` set (a dict), add the time since the last lap to `phase_s[phase]`,
        synchronizing the device first: a profile of where generate's time goes."""
        if self.phase_s is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if phase:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + now - self._lap_start
        self._lap_start = now

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self._ready()
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({params.max_new_tokens}) > max_len "
                             f"({self.max_len})")
        if any(not p for p in prompts):
            raise ValueError("empty prompt")

    def _ready(self) -> None:
        if self.cache.k is None:
            raise RuntimeError("KV cache released: call resume_memory() before generate()")
        if self.model.weights_lost:
            raise RuntimeError("weights released by release_memory(weights=True): write them (load_weights or a "
                               "reshard) before generate()")

    # a continued sequence with at most FOLD new tokens takes them in through decode steps, one a step
    # beside the others' decoding (the decode graph's cost per row is small), instead of a prefill
    # step that holds every running sequence (its launches alone cost tens of ms on CUDA)
    FOLD = 64

    def _join(self, waiting: deque[_Seq], free: list[int], reserved: dict[int, _Seq]) -> list[_Seq]:
        """Move the waiting sequences that continue an idle slot's history by at most FOLD tokens
        into that slot, their new tokens to be fed by the decode steps they join (`_feed`)."""
        joined = [s for s in reserved.values() if len(s.prompt) - s.cached <= self.FOLD]
        if not joined:
            return []
        taken = {id(s) for s in joined}
        kept = [s for s in waiting if id(s) not in taken]
        waiting.clear()
        waiting.extend(kept)
        for s in joined:
            del reserved[s.slot]
            free.remove(s.slot)
        self._restore(self._to_feed(joined))
        return joined

    def _to_feed(self, joined: list[_Seq]) -> torch.Tensor:
        """Ready `joined`, each in its slot with its first `cached` prompt tokens there, to take the
        rest in through the decode steps it joins (`_feed`); returns their slots, on the device."""
        for s in joined:
            self.histories.forget(s.slot)
            s.feeding = s.prompt[s.cached:]
        self.prefilled += sum(len(s.feeding) for s in joined)
        self.reused += sum(s.cached for s in joined)
        slots = to_device(torch.tensor([s.slot for s in joined]), self.device)
        self._kv_lens[slots] = to_device(torch.tensor([s.cached for s in joined]), self.device)
        return slots

    def _fan_out(self, waiting: deque[_Seq], free: list[int], reserved: dict[int, _Seq], running: list[_Seq],
                 spare: bool) -> list[_Seq]:
        """Move waiting samples of a prompt that a running sequence holds into free slots: each copies
        the K/V of that prompt but its last token, which the decode step it joins feeds. So while slots
        are scarce a prompt is prefilled once, not once a sample, and a sample that finds a slot does
        not wait for a prefill step (which holds every running sequence)."""
        if not (free and waiting and self.FAN):
            return []
        # a holder has the prompt's K/V but its last token in; a one-token prompt has none to copy (and a
        # row at 0 cached tokens is idle to the decode graphs, which would not count its tokens)
        holders = {id(s.prompt): s for s in running if len(s.feeding) <= 1 and len(s.prompt) > 1}
        if not holders:
            return []
        room = sum(f not in reserved for f in free)  # slots kept for a continued history stay theirs
        joined: list[_Seq] = []
        passed: list[_Seq] = []  # back to the queue's front, in order
        while waiting and len(joined) < room:  # samples of held prompts queue early: few are passed
            s = waiting.popleft()
            (joined if id(s.prompt) in holders and reserved.get(s.slot) is not s else passed).append(s)
        waiting.extendleft(reversed(passed))
        if not joined:
            return []
        for s in joined:
            s.slot = self._free_slot(free, reserved, spare)
            free.remove(s.slot)
            s.cached = len(s.prompt) - 1
        self.fanned += len(joined)
        src = to_device(torch.tensor([holders[id(s.prompt)].slot for s in joined]), self.device)
        self._share(src, self._to_feed(joined), max(s.cached for s in joined))
        return joined

    FAN = True  # whether waiting samples copy a running sibling's prompt (`_fan_out`); off only to measure it

    def _feed(self, batch: list[_Seq]) -> None:
        """Before a decode step over `batch`: each sequence still being fed gets its next prompt token
        as input; the step's sample for it is void unless that token is the prompt's last."""
        fed = [s for s in batch if s.feeding]
        if not fed:
            return
        for s in fed:
            s.void += len(s.feeding) > 1
        slots, tokens = to_device(torch.tensor([[s.slot, s.feeding.pop(0)] for s in fed]).T, self.device)
        self._ids[slots] = tokens

    def _restore(self, slots: torch.Tensor) -> None:
        """The histories' column 0 back into `slots`, over what idle decode rows wrote there."""
        assert self.cache.k is not None and self.cache.v is not None
        self.cache.k[:, slots, :, 0] = self._col0[0][:, slots]
        self.cache.v[:, slots, :, 0] = self._col0[1][:, slots]

    def _admit(self, waiting: deque[_Seq], free: list[int], reserved: dict[int, _Seq], spare: bool) -> list[_Seq]:
        """Move waiting requests into free slots while their distinct prompts fit the padded
        prefill-token budget; a prompt longer than the budget comes alone (its chunks alternate with
        the running sequences' decode steps, `_prefill_chunk`). A prompt
        that continues what an idle slot holds takes that slot (`reserved` for it) and prefills only
        the rest; others take a free slot no waiting prompt continues, while there is one."""
        batch: list[_Seq] = []
        prompts: set[int] = set()  # ids of the distinct prompt lists admitted (samples share one)
        width = 0
        while waiting and free:
            seq = waiting[0]
            cached = seq.cached if reserved.get(seq.slot) is seq else 0
            width = max(width, len(seq.prompt) - cached)
            if batch and len(prompts | {id(seq.prompt)}) * width > self.max_prefill_tokens:
                break
            prompts.add(id(waiting.popleft().prompt))
            slot = seq.slot if cached else self._free_slot(free, reserved, spare)
            evicted = reserved.pop(slot, None)
            if evicted is not None and evicted is not seq:  # no slot left but one a later prompt continues
                evicted.cached = 0
            free.remove(slot)
            self.histories.forget(slot)
            seq.slot, seq.cached = slot, cached
            batch.append(seq)
        return batch

    MOVE = True  # whether running sequences move down as others retire (`_compact`); off only to measure it

    def _compact(self, running: list[_Seq], free: list[int], reserved: dict[int, _Seq]) -> None:
        """Move the running sequences above the row count that would cover them all into the lowest
        free slots (none reserved), so that decode steps run over fewer rows as sequences retire.
        Each mover swaps places with what its new slot holds: the K/V columns, the decode inputs,
        a step's picks still to be read (a step launched ahead of this one books them by slot),
        and a kept history, which goes on in the slot vacated. The copies queue behind any step in
        flight."""
        target = self._rows_for(len(running))
        movers = [s for s in running if s.slot >= target]
        if not movers:
            return
        room = sorted(f for f in free if f < target and f not in reserved)[:len(movers)]
        if len(room) < len(movers):
            return
        assert self.cache.k is not None and self.cache.v is not None
        # a pair swaps the columns its longer side holds (+ 2: a step in flight), rounded up to a power
        # of 2; pairs of one width copy together, so one long sequence does not widen every copy
        widths = [min(self.max_len, 1 << (max(len(s.prompt) + len(s.tokens) + 2, len(self.histories.get(f))) - 1)
                      .bit_length()) for s, f in zip(movers, room)]
        order = sorted(range(len(movers)), key=widths.__getitem__)
        movers, room = [movers[i] for i in order], [room[i] for i in order]
        src, dst = to_device(torch.tensor([[s.slot for s in movers], room]), self.device)
        start = 0
        for width, n in sorted(Counter(widths).items()):
            at = slice(start, start + n)
            both, swapped = torch.cat([src[at], dst[at]]), torch.cat([dst[at], src[at]])
            for kv in (self.cache.k, self.cache.v):
                kv[:, both, :, :width] = kv[:, swapped, :, :width]  # the right side is gathered first
            start += n
        both, swapped = torch.cat([src, dst]), torch.cat([dst, src])
        self._col0[:, :, both] = self._col0[:, :, swapped]
        for buffer in (self._ids, self._kv_lens):
            buffer[both] = buffer[swapped]
        if self.graphs is not None:
            self.graphs.picked[:, both] = self.graphs.picked[:, swapped]
        for s, slot in zip(movers, room):  # a mover's own slot holds no history: it is running
            if slot in self.histories:
                history = self.histories.get(slot)
                self.histories.forget(slot)
                self.histories.remember(s.slot, history)
            free.remove(slot)
            free.insert(0, s.slot)  # taken last: admissions fill low slots first
            s.slot = slot
        self.moved += len(movers)

    def _free_slot(self, free: list[int], reserved: dict[int, _Seq], spare: bool) -> int:
        """The free slot a fresh request takes: the last freed that no waiting request continues
        (with `spare`, nor holds a history: its episode's next turn may still come), else the last."""
        unreserved = (s for s in reversed(free) if s not in reserved)
        if spare:
            unreserved = (s for s in reversed(free) if s not in reserved and s not in self.histories)
        return next(unreserved, next((s for s in reversed(free) if s not in reserved), free[-1]))

    def _reserve(self, seqs: list[_Seq], reserved: dict[int, _Seq]) -> list[_Seq]:
        """Reserve for each of `seqs` that continues an idle slot's history that slot, at most one
        request a slot (a prompt's other samples prefill it again from the first one's, see
        `_prefill`); returns those requests, which must wait ahead of the others."""
        found: list[_Seq] = []
        matches = self.histories.continued([seq.prompt for seq in seqs]) if self.histories else []
        for seq, (slot, cached) in zip(seqs, matches):
            if slot >= 0 and slot not in reserved:
                reserved[slot], seq.slot, seq.cached = seq, slot, cached
                found.append(seq)
        return found

    def _keep(self, retired: list[_Seq], slots: torch.Tensor) -> None:
        """Remember what the retired sequences' slots (`slots`, on the device) hold: the prompt and
        every sampled token but the last (whose K/V no decode wrote), and each slot's column 0 as it is now."""
        assert self.cache.k is not None and self.cache.v is not None
        self._col0[0][:, slots], self._col0[1][:, slots] = self.cache.k[:, slots, :, 0], self.cache.v[:, slots, :, 0]
        for s in retired:
            self.histories.remember(s.slot, s.prompt + s.tokens[:-1])

    def _forget_all(self) -> None:
        """The cache holds nothing a later prompt may continue (new weights, memory released)."""
        self.histories.forget()
        self._writes = self.model.writes

    def _start_prefill(self, batch: list[_Seq]) -> _Prefill:
        """Lay out the prompts of `batch` for prefill: a prompt's samples share one row, whose K/V is
        copied to their slots once it is in."""
        first: dict[int, int] = {}  # id(prompt) -> row of its prefill
        rows: list[_Seq] = []  # one sequence per distinct prompt
        for s in batch:
            if id(s.prompt) not in first:
                first[id(s.prompt)] = len(rows)
                rows.append(s)
        lens = [len(s.prompt) - s.cached for s in rows]  # what each row prefills
        continued = any(s.cached for s in rows)
        width = None  # a prefill graph's columns, where the step is one (fresh prompts only)
        if self.prefills is not None and not continued:
            width = self.prefills.columns(len(rows), max(lens), self.max_prefill_tokens)
        ids = torch.zeros(len(rows), width or max(lens), dtype=torch.long)  # right-padded; pads never attended
        for i, s in enumerate(rows):
            ids[i, :lens[i]] = torch.tensor(s.prompt[s.cached:])
        slots = torch.tensor([s.slot for s in rows], device=self.device)
        cached = torch.tensor([s.cached for s in rows], device=self.device)
        if continued:
            self._restore(slots)
        self.prefilled += sum(lens)
        self.padded += ids.numel()
        self.reused += sum(s.cached for s in rows)
        return _Prefill(batch, torch.tensor([first[id(s.prompt)] for s in batch], device=self.device),
                        ids.to(self.device), cached[:, None] + torch.arange(ids.shape[1], device=self.device),
                        slots, cached, lens, continued, max(s.cached for s in rows), width is not None)

    def _prefill_chunk(self, p: _Prefill) -> torch.Tensor | None:
        """Write the next `max_prefill_tokens` columns of `p` into its slots (a prompt over that budget
        comes alone, see `_admit`, and goes in over several engine steps: bounded activations, and the
        running sequences decode between two chunks). The last chunk shares each row with its
        samples' slots and returns logits [B, V] at each prompt's last token; the others None."""
        start = p.done
        p.done = end = min(start + self.max_prefill_tokens, p.ids.shape[1])
        last = torch.tensor(p.lens, device=self.device) - 1 - start  # each row's last column in this chunk
        picked = None  # [P, H] the hidden state there
        if p.graphed:
            assert self.prefills is not None
            picked = self.prefills.run(p.ids, p.positions, p.slots, last)
        if picked is None:
            hidden = self.model(p.ids[:, start:end], p.positions[:, start:end], self.cache, p.slots,
                                p.cached + start if p.continued else start, p.reach + end)  # [P, S, H]
            if end < p.ids.shape[1]:  # to a decode step in between, the rows look live: it writes at the
                self._kv_lens[p.slots] = p.cached + end  # column the next chunk starts at, not column 0
                return None
            picked = hidden[torch.arange(len(p.lens), device=self.device), last]
        width = max(len(s.prompt) for s in p.batch)
        self._share(p.slots[p.owner], torch.tensor([s.slot for s in p.batch], device=self.device), width)
        return self.model.logits(picked)[p.owner]

    def _share(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Copy the first `width` cached positions of slots `src` into slots `dst` (all layers)."""
        assert self.cache.k is not None and self.cache.v is not None
        copy = src != dst
        if copy.any():
            src, dst = src[copy], dst[copy]
            self.cache.k[:, dst, :, :width] = self.cache.k[:, src, :, :width]
            self.cache.v[:, dst, :, :width] = self.cache.v[:, src, :, :width]

    def _decode(self, batch: list[_Seq], slots: torch.Tensor) -> torch.Tensor:
        """Feed each sequence's last token; logits [B, V] for the next one, in `batch` order
        (`slots` [B], their slots on the device).

        Decode runs over rows 0..R-1 with row i on slot i, from the inputs `_advance` left (R
        covers the highest busy slot, rounded up to a captured graph size on CUDA); idle rows are
        computed and dropped."""
        self._feed(batch)
        if self.graphs is None:
            busy = max(s.slot for s in batch) + 1
            kv_lens = self._kv_lens[:busy]
            hidden = self.model.decode(self._ids[:busy], kv_lens, self.cache, int(kv_lens.max()) + 1)
        else:
            hidden = self.graphs.decode(self._graph_rows(batch))
        return self.model.logits(hidden[slots])

    def _sampled_step(self, running: list[_Seq], ahead: list[_Seq] | None, generator: torch.Generator,
                      then_decode: bool) -> tuple[list[_Seq], list[_Seq] | None, list[int], list[float]]:
        """(the sequences a sampling decode step ran, those of the step launched after it or None,
        its tokens, its logprobs). The step is the one launched `ahead`, else `running` launched
        now. With `then_decode` the next step is launched over `running` before this one's results
        are read, so the device computes while the host books them; sequences that retire now
        ride along in it and their tokens are void."""
        assert self.graphs is not None
        if ahead is None:
            self._launch_sampled(running, generator)
        stepped = ahead or running
        self.graphs.copy_out()  # before the next replay overwrites the picks
        if then_decode:
            self._launch_sampled(running, generator)
        tokens, logprobs = self.graphs.picks()
        return (stepped, running if then_decode else None, [int(tokens[s.slot]) for s in stepped],
                [logprobs[s.slot] for s in stepped])

    def _launch_sampled(self, batch: list[_Seq], generator: torch.Generator) -> None:
        """Queue a decode step over `batch` that also samples (one graph replay)."""
        assert self.graphs is not None
        self._feed(batch)
        self.graphs.launch_sampled(self._graph_rows(batch), generator)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(named_tensors)

    def release_memory(self, weights: bool = False) -> None:
        """Drop the KV cache and, with `weights`, the weights' memory (on CUDA; their values are
        then lost until written again), so training gets the memory."""
        if weights:
            self.model.release_weights()
        self._forget_all()
        if self.cache.k is None:
            return
        self.cache.free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Allocate the KV cache again, zeroed. The decode graphs point into it and stay valid:
        graphs exist only on CUDA, where the cache comes back at the same addresses (KVCache)."""
        self.cache.allocate()
