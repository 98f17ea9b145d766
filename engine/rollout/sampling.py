"""Sampling a token from a step's logits, outside the decode graphs: the eager paths of the native
engine (top-k, top-p, greedy, and plain sampling where the Triton sampler does not run).

Invariants:
- a draw follows softmax(logits / T) restricted to what top-k and top-p keep;
- the logprob returned is over the full tempered vocabulary (not the filtered one), what a
  training forward computes for the same token;
- the draws are the caller's generator's: the same seed gives the same tokens.

Run: python -m pytest tests/engine/rollout/test_native.py -k "filter_logits or sampling"
"""

from __future__ import annotations

import torch

from rlflow.engine.rollout import kernels
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.tensors import fused


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask to -inf what top-k / top-p exclude from sampling; logits [B, V] already tempered."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keeps the smallest prefix reaching top_p (≥ 1 token)
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


@fused
def gumbel_pick(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A draw from softmax(logits / T) as argmax(logits / T + Gumbel noise) (the Gumbel-max trick)
    and its logprob, in one pass over the vocabulary: logits and uniform noise [B, V]."""
    scaled = logits.float() / temperature
    tokens = (scaled - torch.log(-torch.log(noise))).argmax(-1)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, -1)


def plain(params: SamplingParams) -> bool:
    """Sampling from the whole tempered distribution: no top-k/top-p filter, not greedy."""
    return params.temperature > 0 and params.top_k == 0 and params.top_p == 1.0


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) from logits [B, V]; logprobs over the full vocabulary."""
    if plain(params):
        if kernels.available(logits):
            inv_t = torch.full((1,), 1.0 / params.temperature, device=logits.device)
            uniform = torch.rand(len(logits), generator=generator, device=logits.device)
            return kernels.categorical_sample(logits, inv_t, uniform)
        noise = torch.rand(logits.shape, generator=generator, device=logits.device)
        return gumbel_pick(logits, noise, params.temperature)
    scaled = logits.float() / (params.temperature or 1.0)
    if params.temperature == 0:
        tokens = logits.argmax(-1)
    else:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # the picked logit less the logsumexp, as the trainer computes it (algos.token_logprobs)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, -1)
