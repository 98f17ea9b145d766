"""Rollout engines: prompt token ids in, sampled responses with per-token logprobs out.

One interface (`RolloutEngine`), backends picked by `rollout.backend`:
- `native` (engine/rollout/native.py, the default): our own Qwen2/Qwen3/Llama model with a slot KV cache,
  continuous batching and CUDA-graph decode, holding a copy of the trainer's weights refreshed
  by `load_weights`;
- `hf`: transformers' `generate` over the training module itself (hybrid, zero-copy on one
  device); a slow reference that works for any architecture;
- `vllm` (engine/rollout/vllm.py, the `vllm` extra): vLLM in this process, built from the model
  directory, its copy of the weights refreshed the same way.

Invariants:
- `generate` returns, per prompt, `n` completions in order, so a prompt's samples are contiguous;
- `logprobs[t]` is log softmax(logits_t / temperature)[token_t] over the FULL vocabulary (top-p/k
  only restrict what can be sampled), which is exactly what the trainer recomputes; greedy
  decoding (temperature 0) reports logprobs at temperature 1;
- a response ends with its stop token included (finish "stop") or at max_new_tokens, or its
  prompt's entry in `limits` where given ("length");
- the same seed gives the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlflow.engine import progress
from rlflow.engine.tensors import left_pad


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    n: int = 1
    max_new_tokens: int = 16
    limits: list[int] = field(default_factory=list)  # per prompt, its own max_new_tokens (<= the one above); [] = none
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # per token, the weights version that sampled it, where weights may land mid-sequence (the native
    # engine with a `swap`); [] where they land only between calls
    versions: list[int] = field(default_factory=list)


@dataclass
class Request:
    """A prompt for an engine that serves requests as they come (`serve`, the native engine's)."""
    prompt: list[int]
    keys: list[Any]  # one per sample, handed back with its completion; the samples share one prefill
    limit: int = 0  # its max new tokens; 0: the params' max_new_tokens


# feed(completions finished since the last call, with their keys; whether the engine has nothing
# left to run, so the feed may block) -> new requests, or None once no more will come
Feed = Callable[[list[tuple[Any, Completion]], bool], "list[Request] | None"]


class RolloutEngine(Protocol):
    """What every backend does, and the optional capabilities it declares: a caller asks the
    engine (`streams`, `swaps`), never its class, and `build_rollout` checks each declared one once.

    - `streams`: `serve(params, feed)` runs, taking requests as they come (an episode's next turn
      is admitted while the others decode);
    - `swaps`: the caller may set `swap`, a callable run between two engine steps that may load
      new weights mid-generation and names the version now held (partial rollouts); each
      completion's `versions` then says which version sampled each token."""

    @property
    def streams(self) -> bool: ...

    @property
    def swaps(self) -> bool: ...

    swap: Callable[[], int] | None  # set by the caller where `swaps`; None: weights land between calls

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    # The KV cache's memory, and with `weights` the weights' (an engine may keep them), go back
    # for training; a caller that passes `weights=True` writes every weight before it generates.
    def release_memory(self, weights: bool = False) -> None: ...

    def resume_memory(self) -> None: ...


def _tick_per_token(input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
    """A stopping criterion that stops nothing: it counts each generated token as work done
    (engine/progress.py), so a long `generate` call is not taken for a stuck one."""
    progress.tick()
    return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def stop_ids(tokenizer: Any, params: SamplingParams) -> list[int]:
    """The tokenizer's EOS (when it has one) and the request's stop tokens."""
    return sorted({t for t in (tokenizer.eos_token_id, *params.stop_token_ids) if t is not None})


def limits_of(prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """Each prompt's max new tokens: its entry in `params.limits`, else `params.max_new_tokens`."""
    if not params.limits:
        return [params.max_new_tokens] * len(prompts)
    if len(params.limits) != len(prompts) or not all(0 < n <= params.max_new_tokens for n in params.limits):
        raise ValueError(f"limits needs one value in [1, max_new_tokens={params.max_new_tokens}] per prompt "
                         f"({len(prompts)}), got {params.limits[:8]}")
    return params.limits


class HFRollout:
    """transformers `generate` on a causal LM module, shared with the trainer when hybrid."""

    streams = swaps = False  # one generate call at a time; weights land between calls
    swap = None

    def __init__(self, model: Any, tokenizer: Any, cache_implementation: str = "dynamic") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache_implementation = cache_implementation  # dynamic | static (transformers' names)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        from transformers import GenerationConfig

        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)
        stops = stop_ids(self.tokenizer, params)
        greedy = params.temperature == 0
        gen = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=(params.top_k or None) if not greedy else None,
            max_new_tokens=params.max_new_tokens, eos_token_id=stops or None,
            pad_token_id=self.tokenizer.pad_token_id,
            cache_implementation=None if self.cache_implementation == "dynamic" else self.cache_implementation,
        )  # no stop_strings: transformers matches them across the prompt's end; `_cut` looks at the response only
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(params.seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen,
                                      stopping_criteria=[_tick_per_token])
        self.model.train(was_training)
        tokens = out[:, ids.shape[1]:].cpu()  # [B*n, R]
        logp = self._logprobs(ids, mask, tokens, params.temperature)
        # generate runs every row to the batch's longest; a prompt's own limit cuts its rows after
        limits = [limit for limit in limits_of(prompts, params) for _ in range(params.n)]
        flat = [self._cut(tokens[i, :limits[i]], logp[i, :limits[i]], stops, params) for i in range(len(tokens))]
        return [flat[i:i + params.n] for i in range(0, len(flat), params.n)]

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                  temperature: float) -> torch.Tensor:
        """Per-token logprobs [B*n, R] by one more forward over prompt + response: keeping
        generate's per-step logits would hold [B*n, R, vocab] floats (37 GB at 256 x 256 x 152k)."""
        from rlflow.engine.train.fsdp import response_logprobs

        full = torch.cat([mask, torch.ones_like(tokens)], 1)
        vocab = self.model.config.vocab_size
        budget = max(ids.shape[1] + tokens.shape[1], 2**31 // (4 * vocab))  # ~2 GiB of fp32 logits a chunk
        logp, _ = response_logprobs(self.model, torch.cat([ids, tokens], 1), full,
                                    (full.cumsum(1) - 1).clamp(min=0), tokens, temperature, budget)
        return logp

    def _cut(self, tokens: torch.Tensor, logp: torch.Tensor, stops: list[int],
             params: SamplingParams) -> Completion:
        """Trim one row to its first stop token (kept) or stop string; name the finish reason."""
        toks = tokens.tolist()
        for t, tok in enumerate(toks):
            if tok in stops:
                return Completion(toks[:t + 1], logp[:t + 1].tolist(), "stop")
        for t in range(len(toks) if params.stop_strings else 0):
            text = self.tokenizer.decode(toks[:t + 1])
            if any(text.endswith(s) for s in params.stop_strings):
                return Completion(toks[:t + 1], logp[:t + 1].tolist(), "stop")
        return Completion(toks, logp.tolist(), "length")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if params[name] is not tensor:  # the trainer's own module needs no copy
                    params[name].copy_(tensor)

    def release_memory(self, weights: bool = False) -> None:
        """Nothing to release: `generate` allocates its cache per call, and the weights stay."""

    def resume_memory(self) -> None:
        """Nothing to take back: see release_memory."""
