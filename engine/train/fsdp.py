"""Training engine: a HF model under FSDP2 (a causal LM unless told; the critic trains a
token-classification model with one label through it), its optimizer and lr schedule,
micro-batched forward/backward.

Data parallelism: FSDP2 over the default process group (one rank when the caller made no
group): each rank holds a dim-0 shard of every weight and a shard of the batch; gradients are
SUM-reduced across ranks in float32. Losses divide by the global (all-rank) token or sequence
count, so the summed gradient equals the single-process gradient of the whole mini-batch,
whatever the number of ranks or micro-batches. Ranks run equally many forwards (FSDP2 gathers
weights in each): one with fewer micro-batches runs zero-loss idle ones.

Forward: with packing, a micro-batch's real tokens go end to end in one row, position ids
restarting at 0 per sequence and no attention mask; transformers reads the sequence boundaries
from the position ids. On CUDA the attention runs each sequence alone, through flash-attn's varlen
kernels when installed, else PyTorch's own (engine/train/varlen.py, padded rows unpadded the same
way); on the CPU, SDPA with a block-diagonal causal mask. With `sp` > 1 (Ulysses sequence
parallelism, engine/train/ulysses.py) groups of sp ranks take the same padded rows and each runs
1/sp of every row's tokens, FSDP2 still spanning all ranks; each rank's logprobs (and so its
loss) cover only its slice. With shared prompts (`shared_prompt_row`) a packed row holds each
distinct prompt once, followed by the responses of all rows that have it, under a mask that lets a
response see only its prompt and itself: the prompt's tokens are computed once for all its
samples, and every logprob and gradient is what separate sequences give. The lm_head runs a chunk
of tokens at a time, so full fp32 logits [tokens, vocab] never exist; under autograd each chunk is
recomputed in backward.

Invariants:
- `logprobs` of the response equals what the rollout reported, up to kernel noise;
- packed, padded and shared-prompt forwards give the same logprobs, entropies and gradients;
- micro-batches never exceed `micro_batch_tokens_per_gpu` tokens (real tokens when packing,
  rows x width when padded) unless one sequence alone does;
- a non-finite loss or gradient never reaches the weights: the step is skipped and counted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM
from transformers.utils import is_flash_attn_2_available

from rlflow.engine import algos, exact, progress
from rlflow.engine.checkpoint import load_shards
from rlflow.engine.tensors import consecutive_group, fused, to_device
from rlflow.engine.train import memory, ulysses, varlen
from rlflow.engine.train.batching import micro_batches
from rlflow.engine.train.lora import LoraConfig, add_adapters
from rlflow.engine.train.memory import LOGITS_CHUNK_TOKENS
from rlflow.engine.train.shared_prompts import pad_to_blocks, shared_prompt_mask, shared_prompt_row

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """Linear warmup to 1, then constant or cosine decay to 0 at `total`."""
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return fn


def all_reduce_sums(values: list[float]) -> list[float]:
    """Each of `values` summed over the default group's ranks, in one all-reduce (float64)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl reduces device tensors only
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_sum(value: float) -> float:
    return all_reduce_sums([value])[0]


def step_metrics(stats: dict[str, list]) -> dict[str, float]:
    """A step's metrics from its per-micro-batch values, floats or 0-dim device tensors, which are
    read here once the step's work is queued: the max of `*_max` keys, the mean of the rest."""
    values = {k: [float(x) for x in v] for k, v in stats.items()}
    return {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in values.items()}


def attn_implementation(device: torch.device, dtype: torch.dtype, share: bool = False) -> str:
    """Unpadded attention where a kernel exists for it (flash-attn's, else PyTorch's varlen on
    CUDA in half precision); otherwise SDPA, which runs a packed row with a block mask. Shared
    prompts (`shared_prompt_row`) need a mask of their own: flex attention on CUDA, SDPA elsewhere."""
    if share:
        return "flex_attention" if device.type == "cuda" else "sdpa"
    if device.type == "cuda" and dtype != torch.float32 and is_flash_attn_2_available():
        return "flash_attention_2"
    return varlen.NAME if varlen.available(device, dtype) else "sdpa"


def response_hidden(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    valid: torch.Tensor, pack: bool, share: bool = False) -> torch.Tensor:
    """Final hidden states [M, H] at the positions that predict the M valid response tokens, on
    the model's device.

    ids, mask, positions: [n, L], prompt left- and response right-padded; valid: [n, R] bool, the
    response mask; all on one device. Their indexing happens there, so host tensors cost the
    device no sync (data-dependent sizes would), and only what the model reads moves to it.
    """
    device = next(model.parameters()).device
    width = valid.shape[1]
    if share:
        tokens, pos, group, row, at = shared_prompt_row(ids, mask, positions, valid)
        flex = model.config._attn_implementation == "flex_attention"
        if flex:
            tokens, pos, group, row = pad_to_blocks(tokens, pos, group, row)
        out = model.base_model(input_ids=to_device(tokens[None], device), position_ids=to_device(pos[None], device),
                               attention_mask=shared_prompt_mask(to_device(group, device), to_device(row, device),
                                                                 flex),
                               use_cache=False)
        return out.last_hidden_state[0, to_device(at, device)]
    if not pack:
        out = model.base_model(input_ids=to_device(ids, device), attention_mask=to_device(mask, device),
                               position_ids=to_device(positions, device), use_cache=False,
                               **varlen.given(model, positions, mask, device))
        rows, cols = valid.nonzero(as_tuple=True)  # row-major, the order of valid[valid]
        at = rows * ids.shape[1] + ids.shape[1] - width - 1 + cols  # into the [n * L] flattened rows
        return out.last_hidden_state.flatten(0, 1)[to_device(at, device)]
    real = mask.bool()
    at = (real.flatten().cumsum(0) - 1).view(real.shape)[:, -width - 1:-1][valid]  # into the packed row
    packed = positions[real][None]
    out = model.base_model(input_ids=to_device(ids[real][None], device), position_ids=to_device(packed, device),
                           use_cache=False, **varlen.given(model, packed, None, device))
    return out.last_hidden_state[0, to_device(at, device)]


def scatter_valid(valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[n, R] of `values` [M] at the True places of `valid` [n, R] (row-major), 0 elsewhere, on
    `values`' device; differentiable, and free of device syncs for a host `valid`."""
    at = to_device(valid.flatten().nonzero().squeeze(1), values.device)
    return values.new_zeros(valid.numel()).index_put((at,), values).view(valid.shape)


@fused
def logits_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                 entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target [c], softmax entropy [c] or zeros) of logits [c, V] at `temperature`,
    in float32. On CUDA one compiled kernel chain, forward and backward: in eager the cast,
    scaling, logsumexp and entropy make a dozen fp32 passes over [c, V], most of an update step's
    time at a 150k vocabulary."""
    z = logits.float() / temperature
    logp = algos.token_logprobs(z, targets)
    return logp, (algos.entropy_from_logits(z) if entropy else torch.zeros_like(logp))


def chunked_token_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                        entropy: bool = True, chunk: int = LOGITS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target [M] and softmax entropy [M] (zeros unless `entropy`) of hidden [M, H]
    through `head`, in as few chunks of at most `chunk` tokens as fit, of sizes within one token of
    each other (a one-token last chunk would cost the compiled statistics another trace); under
    autograd a chunk's logits are recomputed in backward."""
    def stats(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits_stats(head(h), t, temperature, entropy)

    run = partial(checkpoint, stats, use_reentrant=False) if torch.is_grad_enabled() else stats
    # no tokens still runs the head (on none): its weight gets a (zero) gradient, as on other ranks
    n = max(1, -(-len(hidden) // chunk))
    parts = [run(h, t) for h, t in zip(hidden.tensor_split(n), targets.tensor_split(n))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class ResponseLM(nn.Module):
    """A HF causal LM behind one forward that returns response-token statistics. Under FSDP2 this
    is the root: its hooks unshard the embeddings, final norm and lm_head around the whole
    forward (the chunked lm_head included) and reduce their gradients.

    With an SP group (`sp_group`, set by the engine) it runs padded rows sequence-parallel
    (engine/train/ulysses.py): each rank predicts only the response tokens `response_mask` gives it."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm = lm
        self.sp_group: Any = None

    def response_mask(self, mask: torch.Tensor, width: int) -> torch.Tensor:
        """[n, R] bool: the response tokens of rows `mask` [n, L] whose logprobs this rank computes."""
        valid = mask[:, -width:].bool()
        return valid if self.sp_group is None else ulysses.owned(valid, mask.shape[1], self.sp_group)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                targets: torch.Tensor, temperature: float, pack: bool, entropy: bool,
                chunk: int, share: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sp_group is None:
            hidden = response_hidden(self.lm, ids, mask, positions, valid, pack, share)
        elif pack or share:
            raise ValueError("sequence parallelism runs padded rows, not packed ones")
        else:
            device = next(self.parameters()).device
            ids, mask, positions, valid = (x.to(device) for x in (ids, mask, positions, valid))
            hidden = ulysses.response_hidden(self.lm, ids, mask, positions, valid, self.sp_group)
        targets = to_device(targets, hidden.device)
        return chunked_token_stats(self.lm.get_output_embeddings(), hidden, targets, temperature, entropy, chunk)

    def idle(self) -> torch.Tensor:
        """A one-token forward whose loss is 0: it joins the other ranks' weight gathers and
        gradient reductions without moving the weights."""
        device = next(self.parameters()).device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)  # one prompt token, one response token
        valid = self.response_mask(torch.ones_like(ids), 1)
        logp, _ = self(ids, torch.ones_like(ids), torch.arange(2, device=device)[None], valid, ids[:, 1:][valid], 1.0,
                       False, False, LOGITS_CHUNK_TOKENS)
        return logp.sum() * 0.0


def forward_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     responses: torch.Tensor, temperature: float, pack: bool, entropy: bool = True,
                     chunk: int = LOGITS_CHUNK_TOKENS, share: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's forward: response logprobs and entropies [n, R] in float32 on the model's
    device, 0 where the response is padding (entropy 0 unless asked for). `model` is a ResponseLM
    (a TrainEngine's `root`) or a plain HF causal LM. Sequence-parallel, only this rank's tokens
    (`ResponseLM.response_mask`) are filled in. With `share`, rows with the same prompt compute it once
    (`shared_prompt_row`; the model must run the attention `attn_implementation` picks for it).
    ids/mask/positions: [n, P+R]; responses: [n, R]; all on one device, best the host's (see
    `response_hidden`)."""
    if not isinstance(model, ResponseLM) and isinstance(next(model.parameters()), DTensor):
        raise TypeError("an FSDP-sharded model runs forwards through its TrainEngine's `root`")
    policy = model if isinstance(model, ResponseLM) else ResponseLM(model)
    valid = policy.response_mask(mask, responses.shape[1])  # [n, R], where the inputs are (see response_hidden)
    logp, ent = policy(ids, mask, positions, valid, responses[valid], temperature or 1.0, pack, entropy, chunk, share)
    return scatter_valid(valid, logp), scatter_valid(valid, ent)


def in_step(model: Any, count: int) -> int:
    """How many forwards every rank runs when this one has `count`: FSDP2 gathers weights in
    each forward, so its ranks must run the same number (the max; the rest run the root's `idle`)."""
    if not isinstance(model, FSDPModule) or dist.get_world_size() == 1:
        return count
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([count], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def response_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                      responses: torch.Tensor, temperature: float, budget: int, with_entropy: bool = False,
                      pack: bool = False, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad response logprobs [N, R] (and entropy [N, R]) on the CPU, in token-budget micro-batches.

    Padded unless asked: a caller's budget may be sized for logits, and a packed row's SDPA mask
    grows with the square of the budget. With `group_size`, runs of that many rows share their
    prompt, computed once (`forward_logprobs`' `share`)."""
    logps = torch.zeros(responses.shape)
    ents = torch.zeros(responses.shape)
    share = group_size > 0
    chunks = micro_batches(mask, budget, pack, group_size, mask.shape[1] - responses.shape[1] if share else 0)
    with torch.no_grad():
        for rows in chunks:
            logp, ent = forward_logprobs(model, ids[rows], mask[rows], positions[rows], responses[rows],
                                         temperature, pack, with_entropy, share=share)
            logps[rows], ents[rows] = logp.cpu(), ent.cpu()
            progress.tick()
        for _ in range(in_step(model, len(chunks)) - len(chunks)):
            model.idle()
    group = getattr(model, "sp_group", None)
    if group is not None:  # each token came from one rank of the group: the sum is the whole rows
        logps, ents = ulysses.sum_over(logps, group), ulysses.sum_over(ents, group)
    return logps, (ents if with_entropy else None)


class OptimizerStep:
    """An optimizer step under way (`TrainEngine.step`): each micro-batch's loss goes to `backward`
    in turn; `out` holds the step's numbers (grad_norm, lr, loss, skipped steps) once it is over."""

    def __init__(self, engine: TrainEngine, count: int) -> None:
        self.engine, self.count, self.done = engine, count, 0
        self.total = torch.zeros((), device=engine.device)
        self.out: dict[str, float] = {}

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch's loss (gradients accumulate over the step's micro-batches)."""
        loss.backward()
        self.total += loss.detach()
        self.done += 1
        progress.tick()
        # the next one's forward: whole weights kept, and gradients unreduced unless it is the last
        self.engine.hold_gathered(forward=True, backward=self.done < self.count - 1)


def process_group(device: torch.device) -> None:
    """A one-rank default group when the caller made none (one process), so FSDP2 always runs."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


class TrainEngine:
    """A HF model under FSDP2 over the default process group's W ranks: every decoder layer its own
    unit, the embeddings, final norm and head in the root (`root`, a ResponseLM for the actor). Master
    weights and AdamW state are float32 shards; forward and backward run in `dtype`; gradients
    are reduced in float32 and summed (not averaged) over ranks, because losses already divide by
    all-rank counts.

    `model` is the HF module (its parameters are DTensor shards); run forwards through `root`,
    whose `idle()` is the zero-loss forward of a rank that ran out of micro-batches."""

    def __init__(self, model_path: str, lr: float, weight_decay: float, grad_clip: float,
                 warmup_steps: int, total_steps: int, schedule: str, dtype: str, device: str,
                 root: Any = None, checkpointing: bool | None = False, model_cls: Any = AutoModelForCausalLM,
                 sp: int = 1, compile_layers: bool = False, share_prompts: bool = False,
                 lora: LoraConfig | None = None, seed: int = 0, micro_tokens: int = 0, share: int = 1,
                 deterministic: bool = False, **model_kwargs: Any) -> None:
        """`model_cls.from_pretrained(model_path, **model_kwargs)` is the trained module; `root(module)`
        (default `ResponseLM`) the FSDP2 root every forward runs through; `checkpointing` recomputes each
        decoder layer's activations in backward instead of keeping them; `micro_tokens` is a
        micro-batch's token budget; with 0 for it, or None for `checkpointing`, `fit` plans them from
        the device's free memory, of which this trainer takes a `share`-th; `sp` > 1 runs the ResponseLM's
        forwards sequence-parallel over groups of `sp` consecutive ranks, which must pass the same rows;
        `share_prompts` picks the attention that shared-prompt forwards need (`attn_implementation`);
        `lora` trains PEFT adapters (engine/train/lora.py, drawn from `seed`) on a frozen base kept in `dtype`: nothing
        updates it, so it needs no float32 master copy, and the optimizer holds the adapters' state only;
        `deterministic` computes each token's numbers alone (engine/exact.py), as the native rollout
        engine does in that mode."""
        root = root or ResponseLM
        self.device = torch.device(device)
        process_group(self.device)
        if sp > 1 and root is not ResponseLM:
            raise ValueError("sequence parallelism runs only the ResponseLM root's forwards")
        sp_group = consecutive_group(sp) if sp > 1 else None  # collective: before any other group
        attn = ulysses.NAME if sp > 1 else attn_implementation(self.device, DTYPES[dtype], share_prompts)
        attn = exact.NAME if deterministic else attn
        self.model: Any = model_cls.from_pretrained(model_path, dtype=DTYPES[dtype] if lora else torch.float32,
                                                    attn_implementation=attn, **model_kwargs)
        if deterministic:
            exact.per_row(self.model)
        if lora is not None:
            add_adapters(self.model, lora, seed)
        self.lora = lora
        if sp > 1:
            ulysses.check_heads(self.model.config, sp)
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to oddly
        self.model.train()
        self.planned: memory.Plan | None = None
        self._wanted = (micro_tokens, checkpointing, share)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile_layers:  # each decoder layer through inductor (its norms, RoPE and gating fused); token
            for layer in self.model.model.layers:  # counts turn symbolic once they vary, feature sizes stay fixed
                layer.compile()
        self.root: Any = root(self.model)
        if sp > 1:
            self.root.sp_group = sp_group
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        precision = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        fully_shard(self.root, mesh=mesh, mp_policy=precision)
        for unit in self.root.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        self.grad_clip = grad_clip
        trained = [p for p in self.root.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup_steps, total_steps, schedule))
        self.steps = 0  # optimizer steps taken here, skipped ones included
        self.skipped_steps = 0
        self.consecutive_skips = 0  # reset by every finite step
        # optimizer tensor (a view of its DTensor's local shard, kept: `to_local` makes a new
        # object per call) -> its pinned CPU copy
        self._host: dict[torch.Tensor, torch.Tensor] = {}
        self._offloaded = False

    def fit(self, longest: int) -> memory.Plan:
        """The micro-batch budget and checkpointing, planned at the first call (engine/train/memory.py)
        where the constructor left them open, and logged; rows of up to `longest` tokens. On the
        CPU, or with both given on a GPU, they are the given ones (and on a GPU a plan that says they will
        not fit is logged as a warning). Collective with more ranks: all plan from the least free
        memory, so they agree."""
        if self.planned is not None:
            return self.planned
        tokens, checkpointing, share = self._wanted
        model = memory.Model.of(self.model.config, lora=self.lora is not None,
                                head=1 if not isinstance(self.root, ResponseLM) else 0)
        if self.device.type != "cuda":  # the config resolved auto to the CPU's settings (engine/config.py)
            if not tokens:
                raise ValueError("on the CPU a TrainEngine takes its micro-batch budget as given (micro_tokens > 0)")
            self.planned = memory.Plan(tokens, bool(checkpointing), 0.0, 0.0)
            return self.planned
        free = torch.tensor([memory.free_bytes(self.device)], dtype=torch.float64, device=self.device)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        keep = memory.headroom(self.device)
        mine = (int(free.item()) - keep) // share + keep  # trainers sharing the device split what is free
        states = bool(self.optimizer.state)
        try:
            self.planned = memory.plan(model, self, mine, keep, longest, tokens, checkpointing, states)
        except memory.DoesNotFit as e:
            if not tokens or checkpointing is None:
                raise
            log.warning("actor.micro_batch_tokens_per_gpu=%d with activation checkpointing %s may run out of "
                        "memory: %s", tokens, "on" if checkpointing else "off", e)
            step = memory.step_bytes(model, self, tokens, checkpointing, states)
            self.planned = memory.Plan(tokens, checkpointing, mine / memory.GIB, step / memory.GIB)
        if self.planned.checkpointing and not checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log.warning("trainer: %s", self.planned.line())
        return self.planned

    @property
    def micro_tokens(self) -> int:
        """A micro-batch's token budget, once `fit` planned it."""
        if self.planned is None:
            raise RuntimeError("TrainEngine.fit(longest) plans the micro-batches before the first forward")
        return self.planned.tokens

    @contextmanager
    def step(self, micro_batches: int) -> Iterator[OptimizerStep]:
        """One optimizer step over a mini-batch of `micro_batches` micro-batches on this rank: the
        block computes each one's loss and hands it to `OptimizerStep.backward`, in turn; leaving it runs
        the idle micro-batches of a rank with fewer than another, then clips and updates (the
        step's numbers in `OptimizerStep.out`). The host reads no device value before the clip, so it
        queues micro-batches ahead of the device. An error in the block leaves the weights as they were."""
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        step = OptimizerStep(self, in_step(self.root, micro_batches))
        try:
            self.hold_gathered(forward=True, backward=step.count > 1)
            yield step
            while step.done < step.count:
                step.backward(self.root.idle())
        finally:
            self.hold_gathered(forward=False, backward=False)
        params = [p for p in self.root.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        loss_sum = float(step.total)
        lr = float(self.scheduler.get_last_lr()[0])
        if not (math.isfinite(grad_norm) and math.isfinite(loss_sum)):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.consecutive_skips = 0
            self.optimizer.step()
        self.scheduler.step()
        step.out = {"grad_norm": grad_norm, "lr": lr, "loss": loss_sum, "skipped_steps": self.skipped_steps,
                    "consecutive_skips": self.consecutive_skips}

    def hold_gathered(self, forward: bool, backward: bool) -> None:
        """On one rank a shard is the whole weight, so within a step FSDP2 may keep the weights
        gathered in the compute dtype after forward (`forward`) and, between micro-batches, after
        backward too, the gradients then accumulating unreduced in float32 (`backward`).
        Otherwise every micro-batch gathers each layer twice and reduces it once: host work that
        bounds small models' updates (0.5B: 0.73 -> 0.59 s a step on an H200). Outside steps
        (no-grad forwards) both are off. With more ranks whole weights and gradients would cost
        the memory that sharding saves, so they stay sharded."""
        if dist.get_world_size() > 1:
            return
        self.root.set_reshard_after_forward(not forward)
        self.root.set_reshard_after_backward(not backward)
        self.root.set_requires_gradient_sync(not backward)

    def offload(self) -> None:
        """Free this rank's gradients and move its optimizer state to pinned CPU memory (same
        tensors: their device storage is released and later refilled), for generation's memory."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type != "cuda" or self._offloaded:
            return
        if not self._host:  # pinned buffers are made once the state exists (after a step), then reused
            self._host = {t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._optimizer_tensors()}
        for t, host in self._host.items():
            host.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        for t in self._host:
            t.untyped_storage().resize_(0)
        self._offloaded = True

    def onload(self) -> None:
        """Bring the optimizer state back after `offload` (a no-op otherwise)."""
        if not self._offloaded:
            return
        for t, host in self._host.items():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(host, non_blocking=True)
        self._offloaded = False

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """AdamW's moment shards (local tensors of DTensors), not its scalar step counts."""
        out = []
        for state in self.optimizer.state.values():
            for v in state.values():
                local = v.to_local() if isinstance(v, DTensor) else v
                if isinstance(local, torch.Tensor) and local.dim() and local.is_cuda:
                    out.append(local)
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model with HF names on the CPU, on rank 0 (empty elsewhere); every rank calls."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Full HF-named tensors (every rank passes them) into this rank's shards."""
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def state_dict(self) -> dict:
        """Optimizer (this rank's shards, for torch.distributed.checkpoint), schedule and counters."""
        self.onload()  # an offloaded optimizer state has no device storage to read
        return {"optimizer": get_optimizer_state_dict(self.root, self.optimizer),
                "scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps}

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained parameters, whole, on the CPU of every rank: the adapters with LoRA (its
        `named_parameters` names), else the whole model (`full_state_dict`: rank 0 only). Every rank calls."""
        if self.lora is None:
            return self.full_state_dict()
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()
                for name, p in self.model.named_parameters() if p.requires_grad}

    def load(self, weights: dict[str, torch.Tensor], shards: Path) -> None:
        """A checkpoint's trained weights (`trained_state_dict`'s, on every rank) and this rank's
        optimizer shards (a torch distributed checkpoint, written at any world size); every rank calls."""
        self.load_full_state_dict(weights)
        state = self.state_dict()
        load_shards(state, shards)
        self.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        self.onload()
        set_optimizer_state_dict(self.root, self.optimizer, state["optimizer"])
        self._host = {}  # the state tensors were replaced: `offload` pairs the new ones with buffers
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
