import pytest

from pipelines.driver import check_health


def test_repeated_non_finite_steps_stop_the_run_naming_the_intact_checkpoint(tmp_path):
    check_health({"actor/consecutive_skipped_steps": 4}, 5, None)  # below the limit: carry on
    check_health({"actor/consecutive_skipped_steps": 9}, 0, None)  # 0 disables the check
    with pytest.raises(RuntimeError, match=f"5 optimizer steps in a row.*intact: {tmp_path}"):
        check_health({"actor/consecutive_skipped_steps": 5}, 5, tmp_path)
