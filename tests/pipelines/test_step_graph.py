"""The step graphs driven by fake stages in this process, without Ray: which stages run, in which
order, on which rank, colocated and split, and that the runner's local mode reads what the graph
returns. The fakes answer to the real verbs' names, as the workers look them up."""

from __future__ import annotations

from typing import Any

import pytest

from rlflow.engine.batch import RolloutRequest, Update
from rlflow.engine.config import load_config
from rlflow.pipelines import dpo, grpo, sft
from rlflow.pipelines.runtime import LOCAL, Broadcast, Group, InPlace, Runner, Stages
from rlflow.stages.worker import StageWorker

LOG: list[tuple[str, int, str]] = []  # (stage, rank, verb) in call order
LOSS = object()  # stands for a loss object: the graph hands it to the policy's update


class Fake:
    """A stage that logs each call and passes its input on (the update returns an Update)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.version = rank, 0

    def _log(self, verb: str, x: Any) -> Any:
        LOG.append((type(self).__name__, self.rank, verb))
        return x

    def __getattr__(self, verb: str) -> Any:
        if verb.startswith("_"):
            raise AttributeError(verb)
        return lambda x, *rest: self._log(verb, x)


class Policy(Fake):
    def update(self, batch: Any, loss: Any) -> Update:
        assert loss is LOSS
        self._log("update", batch)
        self.version += 1
        return Update({"batch": batch}, {}, [], self.version)


class Advantage(Fake):
    pass


class Reward(Fake):
    pass


class Reference(Fake):
    pass


class Critic(Fake):
    pass


class Rollout(Fake):
    pass


def group(cls: type, n: int) -> Group[Any]:
    workers = [StageWorker(r, n, 1) for r in range(n)]
    for r, w in enumerate(workers):
        w.add(cls, {"rank": r})
    return Group(cls, workers, LOCAL)


def stages(n: int, reference: bool = False, critic: bool = False, split: bool = False) -> Stages:
    policy = group(Policy, n)
    s = Stages(policy=policy, generator=policy, sync=InPlace(), reward=group(Reward, n), advantage=group(Advantage, n),
               reference=group(Reference, n) if reference else None, critic=group(Critic, n) if critic else None)
    if split:
        s.generator = group(Rollout, n)
        s.sync = Broadcast(policy, s.generator)
    return s


@pytest.fixture(autouse=True)
def clear_log():
    LOG.clear()


def test_grpo_colocated_runs_one_chain_per_rank_and_no_weight_sync():
    outputs, waits = grpo.step_graph(stages(2), ["r0", "r1"], LOSS)
    chain = ["generate", "score", "logprobs", "estimate", "update"]
    assert [v for s, r, v in LOG if r == 0] == chain and [v for s, r, v in LOG if r == 1] == chain
    assert [s for s, r, v in LOG if r == 0] == ["Policy", "Reward", "Policy", "Advantage", "Policy"]
    assert [u.metrics["batch"] for u in outputs] == ["r0", "r1"] and waits == []


def test_ppo_with_a_reference_runs_the_critic_before_the_policy_update():
    grpo.step_graph(stages(1, reference=True, critic=True), ["r0"], LOSS)
    assert LOG == [("Policy", 0, "generate"), ("Reward", 0, "score"), ("Reference", 0, "logprobs"),
                   ("Policy", 0, "logprobs"), ("Critic", 0, "values"), ("Advantage", 0, "estimate"),
                   ("Critic", 0, "update"), ("Policy", 0, "update")]


def test_split_generates_on_the_rollout_pool_and_pushes_after_every_update():
    s = stages(2, split=True)
    outputs, waits = grpo.step_graph(s, ["r0", "r1"], LOSS)
    assert [(st, r) for st, r, v in LOG if v == "generate"] == [("Rollout", 0), ("Rollout", 1)]
    # after both ranks' updates: every policy rank pushes and every rollout rank pulls what it made
    assert LOG[-4:] == [("Policy", 0, "push_weights"), ("Policy", 1, "push_weights"),
                        ("Rollout", 0, "pull_weights"), ("Rollout", 1, "pull_weights")]
    assert waits == outputs + outputs  # each push and pull was handed its rank's Update


def test_remax_generates_and_scores_each_ranks_greedy_request_too():
    grpo.step_graph(stages(2), ["r0", "r1", "greedy0", "greedy1"], LOSS)
    assert [(s, v) for s, r, v in LOG if r == 0] == [
        ("Policy", "generate"), ("Reward", "score"), ("Policy", "generate"), ("Reward", "score"),
        ("Policy", "logprobs"), ("Advantage", "estimate"), ("Policy", "update")]
    assert sum(v == "update" for _, _, v in LOG) == 2


def test_dynamic_sampling_starts_the_graph_from_scored_batches():
    grpo.step_graph(stages(1), ["scored"], LOSS, sampled=True)
    assert [v for _, _, v in LOG] == ["logprobs", "estimate", "update"]


def test_sft_and_dpo_graphs():
    sft.step_graph(stages(2), [["a"], ["b"]], LOSS)
    assert LOG == [("Policy", 0, "update"), ("Policy", 1, "update")]
    LOG.clear()
    dpo.step_graph(stages(1, reference=True), ["pairs"], LOSS)
    assert LOG == [("Reference", 0, "logprobs"), ("Policy", 0, "update")]
    LOG.clear()
    dpo.step_graph(stages(1, reference=True), ["pairs"], LOSS, held_out=True)
    assert LOG == [("Reference", 0, "logprobs"), ("Policy", 0, "evaluate")]


def test_the_local_runner_returns_each_ranks_output_and_runs_the_sync():
    s = stages(2, split=True)
    algo = grpo.GRPO(load_config(None, []), "unused", [])
    algo.loss = LOSS
    run = Runner(s, algo.graph, "local")
    out = run([RolloutRequest([], 0), RolloutRequest([], 0)])
    assert [u.weight_version for u in out] == [1, 1] and len(out) == 2
    assert sum(v == "pull_weights" for _, _, v in LOG) == 2
    out = run([RolloutRequest([], 1), RolloutRequest([], 1)])
    assert [u.weight_version for u in out] == [2, 2]
