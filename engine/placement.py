"""Placement: resource pools as Ray placement groups, one worker process per bundle.

A pool of `size` workers reserves `size` bundles ({CPU: 1} or {CPU: 1, GPU: g}) spread over the
cluster's nodes. `plan` fills the alive nodes in a fixed order (the driver's node first, then by
IP and node id), as many bundles on each as its free resources hold (its total ones when the free
ones fall short), and every node used gets one STRICT_PACK placement group. Ranks follow that
order: all ranks of the first node, then those of the next. A one-node cluster gets one group.
A pool knows nothing of what its workers run: the stage runtime (pipelines/runtime.py) builds
stages on them and joins their ranks into a torch.distributed group.

Invariants:
- a pool whose resources cannot be had fails with a clear error after `timeout_s`, never hangs;
- the ranks of one node are consecutive, and rank r sits on bundle r - (first rank of its node).
"""

from __future__ import annotations

import math
from typing import Any

import ray
from ray._private import state
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def plan(nodes: list[tuple[str, dict[str, float]]], bundle: dict[str, float], size: int) -> list[tuple[str, int]]:
    """(node id, bundles) per node used, filling `nodes` (in order, with their resources) as far as
    each holds; empty if all of them together cannot hold `size` bundles."""
    out: list[tuple[str, int]] = []
    left = size
    for node, res in nodes:
        fits = min(math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v)
        if (n := min(fits, left)) > 0:
            out.append((node, n))
            left -= n
    return [] if left else out


def live_nodes(free: bool) -> list[tuple[str, dict[str, float]]]:
    """Alive nodes with their free (or total) resources: the driver's node first, then by IP and id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((n for n in ray.nodes() if n["Alive"]),
                   key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))
    # Ray has no public per-node view of free resources without the dashboard's state API.
    res = state.available_resources_per_node() if free else {n["NodeID"]: n["Resources"] for n in nodes}
    return [(n["NodeID"], res.get(n["NodeID"], {})) for n in nodes]


def layout(bundle: dict[str, float], size: int) -> list[tuple[str, int]]:
    """Where the pool goes: by free resources; else (resources of a pool just removed are freed
    asynchronously) by total ones, and the groups wait; else one group that times out."""
    return (plan(live_nodes(free=True), bundle, size) or plan(live_nodes(free=False), bundle, size)
            or [(live_nodes(free=False)[0][0], size)])


class Pool:
    def __init__(self, name: str, worker_cls: type, size: int, gpus: float, threads: int,
                 timeout_s: float = 120.0, concurrency_groups: dict[str, int] | None = None) -> None:
        """`size` actors of `worker_cls`, each built as `worker_cls(rank, size, threads)`, with the
        thread groups `concurrency_groups` names beside the one that runs their calls in order."""
        bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
        self.name = name
        where = layout(bundle, size)
        # The node is a soft hint: STRICT_PACK keeps each group's ranks together wherever it lands.
        self.groups: list[PlacementGroup] = [
            placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK", name=f"{name}-{i}",
                            _soft_target_node_id=node)
            for i, (node, n) in enumerate(where)
        ]
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups), timeout=timeout_s)
        if len(ready) < len(self.groups):
            for g in self.groups:
                remove_placement_group(g)
            raise RuntimeError(f"pool '{name}': {size} bundles of {bundle} not available within "
                               f"{timeout_s:.0f}s; cluster has {ray.cluster_resources()}")
        slots = [(g, i) for g, (_, n) in zip(self.groups, where) for i in range(n)]  # rank -> (group, bundle)
        self.processes: list[tuple[str, int]] = []  # each rank's (node id, pid), where its owner asked
        self.silence_s = 120.0  # how long a worker may not answer while a stage starts on it, where its owner set it
        # Ray's stubs lack concurrency_groups, and .options() refuses it
        remote_cls: Any = ray.remote(concurrency_groups=concurrency_groups)(worker_cls)  # type: ignore[call-overload]
        self.workers: list[Any] = [
            remote_cls.options(
                num_cpus=1, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=i),
            ).remote(r, size, threads)
            for r, (g, i) in enumerate(slots)
        ]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        for g in self.groups:
            remove_placement_group(g)
