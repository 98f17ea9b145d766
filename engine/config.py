"""Run configuration: typed dataclasses are the single source of defaults and validation.

The defaults serve a real 0.5B-8B model (docs/config.md says where each comes from). A run's
settings are, in order: the defaults; a recipe (engine/recipes.py: a YAML diff, by name or path;
with none named and no model named, `demo`, the embedded task on the CPU); `key=value` overrides
by dotted path (`rollout.samples_per_prompt=8`), parsed as YAML scalars and checked against the
field's type (`key=` with no value changes nothing). Keys set to `auto` are resolved last, from the
job and whether the run has GPUs (`resolve`).

Invariants:
- an unknown key is an error that names rlflow's key for a name users bring from verl, TRL or
  OpenRLHF (engine/aliases.py), else the closest valid key;
- every key has a one-line meaning (its field comment), rendered in docs/config.md by `python -m rlflow.engine.config`;
- the algorithm switches accept exactly the names engine/algos.py dispatches on (its tuples);
- `algorithm.name` is derived, never a switch: the command picks the job (rl, sft, dpo), an RL run's label
  follows its settings (`run_label`); a value that contradicts them is an error;
- a pipeline that needs other values than the user's changes them through `override`, which says so;
- `validate()` runs before any worker starts, so a bad run fails in seconds, not after setup;
- a loaded config holds no `auto`: `to_dict(cfg)` round-trips through `load_config` with the same job
  (it is what a checkpoint stores).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.engine import algos, aliases, recipes
from rlflow.engine.algos import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES, ROLLOUT_CORRECTIONS

EMBEDDED = "embedded"  # model.path / data.*_files value that selects the built-in task
NO_RULE = "none"  # reward.function value: no rule function scores (a reward model, or an environment, alone)
EMBEDDED_WARMSTART_STEPS = 4000  # the embedded model's warm start before RL or DPO: at most this many steps ...
EMBEDDED_WARMSTART_ACCURACY = 0.4  # ... ending once its greedy accuracy on training problems reaches this
DEMO = "demo"  # the recipe of a run that names none and no model: the embedded task on the CPU
AUTO = "auto"  # a key's value that `resolve` fills in; a number key holds it as -1
CPU_MICRO_BATCH_TOKENS = 4096  # actor.micro_batch_tokens_per_gpu auto on the CPU, where memory is seldom short
LR = {"rl": 1e-6, "dpo": 1e-6, "sft": 2e-5}  # actor.lr auto, full weights (TRL's GRPO, DPO and SFT defaults)
LORA_LR_SCALE = 10  # ... times this for LoRA adapters ("LoRA Without Regret", Schulman et al., 2025)


@dataclass
class ModelConfig:
    path: str = ""  # HF model directory, or Hub id org/name[@revision]; "embedded": the demo's tiny Qwen2
    dtype: str = AUTO  # training compute dtype: auto (bfloat16 on GPUs, float32 on the CPU) | float32 | bfloat16


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # training rows: parquet / jsonl, or "embedded"
    val_files: list[str] = field(default_factory=list)  # held-out rows for validation, same formats
    prompts_per_step: int = 64  # prompts per RL step over all workers (pairs for DPO, examples for SFT)
    max_prompt_tokens: int = 1024  # a longer prompt is skipped or refused (data.overlong_prompts), never truncated
    overlong_prompts: str = "skip"  # skip (counted, logged) | error
    val_max_prompts: int = 256  # 0 = the whole validation set


@dataclass
class RolloutConfig:
    backend: str = "native"  # native (engine/rollout/native.py) | hf (transformers generate) | vllm (the vllm extra)
    samples_per_prompt: int = 8  # responses sampled per prompt: the group that group estimators compare
    max_new_tokens: int = 1024  # response length cap (SFT/DPO: longer answers are skipped)
    temperature: float = 1.0  # sampling temperature; training logprobs use it too, so the two agree; 0 = greedy
    top_p: float = 1.0  # sample from the smallest token set holding this much probability; 1 disables
    top_k: int = 0  # 0 disables top-k
    stop_strings: list[str] = field(default_factory=list)  # eos always stops
    dtype: str = AUTO  # auto (model.dtype) | float32 | bfloat16 | fp8 (native, sm89+); other than model's: a correction
    kv_cache_memory: float = 0.3  # native on CUDA: KV cache at most this fraction of free GPU memory
    free_cache: bool = False  # release the rollout's KV cache and weights while training (native: CUDA graphs kept)
    tp: int = 1  # native: tensor-parallel size of generation; groups of tp consecutive workers share their prompts
    env: str = ""  # "module:Class" or "path/file.py:Class": multi-turn episodes with tools (docs/howto/agents.md)
    max_turns: int = 4  # with env: model turns an episode runs at most, each at most max_new_tokens
    episode_tokens: int = 2048  # with env: response tokens of an episode (its turns and observations), at most


@dataclass
class ActorConfig:
    """The policy's training. Keys marked "critic too" also set how the critic (`algorithm.advantage=gae`) trains."""
    lr: float = -1.0  # peak AdamW lr of the policy; auto: RL and DPO 1e-6, SFT 2e-5, x10 with LoRA (critic: critic.lr)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (critic too)
    grad_clip: float = 1.0  # clip the global gradient norm of each optimizer step to this (critic too)
    warmup_steps: int = 0  # optimizer steps of linear lr warmup (critic too; not critic.warmup_steps)
    lr_schedule: str = "constant"  # after warmup: constant | cosine, to 0 at the last optimizer step (critic too)
    mini_batch_prompts: int = 16  # prompts per optimizer step (critic too)
    micro_batch_tokens_per_gpu: int = -1  # tokens a forward/backward, padded rows x width; auto: planned (critic too)
    pack_sequences: str = AUTO  # sequences end to end in one row: true | false | auto: on GPUs (critic too)
    share_prompts: bool = False  # each prompt computed once for its samples (CUDA: flex; long prompts, short answers)
    ppo_epochs: int = 1  # passes over each step's samples; > 1 reuses them under the clipped ratio (critic too)
    clip_low: float = 0.2  # the ratio's lower clip bound is 1 - clip_low
    clip_high: float = 0.2  # upper bound 1 + clip_high; > clip_low is DAPO's clip-higher
    dual_clip: float = 0.0  # 0 disables; else c > 1
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    policy_loss: str = "ppo"  # ppo (token ratio) | gspo (sequence ratio) | cispo (clipped IS weight x logprob)
    kl_loss_coef: float = 0.0  # weight of the KL-to-reference loss term; 0 = none (and RL runs no reference model)
    kl_loss_type: str = "k3"  # its estimator: k1 | k2 | k3 | low_var_kl (verl's name for k3) | abs
    entropy_coef: float = 0.0  # weight of the entropy bonus subtracted from the loss; 0 = none
    offload_optimizer: bool = False  # CUDA: optimizer state in pinned CPU memory while generating
    activation_checkpointing: str = AUTO  # recompute layers in backward: true | false | auto: planned (critic too)
    compile_layers: bool = False  # decoder layers through torch.compile; the first steps compile (critic too)
    sp: int = 1  # Ulysses sequence parallel size: groups of sp workers train on slices of the same rows
    lora_rank: int = 0  # > 0 trains LoRA adapters of this rank (PEFT) on a frozen base, its own reference; 0 = off
    lora_alpha: int = 32  # LoRA scale: adapters' product times lora_alpha / lora_rank
    lora_targets: list[str] = field(default_factory=lambda: ["all-linear"])  # module names; all-linear: decoder's


@dataclass
class AlgorithmConfig:
    name: str = "grpo"  # not a key (DERIVED): the command's sft | dpo, or the RL label (run_label: gae is ppo)
    advantage: str = "grpo"  # grpo | drgrpo | rloo | reinforce_pp | reinforce_pp_baseline | remax | gae | FILE.py:NAME
    gamma: float = 1.0  # discount of per-token returns (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda: 1 = Monte Carlo return minus the value, 0 = one-step TD
    kl_coef: float = 0.0  # weight of a per-token KL to the reference in the reward (reinforce_pp, gae); 0 = none
    kl_target: float = 0.0  # > 0 makes that weight adaptive, starting from kl_coef
    dynamic_sampling_tries: int = 0  # DAPO: > 0 drops groups with equal rewards, generating up to this many rounds
    rollout_correction: str = "none"  # rollout/trainer gap: none | token_tis | seq_tis | token_mask | seq_mask | exact
    rollout_correction_cap: float = 2.0  # tis: weights capped at this; mask: kept within [1/cap, cap]


@dataclass
class CriticConfig:
    """The value model of `algorithm.advantage=gae`: the policy's backbone with a one-output head, trained with
    its own AdamW at critic.lr; the rest of its training follows the actor keys marked "critic too"."""
    lr: float = 5e-4  # its own AdamW's lr; batch sizes, epochs and the rest: the actor's keys marked "critic too"
    warmup_steps: int = 0  # first RL steps that train only the critic, so the actor starts from useful values
    cliprange_value: float = 0.5  # a value moves at most this far from its pre-update value per step (clipped loss)


@dataclass
class RewardConfig:
    function: str = ""  # "module:function" or "path/file.py:function"; "" = built-in by data_source; none: no rule
    on_error: str = "zero"  # zero (counted in reward/errors) | raise
    timeout_s: float = 30.0  # per call; a call that runs longer scores 0 and counts as an error; 0 = none
    overlong_buffer: int = 0  # DAPO: > 0 ramps a penalty to -1 over this many tokens before max_new_tokens
    model: str = ""  # HF sequence-classification directory (num_labels=1) scoring prompt + response; "" = none
    model_weight: float = 1.0  # score = rule reward + model_weight x reward-model score


@dataclass
class DPOConfig:
    beta: float = 0.1  # `rlflow dpo`: strength of the implicit KL anchor to the reference policy
    nll_coef: float = 0.0  # weight of the chosen answers' mean token NLL added to the DPO loss (RPO); 0: plain DPO


@dataclass
class WarmstartConfig:
    steps: int = -1  # supervised steps on train answers before RL/DPO (at most); 0 skips; auto: embedded 4000, else 0
    lr: float = 2e-5  # the warm start's constant learning rate
    stop_accuracy: float = -1.0  # end at this greedy accuracy on 256 held-out train rows; 0 no; auto: .4 embedded


@dataclass
class PlacementConfig:
    workers: int = 1  # data-parallel ranks of the hybrid actor pool, one process each
    own_pool: list[str] = field(default_factory=list)  # roles off the hybrid pool: reward, reference, critic, rollout
    gpus_per_worker: float = -1.0  # auto: 1 where CUDA is visible (to the Ray cluster joined), else 0 (CPU bundles)
    torch_threads: int = 1  # per worker; idle compiled-graph actors spin a core each


@dataclass
class TrainerConfig:
    total_steps: int = 100  # steps of the run, each on data.prompts_per_step prompts (pairs, examples)
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2  # newest complete checkpoints kept; older ones are deleted
    log_checkpoint: bool = True  # also copy the final checkpoint into the MLflow run (twice the disk on a local store)
    resume: str = "auto"  # auto | never | <checkpoint dir>
    output_dir: str = "outputs/rlflow"  # checkpoints, the exported hf_model, the embedded task's files
    seed: int = 0  # seeds data order, sampling, the embedded task and model, and the critic's head
    val_every: int = 10  # validate, and log a table of sample generations, every k steps; 0 = only at the end
    val_samples: int = 4  # k sampled answers per validation prompt for mean@k / pass@k; 0 = greedy only
    dag: str = "compiled"  # compiled | plain (.remote() calls, same verbs)
    max_staleness: int = 0  # 0 = synchronous; k: the rollout pool runs up to k steps ahead, samples <= k versions old
    max_restarts: int = 2  # rebuild the workers after a process dies, from the last checkpoint
    stall_timeout_s: float = 600.0  # no work done this long while a call runs or is awaited: stuck, rebuilt
    experiment: str = "rlflow"  # MLflow experiment of the run
    run_name: str = ""  # MLflow run name; "" lets MLflow pick one
    register_model: str = ""  # Model Registry name for the exported policy; "" = don't register


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    pass


# Fields a run fills in and logs but no one sets: the run's label, from the command and the settings
DERIVED = ("algorithm.name",)


def all_keys(cls: Any = Config, prefix: str = "") -> dict[str, Any]:
    """Every leaf key as {dotted.path: type}: what a recipe or an override may set."""
    out: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out.update(all_keys(tp, key + "."))
        elif key not in DERIVED:
            out[key] = tp
    return out


RENAMED = {  # old key -> what replaced it
    "trainer.async_mode": "trainer.max_staleness (sync: 0, one_step: 1)",
    "trainer.progress": "behaviour: the progress bar shows when stderr is a terminal, lines otherwise",
    "trainer.samples_every": "trainer.val_every: a table of sample generations is logged with each validation",
    "trainer.max_consecutive_skips": "a constant: five non-finite optimizer steps in a row stop the run",
    "reward.rule_weight": "reward.function=none for no rule (a reward model alone); the rule's weight is 1, the "
                          "model's reward.model_weight",
    "warmstart.batch_size": "a constant: 32 examples a warm-start step (pipelines/sft.py, BATCH)",
    "reward.overlong_penalty": "a constant: DAPO's penalty reaches -1 at rollout.max_new_tokens (engine/algos.py)",
    "algorithm.kl_in_reward": "algorithm.kl_coef > 0 (0, the default, puts no KL in the reward)",
    "algorithm.kl_penalty": "a constant: the KL in the reward is k1 (engine/algos.py, REWARD_KL)",
    "trainer.step_timeout_s": "trainer.stall_timeout_s: a step's waits last while the workers move, however long; "
                              "starting a pool has a fixed bound (pipelines/runtime.py, START_TIMEOUT_S)",
}


def _unknown(key: str) -> ConfigError:
    if key in RENAMED:
        return ConfigError(f"config key '{key}' is now {RENAMED[key]}")
    peer = aliases.rlflow_key(key)
    if peer:
        return ConfigError(f"unknown config key '{key}': {peer}")
    close = difflib.get_close_matches(key, list(all_keys()), n=1, cutoff=0.4)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


# Keys that take `auto`, and how each holds it until `resolve` fills it in.
AUTO_KEYS: dict[str, Any] = {"model.dtype": AUTO, "rollout.dtype": AUTO, "actor.lr": -1.0,
                             "placement.gpus_per_worker": -1.0, "warmstart.steps": -1,
                             "warmstart.stop_accuracy": -1.0, "actor.micro_batch_tokens_per_gpu": -1,
                             "actor.activation_checkpointing": AUTO, "actor.pack_sequences": AUTO}


def _coerce(key: str, value: Any, tp: Any) -> Any:
    if value == AUTO and key in AUTO_KEYS:
        return AUTO_KEYS[key]
    if typing.get_origin(tp) is list:
        items = value if isinstance(value, list) else [value]
        return [_coerce(key, v, typing.get_args(tp)[0]) for v in items]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, float) and not math.isfinite(value):  # NaN passes every `<` check
        raise ConfigError(f"{key} must be a finite number, got {value}")
    if tp is str and isinstance(value, bool):  # a switch that also takes auto: YAML's true/false
        return str(value).lower()
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {tp.__name__}, got {value!r}")
    return value


def _set(cfg: Config, key: str, value: Any) -> None:
    types = all_keys()
    if key not in types:
        raise _unknown(key)
    *parents, leaf = key.split(".")
    node: Any = cfg
    for p in parents:
        node = getattr(node, p)
    setattr(node, leaf, _coerce(key, value, types[key]))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in all_keys():
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """{dotted key: value} of `key=value` items; `key=` (empty) keeps the configured value, as
    MLproject's empty parameters rely on."""
    settings: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            known = key in all_keys() or aliases.rlflow_key(key)
            raise ConfigError(f"'{item}' is a config key without a value: write {key}=VALUE" if known else
                              f"'{item}' is not key=value (a recipe or YAML file goes first, or after --config)")
        if raw.strip():
            try:
                settings[key.strip()] = recipes.parse_yaml(raw, f"override '{item}'")
            except recipes.RecipeError as e:
                raise ConfigError(str(e)) from None
    return settings


def recipe_settings(path: str | Path | None, settings: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(the recipe's job, its settings by dotted key) for recipe or file `path`; with none named,
    the `demo` recipe's unless `settings` name a model other than the embedded one."""
    if path is None and settings.get("model.path", EMBEDDED) != EMBEDDED:
        return None, {}
    try:
        job, layers = recipes.read(path or DEMO)
    except recipes.RecipeError as e:
        if str(path) in all_keys() or aliases.rlflow_key(str(path)):
            raise ConfigError(f"'{path}' is a config key without a value: write {path}=VALUE") from None
        raise ConfigError(str(e)) from None
    out: dict[str, Any] = {}
    for layer in layers:
        out.update(_flatten(layer))
    return job, out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                job: str | None = None, gpus: int | None = None) -> Config:
    """The validated config of a run: the defaults, the recipe at `path` (a shipped recipe's name or
    a YAML file; None: `demo` unless the overrides name a model), then `key=value` overrides, for
    the `job` its command runs (`rlflow sft`: sft, `rlflow dpo`: dpo; None: the recipe's, else rl).
    `auto` keys are resolved with `gpus` visible GPUs (None: count this machine's)."""
    settings = parse_overrides(overrides)
    recipe_job, base = recipe_settings(path, settings)
    if job is not None and recipe_job is not None and job != recipe_job:
        raise ConfigError(f"{path} is a recipe for {recipe_job}, not {job}: "
                          f"run `rlflow {_COMMANDS[recipe_job]} {path}`")
    job = job or recipe_job or "rl"
    if job not in JOBS:
        raise ConfigError(f"job {job!r}: choose one of {list(JOBS)}")
    settings = {**base, **settings}
    named = settings.pop("algorithm.name", None)
    cfg = Config()
    for key, value in settings.items():
        _set(cfg, key, value)
    cfg.algorithm.name = name_of(cfg, job)
    if named is not None and str(named) != cfg.algorithm.name:  # a saved config may repeat it, never change it
        raise ConfigError(f"algorithm.name={named!r} contradicts this run, which is {cfg.algorithm.name!r}: the "
                          "command sets sft and dpo (`rlflow sft`, `rlflow dpo`); an RL run's name follows "
                          "algorithm.advantage and actor.policy_loss (advantage gae is ppo)")
    resolve(cfg, job, visible_gpus() if gpus is None else gpus)
    validate(cfg)
    return cfg


_COMMANDS = {"rl": "train", "sft": "sft", "dpo": "dpo"}


def visible_gpus() -> int:
    """GPUs this process sees."""
    import torch

    return torch.cuda.device_count()


def resolve(cfg: Config, job: str, gpus: int) -> None:
    """Fill in every `auto` key, in place: one GPU a worker where `gpus` > 0; bfloat16 and packed
    rows on GPUs; the job's learning rate (ten times it for LoRA); a warm start for the embedded
    model alone."""
    p, a, w = cfg.placement, cfg.actor, cfg.warmstart
    embedded = cfg.model.path == EMBEDDED
    if p.gpus_per_worker == AUTO_KEYS["placement.gpus_per_worker"]:
        p.gpus_per_worker = 1.0 if gpus else 0.0
    if cfg.model.dtype == AUTO:
        cfg.model.dtype = "bfloat16" if p.gpus_per_worker else "float32"
    if cfg.rollout.dtype == AUTO:
        cfg.rollout.dtype = cfg.model.dtype
    if a.lr == AUTO_KEYS["actor.lr"]:
        a.lr = float(f"{LR[job] * (LORA_LR_SCALE if a.lora_rank else 1):.6g}")
    if w.steps == AUTO_KEYS["warmstart.steps"]:  # only the embedded model starts untrained; SFT is the training itself
        w.steps = 0 if not embedded or job == "sft" else EMBEDDED_WARMSTART_STEPS
    if w.stop_accuracy == AUTO_KEYS["warmstart.stop_accuracy"]:  # the embedded task learns most from a weak start
        w.stop_accuracy = EMBEDDED_WARMSTART_ACCURACY if embedded and job != "sft" else 0.0
    if a.pack_sequences == AUTO:  # on the CPU a packed row's attention needs a block mask: padded rows run faster
        a.pack_sequences = "true" if p.gpus_per_worker and a.sp == 1 else "false"
    if not p.gpus_per_worker:  # on GPUs the trainer plans both from the free memory (engine/train/memory.py)
        if a.micro_batch_tokens_per_gpu == AUTO_KEYS["actor.micro_batch_tokens_per_gpu"]:
            a.micro_batch_tokens_per_gpu = max(CPU_MICRO_BATCH_TOKENS, longest_row(cfg))
        if a.activation_checkpointing == AUTO:
            a.activation_checkpointing = "false"


def longest_row(cfg: Config) -> int:
    """The tokens of the longest row a step can hold: the longest prompt and the longest answer."""
    r = cfg.rollout
    return cfg.data.max_prompt_tokens + (r.episode_tokens if r.env else r.max_new_tokens)


def switch(value: str) -> bool | None:
    """A true | false | auto key's value: None for auto."""
    return None if value == AUTO else value == "true"


def packed(cfg: Config) -> bool:
    """Whether the trainers run their sequences end to end (`actor.pack_sequences`, resolved)."""
    if cfg.actor.pack_sequences == AUTO:
        raise ValueError("actor.pack_sequences=auto is resolved when the config is loaded (`resolve`)")
    return cfg.actor.pack_sequences == "true"


def doubts(cfg: Config, gpus: int) -> list[str]:
    """Settings that run but look like a mistake, one line each naming the key: more GPUs asked for
    than are visible, a real model on the CPU while GPUs are visible, answers cut at a toy length."""
    p = cfg.placement
    needed = p.workers * (1 + ("rollout" in p.own_pool)) * p.gpus_per_worker
    out = []
    if needed > gpus:
        pools = " x 2 pools" if "rollout" in p.own_pool else ""
        out.append(f"placement.workers={p.workers} x placement.gpus_per_worker={p.gpus_per_worker:g}{pools}"
                   f" asks for {needed:g} GPUs, and {gpus} are visible: the workers wait for GPUs that may never come")
    if cfg.model.path == EMBEDDED:
        return out
    if not cfg.placement.gpus_per_worker and gpus:
        out.append(f"model.path={cfg.model.path} trains on the CPU (placement.gpus_per_worker=0) while {gpus} "
                   "GPU(s) are visible; placement.gpus_per_worker=auto uses them")
    if cfg.rollout.max_new_tokens < 32:
        out.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} cuts a real model's answers at a toy "
                   "length (the embedded demo's); the default is 1024")
    return out


def run_label(cfg: Config) -> str:
    """An RL run's `algorithm.name`, from the settings that change its math (`algos.run_name`)."""
    return algos.run_name(estimator_of(cfg.algorithm.advantage), cfg.actor.policy_loss,
                          bool(cfg.algorithm.dynamic_sampling_tries))


def estimator_of(spec: str) -> algos.Estimator:
    """The estimator `algorithm.advantage` names: a registered one (`algos.ESTIMATORS`), or an
    `algos.Estimator` of the user's own, "path/to/file.py:NAME" or "package.module:NAME"."""
    if spec in algos.ESTIMATORS:
        return algos.ESTIMATORS[spec]
    if ":" not in spec:
        raise ConfigError(f"algorithm.advantage={spec!r}; choose one of {list(ADVANTAGES)}, or name an Estimator "
                          "of your own as FILE.py:NAME (docs/howto/custom-algorithm.md)")
    from rlflow.engine.specs import load_object

    try:
        found = load_object(spec, "advantage estimator")
    except Exception as e:  # the user's module may fail in any way while it is imported
        raise ConfigError(f"algorithm.advantage={spec}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") \
            from None
    if not isinstance(found, algos.Estimator):
        raise ConfigError(f"algorithm.advantage={spec}: a {type(found).__name__}, not an rlflow.Estimator")
    return found


def name_of(cfg: Config, job: str) -> str:
    """`algorithm.name`: the job's for sft and dpo, the settings' label (`run_label`) for rl."""
    return job if job != "rl" else run_label(cfg)


def deterministic(cfg: Config) -> bool:
    """Deterministic mode (`algorithm.rollout_correction=exact`, engine/exact.py): the rollout engine
    and the trainer compute each token's numbers alike, whatever the batch."""
    return cfg.algorithm.rollout_correction == algos.EXACT


def job_of(cfg: Config) -> str:
    """rl, sft or dpo: what the command runs (`algorithm.name` holds sft and dpo as they are)."""
    return cfg.algorithm.name if cfg.algorithm.name in ("sft", "dpo") else "rl"


def override(cfg: Config, why: str, **changes: Any) -> Config:
    """A copy of `cfg` with `changes` by dotted key (`**{"actor.ppo_epochs": 1}`), for a pipeline that needs
    other values than the user's. Prints one line per value it changes, so none changes silently:
    `rlflow: sft sets actor.ppo_epochs=1 (was 4): one step is one optimizer step`. Not validated."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        if key == "algorithm.name":
            raise ConfigError("algorithm.name is derived; change the settings it follows")
        _set(out, key, value)
        old, new = _get(cfg, key), _get(out, key)
        if new != old:
            print(f"rlflow: {cfg.algorithm.name} sets {key}={new} (was {old}): {why}", flush=True)
    out.algorithm.name = name_of(out, job_of(cfg))
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


JOBS = ("rl", "sft", "dpo")  # what `rlflow train`, `rlflow sft` and `rlflow dpo` run
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16"),
    "rollout.dtype": ("float32", "bfloat16", "fp8"),
    "rollout.backend": ("hf", "native", "vllm"),
    "data.overlong_prompts": ("skip", "error"),
    "actor.lr_schedule": ("constant", "cosine"),
    "actor.loss_agg": LOSS_AGGS,  # the algorithm switches: the names engine/algos.py dispatches on
    "actor.kl_loss_type": KL_ESTIMATORS,
    "actor.policy_loss": POLICY_LOSSES,
    "algorithm.rollout_correction": ROLLOUT_CORRECTIONS,
    "reward.on_error": ("zero", "raise"),
    "trainer.dag": ("compiled", "plain"),
    "actor.activation_checkpointing": (AUTO, "true", "false"),
    "actor.pack_sequences": (AUTO, "true", "false"),
}


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _validate_sp(cfg: Config) -> None:
    """Sequence parallelism slices padded rows that the group's workers share; a loss needing a
    whole sequence's tokens on one rank (a per-sequence mean or ratio) cannot run on slices."""
    a, workers = cfg.actor, cfg.placement.workers
    if a.sp < 1 or workers % a.sp:
        raise ConfigError(f"actor.sp={a.sp} must be >= 1 and divide placement.workers={workers}")
    if a.sp == 1:
        return
    if a.pack_sequences == "true" or a.share_prompts:
        raise ConfigError("actor.sp > 1 runs padded rows: set actor.pack_sequences=false and actor.share_prompts=false")
    if job_of(cfg) != "rl" or algos.needs_whole_sequences(a.policy_loss, a.loss_agg, cfg.algorithm.rollout_correction):
        raise ConfigError(f"actor.sp > 1 trains RL with a token-level loss; got algorithm.name="
                          f"{cfg.algorithm.name}, actor.loss_agg={a.loss_agg}, actor.policy_loss={a.policy_loss}, "
                          f"algorithm.rollout_correction={cfg.algorithm.rollout_correction}")


def validate(cfg: Config) -> None:
    """Every check that can fail before work starts. Raises ConfigError naming the key."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r}; choose one of {list(allowed)}")
    _validate_ranges(cfg)
    d, r, a, p = cfg.data, cfg.rollout, cfg.actor, cfg.placement
    est = estimator_of(cfg.algorithm.advantage)
    if est.group and r.samples_per_prompt < 2:
        raise ConfigError(f"advantage '{cfg.algorithm.advantage}' compares samples of one prompt: "
                          f"rollout.samples_per_prompt must be >= 2, got {r.samples_per_prompt}")
    if d.prompts_per_step % a.mini_batch_prompts:
        raise ConfigError(f"data.prompts_per_step={d.prompts_per_step} is not a multiple of "
                          f"actor.mini_batch_prompts={a.mini_batch_prompts}")
    if a.mini_batch_prompts % p.workers:
        raise ConfigError(f"actor.mini_batch_prompts={a.mini_batch_prompts} does not split over "
                          f"placement.workers={p.workers}")
    _validate_sp(cfg)
    longest = longest_row(cfg)
    if a.micro_batch_tokens_per_gpu != AUTO_KEYS["actor.micro_batch_tokens_per_gpu"] and \
            a.micro_batch_tokens_per_gpu < longest:
        raise ConfigError(f"actor.micro_batch_tokens_per_gpu={a.micro_batch_tokens_per_gpu} cannot hold one "
                          f"sequence of max_prompt_tokens + {'episode_tokens' if r.env else 'max_new_tokens'} = "
                          f"{longest}")
    if r.env and (r.max_turns < 1 or r.episode_tokens < r.max_new_tokens or r.tp > 1):
        raise ConfigError(f"rollout.env needs rollout.max_turns >= 1 (got {r.max_turns}), rollout.episode_tokens >= "
                          f"rollout.max_new_tokens (got {r.episode_tokens} < {r.max_new_tokens}) and rollout.tp=1")
    if r.dtype != cfg.model.dtype and cfg.algorithm.rollout_correction == algos.NO_CORRECTION:
        raise ConfigError(f"rollout.dtype={r.dtype} differs from model.dtype={cfg.model.dtype}: rollout logprobs "
                          "would not match training logprobs; set algorithm.rollout_correction to correct for it")
    if r.dtype == "fp8" and (r.backend != "native" or not p.gpus_per_worker):
        raise ConfigError(f"rollout.dtype=fp8 runs on the native backend on GPUs (compute capability 8.9+); got "
                          f"rollout.backend={r.backend}, placement.gpus_per_worker={p.gpus_per_worker}")
    if r.tp < 1 or p.workers % r.tp or (r.tp > 1 and r.backend != "native"):
        raise ConfigError(f"rollout.tp={r.tp} needs the native backend and must divide placement.workers={p.workers}")
    if a.dual_clip and (a.dual_clip <= 1 or not algos.dual_clip_applies(a.policy_loss)):
        raise ConfigError(f"actor.dual_clip must be 0 (off) or > 1, and needs a ppo/gspo loss; got {a.dual_clip} "
                          f"with actor.policy_loss={a.policy_loss}")
    _validate_dapo(cfg)
    _validate_deterministic(cfg)
    _validate_critic(cfg)
    _validate_scoring(cfg)
    if cfg.algorithm.kl_target and not cfg.algorithm.kl_coef:
        raise ConfigError(f"algorithm.kl_target={cfg.algorithm.kl_target} adapts algorithm.kl_coef, which is 0 "
                          "(no KL in the reward): set a starting kl_coef > 0, e.g. 0.001")
    if cfg.algorithm.kl_coef and not est.token_rewards:
        raise ConfigError("algorithm.kl_coef > 0 needs an advantage that reads per-token rewards, "
                          f"{[e.name for e in algos.ESTIMATORS.values() if e.token_rewards]}; the others use the "
                          "outcome score, so use actor.kl_loss_coef")
    if set(p.own_pool) - {"reward", "reference", "critic", "rollout"}:
        raise ConfigError(f"placement.own_pool takes reward, reference, critic and/or rollout, got {p.own_pool}")
    if "rollout" in p.own_pool:
        _validate_split(cfg)
    _validate_async(cfg)
    if job_of(cfg) == "sft" and cfg.warmstart.steps:
        raise ConfigError(f"warmstart.steps={cfg.warmstart.steps} with algorithm.name=sft: SFT is the supervised "
                          "training itself; set warmstart.steps=0 (trainer.total_steps sets its length)")


def _validate_ranges(cfg: Config) -> None:
    """Each number within its key's range (NaN and infinities are refused where the config is read)."""
    d, r, a, p = cfg.data, cfg.rollout, cfg.actor, cfg.placement
    positive = {"data.prompts_per_step": d.prompts_per_step, "data.max_prompt_tokens": d.max_prompt_tokens,
                "rollout.max_new_tokens": r.max_new_tokens, "actor.mini_batch_prompts": a.mini_batch_prompts,
                "actor.ppo_epochs": a.ppo_epochs, "placement.workers": p.workers,
                "trainer.total_steps": cfg.trainer.total_steps, "actor.lr": a.lr,
                "rollout.samples_per_prompt": r.samples_per_prompt, "placement.torch_threads": p.torch_threads,
                "actor.grad_clip": a.grad_clip,
                "warmstart.lr": cfg.warmstart.lr,
                "trainer.keep_last": cfg.trainer.keep_last, "rollout.top_p": r.top_p,
                "trainer.stall_timeout_s": cfg.trainer.stall_timeout_s}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    non_negative = {"data.val_max_prompts": d.val_max_prompts, "reward.timeout_s": cfg.reward.timeout_s,
                    "rollout.temperature": r.temperature,
                    "rollout.top_k": r.top_k, "actor.weight_decay": a.weight_decay,
                    "actor.warmup_steps": a.warmup_steps, "actor.clip_low": a.clip_low, "actor.clip_high": a.clip_high,
                    "actor.kl_loss_coef": a.kl_loss_coef, "algorithm.kl_coef": cfg.algorithm.kl_coef,
                    "algorithm.kl_target": cfg.algorithm.kl_target, "trainer.save_every": cfg.trainer.save_every,
                    "trainer.val_every": cfg.trainer.val_every, "trainer.max_restarts": cfg.trainer.max_restarts}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if r.top_p > 1 or a.clip_low > 1:
        raise ConfigError(f"rollout.top_p and actor.clip_low must be <= 1; got {r.top_p}, {a.clip_low}")
    if not 0 < r.kv_cache_memory <= 1:
        raise ConfigError(f"rollout.kv_cache_memory must be in (0, 1], got {r.kv_cache_memory}")
    if cfg.algorithm.rollout_correction_cap <= 1:
        raise ConfigError(f"algorithm.rollout_correction_cap must be > 1, got {cfg.algorithm.rollout_correction_cap}")
    if cfg.warmstart.steps < -1:
        raise ConfigError(f"warmstart.steps must be >= 0 (or -1: auto), got {cfg.warmstart.steps}")
    w = cfg.warmstart
    if not (0 <= w.stop_accuracy <= 1 or w.stop_accuracy == -1):
        raise ConfigError(f"warmstart.stop_accuracy must be in [0, 1] (or -1: auto), got {w.stop_accuracy}")
    if a.lora_rank < 0 or a.lora_alpha <= 0 or not a.lora_targets:
        raise ConfigError(f"actor.lora_rank must be >= 0 (0: full weights), actor.lora_alpha > 0 and "
                          f"actor.lora_targets non-empty; got {a.lora_rank}, {a.lora_alpha}, {a.lora_targets}")


def _validate_critic(cfg: Config) -> None:
    """PPO's critic exists exactly when advantages are GAE's, which only RL computes."""
    alg, c, gae = cfg.algorithm, cfg.critic, estimator_of(cfg.algorithm.advantage).critic
    if job_of(cfg) == "rl" and alg.name != run_label(cfg):
        raise ConfigError(f"algorithm.name={alg.name!r} is derived and this config makes it {run_label(cfg)!r}")
    if gae and job_of(cfg) != "rl":
        raise ConfigError(f"algorithm.advantage=gae trains a critic, which {alg.name} has no use for")
    if not (0 <= alg.gamma <= 1 and 0 <= alg.lam <= 1):
        raise ConfigError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {alg.gamma}, {alg.lam}")
    if c.lr <= 0 or c.cliprange_value <= 0:
        raise ConfigError(f"critic.lr and critic.cliprange_value must be > 0, got {c.lr}, {c.cliprange_value}")
    if c.warmup_steps and not gae:
        raise ConfigError("critic.warmup_steps needs algorithm.advantage=gae: only GAE runs a critic")
    if not 0 <= c.warmup_steps < cfg.trainer.total_steps:
        raise ConfigError(f"critic.warmup_steps must be in [0, trainer.total_steps={cfg.trainer.total_steps}), "
                          f"or the actor never trains; got {c.warmup_steps}")
    if "critic" in cfg.placement.own_pool and not gae:
        raise ConfigError("placement.own_pool lists critic, but only algorithm.advantage=gae runs one")


def _validate_split(cfg: Config) -> None:
    """A rollout pool of its own: generation on other workers, fed by a weight broadcast."""
    p = cfg.placement
    if job_of(cfg) != "rl":
        raise ConfigError(f"placement.own_pool lists rollout, but algorithm.name={cfg.algorithm.name} never generates")
    if 0 < p.gpus_per_worker < 1:
        raise ConfigError(f"placement.own_pool=[rollout] with placement.gpus_per_worker={p.gpus_per_worker}: a "
                          "trainer and a rollout worker could share one GPU, and NCCL connects no two ranks there")
    if cfg.rollout.free_cache or cfg.actor.offload_optimizer:
        raise ConfigError("rollout.free_cache and actor.offload_optimizer share one GPU's memory between generation "
                          "and training; with placement.own_pool=[rollout] each has its own GPUs: turn them off")


def _validate_async(cfg: Config) -> None:
    """Generation running ahead of training needs its own workers and a batch known before the step."""
    if cfg.trainer.max_staleness < 0:
        raise ConfigError(f"trainer.max_staleness must be >= 0 (0: synchronous), got {cfg.trainer.max_staleness}")
    if cfg.trainer.max_staleness == 0:
        return
    mode = f"trainer.max_staleness={cfg.trainer.max_staleness}"
    if job_of(cfg) != "rl":
        raise ConfigError(f"{mode}: only RL generates; algorithm.name={cfg.algorithm.name} has nothing to overlap")
    if "rollout" not in cfg.placement.own_pool:
        raise ConfigError(f"{mode} generates while the trainer updates, so the rollout needs workers of its own: "
                          "add placement.own_pool=[rollout]")
    if cfg.algorithm.dynamic_sampling_tries or estimator_of(cfg.algorithm.advantage).greedy_baseline:
        raise ConfigError(f"{mode}: dynamic sampling and ReMax generate again from the current weights inside the "
                          "step; run them with trainer.max_staleness=0")


def _validate_deterministic(cfg: Config) -> None:
    """Deterministic mode holds where its kernels exist (engine/exact.py): name what stands in its way."""
    if not deterministic(cfg):
        return
    a, r, p = cfg.actor, cfg.rollout, cfg.placement
    against = {"rollout.backend": (r.backend, "native"), "placement.gpus_per_worker": (p.gpus_per_worker, 0),
               "model.dtype": (cfg.model.dtype, "float32"), "placement.torch_threads": (p.torch_threads, 1),
               "actor.lora_rank": (a.lora_rank, 0), "rollout.tp": (r.tp, 1), "actor.sp": (a.sp, 1),
               "actor.compile_layers": (a.compile_layers, False), "actor.share_prompts": (a.share_prompts, False)}
    wrong = [f"{key}={got} (needs {want})" for key, (got, want) in against.items() if got != want]
    if wrong:
        raise ConfigError("algorithm.rollout_correction=exact (deterministic mode) runs the native engine and the "
                          "trainer on the CPU in float32, one thread a worker, full weights, no tensor or sequence "
                          f"parallelism, no compiled layers or shared prompts; here: {', '.join(wrong)}")


def _validate_scoring(cfg: Config) -> None:
    """DPO's beta and the reward's rule/model mix."""
    rw = cfg.reward
    if cfg.dpo.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {cfg.dpo.beta}")
    if cfg.dpo.nll_coef < 0:
        raise ConfigError(f"dpo.nll_coef must be >= 0, got {cfg.dpo.nll_coef}")
    if rw.model_weight < 0:
        raise ConfigError(f"reward.model_weight must be >= 0; got {rw.model_weight}")
    if rw.function == NO_RULE and not (rw.model and rw.model_weight) and not cfg.rollout.env:
        raise ConfigError("reward.function=none needs reward.model set and reward.model_weight > 0: "
                          "nothing would score the responses")


def _validate_dapo(cfg: Config) -> None:
    """Dynamic sampling, overlong shaping and validation sampling."""
    rw, tries = cfg.reward, cfg.algorithm.dynamic_sampling_tries
    if tries < 0 or cfg.trainer.val_samples < 0:
        raise ConfigError("algorithm.dynamic_sampling_tries and trainer.val_samples must be >= 0")
    if tries and cfg.rollout.samples_per_prompt < 2:
        raise ConfigError("algorithm.dynamic_sampling_tries compares the rewards of one prompt's samples: "
                          "rollout.samples_per_prompt must be >= 2")
    if not 0 <= rw.overlong_buffer <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}]"
                          f"; got {rw.overlong_buffer}")
    if rw.overlong_buffer and estimator_of(cfg.algorithm.advantage).greedy_baseline:
        raise ConfigError("reward.overlong_buffer with algorithm.advantage=remax would shape the samples' rewards "
                          "but not the greedy baseline's; use one of them")


def meanings() -> dict[str, str]:
    """{dotted key: its one-line meaning}, read off the field comments of the dataclasses above."""
    import inspect
    import re

    out = {}
    for section, cls in typing.get_type_hints(Config).items():
        comments = dict(re.findall(r"^\s+(\w+): [^#\n]*?(?:#\s*(.*))?$", inspect.getsource(cls), re.M))
        out.update({f"{section}.{f.name}": comments.get(f.name, "") for f in dataclasses.fields(cls)
                    if f"{section}.{f.name}" not in DERIVED})
    return out


def reference_markdown() -> str:
    """The config reference table (docs/config.md), read off the dataclasses and their comments."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults, meaning = to_dict(Config()), meanings()
    for key, tp in all_keys().items():
        section, name = key.split(".")
        type_name = getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is not list else str(tp)
        default = AUTO if key in AUTO_KEYS else repr(defaults[section][name])
        escaped = meaning[key].replace("|", "\\|")
        rows.append(f"| `{key}` | {type_name} | `{default}` | {escaped} |")
    return "\n".join(rows) + "\n"


KEYS_BEGIN = "<!-- keys: generated by python -m rlflow.engine.config docs/config.md -->"
KEYS_END = "<!-- end of keys -->"

if __name__ == "__main__":  # rewrite the key table of the reference page in place, between its markers
    import sys

    page = Path(sys.argv[1])
    text = page.read_text()
    head, _, rest = text.partition(KEYS_BEGIN)
    page.write_text(head + KEYS_BEGIN + "\n" + reference_markdown() + KEYS_END + rest.partition(KEYS_END)[2])
