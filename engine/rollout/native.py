"""The native rollout engine: our compact model (engine/rollout/model.py) behind `RolloutEngine`, as a
loop (here) over a scheduler (scheduler.py: which sequences run, where, when; no torch) and a model
runner (runner.py: the KV cache, the slots' inputs, prefill and decode on the device).

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

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rlflow.engine import progress
from rlflow.engine.rollout.base import Completion, Feed, Request, SamplingParams, limits_of, stop_ids
from rlflow.engine.rollout.model import NativeCausalLM
from rlflow.engine.rollout.runner import ModelRunner
from rlflow.engine.rollout.sampling import sample
from rlflow.engine.rollout.scheduler import Scheduler, Seq


class NativeRollout:
    """Continuous-batching generation with our own model; implements `RolloutEngine`. The loop
    (`_run`) asks the scheduler what to run and the model runner to run it."""

    def __init__(self, model_or_path: NativeCausalLM | str | Path, tokenizer: Any, max_slots: int = 256,
                 max_len: int = 2048, max_prefill_tokens: int = 8192, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cuda_graphs: bool = True, memory_fraction: float = 0.0) -> None:
        if isinstance(model_or_path, (str, Path)):
            model_or_path = NativeCausalLM.from_pretrained(model_or_path, dtype, device or "cpu")
        self.model = model_or_path.eval()
        self.tokenizer = tokenizer
        self.runner = ModelRunner(self.model, max_slots, max_len, max_prefill_tokens, cuda_graphs, memory_fraction)
        self.device, self.max_len = self.runner.device, max_len
        self.scheduler = Scheduler(self.runner.max_slots, max_len, max_prefill_tokens)
        self._writes = self.model.writes  # the weights the scheduler's kept histories were computed with
        # partial rollouts: called between engine steps, it may load new weights (`load_weights`) and
        # names the version now held, which the tokens of the steps launched after it carry
        self.swap: Callable[[], int] | None = None
        self.version = 0
        self.between = 0  # decode steps run between two chunks of a long prefill
        self.phase_s: dict[str, float] | None = None  # set to {} to profile generate (see _lap)
        self._lap_start = 0.0

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

    def _run(self, params: SamplingParams, feed: Feed, spare: bool) -> None:
        """The engine's loop: take requests, then each step join continued sequences and copied
        prompts to decode, admit what is due (a prefill, chunk by chunk), else decode everyone;
        sample; book; retire. See `serve`; with `spare` (serving) admissions are gathered."""
        sched, runner = self.scheduler, self.runner
        if self.model.writes != self._writes:  # new weights: what the cache holds is another policy's
            self._forget_all()
        in_graph = runner.begin(params)  # decode steps sample inside the graphs
        sched.start(spare)
        stops = set(stop_ids(self.tokenizer, params))
        ends = tuple(params.stop_strings)

        def stopped(seq: Seq, token: int) -> bool:
            return token in stops or bool(ends) and self.tokenizer.decode(seq.tokens).endswith(ends)

        generator = torch.Generator(self.device).manual_seed(params.seed)
        finished: list[tuple[Any, Completion]] = []
        more = True  # whether feed may give more requests
        rows: torch.Tensor | None = None  # the running sequences' slots on the device, while they are unchanged
        ahead: list[Seq] | None = None  # the sequences of a sampling decode launched before the last was read
        ahead_version = self.version  # the weights version that step was launched with
        filling = None  # a prefill whose chunks alternate with the running ones' decode steps
        chunked = False  # whether the last step ran a chunk of it
        with torch.inference_mode():
            self._lap("")
            while True:
                progress.tick()
                if more:
                    more = sched.take(feed(finished, sched.idle and not filling), params.max_new_tokens)
                    finished = []
                if self.swap is not None:  # new weights land between steps; a step launched ahead keeps
                    self.version = self.swap()  # the old ones (the copy queues behind it on the stream)
                if sched.idle and not filling:
                    if more:
                        continue
                    break
                continued, copies = sched.join()
                runner.place(continued)
                runner.place([s for s, _ in copies], [slot for _, slot in copies])
                rows = None if continued or copies else rows
                due = sched.due()
                admitted = sched.admit(due and ahead is None and filling is None)
                filling = runner.start_prefill(admitted, sched.max_prefill_tokens) if admitted else filling
                self._lap("schedule")
                entered: list[Seq] = []  # the sequences whose prefill ends this step
                if filling is not None and not (sched.running and chunked):  # a chunk, else the running decode first
                    logits, chunked = runner.prefill_chunk(filling), True
                    if logits is None:  # more chunks to go
                        self._lap("prefill")
                        continue
                    entered, filling = filling.batch, None
                else:
                    self.between += chunked and filling is not None
                    chunked = False
                # the weights version of the step whose tokens are booked below: one launched ahead keeps its own
                version = self.version if ahead is None else ahead_version
                if in_graph and not entered:  # one replay: decode, sample, next inputs; the next step
                    # is launched now too, unless a prefill is due or under way
                    stepped, ahead, tokens, logprobs = self._sampled_step(
                        ahead, generator, then_decode=bool(sched.running) and not due and filling is None)
                    ahead_version = self.version
                    self._lap("decode")
                else:
                    if not entered:
                        rows = runner.slots(sched.running) if rows is None else rows
                    stepped, tokens, logprobs = self._step(entered, logits if entered else None, rows, params,
                                                           generator)
                retired = sched.book(stepped, tokens, logprobs, None if self.swap is None else version, stopped)
                finished += [(s.key, Completion(s.tokens, s.logprobs, s.finish, s.versions)) for s in retired]
                if entered or retired:
                    runner.retire([s.slot for s in retired], sched.retire(retired, entered))
                    rows = None
                self._lap("schedule")
        if finished:
            feed(finished, False)

    def _step(self, entered: list[Seq], logits: torch.Tensor | None, rows: torch.Tensor | None,
              params: SamplingParams, generator: torch.Generator) -> tuple[list[Seq], list[int], list[float]]:
        """An eager step: sample from the logits of the prefill that `entered` ended, else from a
        decode of the running sequences (in slots `rows`); (the sequences stepped, tokens, logprobs)."""
        if entered:
            assert logits is not None
            slots = self.runner.slots(entered)
        else:
            assert rows is not None
            slots, logits = rows, self._decode(self.scheduler.running, rows)
        self._lap("prefill" if entered else "decode")
        tokens, logprobs = sample(logits, params, generator)
        self.runner.advance(slots, tokens, entered)
        self._lap("sample")
        return entered or self.scheduler.running, tokens.tolist(), logprobs.tolist()

    def _decode(self, batch: list[Seq], slots: torch.Tensor) -> torch.Tensor:
        """Feed each sequence's last token; logits [B, V] for the next one, in `batch` order."""
        self.runner.feed(self.scheduler.fed(batch))
        busy = max(s.slot for s in batch) + 1
        return self.runner.decode(busy, self.scheduler.rows_for(busy), slots)

    def _sampled_step(self, ahead: list[Seq] | None, generator: torch.Generator,
                      then_decode: bool) -> tuple[list[Seq], list[Seq] | None, list[int], list[float]]:
        """(the sequences a sampling decode step ran, those of the step launched after it or None,
        its tokens, its logprobs). The step is the one launched `ahead`, else one over the running
        sequences launched now. With `then_decode` the next step is launched before this one's
        results are read, so the device computes while the host books them; sequences that retire
        now ride along in it and their tokens are void."""
        graphs, running = self.runner.graphs, self.scheduler.running
        assert graphs is not None
        if ahead is None:
            self._launch_sampled(running, generator)
        stepped = ahead or running
        graphs.copy_out()  # before the next replay overwrites the picks
        if then_decode:
            self._launch_sampled(running, generator)
        tokens, logprobs = graphs.picks()
        return (stepped, running if then_decode else None, [int(tokens[s.slot]) for s in stepped],
                [logprobs[s.slot] for s in stepped])

    def _launch_sampled(self, batch: list[Seq], generator: torch.Generator) -> None:
        """Queue a decode step over `batch` that also samples (one graph replay)."""
        assert self.runner.graphs is not None
        self.runner.feed(self.scheduler.fed(batch))
        self.runner.graphs.launch_sampled(self.scheduler.rows_for(max(s.slot for s in batch) + 1), generator)

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
        if self.runner.cache.k is None:
            raise RuntimeError("KV cache released: call resume_memory() before generate()")
        if self.model.weights_lost:
            raise RuntimeError("weights released by release_memory(weights=True): write them (load_weights or a "
                               "reshard) before generate()")

    def _forget_all(self) -> None:
        """The cache holds nothing a later prompt may continue (new weights, memory released)."""
        self.scheduler.forget()
        self._writes = self.model.writes

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(named_tensors)

    def release_memory(self, weights: bool = False) -> None:
        """Drop the KV cache and, with `weights`, the weights' memory (on CUDA; their values are
        then lost until written again), so training gets the memory."""
        if weights:
            self.model.release_weights()
        self._forget_all()
        self.runner.release()

    def resume_memory(self) -> None:
        """Allocate the KV cache again, zeroed. The decode graphs point into it and stay valid:
        graphs exist only on CUDA, where the cache comes back at the same addresses (KVCache)."""
        self.runner.cache.allocate()
