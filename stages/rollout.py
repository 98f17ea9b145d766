"""The rollout stage: a rollout engine with its copy of the policy, and the `generate` verb.

Hybrid placement (the default): the policy (stages/hybrid.py) owns one and refreshes it in place
after every update. Split placement (`placement.own_pool=[rollout]`): a pool of these, rank r
generating for the policy's data-parallel rank r, fed by the trainer over `engine.reshard`'s
weight broadcast. Verbs: `generate`; split only: `connect` (once), `pull_weights` (collective
with the policy's `push_weights` on every trainer rank and the other rollout ranks).

Invariants:
- sampling is seeded from (trainer.seed, step, rank // rollout.tp): the same request draws the
  same samples in either placement, and a resumed step repeats them;
- with `rollout.tp` > 1, `generate` is collective within each group of tp consecutive ranks of
  its pool: the group generates all its ranks' prompts together, tensor parallel, and each rank
  keeps its own;
- `weight_version` is the actor's version of the weights this engine holds (0: the model
  directory it was built from), and every Batch it generates carries it;
- generating ahead of training (`trainer.max_staleness` > 0), a push arrives beside generation
  (runtime.BESIDE) into a copy of its own, and the engine takes the newest one received when a
  `generate` starts. Streaming (`max_staleness` >= 2) with the native engine and `rollout.tp` 1,
  it also takes one between two engine steps (partial rollouts): a sequence may then span
  versions, each token's is in `rollout_versions`, and the Batch's `weight_version` is the
  oldest. With one step ahead, or another engine, a batch has one version throughout.

Tests: tests/stages/test_policy.py (hybrid), tests/engine/test_reshard.py -k push (the weight
broadcast), tests/pipelines/test_e2e.py -k split (split placement, same metrics as hybrid),
tests/stages/test_rollout.py (a push taken mid-generation, versions per token).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from rlflow.engine.agents.episodes import run_episodes
from rlflow.engine.batch import Batch, RolloutRequest, Update
from rlflow.engine.config import Config, deterministic
from rlflow.engine.reshard import WeightBroadcast
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.build import build_rollout, weights_dtype
from rlflow.engine.rollout.model import TP
from rlflow.engine.specs import load_function
from rlflow.engine.tensors import left_pad, peak_memory, right_pad
from rlflow.engine.train import lora
from rlflow.engine.train.fsdp import DTYPES


class Rollout:
    def __init__(self, cfg: Config, model_path: str, rank: int = 0, world: int = 1, device: str = "cpu") -> None:
        self.cfg, self.rank, self.device, self.model_path = cfg, rank, torch.device(device), model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        r = cfg.rollout
        self.tp = TP.over_world(r.tp)  # a TP group generates the prompts of all its ranks at once
        self.env = load_function(r.env, "environment") if r.env else None
        self.engine = build_rollout(r.backend, self.tokenizer, model_path, r.dtype, device,
                                    cfg.data.max_prompt_tokens + (r.episode_tokens if self.env else r.max_new_tokens),
                                    -(-cfg.data.prompts_per_step * r.samples_per_prompt // world) * r.tp,
                                    r.kv_cache_memory, self.tp if r.tp > 1 else None, deterministic(cfg))
        self.weight_version = 0
        self.link: WeightBroadcast | None = None
        self.sink: Any = self.engine  # what a push loads into: the engine, or a LoRA Merger in front of it
        self.ahead = cfg.trainer.max_staleness > 0  # pushes arrive while generating: staged, taken at a generate
        self.staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None  # (version, tensors) received
        self.lock = threading.Lock()
        if cfg.trainer.max_staleness >= 2 and self.engine.swaps:
            self.engine.swap = self._swap  # partial rollouts: pushes land between engine steps

    def generate(self, request: RolloutRequest) -> Batch:
        start = time.perf_counter()
        self._take_staged()
        first = self.weight_version  # the version of tokens whose engine books none
        r = self.cfg.rollout
        params = SamplingParams(
            temperature=0.0 if request.greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            n=1 if request.greedy else request.samples or r.samples_per_prompt, max_new_tokens=r.max_new_tokens,
            stop_strings=r.stop_strings, seed=hash((self.cfg.trainer.seed, request.step, self.rank // r.tp)) % 2**31)
        if self.env is not None:
            return self._episodes(request, params, start, first)
        prompts, mine = self._tp_prompts([p.ids for p in request.prompts])
        # a rank may have no prompts (validation of fewer prompts than ranks); with TP it still
        # generates its group's
        groups = self.engine.generate(prompts, params)[mine] if prompts else []
        completions = [c for group in groups for c in group]
        batch = self._rows(request, params.n, first, [c.token_ids for c in completions],
                           [c.logprobs for c in completions], [c.versions for c in completions],
                           finish_reason=[c.finish_reason for c in completions],
                           responses=self.tokenizer.batch_decode([c.token_ids for c in completions],
                                                                 skip_special_tokens=True))
        batch.timing["gen"] = time.perf_counter() - start
        peak_memory("gen", batch.metrics)
        if self.link is not None:
            batch.metrics["perf/weight_sync_gb"] = self.link.bytes_per_push / 1e9  # what each push moves
        return batch

    def _episodes(self, request: RolloutRequest, params: SamplingParams, start: float, first: int) -> Batch:
        """`rollout.env`'s multi-turn episodes (engine/agents/episodes.py) as rows: each response is
        an episode's turns and observations, `loss_mask` 1 on its sampled tokens only."""
        r, rw = self.cfg.rollout, self.cfg.reward
        episodes, metrics = run_episodes(self.engine, self.tokenizer, request.prompts, params, self.env, r.max_turns,
                                         r.episode_tokens, rw.timeout_s, rw.on_error)
        batch = self._rows(request, params.n, first, [e.ids for e in episodes], [e.logprobs for e in episodes],
                           [e.versions for e in episodes],
                           finish_reason=["length" if e.truncated else "stop" for e in episodes],
                           responses=[e.answer for e in episodes],
                           loss_mask=right_pad([e.mask for e in episodes], 0.0, torch.float32),
                           env_rewards=right_pad([e.rewards for e in episodes], 0.0, torch.float32))
        batch.metrics.update(metrics)
        batch.timing["gen"] = time.perf_counter() - start
        peak_memory("gen", batch.metrics)
        return batch

    def _rows(self, request: RolloutRequest, n: int, first: int, ids: list[list[int]], logprobs: list[list[float]],
              versions: list[list[int]], **fields) -> Batch:
        """A Batch of `n` responses (`ids`, `logprobs`, each token's weights `versions`, where empty
        the version `first`) per request prompt, in order, with `fields`."""
        pids, pmask = left_pad([p.ids for p in request.prompts], self.tokenizer.pad_token_id)
        expand = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        versions = [v or [first] * len(x) for v, x in zip(versions, ids)]
        return Batch(
            prompt_ids=pids.repeat_interleave(n, 0), prompt_mask=pmask.repeat_interleave(n, 0), group_size=n,
            data_source=expand([p.data_source for p in request.prompts]),
            ground_truth=expand([p.ground_truth for p in request.prompts]),
            extra_info=expand([p.extra_info for p in request.prompts]),
            response_ids=right_pad(ids, self.tokenizer.pad_token_id, torch.long),
            response_mask=right_pad([[1.0] * len(x) for x in ids], 0.0, torch.float32),
            rollout_logprobs=right_pad(logprobs, 0.0, torch.float32),
            rollout_versions=right_pad(versions, first, torch.long),
            prompt_text=expand([p.text for p in request.prompts]),
            step=request.step, weight_version=min((min(v) for v in versions if v), default=first), **fields)

    def _tp_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], slice]:
        """(the prompts of every rank in this TP group, in rank order; where this rank's sit):
        tensor-parallel ranks must generate the same batch together (collective in the group)."""
        if self.tp.size == 1:
            return prompts, slice(None)
        every: list[list[list[int]]] = [[] for _ in range(self.tp.size)]
        torch.distributed.all_gather_object(every, prompts, group=self.tp.group)
        start = sum(len(x) for x in every[:self.tp.rank])
        return [p for x in every for p in x], slice(start, start + len(prompts))

    # -- split placement -------------------------------------------------------------------
    def connect(self, host: str, port: int, size: int) -> None:
        """Join the weight group hosted by trainer rank 0 at host:port, as its rank 1 + this rank,
        and take the trainer's push plan from it (`engine.reshard.weight_shapes`)."""
        dtype = weights_dtype(self.cfg.rollout.dtype)  # bf16 for fp8: quantised on arrival
        self.link = WeightBroadcast(host, port, 1 + self.rank, size, None, dtype, self.device)
        a = self.cfg.actor
        if a.lora_rank:  # the trainer pushes adapters: merge them beside a copy of the base
            self.sink = lora.Merger(self.engine, self.model_path, [n for n, _ in self.link.shapes],
                                    a.lora_alpha / a.lora_rank, DTYPES[self.cfg.model.dtype], self.device)

    def pull_weights(self, update: Update | None) -> int:
        """Take the trainer's weights (every rollout rank, with every actor rank's `push_weights`):
        those of `update`, or (None) those a checkpoint load set; returns their version. Generating
        ahead, they are staged for the next `generate`, and a newer push replaces an untaken one."""
        assert self.link is not None, "connect first"
        tensors: list[tuple[str, torch.Tensor]] = []
        version = self.link.receive(tensors.extend if self.ahead else self.sink.load_weights)
        if update is not None and update.weight_version != version:
            raise RuntimeError(f"expected weights version {update.weight_version}, received {version}")
        if self.ahead:
            with self.lock:
                self.staged = (version, tensors)
        else:
            self.weight_version = version
        return version

    def _take_staged(self) -> None:
        """Load the newest weights a push staged (generating ahead), before a generation starts. A
        tensor-parallel group takes them only once each of its ranks holds the same version (a push
        lands on its ranks at slightly different times), so the group never generates with two."""
        if not self.ahead:
            return
        with self.lock:
            staged = self.staged
        if self.tp.size > 1:  # collective in the group, as generate is
            every: list[int | None] = [None] * self.tp.size
            torch.distributed.all_gather_object(every, staged[0] if staged else self.weight_version,
                                                group=self.tp.group)
            if len(set(every)) > 1:
                return  # the next generate takes them
        if staged is None:
            return
        with self.lock:
            if self.staged is staged:  # else a newer push replaced it meanwhile: the next generate takes that
                self.staged = None
        version, tensors = staged
        self.sink.load_weights(tensors)
        self.weight_version = version

    def _swap(self) -> int:
        """Between two engine steps (partial rollouts): take weights staged since, if any; the
        version the engine holds."""
        if self.staged is not None:  # a read without the lock: a push landing now is taken next step
            self._take_staged()
        return self.weight_version
