"""Placement: resource pools as Ray placement groups, one worker process per bundle.

A pool of `size` workers reserves `size` bundles ({CPU: 1} or {CPU: 1, GPU: g}) in one placement
group with the PACK strategy, so colocated ranks land together and rank order follows bundle
order. Workers of a pool with more than one rank join one torch.distributed group.

Invariants:
- a pool whose resources cannot be had fails with a clear error after `timeout_s`, never hangs;
- rank r of every pool sits on bundle r.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class Pool:
    def __init__(self, name: str, worker_cls: type, size: int, gpus: float, threads: int,
                 timeout_s: float = 120.0) -> None:
        bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
        self.name = name
        self.group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK", name=name)
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(f"pool '{name}': {size} bundles of {bundle} not available within "
                               f"{timeout_s:.0f}s; cluster has {ray.cluster_resources()}")
        remote_cls: Any = ray.remote(worker_cls)
        self.workers: list[Any] = [
            remote_cls.options(
                num_cpus=1, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=r),
            ).remote(r, size, threads)
            for r in range(size)
        ]
        if size > 1:
            host, port = ray.get(self.workers[0].address.remote())
            ray.get([w.init_process_group.remote(host, port) for w in self.workers])

    def add(self, role: str, cls: type, kwargs_for_rank: Any) -> None:
        """Construct stage `cls` on every worker; `kwargs_for_rank(rank)` gives its arguments."""
        ray.get([w.add.remote(role, cls, kwargs_for_rank(r)) for r, w in enumerate(self.workers)])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.group)
