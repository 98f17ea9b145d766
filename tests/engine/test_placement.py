"""How a pool's bundles are spread over nodes: `plan` is pure, so no Ray cluster is needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.engine.placement import plan

CPU = {"CPU": 1.0}


def test_one_node_that_holds_the_pool_gets_one_group():
    assert plan([("a", {"CPU": 8.0})], CPU, 4) == [("a", 4)]


def test_nodes_fill_in_order_and_ranks_follow_nodes():
    free = [("a", {"CPU": 2.0}), ("b", {"CPU": 3.0}), ("c", {"CPU": 4.0})]
    assert plan(free, CPU, 4) == [("a", 2), ("b", 2)]


def test_a_node_without_room_is_skipped():
    free = [("a", {"CPU": 0.5}), ("b", {"CPU": 2.0}), ("c", {"CPU": 2.0})]
    assert plan(free, CPU, 3) == [("b", 2), ("c", 1)]


def test_every_resource_of_the_bundle_must_fit():
    gpu = {"CPU": 1.0, "GPU": 0.5}
    free = [("a", {"CPU": 8.0, "GPU": 1.0}), ("b", {"CPU": 1.0, "GPU": 8.0}), ("c", {"CPU": 8.0})]
    assert plan(free, gpu, 3) == [("a", 2), ("b", 1)]


def test_nodes_that_cannot_hold_the_pool_give_no_plan():
    # the pool then plans by total resources and waits, or times out with a clear error
    assert plan([("a", {"CPU": 1.0}), ("b", {"CPU": 1.0})], CPU, 3) == []
    assert plan([("a", {}), ("b", {"CPU": 1.0})], CPU, 1) == [("b", 1)]
    assert plan([], CPU, 1) == []



LIVE = """
import pytest, ray
from rlflow.engine.placement import Pool

class Rank:  # defined in __main__, so Ray ships it by value
    def __init__(self, rank, world, threads):
        self.rank = rank

    def get(self):
        return self.rank

ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
pool = Pool("one", Rank, size=1, gpus=0.0, threads=1, timeout_s=60)
assert len(pool.groups) == 1 and ray.get(pool.workers[0].get.remote()) == 0
pool.shutdown()
with pytest.raises(RuntimeError, match="3 bundles of .* not available within 2s"):
    Pool("big", Rank, size=3, gpus=0.0, threads=1, timeout_s=2)
assert ray.util.placement_group_table() and all(  # the failed pool left no group behind
    g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
print("ok")
"""


@pytest.mark.slow
def test_a_pool_is_one_group_on_one_node_and_a_pool_too_big_fails_clearly(tmp_path):
    # Its own process: Ray's driver-side cluster state outlives ray.shutdown() in a process, and a
    # later ray.init to another cluster in the same test process would plan on stale nodes.
    script = tmp_path / "live.py"
    script.write_text(LIVE)
    # no autoscaler events: its note on the refused pool can reach stdout after the script's last line
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "RAY_SCHEDULER_EVENTS": "0"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
