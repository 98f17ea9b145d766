"""The stage runtime: typed handles to the stages on their worker pools, one step runner for
compiled and plain execution, and collective calls that every pipeline shares.

A pipeline names a stage verb by the stage class's own method, so mypy checks its name, arity
and argument types as if the call were direct:

    batch = stages.reward.at(rank, Reward.score, batch)

How the call runs depends on how the handles are bound (`Stages.bound`):
- `BIND`: a node of a Ray compiled graph, built once and executed every step;
- `SUBMIT`: a `.remote()` call, whose value is an ObjectRef (`BESIDE`: the same, on the worker's
  second thread);
- `LOCAL`: the stage instance in this process runs it (tests; no Ray), and the value is the result.
With BIND and SUBMIT the value a call returns is a future of the declared type, which only the
runner reads. Role and verb names never appear as strings: a worker finds a stage by its class's
name and a verb by the method's name.

Invariants:
- a collective verb (save, load, export, update) is called on every rank of its group together
  (`Group.all`), and every wait on the workers ends: in a watched block (a step, a validation,
  the final checkpoint) when the workers stop moving for `trainer.stall_timeout_s`
  (pipelines/hangs.py), however long it runs while they move; elsewhere (starting the workers,
  loading a checkpoint into them) after `START_TIMEOUT_S`;
- a split rollout pool gets the trainer's weights only through `WeightSync`: the step graph never
  asks where the rollout runs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import ray

from rlflow.engine.batch import Batch, RolloutRequest
from rlflow.engine.config import Config
from rlflow.engine.data.prompts import Prompt
from rlflow.engine.placement import Pool
from rlflow.pipelines import hangs
from rlflow.stages.advantage import Advantage
from rlflow.stages.critic import Critic
from rlflow.stages.hybrid import HybridPolicy
from rlflow.stages.policy import Policy, PolicySender
from rlflow.stages.reference import Reference
from rlflow.stages.reward import Reward
from rlflow.stages.rollout import Rollout
from rlflow.stages.worker import StageWorker

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", covariant=True)
T = TypeVar("T")

Call = Callable[[Any, str, str, tuple], Any]  # (worker, stage key, verb name, args) -> value or future
BIND: Call = lambda w, key, verb, args: w.run.bind(key, verb, *args)  # noqa: E731
SUBMIT: Call = lambda w, key, verb, args: w.run.remote(key, verb, *args)  # noqa: E731
LOCAL: Call = lambda w, key, verb, args: w.run(key, verb, *args)  # noqa: E731
# a `.remote()` call on the worker's second thread, not queued behind its calls in flight
BESIDE: Call = lambda w, key, verb, args: w.run.options(  # noqa: E731
    concurrency_group="beside").remote(key, verb, *args)

# The most that starting the workers may take (placing them, loading their models, joining their
# groups), and any wait outside a watched block: a 70B model read from network storage takes
# minutes; a worker stuck as it starts does no work the watchdog could see.
START_TIMEOUT_S = 1800.0

# A stage's process died (OOM kill, node loss, segfault) or was killed as stuck (the watchdog),
# or a wait outside a watched block ran past START_TIMEOUT_S: the driver rebuilds the workers.
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayChannelError,
               ray.exceptions.GetTimeoutError)


def how_lost(e: BaseException) -> str:
    """What happened to the worker behind one of WORKER_LOST, for the restart line."""
    return "did not answer in time" if isinstance(e, TimeoutError) else "died"


def silence_s(cfg: Config) -> float:
    """How long a starting worker may not answer before it counts as lost: a stopped one is not
    waited on longer than a stuck step would be, nor longer than two minutes."""
    return min(120.0, cfg.trainer.stall_timeout_s)


class Group(Generic[S]):
    """One stage class on every rank of a pool; `at` and `all` call its verbs."""

    def __init__(self, cls: type, workers: Sequence[Any], call: Call) -> None:
        self.key, self.workers, self.call = cls.__name__, list(workers), call

    @property
    def size(self) -> int:
        return len(self.workers)

    def bound(self, call: Call) -> Group[S]:
        out = copy.copy(self)
        out.call = call
        return out

    def at(self, rank: int, verb: Callable[Concatenate[S, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`verb(*args)` on rank `rank`'s stage; a future of its result unless bound LOCAL."""
        assert not kwargs, "stage verbs take positional arguments (a compiled graph binds no keywords)"
        return self.call(self.workers[rank], self.key, verb.__name__, args)

    def all(self, verb: Callable[Concatenate[S, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """`verb(*args)` on every rank together (a collective verb), waited for; the results by rank."""
        assert not kwargs, "stage verbs take positional arguments"
        return wait([self.call(w, self.key, verb.__name__, args) for w in self.workers], self.call)


def wait(values: list[Any], call: Call) -> list[Any]:
    """The results of `values`: futures are read (as long as the workers move, in a watched block;
    else at most START_TIMEOUT_S), local results are themselves."""
    if call is LOCAL:
        return values
    with hangs.awaited(START_TIMEOUT_S) as limit:
        return ray.get(values, timeout=limit)


class Generator(Protocol):
    """What generates: the policy's own rollout engine (colocated) or a rollout pool (split)."""

    def generate(self, request: RolloutRequest) -> Batch: ...


class Stateful(Protocol):
    """What a checkpoint holds a part of; both verbs are collective over the group's ranks."""

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


class WeightSync(Protocol):
    """How the trainer's new weights reach the engine that generates. Colocated, the engine takes
    them itself when it next generates (`engine.reshard`), so both calls add nothing; split, the
    trainer ranks broadcast them to the rollout pool (`Broadcast`)."""

    def after_update(self, updates: list[Any]) -> list[Any]:
        """Graph nodes that move the weights of `updates` (each rank's update result): waited for, not read."""
        ...

    def after_load(self) -> None:
        """Move the weights a checkpoint load gave the trainer, from the driver."""
        ...

    def bound(self, call: Call) -> WeightSync: ...


class InPlace:
    """Colocated: the policy's rollout engine reshards the trainer's weights in place when it next generates."""

    def after_update(self, updates: list[Any]) -> list[Any]:
        return []

    def after_load(self) -> None:
        pass

    def bound(self, call: Call) -> InPlace:
        return self


@dataclass
class Broadcast:
    """Split: after every update every trainer rank pushes and every rollout rank pulls, together.
    With generation running ahead (`beside`), a rollout rank pulls on its second thread, so a push
    never waits for the batches queued on it; it takes the weights when it next generates."""

    sender: Group[PolicySender]  # the policy's trainer ranks
    receiver: Group[Rollout]  # the rollout pool
    beside: bool = False  # trainer.max_staleness > 0; the pushes are then the driver's calls, never graph nodes

    def after_update(self, updates: list[Any]) -> list[Any]:
        receiver = self.receiver.bound(BESIDE) if self.beside else self.receiver
        return ([self.sender.at(r, PolicySender.push_weights, u) for r, u in enumerate(updates)] +
                [receiver.at(r, Rollout.pull_weights, u) for r, u in enumerate(updates)])

    def after_load(self) -> None:
        sender, receiver = self.sender.bound(SUBMIT), self.receiver.bound(SUBMIT)
        wait([sender.at(r, PolicySender.push_weights, None) for r in range(sender.size)] +
             [receiver.at(r, Rollout.pull_weights, None) for r in range(receiver.size)], SUBMIT)

    def bound(self, call: Call) -> Broadcast:
        return Broadcast(self.sender.bound(call), self.receiver.bound(call), self.beside)


@dataclass
class Stages:
    """The typed handles of one job's stages; the pipeline's step graph reads only these."""

    policy: Group[Policy]  # trains the policy (colocated, a HybridPolicy, which also generates)
    generator: Group[Generator] | None = None  # the policy itself (colocated), the rollout pool (split), or none
    sync: WeightSync = field(default_factory=InPlace)
    reward: Group[Reward] | None = None
    advantage: Group[Advantage] | None = None
    reference: Group[Reference] | None = None
    critic: Group[Critic] | None = None
    pools: list[Pool] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return self.policy.size

    def groups(self) -> list[Group[Any]]:
        """Every stage's group, for naming what each worker hosts."""
        return [g for g in (self.policy, self.generator, self.reward, self.advantage, self.reference, self.critic)
                if g is not None]

    def stateful(self) -> list[Group[Stateful]]:
        """The groups whose state a checkpoint holds."""
        return [g for g in (self.policy, self.advantage, self.critic) if g is not None]

    def bound(self, call: Call) -> Stages:
        """The same stages, their verbs called through `call` (BIND, SUBMIT or LOCAL)."""
        def rebind(g: Any) -> Any:
            return g.bound(call) if g is not None else None
        return dataclasses.replace(self, **{f.name: rebind(getattr(self, f.name))
                                            for f in dataclasses.fields(self) if f.name != "pools"})

    def save(self, directory: str) -> None:
        for group in self.stateful():
            group.all(Stateful.save, directory)

    def load(self, directory: str) -> None:
        for group in self.stateful():
            group.all(Stateful.load, directory)
        self.sync.after_load()  # split: the rollout pool still holds the weights it was built with

    def shutdown(self) -> None:
        for pool in self.pools:
            pool.shutdown()


def launch(cfg: Config, model_path: str, *, reward: bool = True, advantage: bool = False, reference: bool = False,
           critic: bool = False, generates: bool = True) -> Stages:
    """Start the worker pools and build each stage on its pool, as `placement` lays them out.

    Colocated stages share the "hybrid" pool (one process per rank); a stage listed in
    `placement.own_pool` gets a pool of its own. The policy generates itself (a HybridPolicy)
    unless a rollout pool does (split: a PolicySender feeds it) or nothing samples
    (`generates=False`: SFT, DPO, the warm start). A failure leaves no pool behind."""
    p, n = cfg.placement, cfg.placement.workers
    device = "cuda" if p.gpus_per_worker else "cpu"
    pools: dict[str, Pool] = {}

    def place(cls: type[T], own: str, kwargs: Callable[[int], dict]) -> Group[T]:
        where = own if own in p.own_pool else "hybrid"
        if where not in pools:
            pools[where] = role_pool(cfg, where)
        return build(cls, pools[where], kwargs)

    try:
        trained = dict(cfg=cfg, model_path=model_path, world=n, device=device)
        split = generates and "rollout" in p.own_pool
        ranked = lambda r: dict(trained, rank=r)  # noqa: E731
        if split:
            sender = place(PolicySender, "actor", ranked)
            stages = Stages(policy=sender)
        elif generates:
            hybrid = place(HybridPolicy, "actor", ranked)
            stages = Stages(policy=hybrid, generator=hybrid)
        else:
            stages = Stages(policy=place(Policy, "actor", ranked))
        if reward:
            stages.reward = place(Reward, "reward", lambda r: dict(cfg=cfg, device=device))
        if advantage:
            stages.advantage = place(Advantage, "actor", lambda r: dict(cfg=cfg, rank=r))
        if reference and not cfg.actor.lora_rank:  # a LoRA policy is its own reference: the base
            stages.reference = place(Reference, "reference", lambda r: dict(cfg=cfg, model_path=model_path,
                                                                            device=device))
        if critic:
            stages.critic = place(Critic, "critic", ranked)
        if split:  # a pool of its own generates
            pools["rollout"] = role_pool(cfg, "rollout")
            attach_rollout(cfg, model_path, stages, sender, pools["rollout"])
    except BaseException:
        for pool in pools.values():
            pool.shutdown()
        raise
    stages.pools = list(pools.values())
    return stages


def attach_rollout(cfg: Config, model_path: str, stages: Stages, sender: Group[PolicySender], pool: Pool) -> None:
    """Split placement: the rollout stage on `pool`, joined to the trainer's weight group, as the
    stages' generator and weight sync."""
    n = cfg.placement.workers
    device = "cuda" if cfg.placement.gpus_per_worker else "cpu"
    rollout = build(Rollout, pool, lambda r: dict(cfg=cfg, model_path=model_path, world=n, device=device, rank=r))
    connect(sender, rollout, silence_s(cfg))
    stages.generator, stages.sync = rollout, Broadcast(sender, rollout, cfg.trainer.max_staleness > 0)


def shards(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    """Every prompt, in n contiguous shards whose sizes differ by at most one (equal when n divides
    them, as a training step's do), so every prompt's group stays on one rank."""
    return [prompts[i * len(prompts) // n:(i + 1) * len(prompts) // n] for i in range(n)]


def rollout(generator: Group[Generator] | None, reward: Group[Reward] | None, prompts: list[Prompt], step: int,
            greedy: bool = False, samples: int = 0) -> list[Batch]:
    """Generate and score `prompts` over the ranks with plain calls, outside the step graph
    (validation, dynamic sampling, `rlflow eval`).

    Every rank generates (tensor-parallel ranks generate together), also one left without a
    prompt when there are fewer prompts than ranks; its empty batch is not scored."""
    assert generator is not None
    return wait(submit_rollout(generator, reward, prompts, step, greedy, samples), SUBMIT)


def submit_rollout(generator: Group[Generator], reward: Group[Reward] | None, prompts: list[Prompt], step: int,
                   greedy: bool = False, samples: int = 0) -> list[Any]:
    """`rollout`'s calls, submitted and not waited for: each rank's scored batch, to come (without
    `reward`, its generated batch)."""
    gen, score = generator.bound(SUBMIT), reward.bound(SUBMIT) if reward else None
    refs = []
    for rank, part in enumerate(shards(prompts, gen.size)):
        batch = gen.at(rank, Generator.generate, RolloutRequest(part, step, greedy, samples))
        refs.append(score.at(rank, Reward.score, batch) if part and score else batch)
    return refs


def rebuild_rollout(cfg: Config, model_path: str, stages: Stages) -> None:
    """A new rollout pool in place of one that lost a worker, holding the trainer's current weights;
    the trainer's workers go on as they are (generation ahead of training: they never wait on it)."""
    assert isinstance(stages.sync, Broadcast), "only a split rollout pool is rebuilt alone"
    sender = stages.sync.sender
    for pool in [p for p in stages.pools if p.name == "rollout"]:
        pool.shutdown()
        stages.pools.remove(pool)
    pool = role_pool(cfg, "rollout")
    stages.pools.append(pool)
    attach_rollout(cfg, model_path, stages, sender, pool)
    stages.sync.after_load()  # the trainer's weights as they are now, and their version


def settle(refs: list[Any], timeout: float = 10.0) -> None:
    """Read the outcome of calls given up on (errors expected), so that Ray does not print each
    one's error as unhandled when it forgets them."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # the loss is handled already
            pass


def rollout_lost(stages: Stages) -> bool:
    """Whether a worker of the split rollout pool is gone (asked on its second thread, which a
    worker busy generating still answers)."""
    assert isinstance(stages.sync, Broadcast), "only a split rollout pool is lost alone"
    try:
        ray.get([w.status.remote() for w in stages.sync.receiver.workers], timeout=10)
    except WORKER_LOST:
        return True
    return False


@dataclass
class Scoring:
    """A rollout engine and a reward stage on one pool, without a trainer: what `rlflow eval` runs on."""

    generator: Group[Rollout]
    reward: Group[Reward]
    pool: Pool

    def shutdown(self) -> None:
        self.pool.shutdown()


def launch_scoring(cfg: Config, model_path: str) -> Scoring:
    """`placement.workers` processes, each generating with the model at `model_path` and scoring."""
    p = cfg.placement
    device = "cuda" if p.gpus_per_worker else "cpu"
    pool = role_pool(cfg, "rollout")
    try:
        generator = build(Rollout, pool, lambda r: dict(cfg=cfg, model_path=model_path, rank=r, world=p.workers,
                                                        device=device))
        reward = build(Reward, pool, lambda r: dict(cfg=cfg, device=device))
    except BaseException:
        pool.shutdown()
        raise
    return Scoring(generator, reward, pool)


def role_pool(cfg: Config, where: str) -> Pool:
    """The pool `where` ("hybrid", or a role of `placement.own_pool`): rule rewards alone need no GPU,
    and a rollout pool needs a process group only to generate tensor parallel (vLLM refuses one)."""
    p = cfg.placement
    gpus = 0.0 if where == "reward" and not cfg.reward.model else p.gpus_per_worker
    group = p.workers > 1 and (where != "rollout" or cfg.rollout.tp > 1)
    return start_pool(where, p.workers, gpus, p.torch_threads, group,
                      compile_cache=os.path.abspath(os.path.join(cfg.trainer.output_dir, "compile_cache")),
                      call_timeout_s=silence_s(cfg))


def start_pool(name: str, size: int, gpus: float, threads: int, group: bool, timeout_s: float = 120.0,
               compile_cache: str | None = None, call_timeout_s: float = 120.0) -> Pool:
    """A pool of StageWorkers, placed within `timeout_s`; with `group`, its ranks join one
    torch.distributed group; with `compile_cache`, they keep what torch.compile makes there
    (StageWorker.cache_compiles). Each of these calls answers within `call_timeout_s`, or the
    worker counts as lost (`silence_s`); the stages built on it later wait as long (`build`)."""
    pool = Pool(name, StageWorker, size, gpus, threads, timeout_s, StageWorker.GROUPS)
    pool.silence_s = call_timeout_s
    try:  # a worker lost here takes its pool down, so the driver's rebuild can place one of the same name
        pool.processes = [s[:2] for s in ray.get([w.status.remote() for w in pool.workers], timeout=call_timeout_s)]
        if compile_cache:
            ray.get([w.cache_compiles.remote(compile_cache) for w in pool.workers], timeout=call_timeout_s)
        if group:
            host, port = ray.get(pool.workers[0].address.remote(), timeout=call_timeout_s)
            ray.get([w.init_process_group.remote(host, port) for w in pool.workers], timeout=call_timeout_s)
    except BaseException:
        pool.shutdown()
        raise
    return pool


def build(cls: type[T], pool: Pool, kwargs: Callable[[int], dict]) -> Group[T]:
    """Stage `cls` built on every worker of `pool` (`kwargs(rank)` its arguments), and its handle:
    as long as the workers answer (a model load ticks no work done), up to START_TIMEOUT_S."""
    hangs.answered([w.add.remote(cls, kwargs(r)) for r, w in enumerate(pool.workers)], pool.workers, pool.silence_s,
                   START_TIMEOUT_S)
    return Group(cls, pool.workers, SUBMIT)


def connect(policy: Group[PolicySender], rollout: Group[Rollout], silence: float) -> None:
    """Split placement: trainer rank 0 hosts the weight group and every rollout rank joins it, all
    at once, as long as they answer (`build`)."""
    host, port = ray.get(policy.workers[0].address.remote(), timeout=silence)
    size = rollout.size + 1
    hangs.answered([policy.at(0, PolicySender.connect_rollout, host, port, size)] +
                   [rollout.at(r, Rollout.connect, host, port, size) for r in range(rollout.size)],
                   [policy.workers[0], *rollout.workers], silence, START_TIMEOUT_S)


Graph = Callable[[Stages, list[Any]], tuple[list[Any], list[Any]]]
"""A step's dataflow: (stages bound to a call mode, per-rank inputs) -> (outputs the driver
reads, one per rank; further nodes that must finish, not read)."""


class Runner:
    """Runs one step of `graph` on the stages: a compiled Ray graph (compiled once here), chained
    `.remote()` calls (plain), or in-process calls (local, for tests); the same verbs in the same
    order in every mode, so a seed gives identical metrics."""

    def __init__(self, stages: Stages, graph: Graph, mode: str) -> None:
        self.stages, self.graph, self.mode = stages, graph, mode
        self.compiled: Any = None  # compiled at the first step, for as many inputs as it has
        self.outputs = 0

    def _compile(self, inputs: int) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            outputs, waits = self.graph(self.stages.bound(BIND), [inp[i] for i in range(inputs)])
            self.outputs = len(outputs)
            dag = MultiOutputNode(outputs + waits)
        self.compiled = dag.experimental_compile(_submit_timeout=START_TIMEOUT_S)

    def __call__(self, inputs: list[Any]) -> list[Any]:
        """Each rank's output of one step."""
        if self.mode == "compiled":
            if self.compiled is None:
                self._compile(len(inputs))
            with hangs.awaited(START_TIMEOUT_S) as limit:  # a compiled graph's read: -1 waits, None means 10 s
                return ray.get(self.compiled.execute(*inputs), timeout=-1 if limit is None else limit)[:self.outputs]
        call = LOCAL if self.mode == "local" else SUBMIT
        outputs, waits = self.graph(self.stages.bound(call), inputs)
        return wait(outputs + waits, call)[:len(outputs)]

    def close(self, lost: bool = False) -> None:
        """Tear the compiled graph down; `lost`: a worker died or hangs, so kill the workers rather
        than wait for their graph loops (a stopped process would never answer). Ray logs each
        lost worker's failed cancel as an error with a traceback: the driver says what happened
        in one line instead, so that logger stays quiet here."""
        if self.compiled is None:
            return
        ray_log = logging.getLogger("ray.dag.compiled_dag_node")
        level = ray_log.level
        if lost:
            ray_log.setLevel(logging.CRITICAL)
        try:
            self.compiled.teardown(kill_actors=lost)
        finally:
            ray_log.setLevel(level)
