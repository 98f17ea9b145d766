"""A learned reward: a HF sequence-classification model (num_labels=1) scoring whole texts.

The reward stage hands it `prompt + response` texts (the templated prompt, then the decoded
response) and mixes its scores with the rule reward. The model keeps its own tokenizer, so it
need not share the policy's vocabulary.

Invariants:
- no gradient and eval mode: the same texts always get the same scores, whatever the batch
  (rows are left-padded with explicit position ids, so padding does not shift a score);
- texts are never truncated: one longer than the model's context fails loudly in the forward;
- a model whose head has more than one output is refused at load time, naming the directory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlflow.engine import hub
from rlflow.engine.tensors import left_pad
from rlflow.engine.train.batching import micro_batches
from rlflow.engine.train.fsdp import DTYPES


class RewardModel:
    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", budget_tokens: int = 4096) -> None:
        path = hub.local(path)  # a Hub snapshot another node fetched: the same commit, here
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype])
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path} has num_labels={self.model.config.num_labels}; "
                             "a reward model scores with one output (num_labels=1)")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else pad
        self.model.config.pad_token_id = self.pad_id  # the head reads the last non-pad token
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.budget = torch.device(device), budget_tokens

    def score(self, texts: list[str]) -> torch.Tensor:
        """One float32 score per text [N], on the CPU."""
        ids, mask = left_pad([self.tokenizer(t)["input_ids"] for t in texts], self.pad_id)  # [N, L]
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = torch.zeros(len(texts))
        with torch.no_grad():
            for rows in micro_batches(mask, self.budget, pack=False):
                logits = self.model(input_ids=ids[rows].to(self.device), attention_mask=mask[rows].to(self.device),
                                    position_ids=positions[rows].to(self.device)).logits  # [n, 1]
                out[rows] = logits[:, 0].float().cpu()
        return out
