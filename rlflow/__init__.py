"""rlflow: reinforcement-learning post-training for LLMs (GRPO and its relatives, PPO, DPO, SFT) on
Ray, tracked in MLflow.

The public API is what this module exports (docs/api.md): a Python entry point, the config, and
what user code is written against (environments, tools, reward functions, advantage estimators). Everything under
`rlflow.engine`, `rlflow.stages` and `rlflow.pipelines` is internal and may change.

    import rlflow
    run_id = rlflow.train("gsm8k", {"model.path": "Qwen/Qwen2.5-0.5B-Instruct",
                                    "data.train_files": ["train.parquet"], "data.val_files": ["test.parquet"]})

Names load on first use, so `from rlflow import Step` in an environment file stays light.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlflow.engine.agents.env import Environment, Step
    from rlflow.engine.agents.tools import CALCULATOR, Tool, python_tool
    from rlflow.engine.algos import AdvantageInputs, Estimator
    from rlflow.engine.config import Config, ConfigError, load_config
    from rlflow.engine.data.prompts import Prompt
    from rlflow.engine.data.rewards import ComputeScore

_EXPORTS = {
    "Config": "rlflow.engine.config", "ConfigError": "rlflow.engine.config", "load_config": "rlflow.engine.config",
    "Environment": "rlflow.engine.agents.env", "Step": "rlflow.engine.agents.env",
    "Tool": "rlflow.engine.agents.tools", "CALCULATOR": "rlflow.engine.agents.tools",
    "python_tool": "rlflow.engine.agents.tools", "Prompt": "rlflow.engine.data.prompts",
    "ComputeScore": "rlflow.engine.data.rewards",
    "Estimator": "rlflow.engine.algos", "AdvantageInputs": "rlflow.engine.algos",
}
__all__ = ["train", "recipes", "Config", "ConfigError", "load_config", "Environment", "Step", "Tool", "CALCULATOR",
           "python_tool", "Prompt", "ComputeScore", "Estimator", "AdvantageInputs"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlflow' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def train(config: str | Path | Config | None = None, overrides: dict[str, Any] | list[str] | None = None,
          job: str | None = None) -> str:
    """Run a job as `rlflow train` does and return its MLflow run id.

    `config`: a recipe's name (`rlflow recipes`), a YAML file, or a loaded `Config`; None runs the
    embedded demo unless `overrides` name a model. `overrides`: {"dotted.key": value} or
    ["key=value", ...]. `job`: "rl", "sft" or "dpo"; None: the recipe's (else rl). Raises
    ConfigError for a setting or input that cannot work, before anything starts."""
    from rlflow.engine.config import Config, ConfigError
    from rlflow.pipelines import cli

    cli.prepare_environment()
    if isinstance(config, Config):
        if overrides:
            raise ConfigError("a loaded Config takes no overrides: set them on it, or pass a recipe")
        cfg = config
    else:
        items = [f"{k}={json.dumps(v)}" for k, v in overrides.items()] if isinstance(overrides, dict) else \
            list(overrides or [])
        cfg = cli.configure(items, job, None if config is None else str(config))
    cli.check_inputs(cfg)
    return cli.train(cfg)["run_id"]


def recipes() -> dict[str, str]:
    """{name: what it is} of the shipped recipes."""
    from rlflow.engine import recipes as shipped

    return {name: shipped.describe(path) for name, path in shipped.shipped().items()}
