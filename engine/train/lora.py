"""LoRA on the trained policy: PEFT's adapters injected into the HF model, its base frozen.

`add_adapters` puts a `peft` LoRA layer on every targeted linear of a HF causal LM in place: the
model keeps its class and its module paths, a target's weight moves to `<module>.base_layer.weight`
and its adapters are `<module>.lora_A.default.weight` [r, in] and `<module>.lora_B.default.weight`
[out, r] (B starts at zero, so the adapted model starts as the base). Only adapters require grad.

Invariants:
- the base weights are never written: merged weights (`merged`) are computed beside them, so a
  base stays bit-identical however many syncs and exports happen (merge-and-unmerge would drift it);
- merged = base + (B @ A) * (alpha / r), computed in float32 (`peft`'s own merge computes the same
  expression) a block of rows at a time, and stored in the base's dtype;
- `adapters_off` runs the model as its base (the reference policy): no second copy of the weights;
- a push to a rollout pool of its own sends the adapters alone; its `Merger` merges them into the
  engine beside a base copy of its own, the same way `merged` does;
- an adapter directory (`save_adapter`) is what `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # in checkpoints and exports: the PEFT adapter directory


def lora_config(rank: int, alpha: int, targets: list[str]) -> LoraConfig:
    """PEFT's config of `actor.lora_*`: `targets` are module names, or ["all-linear"] for every
    linear of the decoder (not the lm_head)."""
    modules: str | list[str] = "all-linear" if targets == ["all-linear"] else targets
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, bias="none")


def add_adapters(model: Any, config: LoraConfig, seed: int = 0) -> Any:
    """`model` with LoRA layers on its targets, in float32 whatever the base's dtype, the rest frozen.
    Their random initial weights are drawn from `seed`: the same on every rank and in every run of
    a seed, so a rerun (or a resume) repeats it. A target that matches nothing, or a rank above a
    target's width, is a ValueError naming it."""
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays where it was
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model ..."
        raise ValueError(f"actor.lora_targets={config.target_modules} matches no module of the model: {e}") from None
    layers = dict(adapted(model))
    for name, layer in layers.items():
        base = layer.get_base_layer()
        if config.r > min(base.in_features, base.out_features):
            raise ValueError(f"actor.lora_rank={config.r} is larger than {name} "
                             f"({base.in_features} -> {base.out_features}); a rank above a layer's width adds nothing")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers.values():
        for ab in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            ab.weight.data = ab.weight.data.float()  # the trained adapters keep float32 master weights
            ab.weight.requires_grad_(True)
    return model


def adapted(model: Any) -> Iterator[tuple[str, Any]]:
    """(module path, peft LoRA layer) of every adapted module."""
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            yield name, m


def has_adapters(model: Any) -> bool:
    return next(adapted(model), None) is not None


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Within the block the model is its base: the reference policy of a LoRA run.

    It sets the flag peft's LoRA forward reads (`_disable_adapters`), not `enable_adapters`, which
    also turns the adapters' requires_grad off and on: FSDP2 fixes each unit's gradient dtypes from
    its trainable parameters at the first forward, and when that is the reference's, float32
    adapters would get bf16 gradients and the first backward fails (tests/stages/test_lora.py)."""
    layers = [m for _, m in adapted(model)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def hf_name(name: str) -> str | None:
    """The HF name a parameter of an adapted model has in the merged model; None for an adapter."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def merged(model: Any, full: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, merged full tensor) of every weight of the merged model, in `named_parameters`
    order; `full(p)` is a parameter's whole tensor (an FSDP2 shard all-gathered: every rank must
    iterate in step). A target's weight is its base plus its adapters' product."""
    scales = {f"{name}.base_layer.weight": (layer, layer.scaling[ADAPTER]) for name, layer in adapted(model)}
    for name, p in model.named_parameters():
        out = hf_name(name)
        if out is None:
            continue
        tensor = full(p)
        if name in scales:
            layer, scale = scales[name]
            tensor = merge(tensor, full(layer.lora_A[ADAPTER].weight), full(layer.lora_B[ADAPTER].weight), scale)
        yield out, tensor


MERGE_BLOCK = 1 << 24  # elements of a weight merged at a time: 64 MB of float32 temporaries


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """base [out, in] + (b [out, r] @ a [r, in]) * scale, in float32, returned in the base's dtype.
    Rows a block at a time: a 7B MLP weight in float32 whole would be three ~270 MB temporaries on a
    device that the trainer and the rollout engine already fill."""
    out = torch.empty_like(base)
    a32 = a.float()
    rows = max(1, MERGE_BLOCK // base.shape[1])
    for lo in range(0, base.shape[0], rows):
        block = slice(lo, lo + rows)
        out[block] = torch.addmm(base[block].float(), b[block].float(), a32, alpha=scale).to(base.dtype)
    return out


def adapter_tensors(model: Any, full: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every adapter parameter, in `named_parameters` order (A before B of
    each module); `full` as `merged`'s (collective under FSDP2)."""
    for name, p in model.named_parameters():
        if ".lora_" in name:
            yield name, full(p)


class Merger:
    """A rollout engine's end of adapter-only weight pushes (split placement): it keeps the base of
    every adapted weight (read once from the model directory, in the trainer's `dtype`, on
    `device`) and, as each module's A and B arrive, loads base + B @ A x scale into the engine:
    the weights `merged` gives the trainer side, while a push moves only the adapters. The price is
    a second copy of the adapted base weights on the rollout's device."""

    def __init__(self, engine: Any, model_path: str, names: list[str], scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        from safetensors import safe_open

        self.engine, self.scale = engine, scale
        wanted = {f"{n.partition('.lora_A.')[0]}.weight" for n in names if ".lora_A." in n}
        self.base: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                for key in wanted & set(st.keys()):
                    self.base[key] = st.get_tensor(key).to(device=device, dtype=dtype)
        if len(self.base) != len(wanted):
            raise ValueError(f"{model_path} lacks the base of {sorted(wanted - set(self.base))[:3]}")
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in named_tensors:
            module, _, kind = name.partition(".lora_")
            ab = self.pending.setdefault(module, {})
            ab[kind[0]] = t  # "A" or "B"
            if len(ab) == 2:
                del self.pending[module]
                weight = f"{module}.weight"
                self.engine.load_weights([(weight, merge(self.base[weight], ab["A"], ab["B"], self.scale))])


def merged_shapes(model: Any) -> list[tuple[str, list[int]]]:
    """(HF name, full shape) of `merged`'s tensors, in its order."""
    return [(out, list(p.shape)) for name, p in model.named_parameters() if (out := hf_name(name)) is not None]


def adapter_names(model: Any) -> list[str]:
    """The adapters' parameter names (as `named_parameters` gives them), in order."""
    return [name for name, _ in model.named_parameters() if ".lora_" in name]


def save_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], config: LoraConfig, base: str) -> None:
    """A PEFT adapter directory of `tensors` (adapter parameters, `named_parameters` names) for the
    model at `base`: what `PeftModel.from_pretrained(base_model, directory)` loads."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    peft_names = {f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": t.contiguous()
                  for name, t in tensors.items()}
    save_file(peft_names, d / "adapter_model.safetensors", metadata={"format": "pt"})
    config.base_model_name_or_path = str(Path(base).resolve()) if Path(base).exists() else str(base)
    config.save_pretrained(str(d))


def load_adapter(directory: str | Path) -> dict[str, torch.Tensor]:
    """`save_adapter`'s tensors under their `named_parameters` names."""
    from safetensors.torch import load_file

    out = {}
    for key, t in load_file(Path(directory) / "adapter_model.safetensors").items():
        name = key.removeprefix("base_model.model.")
        for ab in ("lora_A", "lora_B"):
            name = name.replace(f".{ab}.weight", f".{ab}.{ADAPTER}.weight")
        out[name] = t
    return out


def adapter_rank(directory: str | Path) -> int:
    """The rank of the adapter directory under a checkpoint, 0 when it has none (full weights)."""
    path = Path(directory) / ADAPTER_DIR / "adapter_config.json"
    return int(json.loads(path.read_text())["r"]) if path.is_file() else 0
