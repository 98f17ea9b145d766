"""The trainer's memory plan: for a real (tiny) TrainEngine, given free memory, which micro-batch
budget and checkpointing it picks, and what it refuses. The device's free memory is the one input
a CPU cannot have, so each case gives it as a multiple of what the model's own step needs."""

import pytest

from rlflow.engine.config import load_config
from rlflow.engine.train import memory
from rlflow.engine.train.fsdp import TrainEngine

KEEP = 1 << 30


@pytest.fixture(scope="module")
def engine(model_dir):
    return TrainEngine(str(model_dir), 1e-3, 0.0, 1.0, 0, 10, "constant", "float32", "cpu")


@pytest.fixture(scope="module")
def model(engine):
    return memory.Model.of(engine.model.config)


def free_for(model, engine, tokens, checkpointing):
    """Free memory that holds a step of `tokens` a micro-batch exactly, plus what is kept back."""
    return KEEP + memory.step_bytes(model, engine, tokens, checkpointing, states_allocated=False)


def test_plenty_of_memory_keeps_layers_whole_and_caps_the_budget(engine, model):
    plan = memory.plan(model, engine, free_for(model, engine, 10**6, False), KEEP, longest=2048)
    assert (plan.tokens, plan.checkpointing) == (memory.MOST_TOKENS, False)


def test_the_budget_is_what_fits_and_the_step_fits_in_it(engine, model):
    free = free_for(model, engine, 12000, False)
    plan = memory.plan(model, engine, free, KEEP, longest=2048)
    assert not plan.checkpointing and 12000 - 256 < plan.tokens <= 12000
    assert memory.step_bytes(model, engine, plan.tokens, False, False) <= free - KEEP
    assert f"{plan.tokens} tokens" in plan.line() and "checkpointing off" in plan.line()
    smaller = memory.plan(model, engine, free_for(model, engine, 9000, False), KEEP, longest=2048)
    assert smaller.tokens < plan.tokens, "less free memory, a smaller budget"


def test_too_few_whole_layer_tokens_turn_checkpointing_on(engine, model):
    # whole layers would fit 4096 tokens: fewer than the least worth running without recomputation
    plan = memory.plan(model, engine, free_for(model, engine, 4096, False), KEEP, longest=2048)
    assert plan.checkpointing and plan.tokens > 4096, "recomputing layers frees room for more tokens"
    # a long row that whole layers cannot hold at all
    plan = memory.plan(model, engine, free_for(model, engine, 20000, False), KEEP, longest=30000)
    assert plan.checkpointing and plan.tokens >= 30000


def test_a_given_setting_is_kept_where_it_fits(engine, model):
    free = free_for(model, engine, 20000, False)
    assert memory.plan(model, engine, free, KEEP, 2048, tokens=16384).tokens == 16384
    plan = memory.plan(model, engine, free, KEEP, 2048, checkpointing=True)
    assert plan.checkpointing and plan.tokens == memory.MOST_TOKENS
    plan = memory.plan(model, engine, free, KEEP, 2048, tokens=30000)  # whole layers cannot: recompute
    assert (plan.tokens, plan.checkpointing) == (30000, True)


def test_a_row_that_fits_no_way_is_refused_naming_what_to_change(engine, model):
    free = free_for(model, engine, 1000, True)
    with pytest.raises(memory.DoesNotFit, match="rollout.max_new_tokens") as e:
        memory.plan(model, engine, free, KEEP, longest=2048)
    assert "rollout.free_cache" in str(e.value) and "actor.lora_rank" in str(e.value)
    with pytest.raises(memory.DoesNotFit):
        memory.plan(model, engine, free_for(model, engine, 4096, False), KEEP, 2048, tokens=8192, checkpointing=False)


def test_optimizer_state_not_yet_made_is_counted_and_lora_keeps_more_per_token(engine, model):
    assert memory.step_bytes(model, engine, 0, False, False) > memory.step_bytes(model, engine, 0, False, True)
    lora = memory.Model(**{**model.__dict__, "lora": True})
    assert lora.token_bytes(False) > model.token_bytes(False)
    assert model.token_bytes(True) < model.token_bytes(False)


def test_auto_on_the_cpu_resolves_to_the_old_default_and_the_engine_keeps_it(model_dir):
    cfg = load_config(None, [f"model.path={model_dir}"], gpus=0)
    assert cfg.actor.micro_batch_tokens_per_gpu == 4096 and cfg.actor.activation_checkpointing == "false"
    long = load_config(None, [f"model.path={model_dir}", "rollout.max_new_tokens=8192"], gpus=0)
    assert long.actor.micro_batch_tokens_per_gpu == 8192 + long.data.max_prompt_tokens
    gpu = load_config(None, [f"model.path={model_dir}", "actor.activation_checkpointing=true"], gpus=1)
    assert gpu.actor.micro_batch_tokens_per_gpu == -1 and gpu.actor.activation_checkpointing == "true"
    assert memory.settings(gpu) == dict(micro_tokens=0, checkpointing=True, share=1)
