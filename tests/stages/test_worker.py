"""A stage worker keeps what torch.compile makes under the run's output_dir, so a second start
loads compiled code and knows at once which sizes vary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

START = """
import json, sys
import torch
from torch._dynamo.utils import counters
from rlflow.stages.worker import StageWorker

StageWorker(0, 1, 1).cache_compiles(sys.argv[1])
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
for n in (4, 5, 6):  # the size varies from call to call, as a step's token count does
    f(torch.randn(n))
print(json.dumps({"graphs": counters["stats"]["unique_graphs"], "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def start(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_COMPILE_JOB_ID")}
    out = subprocess.run([sys.executable, "-c", START, str(cache)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_compiled_code_and_compiles_a_varying_size_once(tmp_path: Path) -> None:
    cache = tmp_path / "compile_cache"
    first = start(cache)
    assert first["graphs"] == 2 and first["hits"] == 0  # size 4 as a constant, then symbolic from size 5
    assert list((cache / "dynamo").glob("code_state_*")), "no record of which sizes vary"
    second = start(cache)
    assert second["graphs"] == 1  # symbolic from the first call
    assert second["hits"] == 1  # and its kernel loaded, not built
