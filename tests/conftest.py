"""Shared fixtures: a real HF model directory and real parquet data, built locally."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlflow.engine.data import task


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A ~0.8M-parameter Qwen2 with the char tokenizer, saved as a HF directory."""
    return task.build_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def trainer_logprobs(model, prompts: list[list[int]], n: int, completions: list, pad_id: int,
                     temperature: float) -> torch.Tensor:
    """What the trainer recomputes for rollout `completions` (n per prompt, in order): [N, R]."""
    from rlflow.engine.tensors import left_pad
    from rlflow.engine.train.fsdp import response_logprobs

    pids, pmask = left_pad([p for p in prompts for _ in range(n)], pad_id)
    width = max(len(c.token_ids) for c in completions)
    rids = torch.tensor([c.token_ids + [pad_id] * (width - len(c.token_ids)) for c in completions])
    rmask = torch.tensor([[1] * len(c.token_ids) + [0] * (width - len(c.token_ids)) for c in completions])
    mask = torch.cat([pmask, rmask], 1)
    logp, _ = response_logprobs(model, torch.cat([pids, rids], 1), mask, (mask.cumsum(1) - 1).clamp(min=0),
                                rids, temperature, 4096)
    return logp


def perturbed(hf, scale: float = 0.2, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Another policy of the same shapes: `hf`'s weights plus noise."""
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * p.detach().std() * torch.randn(p.shape, generator=g))
            for n, p in hf.named_parameters()]


def leave_group() -> None:
    """End a spawned test worker once its results are saved: a barrier, so no rank tears its gloo
    pairs down while a peer still reads from them, then an exit without the interpreter's teardown.
    Either one was seen to abort a rank after its work was done ("terminate called without an
    active exception"), which fails the test on timing alone."""
    import os

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> dict[str, str]:
    """Unpadded problems (`7+45=` -> `52`): prompts and answers of mixed lengths exercise the padding paths."""
    return task.build_data(tmp_path_factory.mktemp("data"), n_train=512, n_val=64, seed=0, pad=False)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2ForSequenceClassification (one output) with the char tokenizer, as a HF directory."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    out = tmp_path_factory.mktemp("reward_model") / "rm"
    tok = task.build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def plant(cache: Path, repo: str, files: Path, kind: str = "model", commit: str = "a" * 40) -> Path:
    """A Hugging Face cache holding `files` (a folder) as repo `repo`'s main revision, laid out as
    huggingface_hub lays out what it downloads (refs/main naming the commit, snapshots/<commit>/):
    what a user's cache holds once a download has run. Returns the snapshot directory."""
    org, name = repo.split("/")
    root = cache / f"{kind}s--{org}--{name}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(files, root / "snapshots" / commit, dirs_exist_ok=True)
    return root / "snapshots" / commit


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, model_dir) -> tuple[Path, str]:
    """(a HF hub cache directory, a model id in it): the tiny model as if downloaded from the Hub."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    plant(cache, "rlflow-test/tiny-qwen2", model_dir)
    return cache, "rlflow-test/tiny-qwen2"
