"""Algorithm math for RL post-training: advantages, policy/value/DPO losses, KL terms, aggregation,
and the registry of estimators by name (`ESTIMATORS`), each saying what it needs of a step.

This module is pure tensor math. It imports only torch and the standard library, so every
stage and pipeline can use it and tests run on CPU in milliseconds. It is the one place that
knows the algorithms by name: the config's checks, the step graph and the stages ask an
`Estimator`'s fields (or `needs_whole_sequences`, `run_name`), never compare names (a test checks).

Conventions and invariants:
- N is the number of responses, T the padded response length, V the vocabulary size.
- ``mask`` is a float or bool tensor ``[N, T]`` with 1 on valid response tokens.
- Responses of one prompt are contiguous: group g holds rows ``g*G .. g*G+G-1``.
- Every ``[N, T]`` output of this module is 0 where ``mask == 0``.
- Metrics are returned as detached 0-dim tensors, so callers decide when to sync to host.

Run its tests with ``python -m pytest tests/engine/test_algos.py -q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# The names the math dispatches on, which are also the allowed values of the config keys named beside them
# (engine/config.py validates against these tuples; there is no second list). The advantage
# estimators are `ESTIMATORS`, below the functions they call.
POLICY_LOSSES = ("ppo", "gspo", "cispo")  # actor.policy_loss
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # actor.loss_agg
KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "low_var_kl")  # actor.kl_loss_type
# The KL in the reward (algorithm.kl_coef) is k1, a constant: summed over a row's tokens it is the
# row's log ratio to the reference, an unbiased estimate of the sequences' KL, which the returns
# then carry; the others are not (InstructGPT's penalty, verl's and OpenRLHF's PPO default).
REWARD_KL = "k1"
NO_CORRECTION = "none"
EXACT = "exact"  # no gap to correct: the rollout and the trainer compute each logprob alike (engine/exact.py)
# algorithm.rollout_correction
ROLLOUT_CORRECTIONS = (NO_CORRECTION, "token_tis", "seq_tis", "token_mask", "seq_mask", EXACT)
WHOLE_SEQUENCE = ("gspo", "seq-mean-token-mean", "seq_tis", "seq_mask")  # a ratio or mean over a row's tokens


# ---------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; an empty selection gives 0, not nan."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1e-8)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` over all valid positions with the population (biased) variance.

    ``(x - mean) / sqrt(var + eps)``; masked positions are set to 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


# ---------------------------------------------------------------- advantages


def group_advantages(scores: Tensor, group_size: int, estimator: str, eps: float = 1e-6) -> Tensor:
    """Outcome advantage per response from its group of ``group_size`` siblings, for the group
    estimators grpo (divided by the group's std), rloo (leave-one-out mean), drgrpo and
    reinforce_pp_baseline (centred).

    scores: [N] scalar reward per response. Returns [N].
    """
    if estimator not in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline"):
        raise ValueError(f"unknown group estimator {estimator!r}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    if estimator in ("grpo", "rloo") and group_size < 2:
        # The unbiased std and the leave-one-out mean are undefined for a single sample.
        raise ValueError(f"{estimator} needs group_size >= 2, got {group_size}")
    grouped = scores.view(-1, group_size)  # [N/G, G]
    centered = grouped - grouped.mean(dim=-1, keepdim=True)  # [N/G, G]
    if estimator == "grpo":
        centered = centered / (grouped.std(dim=-1, keepdim=True) + eps)
    elif estimator == "rloo":
        # s - mean(others) == G/(G-1) * (s - mean(all)).
        centered = centered * (group_size / (group_size - 1))
    return centered.reshape(-1)  # [N]


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` per token, t+1 being the next token
    with mask 1 (an episode's observation tokens neither earn nor discount). Returns [N, T]."""
    mask = mask.to(token_rewards.dtype)
    rewards = token_rewards * mask  # [N, T]
    returns = torch.zeros_like(rewards)  # [N, T]
    running = torch.zeros_like(rewards[:, 0])  # [N]
    for t in reversed(range(rewards.shape[1])):  # a masked token (an observation) passes `running` on
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def on_last_token(values: Tensor, mask: Tensor) -> Tensor:
    """Place a per-row value [N] on the last valid token of each row. Returns [N, T]."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)  # [T]
    last = (mask.bool() * positions).argmax(dim=-1, keepdim=True)  # [N, 1]
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)  # [N, T]
    out.scatter_(1, last, values.unsqueeze(-1))
    # Rows with no valid token put their value on a masked slot; clear it.
    return out * mask.to(values.dtype)


def token_scores(scores: Tensor, mask: Tensor, earned: Tensor | None = None) -> Tensor:
    """Outcome scores [N] as per-token rewards [N, T]: the part a multi-turn episode's turns
    `earned` [N, T] stays on the tokens that earned it, the rest goes on each row's last valid token
    (all of it without `earned`); each row still sums to its score."""
    if earned is None:
        return on_last_token(scores, mask)
    turns = earned * mask.to(earned.dtype)  # [N, T]
    return turns + on_last_token(scores - turns.sum(-1), mask)


def remax_advantages(scores: Tensor, greedy_scores: Tensor, mask: Tensor) -> Tensor:
    """ReMax (Li et al., 2023): a sample's reward minus that of the greedy response to its prompt.

    scores, greedy_scores: [N]. Returns [N, T], constant over each row's valid tokens.
    """
    return (scores - greedy_scores).unsqueeze(-1) * mask.to(scores.dtype)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over right-padded responses.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with V = 0 past the last valid token, and
    ``A_t = delta_t + gamma * lam * A_{t+1}``, t+1 being the next token with mask 1 (the observation
    tokens inside a multi-turn episode are skipped, not treated as an end). Inputs [N, T]; returns
    (advantages, returns = A + V), both [N, T] and not whitened.
    """
    fmask = mask.to(values.dtype)
    rewards, values = token_rewards * fmask, values * fmask  # [N, T]
    advantages = torch.zeros_like(values)  # [N, T]
    running = torch.zeros_like(values[:, 0])  # [N]
    next_value = torch.zeros_like(values[:, 0])  # [N]
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        valid = fmask[:, t] > 0  # a masked token (padding, or an episode's observation) is skipped:
        running = torch.where(valid, delta + gamma * lam * running, running)  # the token before it
        advantages[:, t] = running  # bootstraps from the next valid one
        next_value = torch.where(valid, values[:, t], next_value)
    # Padding sits after the last valid token, so it adds nothing above; mask what it holds.
    return advantages * fmask, (advantages + values) * fmask


# ---------------------------------------------------------------- the estimators, by name


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read, for N responses of T tokens (the rows of one prompt contiguous)."""

    scores: Tensor  # [N] outcome rewards, with any shaping (DAPO's overlong penalty)
    mask: Tensor  # [N, T] 1 on the tokens trained on
    group_size: int  # G: samples of one prompt
    rewards: Tensor  # [N, T] per-token rewards: each score on its row's last token, an episode's turns' on
    #                  the turns that earned them, an in-reward KL penalty folded in
    gamma: float = 1.0  # discount of per-token returns
    lam: float = 1.0  # GAE's lambda
    baseline: Tensor | None = None  # [N] the score of the greedy answer to each row's prompt
    values: Tensor | None = None  # [N, T] the critic's values


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator (`algorithm.advantage`): its math, and what it needs of a step. The
    config checks, the step graph (a critic, a greedy request a prompt) and the advantage stage
    read these fields; nothing else knows an estimator by name. `compute` returns the advantages
    [N, T], 0 where the mask is, and, for an estimator that trains a critic, its returns [N, T]."""

    name: str
    compute: Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]
    group: bool = False  # compares one prompt's samples: rollout.samples_per_prompt >= 2
    critic: bool = False  # reads a value model's values: the step trains one beside the policy
    greedy_baseline: bool = False  # reads the score of each prompt's greedy answer: the step asks for one
    token_rewards: bool = False  # reads per-token rewards (an episode's turns, an in-reward KL); the others, scores
    label: str = ""  # the run's name (`algorithm.name`) where it is not `name`


def _group(name: str) -> Callable[[AdvantageInputs], tuple[Tensor, None]]:
    def compute(x: AdvantageInputs) -> tuple[Tensor, None]:
        return group_advantages(x.scores, x.group_size, name).unsqueeze(-1) * x.mask.to(x.scores.dtype), None
    return compute


def _reinforce_pp(x: AdvantageInputs) -> tuple[Tensor, None]:
    return masked_whiten(reinforce_pp_returns(x.rewards, x.mask, x.gamma), x.mask.to(x.scores.dtype)), None


def _reinforce_pp_baseline(x: AdvantageInputs) -> tuple[Tensor, None]:
    centred = on_last_token(group_advantages(x.scores, x.group_size, "reinforce_pp_baseline"), x.mask)  # [N, T]
    return masked_whiten(reinforce_pp_returns(centred, x.mask, x.gamma), x.mask.to(x.scores.dtype)), None


def _remax(x: AdvantageInputs) -> tuple[Tensor, None]:
    if x.baseline is None:
        raise ValueError("remax reads the score of each prompt's greedy answer: give a baseline")
    return remax_advantages(x.scores, x.baseline, x.mask), None


def _gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if x.values is None:
        raise ValueError("gae reads a critic's values: give values")
    advantages, returns = gae(x.rewards, x.values, x.mask, x.gamma, x.lam)
    return masked_whiten(advantages, x.mask), returns


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("grpo", _group("grpo"), group=True),  # the group's mean and std (Shao et al., 2024)
    Estimator("drgrpo", _group("drgrpo"), group=True),  # centred only (Liu et al., 2025)
    Estimator("rloo", _group("rloo"), group=True),  # the mean of the others (Ahmadian et al., 2024)
    Estimator("reinforce_pp", _reinforce_pp, token_rewards=True),  # whitened discounted returns (Hu, 2025)
    Estimator("reinforce_pp_baseline", _reinforce_pp_baseline, group=True),  # ... of group-centred scores
    Estimator("remax", _remax, greedy_baseline=True),  # the greedy answer's score (Li et al., 2023)
    Estimator("gae", _gae, critic=True, token_rewards=True, label="ppo"),  # a critic (Schulman et al., 2016)
)}
ADVANTAGES = tuple(ESTIMATORS)  # algorithm.advantage, besides an Estimator of the user's own ("file.py:NAME")


def run_name(estimator: Estimator, policy_loss: str, dynamic_sampling: bool) -> str:
    """An RL run's `algorithm.name`: its estimator's (gae runs ppo; grpo with dynamic sampling is
    dapo), then `+policy_loss` where that is not ppo's: grpo+gspo."""
    label = estimator.label or estimator.name
    if label == "grpo" and dynamic_sampling:
        label = "dapo"
    return label if policy_loss == "ppo" else f"{label}+{policy_loss}"


def needs_whole_sequences(*settings: str) -> list[str]:
    """Those of `settings` (a policy loss, a loss aggregation, a rollout correction) that need every
    token of a row on one rank: a ratio or a mean over the row."""
    return [s for s in settings if s in WHOLE_SEQUENCE]


def divides_by_rows(loss_agg: str) -> bool:
    """Whether a loss aggregation's denominator counts rows (a mean over sequences), not tokens."""
    return loss_agg != "token-mean"


def dual_clip_applies(policy_loss: str) -> bool:
    """Whether a dual clip bounds this policy loss (it caps a ratio's surrogate; CISPO has none)."""
    return policy_loss != "cispo"


def varied_groups(scores: Tensor, group_size: int) -> Tensor:
    """DAPO's dynamic-sampling filter: True for groups whose scores are not all equal. [N] -> [N/G]."""
    grouped = scores.view(-1, group_size)  # [N/G, G]
    return (grouped != grouped[:, :1]).any(dim=-1)


def dynamic_sampling_rows(scores: Tensor, group_size: int, want: int) -> Tensor:
    """Row indices of ``want`` groups for one DAPO step: groups whose scores differ first, in order,
    then groups that all agree to top up a short step. scores: [N]. Returns [min(want, N/G) * G]."""
    varied = varied_groups(scores, group_size)  # [N/G]
    groups = torch.cat([varied.nonzero(), (~varied).nonzero()]).flatten()[:want]  # [<= want]
    return (groups.unsqueeze(-1) * group_size + torch.arange(group_size, device=scores.device)).flatten()


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward. lengths: [N] response tokens. Returns [N].

    0 up to ``max_len - buffer`` tokens, then falling linearly to -1 at ``max_len``: DAPO's shaping
    (Yu et al., 2025), whose -1 is a wrong answer's distance from a right one under 0/1 rewards.
    """
    over = (lengths.float() - (max_len - buffer)) / buffer  # [N], > 0 inside the buffer
    return -over.clamp(0.0, 1.0)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with ``correct`` right (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= correct <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 0 < k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0  # every k-subset holds a correct sample
    # The product form of the binomial ratio stays finite for large n.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


# ---------------------------------------------------------------- losses


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    denom: float | None = None,
    norm_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar.

    ``denom`` overrides the divisor (tokens for "token-mean", rows otherwise) so callers can
    divide every micro-batch by the mini-batch total and make gradient accumulation exact.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        total = denom if denom is not None else mask.sum().clamp(min=1.0)
        return (loss_mat * mask).sum() / total
    rows = denom if denom is not None else loss_mat.shape[0]
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).sum() / rows
    if mode == "seq-mean-token-sum-norm":
        # Dr.GRPO: a constant length normaliser removes the bias towards long wrong answers.
        length = norm_len if norm_len is not None else loss_mat.shape[1]
        return ((loss_mat * mask).sum(dim=-1) / length).sum() / rows
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGGS}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    denom: float | None = None,
    norm_len: int | None = None,
    kind: str = "ppo",
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss; ``kind`` is one of ``POLICY_LOSSES``; ``weights`` [N, T], if
    given, scale each token's term (``rollout_correction``'s).

    - "ppo": the PPO clipped surrogate on per-token ratios in [1 - clip_low, 1 + clip_high],
      with an optional dual clip for negative advantages;
    - "gspo": the same surrogate on GSPO's sequence-level ratio (see ``gspo_ratio``);
    - "cispo": MiniMax-M1's clipped, stop-gradient IS weight times the logprob (``cispo_surrogate``).

    All inputs are [N, T]. Returns the aggregated loss and detached 0-dim metrics, which are
    masked means over this micro-batch (independent of ``denom``).
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; expected one of {POLICY_LOSSES}")
    if dual_clip is not None and (dual_clip <= 1.0 or kind == "cispo"):
        raise ValueError(f"dual_clip must be > 1 and needs a ppo/gspo loss, got {dual_clip} with {kind!r}")
    log_ratio = logp - old_logp  # [N, T]
    if kind == "gspo":
        ratio = gspo_ratio(logp, old_logp, mask)  # [N, T]
    else:
        # Clamp before exp so a stale token cannot overflow the ratio to inf.
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # [N, T]
    if kind == "cispo":
        loss_mat, clipped = cispo_surrogate(logp, ratio, advantages, clip_low, clip_high)
        capped = torch.zeros_like(clipped)
    else:
        loss_mat, clipped, capped = ppo_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    if weights is not None:
        loss_mat = loss_mat * weights
    loss = agg_loss(loss_mat, mask, agg_mode, denom=denom, norm_len=norm_len)
    metrics = {
        "pg_clipfrac": masked_mean(clipped.to(logp.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
        "pg_clipfrac_lower": masked_mean(capped.to(logp.dtype), mask).detach(),
    }
    return loss, metrics


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, kind: str,
                       cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights [N, T] on the policy loss for the gap between the policy that sampled the
    tokens (the rollout engine's logprobs: another precision, kernels or, running ahead, weight
    version) and the one the loss's ratio starts from (``old_logp``: the trainer's, before this
    step's updates), and their metrics. With w = old / rollout, ``kind`` is one of
    ``ROLLOUT_CORRECTIONS``:

    - "none", "exact": 1 (exact: deterministic mode, where the gap is 0 by construction and
      `mismatch_kl` shows it);
    - "token_tis": min(w_t, cap), truncated importance sampling per token; with the trainer's
      pre-update policy as the proximal one, this is decoupled PPO's weight, capped;
    - "seq_tis": min(prod_t w_t, cap) on every token of a sequence;
    - "token_mask": 1 where 1/cap <= w_t <= cap, else 0 (the token is left out of the gradient);
    - "seq_mask": the same on a sequence's geometric mean exp(mean_t log w_t), for all its tokens.

    Metrics (detached): ``mismatch_kl``, KL(rollout || old) estimated on the sampled tokens with
    the k3 estimator (w - 1 - log w, unbiased and never negative, where the plain mean of
    log(rollout / old) dips below 0 on a small gap);
    ``weight_mean`` and ``weight_max`` of the applied weights; ``corrected_fraction``, the share of
    tokens capped (tis) or masked to 0 (mask). A masked token still counts in the loss's
    denominator, as a token with zero gradient.
    """
    if kind not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {kind!r}; expected one of {ROLLOUT_CORRECTIONS}")
    m = mask.to(old_logp.dtype)
    log_w = log_w_token = (old_logp - rollout_logp).clamp(-20.0, 20.0) * m  # [N, T]
    if kind.startswith("seq"):
        seq = log_w.sum(-1, keepdim=True) if kind == "seq_tis" else log_w.sum(-1, keepdim=True) / m.sum(
            -1, keepdim=True).clamp(min=1)
        log_w = seq.clamp(-20.0, 20.0).expand_as(log_w)  # [N, T]: the sequence's, on each of its tokens
    w = torch.exp(log_w)
    if kind in (NO_CORRECTION, EXACT):
        weights, corrected = torch.ones_like(w), torch.zeros_like(w, dtype=torch.bool)
    elif kind.endswith("tis"):
        weights, corrected = w.clamp(max=cap), w > cap
    else:
        corrected = (w < 1.0 / cap) | (w > cap)
        weights = (~corrected).to(w.dtype)
    weights = (weights * m).detach()
    metrics = {
        "mismatch_kl": masked_mean(torch.expm1(log_w_token) - log_w_token, m).detach(),
        "weight_mean": masked_mean(weights, m),
        "weight_max": weights.max() if weights.numel() else weights.new_zeros(()),
        "corrected_fraction": masked_mean(corrected.to(w.dtype), m),
    }
    return weights, metrics


def ppo_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token ``max(-A * r, -A * clip(r))``, capped at ``-dual_clip * A`` where A < 0.

    Inputs [N, T]. Returns (loss [N, T], ratio-clipped [N, T] bool, dual-capped [N, T] bool).
    """
    loss1 = -advantages * ratio  # [N, T]
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    clipped = torch.maximum(loss1, loss2)  # [N, T]
    if dual_clip is None:
        return clipped, loss2 > loss1, torch.zeros_like(loss1, dtype=torch.bool)
    # For A < 0 a huge ratio makes the loss unbounded; cap it at -c * A.
    cap = -advantages * dual_clip  # [N, T]
    capped = (clipped > cap) & (advantages < 0)  # [N, T]
    return torch.where(capped, cap, clipped), loss2 > loss1, capped


def gspo_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's (Zheng et al., 2025) sequence ratio ``s_i = exp(mean_t(logp - old_logp))`` on every token.

    Its value is s_i on each valid token, and its gradient is ``s_i * grad logp_t`` (the paper's
    GSPO-token form), so the PPO surrogate clips whole sequences: with "seq-mean-token-mean"
    aggregation the gradient is the paper's ``s_i * A_i * mean_t grad logp_t``. Inputs [N, T].
    """
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=-1)  # [N]
    log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [N, T]
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def cispo_surrogate(
    logp: Tensor, ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``.

    Clipping the weight instead of the update keeps every token's gradient, rare ones included.
    The paper only bounds the weight from above (clip_low = 1 removes the lower bound).
    Inputs [N, T]. Returns (loss [N, T], weight-clipped [N, T] bool).
    """
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [N, T]
    return -advantages * weight * logp, weight != ratio.detach()


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float,
    agg_mode: str = "token-mean",
    denom: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, V_clip = old + clip(V - old, ±clip).

    Inputs [N, T]. Returns the aggregated loss and the detached fraction of tokens where the
    clipped term was larger (``vf_clipfrac``).
    """
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)  # [N, T]
    plain, clipped = (values - returns).square(), (clipped_values - returns).square()  # [N, T]
    loss = agg_loss(0.5 * torch.maximum(plain, clipped), mask, agg_mode, denom=denom)
    return loss, {"vf_clipfrac": masked_mean((clipped > plain).to(values.dtype), mask).detach()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over valid tokens, population variances. Inputs [N, T].

    1 is a perfect critic, 0 one no better than the mean return, < 0 worse; 0-dim, detached.
    """
    def var(x: Tensor) -> Tensor:
        return masked_mean((x - masked_mean(x, mask)).square(), mask)

    return (1.0 - var(returns - values) / var(returns).clamp(min=1e-8)).detach()


def dpo_loss(
    chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor, beta: float,
    chosen_tokens: Tensor | None = None, nll_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al., 2023): ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``, batch mean.

    Inputs [B]: summed response logprobs of each pair's chosen and rejected answer under the
    policy and the frozen reference. Metrics are the implicit rewards ``beta * (pi - ref)``.

    With `nll_coef`, plus that times the chosen answers' negative logprob per token (`chosen_tokens`
    [B] of each), batch mean: RPO's term (Pang et al., 2024), which keeps DPO from widening the
    margin by lowering the chosen answers' likelihood along with the rejected ones'.
    """
    chosen = beta * (chosen_logp - ref_chosen_logp)  # [B]
    rejected = beta * (rejected_logp - ref_rejected_logp)  # [B]
    loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    metrics = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margin": (chosen - rejected).mean(),
        "rewards/accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }
    if nll_coef:
        assert chosen_tokens is not None, "the NLL term is per token: pass each chosen answer's token count"
        metrics["nll"] = (-chosen_logp / chosen_tokens.clamp(min=1)).mean()
        loss = loss + nll_coef * metrics["nll"]
    return loss, {k: v.detach() for k, v in metrics.items()}


# ---------------------------------------------------------------- KL


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Elementwise KL estimate between the policy and the reference, same shape as the inputs."""
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        # Schulman's k3, r - 1 - log r with r = ref/pi: unbiased and always >= 0. Clamped as verl does, which
        # calls it low_var_kl: d to [-20, 20] keeps exp and its gradient finite, the estimate to [-10, 10].
        d = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl kind {kind!r}; expected one of {KL_ESTIMATORS}")


@dataclass
class FixedKLController:
    """Constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""


KL_HORIZON = 10000  # adaptive KL: responses over which the coefficient moves by at most 20% (Ziegler et al.)


@dataclass
class AdaptiveKLController:
    """Proportional controller steering the observed KL towards ``target`` (Ziegler et al., 2019)."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` by ``1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_in_reward(token_scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token reward with the KL penalty folded in: ``(scores - beta * kl) * mask``. [N, T]."""
    return (token_scores - beta * kl) * mask.to(token_scores.dtype)


# ---------------------------------------------------------------- logits


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in the dtype of ``logits``. [...]"""
    # H = logsumexp(z) - sum(p * z) avoids log(p) of underflowed probabilities.
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[tokens] in float32. logits: [N, T, V], tokens: [N, T]. Returns [N, T]."""
    # Gather minus logsumexp instead of log_softmax, which would allocate a full [N, T, V] output.
    logits = logits.float()  # no copy when already float32
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]
    return picked - torch.logsumexp(logits, dim=-1)
