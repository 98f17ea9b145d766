"""The reference stage: the frozen initial policy, scoring responses for the KL term.

Verb: `logprobs(batch) -> batch` filling `ref_logprobs` [N, R].
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rlflow.engine.batch import Batch
from rlflow.engine.config import Config, packed
from rlflow.engine.tensors import peak_memory
from rlflow.engine.train import memory
from rlflow.engine.train.fsdp import DTYPES, attn_implementation, response_logprobs


class Reference:
    def __init__(self, cfg: Config, model_path: str, device: str = "cpu") -> None:
        self.cfg = cfg
        dtype = DTYPES[cfg.model.dtype]
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn_implementation(torch.device(device), dtype))
        self.model.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
        self.model.eval().requires_grad_(False)

    def logprobs(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        ids, mask, pos = batch.sequences()
        batch.ref_logprobs, _ = response_logprobs(
            self.model, ids, mask, pos, batch.response_ids, self.cfg.rollout.temperature,
            memory.forward_tokens(self.cfg), pack=packed(self.cfg))
        batch.timing["ref"] = time.perf_counter() - start
        peak_memory("ref", batch.metrics)
        return batch
