import re
from pathlib import Path

import pytest
import yaml

from rlflow.engine import algos, recipes
from rlflow.engine.config import (
    AUTO_KEYS,
    CHOICES,
    ConfigError,
    _flatten,
    all_keys,
    doubts,
    job_of,
    load_config,
    meanings,
    override,
    packed,
    reference_markdown,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_validate():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.rollout.samples_per_prompt >= 2 and cfg == load_config(None, [], "rl")


def test_overrides_are_typed():
    cfg = load_config(None, ["rollout.samples_per_prompt=4", "actor.lr=1", "data.train_files=a.parquet",
                             "trainer.run_name=7", "trainer.seed="])
    assert cfg.rollout.samples_per_prompt == 4
    assert cfg.actor.lr == 1.0 and isinstance(cfg.actor.lr, float)
    assert cfg.data.train_files == ["a.parquet"]
    assert cfg.trainer.run_name == "7"
    assert cfg.trainer.seed == 0  # empty value keeps the default


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match="did you mean 'rollout.samples_per_prompt'"):
        load_config(None, ["rollout.sample_per_prompt=4"])


def test_unknown_key_in_yaml(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("trainer:\n  total_step: 3\n")
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        load_config(f)


def test_malformed_yaml_is_one_line_naming_the_file_and_place(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("trainer:\n  total_steps: 3\n save_every: 2\n")
    with pytest.raises(ConfigError, match=f"{f} is not valid YAML: .* at line 3, column 2$"):
        load_config(f)


@pytest.mark.parametrize("overrides,message", [
    ("rollout.samples_per_prompt=1", "samples_per_prompt must be >= 2"),
    ("actor.mini_batch_prompts=48", "not a multiple"),
    ("placement.workers=3", "does not split"),
    ("actor.micro_batch_tokens_per_gpu=10", "cannot hold one"),
    ("rollout.dtype=bfloat16", "differs from model.dtype"),
    ("rollout.tp=2", "must divide placement.workers=1"),
    (["placement.workers=2", "rollout.tp=2", "rollout.backend=hf"], "needs the native backend"),
    ("rollout.backend=nope", "choose one of"),
    ("actor.lr=abc", "must be float"),
    ("trainer.total_steps=0", "must be > 0"),
    ("actor.dual_clip=0.5", "dual_clip"),
    ("algorithm.kl_coef=0.001", "kl_coef > 0 needs an advantage that reads per-token rewards"),
    (["algorithm.advantage=gae", "algorithm.kl_target=0.1"], "adapts algorithm.kl_coef, which is 0"),
    ("algorithm.kl_in_reward=true", "is now algorithm.kl_coef > 0"),
    (["algorithm.rollout_correction=exact", "rollout.backend=vllm"], "exact \\(deterministic mode\\) runs the native "
                                                                    "engine.*rollout.backend=vllm \\(needs native\\)"),
    (["algorithm.rollout_correction=exact", "actor.lora_rank=8", "placement.gpus_per_worker=1"],
     "placement.gpus_per_worker=1.0 \\(needs 0\\).*actor.lora_rank=8 \\(needs 0\\)"),
    ("algorithm.kl_penalty=k3", "is now a constant: the KL in the reward is k1"),
    ("actor.policy_loss=trpo", "choose one of"),
    (["actor.policy_loss=cispo", "actor.dual_clip=3"], "needs a ppo/gspo loss"),
    ("reward.overlong_buffer=9", "overlong_buffer must be in"),
    (["algorithm.dynamic_sampling_tries=2", "algorithm.advantage=remax", "rollout.samples_per_prompt=1"],
     "samples_per_prompt must be >= 2"),
    (["algorithm.advantage=remax", "reward.overlong_buffer=2"], "greedy baseline"),
    ("trainer.val_samples=-1", "must be >= 0"),
    ("rollout.temperature=nan", "rollout.temperature must be a finite number, got nan"),  # NaN fails no `<`
    ("actor.lr=.inf", "actor.lr must be a finite number, got inf"),
    ("data.val_max_prompts=-1", "data.val_max_prompts must be >= 0, got -1"),  # was prompts[:-1]
    ("actor.kl_loss_coef=-1", "actor.kl_loss_coef must be >= 0, got -1"),
    ("reward.timeout_s=-1", "reward.timeout_s must be >= 0, got -1"),
    ("actor.grad_clip=0", "actor.grad_clip must be > 0"),  # clip_grad_norm_ to 0 zeroes every gradient
    ("trainer.keep_last=0", "trainer.keep_last must be > 0, got 0"),
    ("trainer.save_every=-1", "trainer.save_every must be >= 0, got -1"),
    ("rollout.top_p=2", "rollout.top_p and actor.clip_low must be <= 1; got 2.0"),
    ("data.train_files=[a.jsonl,b.jsonl", "override 'data.train_files=\\[a.jsonl,b.jsonl' is not valid YAML: "
     "expected ',' or '\\]', but got '<stream end>' at line 1, column 17"),
    ("warmstart.stop_accuracy=1.5", "stop_accuracy must be in"),
    ("trainer.stall_timeout_s=0", "stall_timeout_s must be > 0"),
    ("trainer.step_timeout_s=60", "is now trainer.stall_timeout_s: a step's waits last while the workers move"),
    ("algorithm.name=ppo", "contradicts this run, which is 'grpo'"),
    ("algorithm.name=dpo", "the command sets sft and dpo"),
    (["algorithm.advantage=gae", "algorithm.name=grpo"], "contradicts this run, which is 'ppo'"),
    ("critic.warmup_steps=3", "needs algorithm.advantage=gae"),
    ("placement.own_pool=[critic]", "only algorithm.advantage=gae runs one"),
    (["algorithm.advantage=gae", "critic.warmup_steps=100"], "or the actor never trains"),
    (["algorithm.advantage=gae", "algorithm.lam=1.5"], "must be in \\[0, 1\\]"),
    (["algorithm.advantage=gae", "critic.cliprange_value=0"], "must be > 0"),
    ("placement.own_pool=[actor]", "takes reward, reference, critic and/or rollout"),
    (["placement.own_pool=[rollout]", "placement.gpus_per_worker=0.5"], "NCCL connects no two ranks"),
    (["placement.own_pool=[rollout]", "rollout.free_cache=true"], "each has its own GPUs"),
    (["placement.own_pool=[rollout]", "actor.offload_optimizer=true"], "each has its own GPUs"),
    (["trainer.max_staleness=1"], "add placement.own_pool=\\[rollout\\]"),
    (["trainer.max_staleness=2", "placement.own_pool=[rollout]", "algorithm.dynamic_sampling_tries=3"],
     "run them with trainer.max_staleness=0"),
    (["trainer.max_staleness=-1"], "must be >= 0"),
    (["trainer.async_mode=one_step"], "is now trainer.max_staleness \\(sync: 0, one_step: 1\\)"),
    (["trainer.progress=false"], "is now behaviour: the progress bar shows when stderr is a terminal"),
    ("actor.sp=2", "divide placement.workers=1"),
    (["placement.workers=2", "actor.sp=2", "actor.pack_sequences=true"], "runs padded rows"),
    (["placement.workers=2", "actor.sp=2", "actor.loss_agg=seq-mean-token-mean"], "token-level loss"),
    (["placement.workers=2", "actor.sp=2", "actor.policy_loss=gspo"], "token-level loss"),
])
def test_invalid_values_fail_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides if isinstance(overrides, list) else [overrides])


def test_ppo_needs_no_group_and_may_split_off_its_critic():
    cfg = load_config(None, ["algorithm.advantage=gae", "rollout.samples_per_prompt=1",
                             "placement.own_pool=[critic]", "algorithm.kl_coef=0.001"])
    assert cfg.rollout.samples_per_prompt == 1 and cfg.placement.own_pool == ["critic"]


@pytest.mark.parametrize("backend", ["native", "hf", "vllm"])
def test_every_rollout_backend_may_have_its_own_pool(backend):
    # each builds its own copy of the weights from the model directory, which the broadcast refreshes
    cfg = load_config(None, ["placement.own_pool=[rollout, reward]", f"rollout.backend={backend}",
                             "placement.gpus_per_worker=1"])
    assert cfg.placement.own_pool == ["rollout", "reward"]


def test_drgrpo_with_one_sample_is_still_a_group_error():
    with pytest.raises(ConfigError):
        load_config(None, ["algorithm.advantage=drgrpo", "rollout.samples_per_prompt=1"])


CONFS = sorted((ROOT / "conf").glob("*.yaml"))
USER = ["model.path=/models/m", "data.train_files=[train.parquet]", "data.val_files=[test.parquet]"]


def needs_user(path: Path) -> list[str]:
    """A recipe for the user's model runs with their model and data; the demo's bring their own."""
    return [] if recipes.read(path)[1][0].get("model", {}).get("path") == "embedded" else USER


@pytest.mark.parametrize("path", CONFS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    job = recipes.read(path)[0] or "rl"
    cfg = load_config(path, needs_user(path))
    assert job_of(cfg) == job
    again = load_config(None, [f"{k}={v}" for k, v in _flat(to_dict(cfg)).items() if v not in ([], "")], job)
    assert again == cfg


@pytest.mark.parametrize("path", CONFS, ids=lambda p: p.name)
def test_shipped_configs_hold_only_differences(path, tmp_path):
    # a restated default (or a base's value) would pin today's value silently when that one changes
    layer = yaml.safe_load(path.read_text()) or {}
    meta = {k: layer.pop(k) for k in recipes.META if k in layer}
    whole = to_dict(load_config(path, needs_user(path), gpus=1))
    restated = []
    for key in _flatten(layer):
        section, name = key.split(".")
        without = {s: {n: v for n, v in values.items() if f"{s}.{n}" != key} for s, values in layer.items()}
        (tmp_path / "r.yaml").write_text(yaml.safe_dump({**meta, **without}))
        try:
            alone = to_dict(load_config(tmp_path / "r.yaml", needs_user(path), gpus=1))
        except ConfigError:  # the others need it (a critic's warm-up needs the critic's estimator)
            continue
        if alone[section][name] == whole[section][name]:
            restated.append(key)
    assert not restated, f"{path.name} restates what it would have anyway: {restated}"
    assert "algorithm.name" not in _flatten(layer), "algorithm.name is derived: the command picks sft/dpo"


REAL = [p for p in CONFS if needs_user(p)]


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_a_recipe_for_the_users_model_resolves_to_real_settings(path):
    """bf16 on one GPU a worker where one is visible, real token limits, and nothing to warn about."""
    cfg = load_config(path.stem, USER, gpus=1)
    assert (cfg.model.dtype, cfg.rollout.dtype, cfg.placement.gpus_per_worker) == ("bfloat16", "bfloat16", 1.0)
    assert cfg.rollout.max_new_tokens >= 512 and cfg.data.max_prompt_tokens >= 512 and cfg.warmstart.steps == 0
    assert cfg.actor.lr <= 2e-5 and doubts(cfg, gpus=1) == []


def test_a_users_model_without_a_recipe_gets_the_defaults_for_real_models():
    on_gpu, on_cpu = load_config(None, USER, gpus=1), load_config(None, USER, gpus=0)
    assert (on_gpu.model.dtype, on_gpu.rollout.dtype, on_gpu.placement.gpus_per_worker) == ("bfloat16", "bfloat16", 1)
    assert (on_cpu.model.dtype, on_cpu.rollout.dtype, on_cpu.placement.gpus_per_worker) == ("float32", "float32", 0)
    for cfg in (on_gpu, on_cpu):
        assert (cfg.rollout.max_new_tokens, cfg.data.max_prompt_tokens, cfg.actor.lr) == (1024, 1024, 1e-6)
        assert (cfg.warmstart.steps, cfg.warmstart.stop_accuracy) == (0, 0)
    assert doubts(on_cpu, gpus=0) == []
    assert load_config(None, [*USER, "placement.gpus_per_worker=0"], gpus=1).model.dtype == "float32"
    # packed rows on GPUs; padded on the CPU and where sequence parallelism slices rows; as set otherwise
    assert (packed(on_gpu), packed(on_cpu)) == (True, False)
    assert not packed(load_config(None, [*USER, "placement.workers=2", "actor.sp=2"], gpus=2))
    assert not packed(load_config(None, [*USER, "actor.pack_sequences=false"], gpus=1))
    assert packed(load_config(None, [*USER, "actor.pack_sequences=true"], gpus=0))


@pytest.mark.parametrize("job,lora,lr", [("rl", 0, 1e-6), ("dpo", 0, 1e-6), ("sft", 0, 2e-5), ("rl", 64, 1e-5),
                                         ("sft", 16, 2e-4)])
def test_the_learning_rate_follows_the_job_and_lora(job, lora, lr):
    assert load_config(None, [*USER, f"actor.lora_rank={lora}"], job, gpus=0).actor.lr == lr
    assert load_config(None, [*USER, "actor.lr=3e-6"], job, gpus=0).actor.lr == 3e-6


def test_settings_that_look_like_a_mistake_are_named():
    said = doubts(load_config(None, [*USER, "placement.gpus_per_worker=0", "rollout.max_new_tokens=8"], gpus=1),
                  gpus=1)
    assert len(said) == 2 and "placement.gpus_per_worker" in said[0] and "rollout.max_new_tokens=8" in said[1]
    assert doubts(load_config(gpus=1), gpus=1) == []  # the demo is meant to be small and on the CPU
    [more] = doubts(load_config(None, [*USER, "placement.workers=4"], gpus=2), gpus=2)
    assert more.startswith("placement.workers=4 x placement.gpus_per_worker=1 asks for 4 GPUs, and 2 are visible")


def test_auto_is_accepted_and_never_left_in_a_loaded_config():
    cfg = load_config("demo", ["model.dtype=auto", "placement.gpus_per_worker=auto", "actor.lr=auto"], gpus=1)
    assert (cfg.model.dtype, cfg.placement.gpus_per_worker, cfg.actor.lr) == ("bfloat16", 1.0, 1e-6)
    flat = _flat(to_dict(load_config(None, USER, gpus=0)))
    assert all(flat[key] not in ("auto", -1) for key in AUTO_KEYS)


def test_a_recipe_builds_on_its_base_and_carries_its_job(tmp_path):
    (tmp_path / "mine.yaml").write_text("base: demo-dpo\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(tmp_path / "mine.yaml")
    assert (cfg.algorithm.name, cfg.trainer.total_steps, cfg.dpo.nll_coef) == ("dpo", 7, 1.0)
    assert cfg.model.path == "embedded"
    with pytest.raises(ConfigError, match="a recipe for dpo, not sft: run `rlflow dpo"):
        load_config(tmp_path / "mine.yaml", job="sft")
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="circle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="no recipe or file named 'gsm9k'.*gsm8k"):
        load_config("gsm9k")
    (tmp_path / "empty.yaml").write_text("{}\n")  # a recipe of the user's own names no demo
    assert load_config(tmp_path / "empty.yaml", gpus=0).model.path == ""  # a run asks for one (test_cli)


@pytest.mark.parametrize("key,answer", [
    ("rollout.n", "rollout.samples_per_prompt"),
    ("actor_rollout_ref.rollout.n", "rollout.samples_per_prompt"),
    ("data.train_batch_size", "data.prompts_per_step"),
    ("actor_rollout_ref.actor.optim.lr", "actor.lr"),
    ("critic.optim.lr", "critic.lr"),
    ("actor.learning_rate", "actor.lr"),
    ("learning_rate", "actor.lr"),
    ("trainer.max_steps", "trainer.total_steps"),
    ("num_generations", "rollout.samples_per_prompt"),
    ("max_completion_length", "rollout.max_new_tokens"),
    ("data.max_response_length", "rollout.max_new_tokens"),
    ("beta", "actor.kl_loss_coef (RL's KL term) or dpo.beta"),
    ("algorithm.adv_estimator", "algorithm.advantage"),
    ("n_samples_per_prompt", "rollout.samples_per_prompt"),
])
def test_names_from_verl_trl_and_openrlhf_are_answered_with_rlflows_key(key, answer):
    with pytest.raises(ConfigError, match=f"unknown config key '{re.escape(key)}': .* is {re.escape(answer)}"):
        load_config(None, [f"{key}=1"])


def test_a_key_without_a_value_is_named():
    with pytest.raises(ConfigError, match="'actor.lr' is a config key without a value: write actor.lr=VALUE"):
        load_config("actor.lr")
    with pytest.raises(ConfigError, match="'rollout.n' is a config key without a value"):
        load_config(None, ["rollout.n"])
    with pytest.raises(ConfigError, match="'whatever' is not key=value"):
        load_config(None, ["whatever"])


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_readme_config_reference_lists_every_key():
    text = (ROOT / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", text, re.M))
    assert documented == set(all_keys()), "regenerate: python -m rlflow.engine.config docs/config.md"
    assert reference_markdown() in text, "regenerate: python -m rlflow.engine.config docs/config.md"


def test_every_key_has_a_meaning_within_the_budget():
    unexplained = [k for k, meaning in meanings().items() if not meaning.strip()]
    assert not unexplained, f"give these keys a field comment: {unexplained}"
    assert set(meanings()) == set(all_keys()) and len(all_keys()) <= 90, "keys are a cost: budget 90"


def test_algorithm_switches_accept_exactly_what_the_math_dispatches_on():
    assert CHOICES["actor.policy_loss"] is algos.POLICY_LOSSES
    with pytest.raises(ConfigError, match="choose one of \\['grpo', 'drgrpo', 'rloo', 'reinforce_pp'"):
        load_config(None, ["algorithm.advantage=ppo2"])  # algos.ESTIMATORS, or an Estimator of the user's own
    assert CHOICES["actor.loss_agg"] is algos.LOSS_AGGS
    assert CHOICES["actor.kl_loss_type"] is algos.KL_ESTIMATORS and algos.REWARD_KL in algos.KL_ESTIMATORS
    cfg = load_config(None, ["actor.kl_loss_type=low_var_kl"])
    assert cfg.actor.kl_loss_type == "low_var_kl"


@pytest.mark.parametrize("overrides,name", [
    ([], "grpo"),
    (["algorithm.advantage=gae"], "ppo"),
    (["algorithm.advantage=rloo"], "rloo"),
    (["algorithm.dynamic_sampling_tries=3"], "dapo"),
    (["actor.policy_loss=gspo"], "grpo+gspo"),
    (["algorithm.advantage=gae", "actor.policy_loss=cispo"], "ppo+cispo"),
    (["algorithm.advantage=gae", "algorithm.name=ppo"], "ppo"),  # a saved config may repeat it
])
def test_an_rl_runs_name_follows_its_settings(overrides, name):
    assert load_config(None, overrides).algorithm.name == name


@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_the_command_sets_the_job(job):
    cfg = load_config(None, [f"algorithm.name={job}"], job=job)
    assert cfg.algorithm.name == job
    assert load_config(None, [], job=job).warmstart.steps == {"sft": 0, "dpo": 4000}[job]
    assert load_config(None, [], job=job).warmstart.stop_accuracy == {"sft": 0, "dpo": 0.4}[job]
    with pytest.raises(ConfigError, match=f"contradicts this run, which is '{job}'"):
        load_config(None, ["algorithm.name=grpo"], job=job)
    with pytest.raises(ConfigError, match="trains a critic"):
        load_config(None, ["algorithm.advantage=gae"], job=job)
    with pytest.raises(ConfigError, match="never generates"):
        load_config(None, ["placement.own_pool=[rollout]"], job=job)
    with pytest.raises(ConfigError, match="choose one of"):
        load_config(None, [], job="ppo")


def test_ppo_is_gae_without_naming_it():
    cfg = load_config(None, ["algorithm.advantage=gae", "critic.warmup_steps=3"])
    assert cfg.algorithm.name == "ppo" and cfg.critic.warmup_steps == 3


def test_override_says_what_it_changes(capsys):
    cfg = load_config(None, ["actor.ppo_epochs=4"], job="sft")
    out = override(cfg, "one step is one optimizer step", **{"actor.ppo_epochs": 1, "actor.mini_batch_prompts": 64,
                                                            "actor.lr": 1})
    assert capsys.readouterr().out.splitlines() == [
        "rlflow: sft sets actor.ppo_epochs=1 (was 4): one step is one optimizer step",
        "rlflow: sft sets actor.mini_batch_prompts=64 (was 16): one step is one optimizer step",
        "rlflow: sft sets actor.lr=1.0 (was 0.0002): one step is one optimizer step",
    ]
    assert (out.actor.ppo_epochs, out.actor.mini_batch_prompts, out.actor.lr) == (1, 64, 1.0)
    assert cfg.actor.ppo_epochs == 4 and cfg.actor.mini_batch_prompts == 16  # the caller's config is unchanged
    assert override(out, "again", **{"actor.ppo_epochs": 1}) == out
    assert capsys.readouterr().out == ""  # nothing to say when a value already matches


def test_override_keeps_the_name_derived_and_refuses_unknown_keys():
    cfg = override(load_config(), "a critic", **{"algorithm.advantage": "gae"})
    assert cfg.algorithm.name == "ppo"
    with pytest.raises(ConfigError, match="did you mean 'actor.ppo_epochs'"):
        override(cfg, "typo", **{"actor.ppo_epoch": 1})
    with pytest.raises(ConfigError, match="must be int"):
        override(cfg, "type", **{"actor.ppo_epochs": "one"})
    with pytest.raises(ConfigError, match="derived"):
        override(cfg, "rename", **{"algorithm.name": "dpo"})


def test_the_embedded_rl_warm_start_stops_on_an_accuracy():
    cfg = load_config(None, [])
    assert (cfg.warmstart.steps, cfg.warmstart.stop_accuracy) == (4000, 0.4)
    cfg = load_config(None, USER)
    assert (cfg.warmstart.steps, cfg.warmstart.stop_accuracy) == (0, 0)  # a user's model: no warm start


def test_every_choice_is_named_in_its_keys_meaning():
    """docs/config.md reads a key's values off its comment: a name added to engine/algos.py (a new
    estimator, say) must be added there too, or the reference and `rlflow config` never show it."""
    from rlflow.engine.config import CHOICES, meanings

    for key, allowed in CHOICES.items():
        text = meanings()[key]
        if "as actor." in text:  # "as actor.kl_loss_type": the same set, named once
            continue
        missing = [a for a in allowed if not re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", text)]
        assert not missing, f"{key}: its comment in engine/config.py does not name {missing}"
