"""Work done in this process, counted as it happens: an engine step (native or vLLM), a
micro-batch, a scored row, an environment call, a token of the hf backend. It says nothing of
how much is left, only that the process moves.

A stage worker reports the count (`StageWorker.status`, on its second thread, so a busy worker
answers), and the driver's watchdog (pipelines/hangs.py) declares a step stuck only when, with
a call running or awaited, no worker's count has moved for `trainer.stall_timeout_s`: a long
step that moves is never stopped. Code that runs long without a tick (a compile, a checkpoint's
write) must fit within that timeout; a stage's start (a model load) is watched by its workers'
answers instead (pipelines/hangs.py, `answered`).
"""

_done = [0]


def tick() -> None:
    """One more piece of work done (any thread; a tick lost to a race only delays nothing)."""
    _done[0] += 1


def done() -> int:
    return _done[0]
