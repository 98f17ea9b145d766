"""bench/reshard.py's defaults fit the machine it runs on: the TP sizes it measures divide the ranks."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from reshard import tp_sizes  # noqa: E402


@pytest.mark.parametrize("gpus,want", [(1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2]), (8, [1, 2, 4, 8])])
def test_default_tp_sizes_divide_the_ranks(gpus, want):
    assert tp_sizes(gpus) == want


def test_a_tp_size_that_does_not_divide_the_ranks_is_one_clear_line():
    proc = subprocess.run([sys.executable, str(BENCH / "reshard.py"), "--device", "cpu", "--gpus", "3", "--tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == "--tp [2]: each TP size must divide --gpus 3"
