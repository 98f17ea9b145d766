"""A worker process that hosts one or more stages; roles placed in one pool share it.

The pipeline makes this class a Ray actor (`ray.remote(...)(StageWorker)`) on a placement-group
bundle; its typed stage handles (pipelines/runtime.py) reach every stage verb through
`run(stage class name, verb name, *args)`, when binding a compiled graph, when calling
`.remote()` directly, and in-process in tests. Calls run one at a time, in order; a call sent to
the "beside" concurrency group (`run.options(concurrency_group="beside")`) runs on a thread of its
own beside them (a rollout rank taking weights while it generates ahead of training).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import ray
import torch

from rlflow.engine import hub, progress
from rlflow.engine.tensors import tcp_store


class StageWorker:
    GROUPS = {"beside": 1}  # Ray concurrency groups besides the default (one thread, calls in order)

    def __init__(self, rank: int, world: int, threads: int) -> None:
        self.rank, self.world = rank, world
        torch.set_num_threads(threads)
        self.stages: dict[str, Any] = {}
        self.running = 0  # calls in `run` now (a second thread's too)

    def add(self, cls: type, kwargs: dict[str, Any]) -> None:
        """Build stage `cls` here; calls reach it by its class's name. A model from the Hub that the
        driver fetched on another node is fetched here too, at the same commit."""
        if "model_path" in kwargs:
            kwargs = {**kwargs, "model_path": hub.local(kwargs["model_path"])}
        self.stages[cls.__name__] = cls(**kwargs)

    def run(self, stage: str, verb: str, *args: Any) -> Any:
        self.running += 1
        progress.tick()
        try:
            return getattr(self.stages[stage], verb)(*args)
        finally:
            self.running -= 1
            progress.tick()

    @ray.method(concurrency_group="beside")
    def status(self) -> tuple[str, int, int, int]:
        """This worker's node and process id, the work it has done (engine/progress.py) and the
        calls it runs now. Answers while the worker's calls are busy: a dead or stopped worker
        never does."""
        return ray.get_runtime_context().get_node_id(), os.getpid(), progress.done(), self.running

    def cache_compiles(self, path: str) -> None:
        """Keep what torch.compile makes under `path` (trainer.output_dir's `compile_cache`): inductor's
        and Triton's code, and which sizes turned out to vary (dynamo's profile of automatic
        dynamism, which torch keeps only for a named job). A resumed or repeated run with the same
        output_dir then loads its kernels instead of building them, and compiles a varying size as
        symbolic at once, instead of first for the size it meets first. Call it before anything
        compiles. A user's own TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR or TORCH_COMPILE_JOB_ID wins
        (importing torch's compiler sets the first to its default, /tmp/torchinductor_<user>: that
        one is not the user's)."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(path, "triton"))
        torch.compiler.config.job_id = torch.compiler.config.job_id or "rlflow"

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for rank 0 to host a group's store there."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def init_process_group(self, host: str, port: int) -> None:
        """Join the data-parallel group (gloo on CPU, nccl on GPU) of this pool's ranks, whose
        store rank 0 hosts at host:port."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(minutes=30)
        torch.distributed.init_process_group(backend, store=tcp_store(host, port, self.world, self.rank, timeout),
                                             rank=self.rank, world_size=self.world, timeout=timeout)
