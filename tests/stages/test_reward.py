"""The reward stage: rule rewards mixed with a real (tiny) reward model's scores."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlflow.engine.batch import Batch
from rlflow.engine.config import ConfigError, load_config
from rlflow.engine.data.reward_model import RewardModel
from rlflow.stages.reward import Reward

PROMPTS = ["12+30=", "7+8=", "99+1=", "5+5="]
RESPONSES = ["42", "16", "100 and more text", ""]
TRUTHS = ["42", "15", "100", "10"]


def batch() -> Batch:
    n = len(PROMPTS)
    return Batch(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long), 1, ["arith"] * n,
                 list(TRUTHS), [None] * n, prompt_text=list(PROMPTS), responses=list(RESPONSES))


def direct_scores(path) -> list[float]:
    """Each text alone, no padding, through plain transformers."""
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        return [float(model(**tok(p + r, return_tensors="pt")).logits[0, 0]) for p, r in zip(PROMPTS, RESPONSES)]


def test_reward_model_scores_are_deterministic_and_padding_free(reward_model_dir):
    rm = RewardModel(str(reward_model_dir), budget_tokens=40)  # 40: two rows per forward
    texts = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    scores = rm.score(texts)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.equal(scores, rm.score(texts))
    assert len(set(scores.tolist())) == 4  # a real model: different texts, different scores
    torch.testing.assert_close(scores, torch.tensor(direct_scores(reward_model_dir)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rm.score(texts[2:3]), scores[2:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule_weight,model_weight", [(1.0, 1.0), (1.0, 2.5), (0.0, 1.0), (1.0, 0.0)])
def test_score_is_the_weighted_sum_of_rule_and_model(reward_model_dir, rule_weight, model_weight):
    cfg = load_config(None, [f"reward.model={reward_model_dir}", f"reward.model_weight={model_weight}"]
                      + ([] if rule_weight else ["reward.function=none"]))
    out = Reward(cfg).score(batch())
    rule = torch.tensor([1.0, 0.0, 0.0, 0.0])  # the built-in arith rule: exact answers only
    model = torch.tensor(direct_scores(reward_model_dir))
    torch.testing.assert_close(out.scores, rule_weight * rule + model_weight * model, rtol=1e-5, atol=1e-5)
    m = out.metrics
    assert ("reward/rule/mean" in m) == bool(rule_weight) and ("reward/model/mean" in m) == bool(model_weight)
    if rule_weight:
        assert m["reward/rule/mean"] == pytest.approx(0.25)
    if model_weight:
        assert m["reward/model/mean"] == pytest.approx(float(model.mean()), abs=1e-5)


def test_rules_alone_are_unchanged_and_bad_mixes_fail_early(reward_model_dir, tmp_path):
    out = Reward(load_config(None, [])).score(batch())
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0] and "reward/model/mean" not in out.metrics
    with pytest.raises(ConfigError, match="function=none needs reward.model"):
        load_config(None, ["reward.function=none"])
    with pytest.raises(ConfigError, match="is now reward.function=none for no rule"):
        load_config(None, ["reward.rule_weight=0"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(None, [f"reward.model={reward_model_dir}", "reward.model_weight=-1"])
    config = AutoConfig.from_pretrained(reward_model_dir)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(reward_model_dir).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(str(tmp_path / "two"))
