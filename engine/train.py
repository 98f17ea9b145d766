"""Training engine: a causal LM, its optimizer and lr schedule, micro-batched forward/backward.

Data parallelism: each rank holds the full model and a shard of the batch; gradients are
SUM-reduced across ranks. Losses divide by the global (all-rank) token or sequence count, so
the summed gradient equals the single-process gradient of the whole mini-batch, whatever the
number of ranks or micro-batches.

Invariants:
- `logprobs` of the response equals what the rollout reported, up to kernel noise;
- micro-batches never exceed `micro_batch_tokens_per_gpu` padded tokens;
- a non-finite loss or gradient never reaches the weights: the step is skipped and counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from engine import algos

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


def micro_batches(rows: int, width: int, budget: int) -> list[slice]:
    """Consecutive row ranges of padded size (rows x width) within `budget` tokens (>= 1 row)."""
    per = max(1, budget // width)
    return [slice(i, min(i + per, rows)) for i in range(0, rows, per)]


def all_reduce_sum(value: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl reduces device tensors only
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def response_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                    positions: torch.Tensor, response_len: int) -> torch.Tensor:
    """Float32 logits that predict each response token: [n, R, V]."""
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                position_ids=positions.to(device), use_cache=False)
    return out.logits[:, -response_len - 1:-1].float()


def response_logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                      positions: torch.Tensor, responses: torch.Tensor, temperature: float,
                      budget: int, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad response logprobs [N, R] (and entropy [N, R]) in token-budget micro-batches."""
    logps, ents = [], []
    with torch.no_grad():
        for rows in micro_batches(ids.shape[0], ids.shape[1], budget):
            logits = response_logits(model, ids[rows], mask[rows], positions[rows], responses.shape[1])
            logits = logits / (temperature or 1.0)
            logps.append(algos.token_logprobs(logits, responses[rows].to(logits.device)).cpu())
            if with_entropy:
                ents.append(algos.entropy_from_logits(logits).cpu())
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


class TrainEngine:
    def __init__(self, model_path: str, lr: float, weight_decay: float, grad_clip: float,
                 warmup_steps: int, total_steps: int, schedule: str, dtype: str, device: str) -> None:
        self.device = torch.device(device)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers types .to oddly
        self.model.train()
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                           fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup_steps, total_steps, schedule))
        self.skipped_steps = 0
        self.consecutive_skips = 0  # reset by every finite step

    def step(self, losses: Callable[[], list[Callable[[], torch.Tensor]]]) -> dict[str, float]:
        """One optimizer step: backward every micro-batch loss, all-reduce, clip, update."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro_loss in losses():
            loss = micro_loss()
            loss.backward()
            total += float(loss.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        if dist.is_available() and dist.is_initialized():
            for p in params:
                dist.all_reduce(p.grad)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        lr = float(self.scheduler.get_last_lr()[0])
        if not (math.isfinite(grad_norm) and math.isfinite(total)):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.consecutive_skips = 0
            self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "loss": total, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
