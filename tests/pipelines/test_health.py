import pytest

from rlflow.pipelines.driver import check_health


def test_repeated_non_finite_steps_stop_the_run_naming_the_intact_checkpoint(tmp_path):
    check_health({"actor/consecutive_skipped_steps": 4}, None)  # below the limit: carry on
    with pytest.raises(RuntimeError, match=f"5 optimizer steps in a row.*intact: {tmp_path}"):
        check_health({"actor/consecutive_skipped_steps": 5}, tmp_path)


def test_the_progress_line_shows_a_failing_reward():
    from rlflow.engine.config import load_config
    from rlflow.pipelines.grpo import GRPO

    algo = GRPO(load_config(None), "unused", [])
    step = {"critic/score/mean": 0.0, "perf/throughput": 310.0}
    assert algo.headline({**step, "reward/error_rate": 0.0}, validation=False) == "reward 0.000 tok/s 310"
    assert algo.headline({**step, "reward/error_rate": 1.0}, validation=False).endswith("reward errors 100%")
