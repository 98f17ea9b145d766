"""A worker process that hosts one or more stages; roles placed in one pool share it.

The pipeline makes this class a Ray actor (`ray.remote(...)(StageWorker)`) on a placement-group
bundle; its typed stage handles (pipelines/runtime.py) reach every stage verb through
`run(stage class name, verb name, *args)`, when binding a compiled graph, when calling
`.remote()` directly, and in-process in tests.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from engine.tensors import tcp_store


class StageWorker:
    def __init__(self, rank: int, world: int, threads: int) -> None:
        self.rank, self.world = rank, world
        torch.set_num_threads(threads)
        self.stages: dict[str, Any] = {}

    def add(self, cls: type, kwargs: dict[str, Any]) -> None:
        """Build stage `cls` here; calls reach it by its class's name."""
        self.stages[cls.__name__] = cls(**kwargs)

    def run(self, stage: str, verb: str, *args: Any) -> Any:
        return getattr(self.stages[stage], verb)(*args)

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for rank 0 to host a group's store there."""
        import ray

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
