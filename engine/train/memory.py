"""How much a training step may take on a GPU, and how the trainer fits its micro-batches into it.

A step allocates, beyond what the trainer keeps between steps (weights, optimizer state):
gradients, the weights gathered in the compute dtype, the lm_head's logits of one chunk, and each
micro-batch's activations, which grow with its tokens. `plan` reads the device's free memory once
(what other processes and the rollout engine hold is already gone from it), takes what the step
needs besides activations, and gives the rest to a micro-batch's tokens: the largest budget,
without recomputing decoder layers where that still holds the longest row with room to spare,
else with activation checkpointing; a longest row that fits neither way is refused with what to
change.

The per-token costs are counts of what a decoder layer's backward keeps, in bytes: an upper
bound for eager layers (1.5B: 3.6 MB a token counted, 3.0 MB measured by `bench/train_memory.py`
on an H100, docs/benchmarks.md). Compiled layers keep less; the plan does not count on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from rlflow.engine.config import estimator_of, longest_row, switch

GIB = 2**30
MOST_TOKENS = 32768  # a larger micro-batch runs no faster: the matmuls are already full
LEAST_UNCHECKPOINTED = 8192  # below this many tokens a micro-batch recomputes layers instead
LOGITS_CHUNK_TOKENS = 1024  # lm_head rows at a time: ~0.6 GB of fp32 logits at a 152k vocab
NO_GRAD_TOKENS = 16384  # a no-grad forward's budget on auto: only one layer's activations live at a time
LOGITS_BYTES = 18  # per logit of a chunk: bf16 logits, float32 scaled copy, log-softmax, softmax, gradient


@dataclass(frozen=True)
class Model:
    """The sizes a step's memory depends on, from a HF config."""
    layers: int
    hidden: int
    intermediate: int
    q_width: int  # heads x head_dim
    kv_width: int
    vocab: int  # the head's outputs (1 for a value head)
    lora: bool

    @classmethod
    def of(cls, config: Any, lora: bool = False, head: int = 0) -> Model:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                   head or config.vocab_size, lora)

    def layer_bytes(self) -> int:
        """What one decoder layer's backward keeps per token, in a 2-byte compute dtype: each norm's
        float32 input and output, the q/k/v/o and MLP inputs, RoPE's and attention's q, k, v and
        output, and the MLP's gate, up, activation and product; with LoRA each adapted linear's
        input again, in float32."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        out = 2 * (14 * h + 4 * q + 4 * kv + 4 * i)
        if self.lora:
            out += 4 * (6 * h + i)
        return out

    def token_bytes(self, checkpointing: bool) -> int:
        """Activation bytes per token of a micro-batch: every layer's, or with checkpointing each
        layer's input and one layer recomputed (with its gradients) at a time."""
        if checkpointing:
            return self.layers * 2 * self.hidden + 2 * self.layer_bytes()
        return self.layers * self.layer_bytes()


@dataclass(frozen=True)
class Plan:
    tokens: int  # real tokens of one micro-batch at most
    checkpointing: bool
    free_gib: float  # what the device had free when planned
    step_gib: float  # what a step of `tokens` takes, estimated

    def line(self) -> str:
        return (f"micro-batches of {self.tokens} tokens, activation checkpointing "
                f"{'on' if self.checkpointing else 'off'}: a step takes about {self.step_gib:.1f} GiB "
                f"of the {self.free_gib:.1f} GiB free")


def step_bytes(model: Model, engine: Any, tokens: int, checkpointing: bool, states_allocated: bool) -> int:
    """What one optimizer step over micro-batches of `tokens` allocates beyond what the trainer holds
    between steps: the activations, the head's chunk of logits, the gradients of what trains
    (float32) and the weights gathered in the compute dtype (all of them on one rank, which keeps
    them gathered through a step; else two units at a time); the optimizer's state too before the
    first step has made it."""
    params = list(engine.root.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    trained = sum(shard.numel() for p, shard in zip(params, local) if p.requires_grad)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    whole = sum(p.numel() for p in params)
    gathered = 2 * (whole if world == 1 else 2 * max(_unit_sizes(engine.root)))
    out = tokens * model.token_bytes(checkpointing) + LOGITS_CHUNK_TOKENS * model.vocab * LOGITS_BYTES
    out += 4 * trained + gathered
    if not states_allocated:
        out += 8 * trained  # AdamW's two moments, float32
    return out


def _unit_sizes(root: torch.nn.Module) -> list[int]:
    """Parameter counts of each FSDP unit's own parameters (the decoder layers, then the root)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    inner = {id(p) for m in units if m is not root for p in m.parameters()}
    sizes = [sum(p.numel() for p in m.parameters()) for m in units if m is not root]
    return [*sizes, sum(p.numel() for p in root.parameters() if id(p) not in inner)]


def free_bytes(device: torch.device) -> int:
    """The device's free memory plus what this process's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def headroom(device: torch.device) -> int:
    """Kept back from a plan: the allocator's fragmentation, cuBLAS and NCCL workspaces, kernels'
    scratch: 6% of the device, at least 2 GiB."""
    return max(2 * GIB, int(0.06 * torch.cuda.get_device_properties(device).total_memory))


class DoesNotFit(RuntimeError):
    pass


def plan(model: Model, engine: Any, free: int, keep: int, longest: int, tokens: int = 0,
         checkpointing: bool | None = None, states_allocated: bool = False) -> Plan:
    """The micro-batch budget and checkpointing of a step with `free` bytes free, `keep` of them
    kept back: the given `tokens` (> 0) and `checkpointing` (not None) where set, the rest chosen.
    Layers kept whole (no recomputation) where the budget then holds the longest row and
    LEAST_UNCHECKPOINTED tokens; at most MOST_TOKENS. DoesNotFit when not even the longest row fits
    with checkpointing (or the given setting does not fit)."""
    for ckpt in [checkpointing] if checkpointing is not None else [False, True]:
        fit = max(0, free - keep - step_bytes(model, engine, 0, ckpt, states_allocated)) // model.token_bytes(ckpt)
        if tokens:
            want, least = tokens, tokens
        else:
            want = max(longest, min(fit, max(MOST_TOKENS, longest)) // 256 * 256)
            least = longest if ckpt or checkpointing is not None else max(longest, LEAST_UNCHECKPOINTED)
        if fit >= least:
            return Plan(want, ckpt, free / GIB, step_bytes(model, engine, want, ckpt, states_allocated) / GIB)
    need = step_bytes(model, engine, tokens or longest, True if checkpointing is None else checkpointing,
                      states_allocated)
    raise DoesNotFit(
        f"a training step of {tokens or longest} tokens a micro-batch needs about {need / GIB:.1f} GiB and "
        f"{(free - keep) / GIB:.1f} GiB are free ({keep / GIB:.1f} GiB kept back): shorten the longest row "
        "(data.max_prompt_tokens + rollout.max_new_tokens), give training the rollout's memory "
        "(rollout.free_cache=true, a smaller rollout.kv_cache_memory), train adapters (actor.lora_rank), "
        "or spread the weights over more GPUs (placement.workers)")


def settings(cfg: Any) -> dict[str, Any]:
    """A trainer's (policy's or critic's) TrainEngine arguments of the config: the micro-batch
    budget (0: planned), checkpointing (None: planned), and how many trainers split the device's
    free memory (two where the critic shares the policy's GPUs)."""
    a = cfg.actor
    critic_beside = estimator_of(cfg.algorithm.advantage).critic and "critic" not in cfg.placement.own_pool
    return dict(micro_tokens=max(0, a.micro_batch_tokens_per_gpu), checkpointing=switch(a.activation_checkpointing),
                share=2 if critic_beside else 1)


def forward_tokens(cfg: Any) -> int:
    """A no-grad forward's token budget (the reference, a reward model): the configured one, or on
    auto the longest row and at least NO_GRAD_TOKENS; its activations live one layer at a time."""
    return cfg.actor.micro_batch_tokens_per_gpu if cfg.actor.micro_batch_tokens_per_gpu > 0 else \
        max(longest_row(cfg), NO_GRAD_TOKENS)
