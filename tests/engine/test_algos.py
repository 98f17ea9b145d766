"""Hand-computed checks for engine/algos.py: every expected value is a literal worked out on paper."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from rlflow.engine.algos import (
    ADVANTAGES,
    ESTIMATORS,
    EXACT,
    KL_ESTIMATORS,
    LOSS_AGGS,
    NO_CORRECTION,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    agg_loss,
    dpo_loss,
    dynamic_sampling_rows,
    entropy_from_logits,
    explained_variance,
    gae,
    group_advantages,
    kl_in_reward,
    kl_penalty,
    masked_mean,
    masked_whiten,
    on_last_token,
    overlong_penalty,
    pass_at_k,
    policy_loss,
    reinforce_pp_returns,
    rollout_correction,
    token_logprobs,
    token_scores,
    value_loss,
    varied_groups,
)
from rlflow.engine.config import ActorConfig, AlgorithmConfig


def compute_advantages(name: str, scores: torch.Tensor, mask: torch.Tensor, group_size: int, gamma: float = 1.0,
                       token_rewards: torch.Tensor | None = None, baseline: torch.Tensor | None = None,
                       values: torch.Tensor | None = None) -> torch.Tensor:
    """The registered estimator's advantages [N, T], as the advantage stage asks for them (each
    score on its row's last token unless `token_rewards` say otherwise)."""
    rewards = on_last_token(scores, mask) if token_rewards is None else token_rewards
    return ESTIMATORS[name].compute(AdvantageInputs(scores, mask, group_size, rewards, gamma, 1.0, baseline,
                                                    values))[0]


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# 2x3 example with a ragged mask shared by several tests.
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
RAGGED = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_import_is_light() -> None:
    code = "import sys, engine.algos; print(sorted({'ray', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- group advantages

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def test_grpo_divides_by_unbiased_std() -> None:
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> 0.5 / 0.57735 = 0.866025
    close(group_advantages(SCORES, 4, "grpo"), [0.866025, -0.866025, -0.866025, 0.866025])


def test_grpo_two_groups_are_independent() -> None:
    # group [1, 3]: mean 2, std sqrt(2) -> -+0.707107; group [2, 2]: 0 (eps keeps it finite)
    close(group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, "grpo"), [-0.707107, 0.707107, 0.0, 0.0])


def test_drgrpo_and_baseline_only_center() -> None:
    close(group_advantages(SCORES, 4, "drgrpo"), [0.5, -0.5, -0.5, 0.5])
    close(group_advantages(SCORES, 4, "reinforce_pp_baseline"), [0.5, -0.5, -0.5, 0.5])


def test_rloo_subtracts_mean_of_others() -> None:
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    close(group_advantages(SCORES, 4, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize(
    ("estimator", "group_size", "match"),
    [
        ("ppo", 4, "unknown"),
        ("grpo", 3, "groups of 3"),
        ("grpo", 1, "grpo needs group_size >= 2"),
        ("rloo", 1, "rloo needs group_size >= 2"),
        ("drgrpo", 0, "groups of 0"),
    ],
)
def test_group_advantages_errors(estimator: str, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(SCORES, group_size, estimator)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean() -> None:
    close(masked_mean(X, RAGGED), 7 / 3)  # (1 + 2 + 4) / 3
    close(masked_mean(X, RAGGED, dim=-1), [1.5, 4.0])
    close(masked_mean(X, torch.zeros_like(X)), 0.0)  # empty selection is 0, not nan


def test_masked_whiten_uses_population_variance() -> None:
    # valid 1, 2, 4: mean 7/3, population var 14/9, std 1.247219
    close(masked_whiten(X, RAGGED), [[-1.069045, -0.267261, 0.0], [1.336306, 0.0, 0.0]])


# ---------------------------------------------------------------- returns and advantages


def test_reinforce_pp_returns_gamma_half() -> None:
    rewards = torch.tensor([[1.0, 2.0, 4.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # row 0: 4, 2 + 0.5*4 = 4, 1 + 0.5*4 = 3; row 1: the masked 9 is dropped -> 2, 0 + 0.5*2 = 1
    close(reinforce_pp_returns(rewards, mask, gamma=0.5), [[3.0, 4.0, 4.0], [1.0, 2.0, 0.0]])


def test_compute_advantages_group_broadcast_is_masked() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = compute_advantages("drgrpo", SCORES, mask, group_size=4)
    close(adv, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    rloo = compute_advantages("rloo", SCORES, mask, group_size=4)
    close(rloo, [[2 / 3, 2 / 3, 0.0], [-2 / 3, 0.0, 0.0], [-2 / 3, -2 / 3, -2 / 3], [0.0, 0.0, 0.0]])
    grpo = compute_advantages("grpo", SCORES, mask, group_size=4)
    assert torch.equal(grpo == 0, mask == 0)


MASK_2x2 = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_reinforce_pp_puts_score_on_last_token_then_whitens() -> None:
    # scores [1, 2] -> rewards [[0, 1], [2, 0]] -> gamma 0.5 returns [[0.5, 1], [2, 0]]
    # valid 0.5, 1, 2: mean 7/6, population std 0.623610
    adv = compute_advantages("reinforce_pp", torch.tensor([1.0, 2.0]), MASK_2x2, group_size=1, gamma=0.5)
    close(adv, [[-1.069045, -0.267261], [1.336306, 0.0]])


def test_reinforce_pp_reads_token_rewards() -> None:
    # same rewards as the previous test given explicitly; the scores are then ignored
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    adv = compute_advantages(
        "reinforce_pp", torch.tensor([9.0, 9.0]), MASK_2x2, 1, gamma=0.5, token_rewards=rewards
    )
    close(adv, [[-1.069045, -0.267261], [1.336306, 0.0]])


def test_token_scores_keep_what_each_turn_earned_where_it_was_earned() -> None:
    """An episode [turn 1 | observation | turn 2 | pad]: its turn-1 reward stays on turn 1's last
    token, the rest of the score (the last turn's and a reward function's) on the last valid token;
    every row sums to its score, and an observation's reward (a mask-0 token) moves to the end."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    earned = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.5, 0.0], [0.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    scores = torch.tensor([1.75, 0.5])  # row 0: 0.25 + 0.5 + a function's 1.0
    placed = token_scores(scores, mask, earned)
    torch.testing.assert_close(placed, torch.tensor([[0.0, 0.25, 0.0, 0.0, 1.5, 0.0], [0.0, 0.0, 0.5, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(token_scores(scores, mask), on_last_token(scores, mask))
    returns = reinforce_pp_returns(placed, mask, gamma=1.0)  # turn 1 is credited with both turns' rewards
    torch.testing.assert_close(returns[0], torch.tensor([1.75, 1.75, 0.0, 1.5, 1.5, 0.0]))


def test_reinforce_pp_baseline() -> None:
    # scores [1, 3] in one group -> [-1, 1] on last tokens -> gamma 1 returns [[-1, -1], [1, 0]]
    # valid -1, -1, 1: mean -1/3, population std 0.942809
    adv = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 3.0]), MASK_2x2, group_size=2)
    close(adv, [[-0.707107, -0.707107], [1.414214, 0.0]])


def test_reinforce_pp_empty_row_stays_zero() -> None:
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    adv = compute_advantages("reinforce_pp", torch.tensor([1.0, 5.0]), mask, group_size=1)
    close(adv[1], [0.0, 0.0])


def test_compute_advantages_errors() -> None:
    with pytest.raises(ValueError, match="gae reads a critic's values"):
        compute_advantages("gae", SCORES, torch.ones(4, 2), group_size=4)
    with pytest.raises(ValueError, match="grpo needs group_size >= 2"):
        compute_advantages("grpo", SCORES, torch.ones(4, 2), group_size=1)


def test_remax_subtracts_the_greedy_score() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv = compute_advantages("remax", torch.tensor([1.0, 0.0, 1.0]), mask, 1, baseline=torch.tensor([1.0, 1.0, 0.0]))
    close(adv, [[0.0, 0.0], [-1.0, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="greedy answer"):
        compute_advantages("remax", torch.ones(3), mask, 1)


GAE_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
GAE_VALUES = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 7.0]])
GAE_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gae_gamma_lambda() -> None:
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.9, lam=0.5)
    # row 0: delta_2 = 1 - 0.5 = 0.5 -> A_2 = 0.5
    #        delta_1 = 0.9*0.5 - 0.5 = -0.05 -> A_1 = -0.05 + 0.45*0.5 = 0.175
    #        delta_0 = -0.05 -> A_0 = -0.05 + 0.45*0.175 = 0.02875
    # row 1: the masked reward 9 and value 7 are dropped, so V_2 = 0 and A_2 = 0
    #        delta_1 = 2 - 1 = 1 -> A_1 = 1;  delta_0 = 0.9*1 - 1 = -0.1 -> A_0 = -0.1 + 0.45*1 = 0.35
    close(adv, [[0.02875, 0.175, 0.5], [0.35, 1.0, 0.0]])
    close(ret, [[0.52875, 0.675, 1.0], [1.35, 2.0, 0.0]])  # A + V


def test_gae_lambda_one_is_monte_carlo_minus_value() -> None:
    adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]])  # reward-to-go (1; 2) minus V
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


# ---------------------------------------------------------------- DAPO pieces and pass@k


def test_varied_groups_drops_groups_that_all_agree() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0])
    assert varied_groups(scores, 2).tolist() == [False, True, False, False]
    assert varied_groups(scores, 4).tolist() == [True, True]


def test_dynamic_sampling_rows_takes_varied_groups_first_then_tops_up() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.0, 3.0])  # groups of 2: agree, differ, agree, differ
    assert dynamic_sampling_rows(scores, 2, 2).tolist() == [2, 3, 6, 7]
    assert dynamic_sampling_rows(scores, 2, 3).tolist() == [2, 3, 6, 7, 0, 1]  # one uninformative group tops up
    assert dynamic_sampling_rows(scores, 2, 9).tolist() == [2, 3, 6, 7, 0, 1, 4, 5]  # never more than exist


def test_overlong_penalty_is_linear_over_the_buffer() -> None:
    # max 8 tokens, buffer 4: free up to 4 tokens, then -(L - 4) / 4, all of -1 at 8
    close(overlong_penalty(torch.tensor([3, 4, 6, 8]), 8, 4), [0.0, 0.0, -0.5, -1.0])
    close(overlong_penalty(torch.tensor([1, 7, 8]), 8, 2), [0.0, -0.5, -1.0])


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # pass@1 is c / n
        (4, 1, 2, 0.5),  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
        (4, 0, 2, 0.0),
        (4, 3, 2, 1.0),  # any 2 of 4 hold one of the 3 correct
        (5, 2, 3, 0.9),  # 1 - C(3, 3) / C(5, 3) = 1 - 1/10
        (4, 2, 4, 1.0),
    ],
)
def test_pass_at_k_unbiased(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("k", [0, 5])
def test_pass_at_k_needs_k_in_range(k: int) -> None:
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, k)


# ---------------------------------------------------------------- loss aggregation


def test_agg_token_mean() -> None:
    close(agg_loss(X, RAGGED, "token-mean"), 7 / 3)  # (1 + 2 + 4) / 3 tokens
    close(agg_loss(X, RAGGED, "token-mean", denom=7.0), 1.0)


def test_agg_seq_mean_token_mean() -> None:
    close(agg_loss(X, RAGGED, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    close(agg_loss(X, RAGGED, "seq-mean-token-mean", denom=11.0), 0.5)


def test_agg_seq_mean_token_sum_norm() -> None:
    close(agg_loss(X, RAGGED, "seq-mean-token-sum-norm"), 7 / 6)  # (3/3 + 4/3) / 2
    close(agg_loss(X, RAGGED, "seq-mean-token-sum-norm", norm_len=2), 1.75)  # (3/2 + 4/2) / 2
    close(agg_loss(X, RAGGED, "seq-mean-token-sum-norm", denom=4.0), 7 / 12)


def test_agg_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        agg_loss(X, RAGGED, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_denom_match_full_batch(mode: str) -> None:
    torch.manual_seed(0)
    loss_mat = torch.randn(4, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).float()
    full = agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)
    denom = mask.sum().item() if mode == "token-mean" else 4.0
    first, second = (agg_loss(loss_mat[i : i + 2], mask[i : i + 2], mode, denom=denom) for i in (0, 2))
    halves = first + second
    (halves_grad,) = torch.autograd.grad(halves, loss_mat)
    torch.testing.assert_close(halves, full)
    torch.testing.assert_close(halves_grad, full_grad)
    # Dividing each half by its own token count (4 vs 7 tokens) would weight tokens unequally.
    if mode == "token-mean":
        naive = (agg_loss(loss_mat[:2], mask[:2], mode) + agg_loss(loss_mat[2:], mask[2:], mode)) / 2
        assert not torch.allclose(naive, full)


# ---------------------------------------------------------------- policy loss


def _logp(ratios: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]])


def test_policy_loss_asymmetric_clip() -> None:
    # clip range [0.8, 1.28]; the 5th token is masked and must not count.
    logp = _logp([1.5, 0.5, 1.25, 0.7, 10.0])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.28)
    # per token max(-A*r, -A*clip(r)):
    #   r=1.5,  A=+1: max(-1.5, -1.28) = -1.28  clipped (upper bound)
    #   r=0.5,  A=-1: max(0.5, 0.8)    =  0.8   clipped (lower bound)
    #   r=1.25, A=+1: inside [0.8, 1.28] -> -1.25 (would clip with clip_high=0.2)
    #   r=0.7,  A=+2: max(-1.4, -1.6)  = -1.4   unclipped branch
    close(loss, -0.7825)  # (-1.28 + 0.8 - 1.25 - 1.4) / 4
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["ppo_kl"], 0.1053034)  # -(ln 1.5 + ln 0.5 + ln 1.25 + ln 0.7) / 4
    close(metrics["pg_clipfrac_lower"], 0.0)
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())


def test_policy_loss_forwards_aggregation() -> None:
    logp = _logp([1.5, 0.5, 1.25, 0.7])
    adv = torch.tensor([[1.0, -1.0, 1.0, 2.0]])
    loss, _ = policy_loss(
        logp,
        torch.zeros_like(logp),
        adv,
        torch.ones(1, 4),
        0.2,
        0.28,
        agg_mode="seq-mean-token-sum-norm",
        norm_len=8,
    )
    close(loss, -0.39125)  # -3.13 / 8 / 1 row


def test_policy_loss_dual_clip() -> None:
    logp = _logp([10.0, 2.0, 10.0]).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logp, torch.zeros(1, 3), adv, mask, dual_clip=3.0)
    #   r=10, A=-1: max(10, 1.2) = 10, capped at -c*A = 3 -> 3   (dual clip active)
    #   r=2,  A=-1: max(2, 1.2)  = 2  < 3                   -> 2
    #   r=10, A=+1: max(-10, -1.2) = -1.2, A > 0 so no cap  -> -1.2 (ratio clip)
    close(loss, 3.8 / 3)
    close(metrics["pg_clipfrac"], 1 / 3)
    close(metrics["pg_clipfrac_lower"], 1 / 3)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 2] == 0.0  # capped and clipped tokens give no gradient
    close(logp.grad[0, 1], 2.0 / 3)  # d(-A * r)/dlogp = r = 2, divided by 3 tokens
    no_dual, _ = policy_loss(logp.detach(), torch.zeros(1, 3), adv, mask)
    close(no_dual, 3.6)  # (10 + 2 - 1.2) / 3


@pytest.mark.parametrize("dual_clip", [1.0, 0.5])
def test_policy_loss_rejects_dual_clip_at_most_one(dual_clip: float) -> None:
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), dual_clip=dual_clip
        )


def test_gspo_clips_whole_sequences() -> None:
    # per-token log ratios; row 0's third token is masked (its 5.0 must not count)
    logp = torch.tensor([[0.3, 0.1, 5.0], [-0.4, 0.0, 0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), adv, mask, agg_mode="seq-mean-token-mean", kind="gspo")
    # s_0 = exp(mean(0.3, 0.1)) = e^0.2 = 1.221403 > 1.2 with A > 0: clipped, -1.2 per token
    # s_1 = exp(mean(-0.4, 0, 0.1)) = e^-0.1 = 0.904837, inside [0.8, 1.2]: +0.904837 per token
    close(loss, -0.1475815)  # (-1.2 + 0.904837) / 2 sequences
    close(metrics["pg_clipfrac"], 0.4)  # 2 of 5 valid tokens sit in the clipped sequence
    loss.backward()
    assert logp.grad is not None
    close(logp.grad[0], [0.0, 0.0, 0.0])
    # every token of row 1 gets -A * s_1 / 3 tokens / 2 rows, not its own token ratio
    close(logp.grad[1], [0.150806, 0.150806, 0.150806])


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    logp = _logp([1.5, 0.5, 1.1]).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_low=1.0, clip_high=0.28,
                                kind="cispo")
    # weights clip(r, 0, 1.28) = [1.28, 0.5, 1.1]; loss -A * w * logp per token:
    #   -1.28 * ln 1.5 = -0.518995;  0.5 * ln 0.5 = -0.346574;  -2.2 * ln 1.1 = -0.209682
    close(loss, -0.358417)  # sum / 3 tokens
    close(metrics["pg_clipfrac"], 1 / 3)
    loss.backward()
    assert logp.grad is not None
    # d/dlogp = -A * w / 3: the clipped token still learns, at the capped weight
    close(logp.grad, [[-1.28 / 3, 0.5 / 3, -2.2 / 3]])


def test_policy_loss_kind_errors() -> None:
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(*args, kind="trpo")
    with pytest.raises(ValueError, match="needs a ppo/gspo loss"):
        policy_loss(*args, dual_clip=3.0, kind="cispo")


# ---------------------------------------------------------------- value and DPO losses


def test_value_loss_takes_the_larger_of_clipped_and_plain() -> None:
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    loss, metrics = value_loss(values, torch.zeros(1, 3), torch.tensor([[1.5, 0.0, 3.0]]), torch.ones(1, 3), 0.5)
    # V_clip = clip(V, -0.5, 0.5) = [0.5, 0.5, 0]
    #   t0: (1 - 1.5)^2 = 0.25 vs (0.5 - 1.5)^2 = 1 -> 1   (clipped term wins)
    #   t1: (2 - 0)^2 = 4      vs 0.5^2 = 0.25      -> 4
    #   t2: (0 - 3)^2 = 9      vs 9                 -> 9
    close(loss, 7 / 3)  # 0.5 * (1 + 4 + 9) / 3
    close(metrics["vf_clipfrac"], 1 / 3)
    loss.backward()
    assert values.grad is not None
    close(values.grad, [[0.0, 2 / 3, -1.0]])  # clipped t0 has no gradient; else (V - R) / 3


def test_explained_variance_over_valid_tokens() -> None:
    returns = torch.tensor([[1.0, 3.0, 99.0], [2.0, 0.0, 0.0]])  # the masked 99 must not count
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # valid returns 1, 3, 2: mean 2, Var = (1 + 1 + 0) / 3 = 2/3
    close(explained_variance(torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]), returns, mask), 1.0)  # exact
    close(explained_variance(torch.full((2, 3), 2.0), returns, mask), 0.0)  # the mean return
    # residuals 1, 2, 0: mean 1, Var = (0 + 1 + 1) / 3 = 2/3 -> 1 - 1 = 0 although no value is the mean
    close(explained_variance(torch.tensor([[0.0, 1.0, 5.0], [2.0, 0.0, 0.0]]), returns, mask), 0.0)
    # residuals -1, 3, -2: mean 0, Var = (1 + 9 + 4) / 3 = 14/3 -> 1 - 7 = -6
    close(explained_variance(torch.tensor([[2.0, 0.0, 0.0], [4.0, 0.0, 0.0]]), returns, mask), -6.0)


def test_dpo_loss_and_reward_stats() -> None:
    loss, metrics = dpo_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0]), torch.tensor([-1.5, -2.0]),
                             torch.tensor([-1.5, -2.0]), beta=0.5)
    # implicit rewards 0.5 * (pi - ref): chosen [0.25, -0.5], rejected [-0.25, 0.5] -> margins [0.5, -1]
    # loss mean(log(1 + e^-0.5), log(1 + e^1)) = mean(0.474077, 1.313262)
    close(loss, 0.8936695)
    close(metrics["rewards/chosen"], -0.125)
    close(metrics["rewards/rejected"], 0.125)
    close(metrics["rewards/margin"], -0.25)
    close(metrics["rewards/accuracy"], 0.5)
    assert "nll" not in metrics
    # RPO's term: chosen NLL per token, [1/2, 3/3] -> mean 0.75, times 2 on top of the same DPO loss
    with_nll, metrics = dpo_loss(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0]), torch.tensor([-1.5, -2.0]),
                                 torch.tensor([-1.5, -2.0]), beta=0.5, chosen_tokens=torch.tensor([2, 3]), nll_coef=2.0)
    close(with_nll, 0.8936695 + 1.5)
    close(metrics["nll"], 0.75)


# ---------------------------------------------------------------- KL

LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-2.0, -1.0, -0.5])  # logp - ref = [1, -1, 0]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [1.0, -1.0, 0.0]),
        ("abs", [1.0, 1.0, 0.0]),
        ("k2", [0.5, 0.5, 0.0]),
        # d = ref - logp = [-1, 1, 0]: e^-1 + 1 - 1 = 0.367879, e - 1 - 1 = 0.718282
        ("k3", [0.367879, 0.718282, 0.0]),
        ("low_var_kl", [0.367879, 0.718282, 0.0]),
    ],
)
def test_kl_penalty_kinds(kind: str, expected: list[float]) -> None:
    close(kl_penalty(LOGP, REF, kind), expected)


def test_k3_is_clamped_and_finite() -> None:
    logp = torch.tensor([0.0, -15.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-30.0, 0.0]), "k3")
    close(kl.detach(), [10.0, 10.0])
    kl.sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_kl_penalty_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown kl kind"):
        kl_penalty(LOGP, REF, "k4")


def test_fixed_kl_controller_never_moves() -> None:
    ctl = FixedKLController(value=0.05)
    ctl.update(current_kl=100.0, n_steps=256)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "n_steps", "expected"),
    [
        (9.0, 256, 0.100512),  # error 0.5 clipped to 0.2: 1 + 0.2 * 256 / 10000
        (3.0, 1000, 0.098),  # error -0.5 clipped to -0.2: 1 - 0.2 * 1000 / 10000
        (6.6, 1000, 0.101),  # error 0.1 unclipped: 1 + 0.1 * 1000 / 10000
    ],
)
def test_adaptive_kl_controller_one_update(current_kl: float, n_steps: int, expected: float) -> None:
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=current_kl, n_steps=n_steps)
    assert ctl.value == pytest.approx(expected, rel=1e-9)


def test_kl_in_reward() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    close(kl_in_reward(scores, kl, mask, beta=0.5), [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])


# ---------------------------------------------------------------- logits


def test_entropy_from_logits() -> None:
    close(entropy_from_logits(torch.zeros(2, 3, 5)), [[math.log(5)] * 3] * 2)  # uniform: log V
    # p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(entropy_from_logits(torch.tensor([0.0, math.log(3.0)])), 0.562335)
    close(entropy_from_logits(torch.tensor([1000.0, 0.0])), 0.0)  # no nan on saturated logits


def test_token_logprobs_literal_and_vs_log_softmax() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    close(token_logprobs(logits, torch.tensor([[1, 0]])), [[-0.287682, -1.386294]])
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 11) * 5
    tokens = torch.randint(0, 11, (3, 4))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)


def test_token_logprobs_upcasts_to_float32() -> None:
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    out = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), dim=-1)[..., 0]
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- every switch value does something

# Random inputs shared by the tests below: 2 prompts x 4 samples, ragged response lengths.
GEN = torch.Generator().manual_seed(0)
N, T, G = 8, 6, 4
R_MASK = (torch.arange(T) < torch.randint(1, T + 1, (N,), generator=GEN).unsqueeze(-1)).float()  # [N, T]
R_SCORES = torch.randn(N, generator=GEN)  # [N]
R_VALUES = torch.randn(N, T, generator=GEN) * R_MASK  # [N, T], a critic's
R_GREEDY = torch.randn(N, generator=GEN)  # [N], remax's baseline
R_LOGP = -torch.rand(N, T, generator=GEN) * 3  # [N, T]
R_OLD = R_LOGP + 0.3 * torch.randn(N, T, generator=GEN)  # [N, T]
R_ADV = torch.randn(N, T, generator=GEN) * R_MASK  # [N, T]


def advantages_for(estimator: str) -> torch.Tensor:
    """Advantages [N, T] the way the advantage stage computes them for `algorithm.advantage=estimator`."""
    return compute_advantages(estimator, R_SCORES, R_MASK, G, baseline=R_GREEDY, values=R_VALUES)


@pytest.mark.parametrize("estimator", [a for a in ADVANTAGES if a != AlgorithmConfig().advantage])
def test_every_advantage_value_changes_the_advantages(estimator: str) -> None:
    assert not torch.allclose(advantages_for(estimator), advantages_for(AlgorithmConfig().advantage))


def loss_for(kind: str = ActorConfig().policy_loss, agg: str = ActorConfig().loss_agg) -> torch.Tensor:
    loss, _ = policy_loss(R_LOGP, R_OLD, R_ADV, R_MASK, agg_mode=agg, norm_len=T, kind=kind)
    return loss


@pytest.mark.parametrize("kind", [k for k in POLICY_LOSSES if k != ActorConfig().policy_loss])
def test_every_policy_loss_value_changes_the_loss(kind: str) -> None:
    assert not torch.allclose(loss_for(kind=kind), loss_for())


@pytest.mark.parametrize("agg", [a for a in LOSS_AGGS if a != ActorConfig().loss_agg])
def test_every_loss_agg_value_changes_the_loss(agg: str) -> None:
    assert not torch.allclose(loss_for(agg=agg), loss_for())


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_every_kl_estimator_is_known(kind: str) -> None:
    # low_var_kl is verl's name for the clamped k3, so the two agree; every other value differs from k3
    kl, k3 = kl_penalty(R_LOGP, R_OLD, kind), kl_penalty(R_LOGP, R_OLD, "k3")
    assert torch.allclose(kl, k3) == (kind in ("k3", "low_var_kl"))


# Rollout correction: the trainer's pre-update logprobs (old) against the rollout engine's.
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.4], [0.3, 0.3, 0.9]]))
ROLLOUT = torch.log(torch.tensor([[0.2, 0.3, 0.1], [0.3, 0.2, 0.9]]))  # w = old/rollout: [2.5, 2/3, 4], [1, 1.5, 1]
MASK3 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the first row's 4 is padding


def test_token_tis_caps_each_tokens_weight():
    w, m = rollout_correction(OLD, ROLLOUT, MASK3, "token_tis", 2.0)
    close(w, [[2.0, 2 / 3, 0.0], [1.0, 1.5, 1.0]])
    close(m["corrected_fraction"], 1 / 5)  # the 2.5, capped; the padded 4 is not counted
    close(m["weight_max"], 2.0)
    log_w = (OLD - ROLLOUT)[MASK3.bool()]
    close(m["mismatch_kl"], float((log_w.exp() - 1 - log_w).mean()))  # k3: w - 1 - log w


def test_seq_tis_weighs_every_token_by_its_sequences_ratio():
    w, _ = rollout_correction(OLD, ROLLOUT, MASK3, "seq_tis", 10.0)
    close(w, [[2.5 * 2 / 3] * 2 + [0.0], [1.5] * 3])  # products over each row's real tokens
    w, _ = rollout_correction(OLD, ROLLOUT, MASK3, "seq_tis", 1.2)
    close(w, [[1.2, 1.2, 0.0], [1.2] * 3])


def test_token_mask_drops_tokens_outside_the_band():
    w, m = rollout_correction(OLD, ROLLOUT, MASK3, "token_mask", 2.0)
    close(w, [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    close(m["corrected_fraction"], 1 / 5)


def test_seq_mask_drops_whole_sequences_by_their_geometric_mean():
    # row 0: geometric mean sqrt(2.5 * 2/3) = 1.29; row 1: 1.5 ** (1/3) = 1.14
    w, _ = rollout_correction(OLD, ROLLOUT, MASK3, "seq_mask", 1.2)
    close(w, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    w, _ = rollout_correction(OLD, ROLLOUT, MASK3, "seq_mask", 1.3)
    close(w, [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_no_correction_weighs_one_and_equal_policies_change_nothing():
    for kind in (NO_CORRECTION, EXACT):  # exact closes the gap in the kernels (engine/exact.py): nothing to weigh
        w, m = rollout_correction(OLD, ROLLOUT, MASK3, kind, 2.0)
        close(w, MASK3.tolist())
        assert float(m["mismatch_kl"]) > 0  # a gap, where there is one, is still measured
    for kind in ROLLOUT_CORRECTIONS:
        w, m = rollout_correction(OLD, OLD, MASK3, kind, 2.0)
        close(w, MASK3.tolist())
        close(m["mismatch_kl"], 0.0)


@pytest.mark.parametrize("kind", [k for k in ROLLOUT_CORRECTIONS
                                  if k not in (AlgorithmConfig().rollout_correction, EXACT)])
def test_every_rollout_correction_value_changes_the_loss(kind: str) -> None:
    rollout = R_OLD + 1.5 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))
    weights, _ = rollout_correction(R_OLD, rollout, R_MASK, kind, AlgorithmConfig().rollout_correction_cap)
    loss, _ = policy_loss(R_LOGP, R_OLD, R_ADV, R_MASK, norm_len=T, weights=weights)
    assert not torch.allclose(loss, loss_for())


# ------------------------------------------------ loss masks: what a multi-turn episode trains on


def _with_observations(x: torch.Tensor, at: list[int], width: int, fill: float) -> torch.Tensor:
    """x [N, T] with `width` columns of `fill` inserted before each column index in `at` (an
    observation's tokens inside an episode, or a tool's output)."""
    parts, last = [], 0
    for a in at:
        parts += [x[:, last:a], torch.full((x.shape[0], width), fill, dtype=x.dtype)]
        last = a
    return torch.cat(parts + [x[:, last:]], 1)


def test_masked_tokens_add_nothing_to_any_loss_term_and_observations_change_no_value():
    """Every loss term, metric and gradient of the sampled tokens is the same with observation
    tokens (mask 0, holding values that would dominate any term they entered) inserted inside and
    after the rows: denominators count trained tokens only, and the masked tokens get no gradient."""
    torch.manual_seed(0)
    N, T, at, width = 4, 6, [2, 5], 3
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    base = {k: torch.randn(N, T) * 0.3 for k in ("logp", "old", "adv", "ref", "rollout", "values", "returns",
                                                    "old_values", "entropy")}
    base["logp"], base["old"], base["ref"], base["rollout"] = (-base[k].abs() - 0.1 for k in ("logp", "old", "ref",
                                                                                           "rollout"))

    def terms(t: dict[str, torch.Tensor], m: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        logp = t["logp"].clone().requires_grad_()
        denom = float(m.sum())
        for kind in POLICY_LOSSES:
            for agg in LOSS_AGGS:
                for corr in ("none", "token_tis", "seq_tis"):
                    w, c = rollout_correction(t["old"], t["rollout"], m, corr, 2.0)
                    dual = 3.0 if kind != "cispo" else None
                    loss, metrics = policy_loss(logp, t["old"], t["adv"], m, 0.2, 0.28, dual, agg,
                                                denom if agg == "token-mean" else None, 8, kind,
                                                None if corr == "none" else w)
                    out[f"{kind}/{agg}/{corr}"] = loss
                    out.update({f"{kind}/{agg}/{corr}/{k}": v for k, v in {**metrics, **c}.items()})
            for est in KL_ESTIMATORS:
                out[f"kl/{est}/{agg}"] = agg_loss(kl_penalty(logp, t["ref"], est), m, agg, denom, 8)
            out[f"entropy/{agg}"] = agg_loss(t["entropy"], m, agg, denom, 8)
        out["value"], _ = value_loss(t["values"], t["old_values"], t["returns"], m, 0.5, "token-mean", denom)
        out["grad"] = torch.autograd.grad(sum(v for k, v in out.items() if v.requires_grad), logp)[0]
        return out

    plain = terms(base, mask)
    padded_mask = _with_observations(mask, at, width, 0.0)
    padded = {k: _with_observations(v, at, width, -50.0 if k in ("logp", "old", "ref", "rollout") else 1e3)
              for k, v in base.items()}
    with_obs = terms(padded, padded_mask)
    trained = padded_mask.bool()
    for k, v in plain.items():
        if k == "grad":
            torch.testing.assert_close(with_obs[k][trained], v[mask.bool()], rtol=1e-5, atol=1e-6)
            assert (with_obs[k][~trained] == 0).all(), "a masked token got a gradient"
        else:
            torch.testing.assert_close(with_obs[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_advantages_skip_observation_tokens_inside_an_episode():
    """Every estimator (GAE and discounted returns with gamma, lam < 1 included) gives the sampled
    tokens the same advantages with observation tokens inside the rows as without them, and the
    observations none."""
    torch.manual_seed(1)
    N, T, at, width = 4, 6, [2, 4], 2
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]).float()
    scores, values, rewards = torch.randn(N), torch.randn(N, T), torch.randn(N, T) * mask
    padded_mask = _with_observations(mask, at, width, 0.0)
    pad = lambda x: _with_observations(x, at, width, 7.0)  # noqa: E731
    trained = padded_mask.bool()
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    adv2, ret2 = gae(pad(rewards), pad(values), padded_mask, 0.9, 0.8)
    torch.testing.assert_close(adv2[trained], adv[mask.bool()])
    torch.testing.assert_close(ret2[trained], ret[mask.bool()])
    assert (adv2[~trained] == 0).all() and (ret2[~trained] == 0).all()
    for est in ESTIMATORS:
        if ESTIMATORS[est].critic:
            continue  # GAE, above
        extra = {"baseline": torch.randn(N)}
        a = compute_advantages(est, scores, mask, 2, 0.9, **extra)
        a2 = compute_advantages(est, scores, padded_mask, 2, 0.9, **extra)
        torch.testing.assert_close(a2[trained], a[mask.bool()], msg=est)
        assert (a2[~trained] == 0).all(), est
