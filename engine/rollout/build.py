"""`build_rollout`: the rollout engine that `rollout.backend` names (engine/rollout/base.py says
what every backend promises). The backends are imported only when picked: vLLM is an extra.
"""

from __future__ import annotations

from typing import Any

import torch

from rlflow.engine.rollout import fp8
from rlflow.engine.rollout.base import HFRollout, RolloutEngine


def weights_dtype(dtype: str) -> torch.dtype:
    """The dtype weights travel in to a rollout of `rollout.dtype`: an fp8 engine takes bf16 and
    quantises on arrival (engine/rollout/fp8.py)."""
    return fp8.WIRE if dtype == "fp8" else getattr(torch, dtype)


def build_rollout(backend: str, tokenizer: Any, model_dir: str, dtype: str, device: str, max_len: int,
                  max_slots: int, kv_cache_memory: float, tp: Any = None, deterministic: bool = False) -> RolloutEngine:
    """A rollout engine with its own copy of the model in `model_dir`, in `dtype` on `device`,
    kept in sync with the trainer through `load_weights` (or, for native, engine/reshard.py),
    running up to `max_slots` sequences at once (native: fewer if its KV cache would overflow
    `kv_cache_memory`, a fraction of free GPU memory). Native only: `tp` (an
    `engine.rollout.model.TP`) holds this rank's tensor-parallel piece. `dtype` fp8: native on a
    CUDA GPU of compute capability 8.9+ only (a RuntimeError elsewhere). `deterministic`: native on
    the CPU only, each token computed alone (engine/exact.py)."""
    if deterministic and (backend != "native" or torch.device(device).type != "cpu"):
        raise RuntimeError(f"deterministic mode runs the native backend on the CPU; got {backend} on {device}")
    if dtype == "fp8" and backend != "native":
        raise RuntimeError(f"rollout.dtype=fp8 needs rollout.backend=native, got {backend}")
    if dtype == "fp8":
        fp8.check_device(device)
    torch_dtype = fp8.FP8 if dtype == "fp8" else getattr(torch, dtype)
    if backend == "hf":
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        return checked(HFRollout(model.to(device), tokenizer))
    if backend == "native":
        from rlflow.engine.rollout.model import NativeCausalLM
        from rlflow.engine.rollout.native import NativeRollout

        model = NativeCausalLM.from_pretrained(model_dir, torch_dtype, device, **({"tp": tp} if tp else {}))
        if deterministic:
            model.exact()
        return checked(NativeRollout(model, tokenizer,
                                     max_slots=max_slots, max_len=max_len, memory_fraction=kv_cache_memory))
    if backend == "vllm":
        from rlflow.engine.rollout.vllm import VLLMRollout

        return checked(VLLMRollout(model_dir, tokenizer, max_len, torch_dtype))
    raise ValueError(f"unknown rollout.backend '{backend}'")


def checked(engine: Any) -> RolloutEngine:
    """`engine`, once it has what it declares (engine/rollout/base.py): a `serve` where it streams;
    so a caller asks the engine, not its class."""
    if engine.streams and not callable(getattr(engine, "serve", None)):
        raise TypeError(f"{type(engine).__name__} declares `streams` but has no `serve`")
    return engine
