"""Multi-turn episodes on real engines: the trained ids are the sampled ids, the native engine
prefills a turn's new tokens only, and every way an environment or a tool call can fail is a
counted outcome."""

import importlib.util
import string
import time

import pytest
import torch
from transformers import AutoTokenizer

from rlflow.engine.agents.env import Step
from rlflow.engine.agents.episodes import Episode, _respond, run_episodes
from rlflow.engine.agents.tools import CALCULATOR, PARSERS
from rlflow.engine.data import task
from rlflow.engine.data.prompts import Prompt
from rlflow.engine.rollout.base import HFRollout, SamplingParams
from rlflow.engine.rollout.native import NativeRollout

# [user]/[tool] turns, the assistant's ending in eos, and ">" cueing the assistant
TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<|endoftext|>"
            "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def merging_model(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer merges "ab" and "12" into one token each: a model that samples
    "a" then "b" wrote text that encodes back to a different id sequence."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = "".join(sorted(set(string.printable) - set("\t\n\r\x0b\x0c")))
    vocab = {t: i for i, t in enumerate([task.PAD, task.EOS, task.UNK, *chars, "ab", "12"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("1", "2")], unk_token=task.UNK))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=task.PAD, eos_token=task.EOS, unk_token=task.UNK,
                                  padding_side="left")
    tok.chat_template = TEMPLATE
    return task.build_model(tmp_path_factory.mktemp("merging") / "model", seed=3, tokenizer=tok)


class Talk:
    """Says "ok" after every turn, rewards 0.25 a turn, and is done after the third."""

    def __init__(self, prompt):
        self.turns = 0

    def step(self, response):
        self.turns += 1
        return Step(None if self.turns == 3 else f"ok {self.turns}, go on", 0.25, self.turns == 3)


class Recording:
    """A real engine, with every (episode, prompt, completion) it made kept for the test to compare:
    the episode's index (the first `generate`, whose order is the episodes'), the episode itself
    (`serve`, whose keys are the episodes), or None (found by its prompt)."""

    def __init__(self, engine, overlap=False):
        self.engine, self.pairs, self.streams = engine, [], overlap

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        first = not self.pairs
        for i, (p, group) in enumerate(zip(prompts, out)):
            self.pairs += [(i * params.n + j if first else None, list(p), c) for j, c in enumerate(group)]
        return out

    def serve(self, params, feed):
        asked = {}

        def recorded(finished, wait):
            self.pairs += [(e, asked.pop(id(e)), c) for e, c in finished]
            new = feed(finished, wait)
            asked.update((id(e), list(r.prompt)) for r in new or [] for e in r.keys)
            return new

        self.engine.serve(params, recorded)

    def turns(self, episodes):
        """Per episode, its (offset in its response, completion) pairs in order."""
        out = [[] for _ in episodes]
        for key, p, c in self.pairs:
            if isinstance(key, Episode):
                i = next(i for i, e in enumerate(episodes) if e is key)
            elif key is None:
                i = next(i for i, e in enumerate(episodes) if e.prompt.ids + e.ids[:len(p) - len(e.prompt.ids)] == p)
            else:
                i = key
            out[i].append((len(p) - len(episodes[i].prompt.ids), c))
        return [sorted(t, key=lambda pair: pair[0]) for t in out]


def prompts_of(tok, texts):
    return [Prompt(tok.encode(t, add_special_tokens=False), "talk", "", {"index": i}, t) for i, t in enumerate(texts)]


def engine_of(backend: str, model_dir, tok):
    from transformers import AutoModelForCausalLM

    if backend == "native":
        return NativeRollout(model_dir, tok, max_slots=32, max_len=160)
    if backend == "hf":
        return HFRollout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tok)
    from rlflow.engine.rollout.vllm import VLLMRollout

    return VLLMRollout(model_dir, tok, 160, torch.float32)


NO_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")


@pytest.mark.parametrize("backend,overlap", [("native", True), ("native", False), ("hf", False),
                                             pytest.param("vllm", False, marks=NO_VLLM)],
                         ids=["native-overlapped", "native", "hf", "vllm"])
def test_the_ids_trained_on_are_the_ids_sampled(merging_model, backend, overlap):
    tok = AutoTokenizer.from_pretrained(merging_model)
    recorded = Recording(engine_of(backend, merging_model, tok), overlap)
    prompts = prompts_of(tok, ["[user]ab 12 ab>", "[user]say 1212>", "[user]abab>"])
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=10, seed=5)
    episodes, metrics = run_episodes(recorded, tok, prompts, params, Talk, max_turns=3, tokens=96, timeout_s=5,
                                     on_error="raise", overlap=overlap)
    changed = 0
    for e, turns in zip(episodes, recorded.turns(episodes)):
        assert len(turns) == e.turns == 3 and e.done and e.reward == pytest.approx(0.75)
        trained = [t for t, m in zip(e.ids, e.mask) if m]
        assert trained == [t for _, c in turns for t in c.token_ids], "trained ids are the sampled ids, in order"
        ends = [at + len(c.token_ids) - 1 for at, c in turns]  # each step's 0.25 sits on its turn's last token
        assert [i for i, r in enumerate(e.rewards) if r] == ends and set(e.rewards) == {0.0, 0.25}
        for at, c in turns:
            assert e.ids[at:at + len(c.token_ids)] == c.token_ids and all(e.mask[at:at + len(c.token_ids)])
            assert e.logprobs[at:at + len(c.token_ids)] == c.logprobs
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            changed += tok.encode(text, add_special_tokens=False) != [t for t in c.token_ids if t != tok.eos_token_id]
        observed = [t for t, m in zip(e.ids, e.mask) if not m]
        # each observation rendered once; an eos first where the turn ended at max_new_tokens without one
        want = tok.decode(tok.encode("[user]ok 1, go on>[user]ok 2, go on>"))
        assert tok.decode(observed).replace(tok.eos_token, "") == want
    assert changed, "this tokenizer must re-encode some sampled turn differently, or the test proves nothing"
    assert metrics["episode/turns/mean"] == 3 and metrics["episode/truncated"] == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "turn-by-turn"])
def test_the_native_engine_prefills_only_each_turns_new_tokens(merging_model, overlap):
    tok = AutoTokenizer.from_pretrained(merging_model)
    engine = NativeRollout(merging_model, tok, max_slots=16, max_len=160)
    recorded = Recording(engine, overlap)
    prompts = prompts_of(tok, ["[user]ab 12 ab>", "[user]say 1212>", "[user]abab>"])
    episodes, _ = run_episodes(recorded, tok, prompts, SamplingParams(temperature=1.0, n=4, max_new_tokens=10, seed=1),
                               Talk, max_turns=3, tokens=96, timeout_s=5, on_error="raise", overlap=overlap)
    new = reused = 0
    for e, turns in zip(episodes, recorded.turns(episodes)):
        assert [at for at, _ in turns][0] == 0 and len(turns) == 3
        for at, _ in turns[1:]:
            history = e.mask[:at]
            observation = len(history) - max(i for i, m in enumerate(history) if m) - 1
            new += observation + 1  # the observation, and the last sampled token, which no decode fed
            reused += len(e.prompt.ids) + at - observation - 1
    # turn 1: each prompt once for its 4 samples; then each turn its new tokens only
    assert engine.scheduler.prefilled == sum(len(p.ids) for p in prompts) + new and engine.scheduler.reused == reused


class Waiting:
    """Episode 0's first step waits until every other episode has ended (at most 20 s); the others
    end after their third turn. Turn by turn, the others cannot end while it waits: the class asks
    for its calls to overlap generation."""

    overlap = True
    others_done = None  # a threading.Event, set per test
    ended = 0

    def __init__(self, prompt):
        self.slow, self.turns = prompt.extra_info["index"] == 0, 0

    def step(self, response):
        self.turns += 1
        if self.slow:
            return Step(None, float(Waiting.others_done.wait(20)), True)
        if self.turns == 3:
            Waiting.ended += 1
            if Waiting.ended == 5:
                Waiting.others_done.set()
        return Step(None if self.turns == 3 else "go on", 0.0, self.turns == 3)


def test_a_slow_call_holds_only_its_own_episode(model_dir):
    import threading

    Waiting.others_done, Waiting.ended = threading.Event(), 0
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = NativeRollout(model_dir, tok, max_slots=8, max_len=128)
    episodes, metrics = run_episodes(engine, tok, prompts_of(tok, [f"{i}+{i}=" for i in range(6)]),
                                     SamplingParams(temperature=1.0, n=1, max_new_tokens=6, seed=0), Waiting,
                                     max_turns=3, tokens=64, timeout_s=60, on_error="raise")
    assert episodes[0].reward == 1.0, "the other episodes ran their three turns while episode 0's call was out"
    assert [e.turns for e in episodes] == [1, 3, 3, 3, 3, 3] and all(e.done for e in episodes)
    assert metrics["episode/env_time_s"] < 20


class Faulty:
    """Fails in the way its prompt's index says: 0 fine, 1 raises at creation, 2 raises in step,
    3 hangs in step, 4 answers a number as its observation, 5 is never done, 6 a reward of NaN."""

    def __init__(self, prompt):
        self.kind = prompt.extra_info["index"]
        if self.kind == 1:
            raise RuntimeError("no such task")

    def step(self, response):
        if self.kind == 2:
            raise KeyError("boom")
        if self.kind == 3:
            time.sleep(30)
        return [Step(None, 1.0, True), None, None, None, Step(42, 0.0, False), Step("more", 0.1, False),
                Step(None, float("nan"), True)][self.kind]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "turn-by-turn"])
def test_every_environment_failure_is_a_counted_outcome_and_the_rest_go_on(model_dir, overlap):
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = NativeRollout(model_dir, tok, max_slots=8, max_len=128)
    prompts = prompts_of(tok, [f"{i}+{i}=" for i in range(7)])
    params = SamplingParams(temperature=1.0, n=1, max_new_tokens=6, seed=0)
    start = time.perf_counter()
    episodes, metrics = run_episodes(engine, tok, prompts, params, Faulty, max_turns=3, tokens=64, timeout_s=1.0,
                                     on_error="zero", overlap=overlap)
    assert time.perf_counter() - start < 15, "a hung environment holds its episode for the timeout, not the run"
    fine, created, raised, hung, number, endless, nan = episodes
    assert fine.done and fine.reward == 1.0 and not fine.error and fine.turns == 1
    assert "creating its environment: RuntimeError: no such task" in created.error and created.turns == 0
    assert "KeyError" in raised.error and "CallTimeout" in hung.error and "TypeError" in number.error
    assert "ValueError" in nan.error
    assert all(e.reward == 0 for e in (created, raised, hung, number, nan))
    assert endless.truncated and endless.turns == 3 and endless.reward == pytest.approx(0.3) and not endless.error
    assert metrics["episode/env_errors"] == 5 and metrics["episode/truncated"] == 1
    with pytest.raises(RuntimeError, match="the environment failed at turn 1: KeyError"):
        run_episodes(engine, tok, prompts[2:3], params, Faulty, max_turns=3, tokens=64, timeout_s=1.0,
                     on_error="raise", overlap=overlap)


def test_a_budget_too_small_for_the_next_turn_ends_the_episode_uncut(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = NativeRollout(model_dir, tok, max_slots=8, max_len=128)
    episodes, metrics = run_episodes(engine, tok, prompts_of(tok, ["1+1=", "2+2="]),
                                     SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=0), Talk,
                                     max_turns=3, tokens=20, timeout_s=1.0, on_error="zero")
    # turn 1 takes 6 tokens; its 12-token observation (eos, "ok 1, go on") and a next turn would be 24
    for e in episodes:
        assert e.truncated and not e.done and e.turns == 1 and e.mask == [1.0] * len(e.ids) and len(e.ids) <= 6
    assert metrics["episode/truncated"] == 4


class Calculating:
    tools = [CALCULATOR]
    tool_parser = "compact"

    def __init__(self, prompt):
        pass

    def step(self, response):
        return Step(None, float(response.strip() == "56088"), True)


def test_tool_calls_in_a_turn_become_its_observation_and_failures_are_counted(model_dir):
    acted = [(Episode(None, env=Calculating(None)), text, True) for text in
             ["<<calc:123*456>>", "<<calc:123*>>", "<<search:x>>", "56088", "<<calc:1+1>><<calc:2+2>>"]]
    observations = _respond(acted, PARSERS["compact"], {"calc": CALCULATOR}, 1.0, "zero")
    assert observations[0] == [{"role": "tool", "name": "calc", "content": "56088"}]
    assert observations[1][0]["content"].startswith("error: SyntaxError")
    assert "no tool named 'search'" in observations[2][0]["content"]
    assert observations[3] is None and acted[3][0].done and acted[3][0].reward == 1.0
    assert [m["content"] for m in observations[4]] == ["2", "4"]
    assert [e.tool_calls for e, _, _ in acted] == [1, 1, 1, 0, 2]
    assert [e.tool_errors for e, _, _ in acted] == [0, 1, 1, 0, 0]


TALK_FILE = '''
from rlflow.engine.agents.env import Step


class Talk:
    def __init__(self, prompt):
        self.turns = 0

    def step(self, response):
        self.turns += 1
        return Step(None if self.turns == 2 else "go on", float(len(response) % 2), self.turns == 2)
'''


def test_a_grpo_step_on_episodes_trains_only_the_sampled_tokens(model_dir, data_files, tmp_path):
    """rollout.env through the stages: rows are whole episodes, the loss mask is 0 under the
    observations, the environment's rewards are the scores (no reward function), and an update
    runs on them."""
    from rlflow.engine.batch import RolloutRequest
    from rlflow.engine.config import load_config
    from rlflow.engine.data.prompts import load_prompts
    from rlflow.engine.train.losses import PolicyGradient
    from rlflow.stages.advantage import Advantage
    from rlflow.stages.hybrid import HybridPolicy
    from rlflow.stages.reward import Reward

    (tmp_path / "talk.py").write_text(TALK_FILE)
    cfg = load_config(None, [f"rollout.env={tmp_path}/talk.py:Talk", "rollout.max_turns=3", "rollout.episode_tokens=40",
                             "data.prompts_per_step=4", "actor.mini_batch_prompts=4", "rollout.samples_per_prompt=4",
                             "actor.micro_batch_tokens_per_gpu=128", "data.max_prompt_tokens=16"])
    actor, reward = HybridPolicy(cfg, str(model_dir)), Reward(cfg)
    prompts, _ = load_prompts([data_files["train"]], actor.tokenizer, 16)
    batch = actor.generate(RolloutRequest(prompts[:4], step=0))
    assert len(batch) == 16 and batch.metrics["episode/turns/mean"] == 2
    observed = (batch.response_mask == 1) & (batch.loss_mask == 0)
    assert observed.sum(1).min() > 0, "every episode holds an observation between its two turns"
    assert (batch.rollout_logprobs[observed] == 0).all() and (batch.rollout_logprobs[batch.loss_mask == 1] < 0).all()
    batch = reward.score(batch)
    torch.testing.assert_close(batch.scores, batch.env_rewards.sum(-1))
    batch = Advantage(cfg).estimate(actor.logprobs(batch))
    assert (batch.advantages[observed] == 0).all()
    out = actor.update(batch, PolicyGradient(cfg))
    assert out.metrics["actor/pg_loss"] == out.metrics["actor/pg_loss"] and "episode/turns/mean" in out.metrics
    assert "goon]]" in out.samples[0]["episode"], "the sample shows the observation, marked as not trained"  # no spaces
