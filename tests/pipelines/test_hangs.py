"""What a lost step's report says of a worker: read from a real process, running, stopped and gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rlflow.pipelines import hangs

# A stage verb that calls the user's code, which waits: what a stuck reward function looks like
USER = """
import time
def wait_for_ever():
    time.sleep(600)
class Scorer:
    def score(self):
        wait_for_ever()
"""
WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
from rlflow.stages.worker import StageWorker
from user_stage import Scorer
w = StageWorker(0, 1, 1)
w.add(Scorer, {})
print("ready", flush=True)
w.run("Scorer", "score")
"""


def test_a_report_names_the_verb_our_innermost_frame_and_the_wait_of_a_running_stopped_and_gone_worker(tmp_path):
    (tmp_path / "user_stage.py").write_text(USER)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.5)
        running = hangs.summary(hangs.look(proc.pid))
        user = tmp_path / "user_stage.py"
        assert running == f"in Scorer.score ({user}:7) > wait_for_ever ({user}:4)", running
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):  # the signal lands asynchronously
            if (stopped := hangs.look(proc.pid))["state"] == "stopped":
                break
            time.sleep(0.05)
        assert hangs.summary(stopped) == f"stopped; {running}"
        assert "stages/worker.py" in hangs._render("hybrid rank 0", stopped)  # every frame of every thread
    finally:
        proc.kill()
        proc.wait()
    assert hangs.summary(hangs.look(proc.pid)) == "gone: the process exited"
