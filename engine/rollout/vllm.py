"""The vLLM rollout engine: vLLM's offline `LLM`, running in this process, behind `RolloutEngine`.

Built from the actor's HF model directory. vLLM's engine core runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so `load_weights` hands the trainer's HF-named tensors
straight to vLLM's in-place reload (the model's own `load_weights`, then its kernel-layout
processing), with no copy through disk or another process.

Invariants (those of engine/rollout/base.py, plus):
- logprobs: vLLM reports them either before any sampling transform ("raw", temperature 1) or after
  top-k/top-p renormalisation ("processed"); neither is log softmax(logits / T) over the full
  vocabulary once top-k/top-p are on. So the temperature goes into the model's own logits scale
  (its `LogitsProcessor.scale`, times 1/T) and vLLM samples at temperature 1: the raw logprobs are
  then exactly the contract's, and sampling (temperature, then top-k/top-p) is unchanged. Greedy
  keeps the scale at 1 and so reports logprobs at temperature 1;
- prompt i's samples are seeded params.seed + i*n + j (vLLM seeds sample j of a request seed + j),
  so no two samples of one call share a seed, even for repeated prompts;
- after `load_weights` the prefix cache is reset: no KV computed with old weights is reused;
- `release_memory` puts vLLM to sleep (level 1: weights offloaded, KV cache dropped) where the
  platform has a sleep mode (CUDA/ROCm/XPU). On CPU vLLM has none: the KV cache
  (`kv_cache_memory_bytes`, sized below) stays allocated. Either way `generate` and
  `load_weights` refuse to run until `resume_memory`;
- every engine step counts as work done (engine/progress.py), so a long `generate` call is not
  taken for a stuck one, and a step that never returns is;
- one engine per process: shutting a vLLM engine down tears down process-wide state (its
  distributed groups) that any other engine in the process still uses;
- the engine is built, and every call into it made, on one thread of its own, whichever thread
  calls this class (a compiled graph's, the actor's main one);
- building the engine seeds this process's global RNGs and turns `torch.set_num_threads` into a
  no-op (vLLM's in-process engine and CPU worker do these): build it before anything relies on
  either, as the actor does.

Run: tests/engine/rollout/test_rollout_contract.py (needs the `vllm` extra; skipped without it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from rlflow.engine import progress
from rlflow.engine.rollout.base import Completion, SamplingParams, limits_of

T = TypeVar("T")
MAX_SEQS = 256  # sequences decoded at once; the CPU KV cache is sized for this many at max_len


class VLLMRollout:
    """vLLM generation over a copy of the trainer's weights; implements `RolloutEngine`."""

    streams = swaps = False  # one generate call at a time; weights land between calls
    swap = None

    def __init__(self, model_dir: str | Path, tokenizer: Any, max_len: int, dtype: torch.dtype) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: weights by reference
        # CPU: vLLM would pin its OpenMP threads from the thread that builds it; leave threads to the process
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise NotImplementedError("rollout.backend=vllm runs one engine per process and would join the "
                                      "trainer's data-parallel group as its own; use placement.workers=1")
        self.tokenizer = tokenizer
        self.released = False
        # vLLM-CPU's attention plans its OpenMP threads on the thread that built the engine and checks
        # them on every call, while a compiled graph calls from a thread of its own: with torch's
        # libgomp preloaded (as vLLM asks, and sets for child processes) the two counts differ and
        # the kernel aborts. So the engine lives on one thread: built there, every call made there.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm")
        self._on_thread(self._build, model_dir, max_len, dtype)

    def _build(self, model_dir: str | Path, max_len: int, dtype: torch.dtype) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.can_sleep = current_platform.is_sleep_mode_available()
        name = cast(Any, str(dtype).removeprefix("torch."))  # "float32" | "bfloat16" | ...
        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=name, max_model_len=max_len,
                       max_num_seqs=MAX_SEQS, seed=0, max_logprobs=0,
                       kv_cache_memory_bytes=kv_cache_bytes(model_dir, max_len, dtype),
                       enable_sleep_mode=self.can_sleep, enforce_eager=not torch.cuda.is_available())
        self.model = cast(Any, self.llm.apply_model(lambda m: m)[0])  # in-process: the module itself, not a copy
        core, step = self.llm.llm_engine, self.llm.llm_engine.step

        def counted(*args: Any, **kwargs: Any) -> Any:  # `generate` runs the engine a step at a time
            out = step(*args, **kwargs)
            progress.tick()
            return out
        core.step = counted
        self.base_scale: float = self.model.logits_processor.scale  # a model's own logit scale (1.0 for Qwen2)

    def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._thread.submit(fn, *args).result()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self._on_thread(self._generate, prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake()
        greedy = params.temperature == 0
        stops = sorted({self.tokenizer.eos_token_id, *params.stop_token_ids})
        requests = [VSamplingParams(  # vLLM refuses n > 1 when greedy: one sample, copied below
            n=1 if greedy else params.n, temperature=0.0 if greedy else 1.0, top_p=params.top_p, top_k=params.top_k,
            seed=params.seed + i * params.n, max_tokens=limit, stop_token_ids=stops,
            stop=params.stop_strings or None, include_stop_str_in_output=True, logprobs=0, detokenize=True,
        ) for i, limit in enumerate(limits_of(prompts, params))]
        self.model.logits_processor.scale = self.base_scale / (1.0 if greedy else params.temperature)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests, use_tqdm=False)
        copies = params.n if greedy else 1
        return [[_completion(o) for o in sorted(out.outputs, key=lambda o: o.index) for _ in range(copies)]
                for out in outs]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_awake()
        self._on_thread(self._load_weights, [(name, t.detach()) for name, t in named_tensors])

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM's in-place reload: the model's `load_weights`, then the kernel-layout processing (e.g. the CPU
        # GEMM's packed weights) that a bare `load_weights` would leave holding the old values
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        head = self.model.lm_head
        if head.weight is self.model.model.embed_tokens.weight:
            # the reload processes a tied weight for its first owner only (a limit vLLM documents), so
            # redo the head's own processing: on CPU its GEMM holds a packed copy of the old embedding
            head.quant_method.process_weights_after_loading(head)
        self.llm.reset_prefix_cache()

    def release_memory(self, weights: bool = False) -> None:
        """Sleep level 1 either way: the weights go to host memory and come back on `resume_memory`."""
        if self.can_sleep:
            self._on_thread(self.llm.sleep, 1)
        self.released = True

    def resume_memory(self) -> None:
        if self.can_sleep:
            self._on_thread(self.llm.wake_up)
        self.released = False

    def _check_awake(self) -> None:
        if self.released:
            raise RuntimeError("vLLM engine released: call resume_memory() first")


def _completion(out: Any) -> Completion:
    """One vLLM sample as a `Completion`; logprobs is one {token: Logprob} dict per token."""
    logprobs = [step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs)]
    return Completion(list(out.token_ids), logprobs, "stop" if out.finish_reason == "stop" else "length")


def kv_cache_bytes(model_dir: str | Path, max_len: int, dtype: torch.dtype) -> int:
    """K and V for MAX_SEQS sequences of max_len tokens, so vLLM never sizes it from free memory
    (on CPU it would claim most of the machine, next to the trainer)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
    return MAX_SEQS * max_len * per_token
