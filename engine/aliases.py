"""The names users bring from verl, TRL and OpenRLHF, and rlflow's key for each.

An unknown config key is looked up here before the closest spelling is guessed: `rollout.n`
is verl's `samples_per_prompt`, not a misspelt `rollout.env`. A name is matched whole, then by
its trailing parts (`actor_rollout_ref.actor.optim.lr`, `optim.lr`, `lr`), so a key nested one
way in a peer's config and another way in the user's memory still finds its answer. Nothing is
renamed silently: the key stays an error that names the rlflow key to use.
"""

from __future__ import annotations

VERL = {
    "rollout.n": "rollout.samples_per_prompt",
    "train_batch_size": "data.prompts_per_step",
    "max_prompt_length": "data.max_prompt_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "critic.optim.lr": "critic.lr",
    "optim.lr": "actor.lr",
    "optim.weight_decay": "actor.weight_decay",
    "optim.lr_warmup_steps": "actor.warmup_steps",
    "ppo_mini_batch_size": "actor.mini_batch_prompts",
    "ppo_micro_batch_size_per_gpu": "actor.micro_batch_tokens_per_gpu (a token budget, not rows)",
    "ppo_max_token_len_per_gpu": "actor.micro_batch_tokens_per_gpu",
    "use_dynamic_bsz": "actor.pack_sequences",
    "use_remove_padding": "actor.pack_sequences",
    "use_kl_loss": "actor.kl_loss_coef (> 0 turns it on)",
    "entropy_coeff": "actor.entropy_coef",
    "clip_ratio": "actor.clip_low and actor.clip_high",
    "clip_ratio_low": "actor.clip_low",
    "clip_ratio_high": "actor.clip_high",
    "clip_ratio_c": "actor.dual_clip",
    "loss_agg_mode": "actor.loss_agg",
    "enable_gradient_checkpointing": "actor.activation_checkpointing",
    "ulysses_sequence_parallel_size": "actor.sp",
    "target_modules": "actor.lora_targets",
    "rollout.name": "rollout.backend",
    "gpu_memory_utilization": "rollout.kv_cache_memory",
    "tensor_model_parallel_size": "rollout.tp",
    "adv_estimator": "algorithm.advantage",
    "use_kl_in_reward": "algorithm.kl_coef > 0 (0 = no KL in the reward)",
    "overlong_buffer.len": "reward.overlong_buffer",
    "overlong_buffer.penalty_factor": "a constant: DAPO's penalty reaches -1 at rollout.max_new_tokens",
    "kl_ctrl.kl_coef": "algorithm.kl_coef",
    "kl_ctrl.target_kl": "algorithm.kl_target",
    "total_training_steps": "trainer.total_steps",
    "total_epochs": "trainer.total_steps (steps, each data.prompts_per_step prompts)",
    "save_freq": "trainer.save_every",
    "test_freq": "trainer.val_every",
    "n_gpus_per_node": "placement.workers (with placement.gpus_per_worker=1)",
    "project_name": "trainer.experiment",
    "experiment_name": "trainer.run_name",
    "default_local_dir": "trainer.output_dir",
    "custom_reward_function.path": "reward.function (file.py:function)",
    "reward_model.model.path": "reward.model",
    "model.enable_gradient_checkpointing": "actor.activation_checkpointing",
}

TRL = {
    "learning_rate": "actor.lr",
    "max_steps": "trainer.total_steps",
    "num_generations": "rollout.samples_per_prompt",
    "max_completion_length": "rollout.max_new_tokens",
    "max_new_tokens": "rollout.max_new_tokens",
    "max_length": "data.max_prompt_tokens and rollout.max_new_tokens (each part has its own budget)",
    "beta": "actor.kl_loss_coef (RL's KL term) or dpo.beta (DPO)",
    "epsilon": "actor.clip_low",
    "epsilon_high": "actor.clip_high",
    "num_iterations": "actor.ppo_epochs",
    "importance_sampling_level": "actor.policy_loss (gspo: the sequence's ratio)",
    "scale_rewards": "algorithm.advantage (drgrpo: no std division)",
    "loss_type": "actor.loss_agg (and algorithm.advantage=drgrpo for dr_grpo)",
    "warmup_ratio": "actor.warmup_steps",
    "lr_scheduler_type": "actor.lr_schedule",
    "max_grad_norm": "actor.grad_clip",
    "gradient_checkpointing": "actor.activation_checkpointing",
    "per_device_train_batch_size": "actor.micro_batch_tokens_per_gpu (a token budget, not rows)",
    "gradient_accumulation_steps": "actor.mini_batch_prompts (prompts per optimizer step)",
    "bf16": "model.dtype=bfloat16 (auto: bfloat16 on GPUs)",
    "output_dir": "trainer.output_dir",
    "save_steps": "trainer.save_every",
    "eval_steps": "trainer.val_every",
    "use_vllm": "rollout.backend=vllm",
    "vllm_gpu_memory_utilization": "rollout.kv_cache_memory",
    "model_name_or_path": "model.path",
    "lora_r": "actor.lora_rank",
    "lora_target_modules": "actor.lora_targets",
    "rpo_alpha": "dpo.nll_coef",
    "num_train_epochs": "trainer.total_steps (steps, each data.prompts_per_step prompts)",
    "seed": "trainer.seed",
    "run_name": "trainer.run_name",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "weight_decay": "actor.weight_decay",
}

OPENRLHF = {
    "n_samples_per_prompt": "rollout.samples_per_prompt",
    "actor_learning_rate": "actor.lr",
    "critic_learning_rate": "critic.lr",
    "init_kl_coef": "actor.kl_loss_coef (or algorithm.kl_coef, the KL in the reward)",
    "generate_max_len": "rollout.max_new_tokens",
    "prompt_max_len": "data.max_prompt_tokens",
    "rollout_batch_size": "data.prompts_per_step",
    "advantage_estimator": "algorithm.advantage",
    "pretrain": "model.path",
    "reward_pretrain": "reward.model",
    "save_path": "trainer.output_dir",
}

PEERS = {"verl": VERL, "TRL": TRL, "OpenRLHF": OPENRLHF}


def rlflow_key(name: str) -> str | None:
    """What to say for a peer's config name: "verl's rollout.n is rollout.samples_per_prompt here",
    or None when no peer uses it."""
    parts = name.split(".")
    for start in range(len(parts)):
        tail = ".".join(parts[start:])
        for peer, names in PEERS.items():
            if tail in names:
                return f"{peer}'s {tail} is {names[tail]} here"
    return None
