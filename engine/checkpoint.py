"""Checkpoint directories: atomic writes, a `latest` pointer, retention, safe loading.

Layout under `<output_dir>/checkpoints/`:
    step_000010/  model.safetensors  config.json  tokenizer files  trainer/ (optimizer shards, torch DCP)
                  worker_<rank>.pt  driver.json  COMPLETE
                  (PPO also: critic.safetensors  critic_trainer/)
    latest        (text: the name of the newest complete checkpoint)

Invariants:
- a checkpoint is written into `.tmp-step_N/` and renamed into place only when every file is
  there; `COMPLETE` (listing each file's size) is written last, inside the temp dir;
- `latest` is replaced atomically and only ever names a directory that has `COMPLETE`;
- loading never executes pickled code: safetensors for weights, torch distributed checkpoint
  for optimizer shards (`load_shards`: its non-tensor entries unpickled as plain data only),
  `torch.load(weights_only=True)` for RNG state, JSON for the driver's state;
- a partial or corrupt checkpoint is skipped with a warning naming what is wrong.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("rlflow.checkpoint")


BYTES_PER_PARAMETER = 12  # fp32 weights (model.safetensors) and AdamW's two fp32 moments (trainer/)


def model_parameters(model_path: str | Path) -> int:
    """How many parameters a HF directory's safetensors files hold, from their headers alone."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def disk_shortfall(root: Path, parameters: int, keep_last: int, copies: int) -> str | None:
    """Why `root`'s disk may not hold the run's checkpoints, or None when it will: at the peak,
    `keep_last` checkpoints of `parameters` parameters are kept while the next is written, and
    `copies` more of the final one exist (an MLflow store's on this disk). Checkpoints already
    under `root` count as room, since pruning frees them."""
    one = parameters * BYTES_PER_PARAMETER
    need = one * (keep_last + 1 + copies)
    root.mkdir(parents=True, exist_ok=True)
    have = shutil.disk_usage(root).free + sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    if have >= need:
        return None
    return (f"the checkpoints under {root} may not fit: each holds ~{one / 1e9:.1f} GB (fp32 weights and "
            f"optimizer state), and {keep_last} kept + 1 being written + {copies} copied into MLflow need "
            f"~{need / 1e9:.1f} GB, but the disk has {have / 1e9:.1f} GB. Free space, or lower "
            f"trainer.keep_last, or set trainer.log_checkpoint=false, or point trainer.output_dir elsewhere")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def begin(root: Path, step: int) -> Path:
    """A fresh temp directory for checkpoint `step`; workers write their files into it."""
    tmp = root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, tmp: Path, step: int, driver_state: dict, keep_last: int) -> Path:
    """Seal `tmp` (driver state, manifest), rename it into place, point `latest` at it, prune."""
    (tmp / "driver.json").write_text(json.dumps(driver_state, indent=1))
    manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / "COMPLETE").write_text(json.dumps(manifest))
    final = step_dir(root, step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def problem(path: Path) -> str | None:
    """Why `path` is not a usable checkpoint, or None when it is complete and intact."""
    marker = path / "COMPLETE"
    if not path.is_dir():
        return "no such directory"
    if not marker.is_file():
        return "no COMPLETE marker (the write never finished)"
    try:
        manifest = json.loads(marker.read_text())
    except ValueError:
        return "COMPLETE marker is unreadable"
    for name, size in manifest.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return f"{name} is missing or has the wrong size"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """Intact checkpoints, oldest first; partial ones are skipped with a warning."""
    found = []
    for path in sorted(root.glob("step_*")):
        reason = problem(path)
        if reason:
            log.warning("skipping checkpoint %s: %s", path, reason)
        else:
            found.append(path)
    return found


def find_resume(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `never` -> None, `auto` -> newest intact, else that path."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        reason = problem(path)
        if reason:
            raise FileNotFoundError(f"trainer.resume={resume}: not a usable checkpoint: {reason}")
        return path
    found = complete_checkpoints(root) if root.is_dir() else []
    return found[-1] if found else None


def read_driver_state(path: Path) -> dict:
    return json.loads((path / "driver.json").read_text())


def load_shards(state: dict, path: Path) -> None:
    """Fill `state` in place from the torch distributed checkpoint at `path` (every rank calls).

    DCP's default planner unpickles non-tensor entries (param groups, schedule, counters) with
    `weights_only=False`; here each is first read with `weights_only=True`, so a checkpoint cannot
    make loading run code."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainData(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            checked = io.BytesIO()
            torch.save(torch.load(value, weights_only=True), checked)  # raises on anything but plain data
            checked.seek(0)
            super().load_bytes(read_item, checked)

    dcp.load(state, checkpoint_id=path, planner=PlainData())
