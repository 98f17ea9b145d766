"""What a run reads, found and checked before MLflow or Ray start: the model (a directory, a Hub id
fetched once into the HF cache, or the embedded one, built on first use), the data files and their
rows' data sources, the reward function and the environment.

Invariants:
- every input that can be checked before the run starts is, and the first that fails is one
  ConfigError line naming its key: a run never fails on its inputs after its workers start;
- a Hub id is fetched by the driver alone, and the workers get its snapshot's local path.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import cache
from pathlib import Path

from rlflow.engine import checkpoint, hub
from rlflow.engine.config import EMBEDDED, Config, ConfigError, job_of


def first_line(e: BaseException) -> str:
    """An error's first line, or its type's name when it says nothing: a config error's reason."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@cache
def _fetched(spec: str) -> str:
    print(f"rlflow: fetching {spec} from the Hugging Face Hub into its cache (once; later runs read the cache)",
          flush=True)
    return hub.fetch(spec)


def model_dir(key: str, spec: str) -> str:
    """The HF model directory `spec` names, a Hub id fetched into the HF cache; checked."""
    if hub.is_id(spec):
        try:
            spec = _fetched(spec)
        except hub.HubError as e:
            raise ConfigError(f"{key}={e}") from None
    where = Path(spec)
    if not where.is_dir():
        raise ConfigError(f"{key}={spec}: no such directory (expected a HF model directory or a Hub id org/name)")
    if not (where / "config.json").is_file():
        raise ConfigError(f"{key}={spec}: not a HF model directory (no config.json)")
    if not any((where / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{key}={spec}: no tokenizer in the model directory "
                          "(expected tokenizer.json or tokenizer_config.json)")
    return spec


def resolve_files(cfg: Config) -> dict[str, list[str]]:
    """{"train": [...], "val": [...]} data files, building the embedded ones on first use
    (preference pairs for DPO; with the embedded agent task's environment, its problems and, under
    "demos", the demonstrations its warm start learns from; prompts otherwise)."""
    from rlflow.engine.agents import calc
    from rlflow.engine.data.prompts import embedded_files, embedded_pair_files

    root = Path(cfg.trainer.output_dir) / "embedded"
    build = embedded_pair_files if cfg.algorithm.name == "dpo" else \
        calc.embedded_files if cfg.rollout.env == calc.ENV else embedded_files
    built = build(root, cfg.trainer.seed) if EMBEDDED in cfg.data.train_files + cfg.data.val_files else {}
    files = {split: [built[split] if f == EMBEDDED else f for f in getattr(cfg.data, f"{split}_files")]
             for split in ("train", "val")}
    if "demos" in built and EMBEDDED in cfg.data.train_files:
        files["demos"] = [built["demos"]]
    return files


def resolve_inputs(cfg: Config) -> tuple[Config, str, dict[str, list[str]]]:
    """(the config its workers run: `reward.model` a local directory; the model directory; the data
    files), building the embedded model and data on first use and fetching Hub ids."""
    from rlflow.engine.data.task import build_model

    if cfg.model.path == EMBEDDED:
        model = Path(cfg.trainer.output_dir) / "embedded" / "model"
        if not (model / "config.json").is_file():
            build_model(model, seed=cfg.trainer.seed)
        path = str(model)
    else:
        path = model_dir("model.path", cfg.model.path)
    if cfg.reward.model:
        cfg = replace(cfg, reward=replace(cfg.reward, model=model_dir("reward.model", cfg.reward.model)))
    return cfg, path, resolve_files(cfg)


def check_inputs(cfg: Config, model: bool = True) -> None:
    """Name the first configured input that cannot be read, before MLflow or Ray start: the model
    (`model=False` for eval, whose model is its argument), the data files and their rows' data
    sources, the reward model and function, the environment."""
    from rlflow.engine.agents.env import check_environment
    from rlflow.engine.specs import load_function

    if model and not cfg.model.path:
        raise ConfigError("model.path is not set: name a HF model directory or a Hub id (org/name); "
                          "`rlflow train` alone runs the embedded demo, `rlflow recipes` lists the rest")
    if model and cfg.model.path != EMBEDDED:
        model_dir("model.path", cfg.model.path)
    if model and cfg.trainer.resume not in ("auto", "never"):
        reason = checkpoint.problem(Path(cfg.trainer.resume))
        if reason:
            raise ConfigError(f"trainer.resume={cfg.trainer.resume}: not a usable checkpoint: {reason}")
    keys = ("train_files", "val_files") if model else ("val_files",)
    for key in keys:
        if not getattr(cfg.data, key):
            raise ConfigError(f"data.{key} is empty: name parquet or jsonl files of rows (docs/howto/data.md; "
                              "`rlflow data gsm8k DIR` writes GSM8K's)")
        for f in (f for f in getattr(cfg.data, key) if f != EMBEDDED):
            _check_file(f"data.{key}", f)
    if cfg.reward.model:
        model_dir("reward.model", cfg.reward.model)
    for key, spec, what in (("reward.function", cfg.reward.function, "reward function"),
                            ("rollout.env", cfg.rollout.env, "environment")):
        if spec:
            try:
                loaded = load_function(spec, what)
                if key == "rollout.env":
                    check_environment(loaded)
            except Exception as e:  # the user's module may fail in any way while it is imported
                raise ConfigError(f"{key}={spec}: {first_line(e)}") from None
    _check_sources(cfg, keys)


def _check_file(key: str, f: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlflow.engine.data.prompts import FORMATS

    if not Path(f).is_file():
        raise ConfigError(f"{key}: {f}: no such file (expected a {'/'.join(FORMATS)} file or {EMBEDDED})")
    if Path(f).suffix not in FORMATS:
        raise ConfigError(f"{key}: {f}: unsupported file type (expected {'/'.join(FORMATS)})")
    if Path(f).suffix == ".parquet":  # the footer only: a truncated or mislabelled file fails here, cheaply
        try:
            pq.read_metadata(f)
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"{key}: {f}: not a readable parquet file: {first_line(e)}") from None


def _check_sources(cfg: Config, keys: tuple[str, ...]) -> None:
    """An RL run scored by the built-in rules alone needs a scorer for every row's data_source:
    name the first that has none, with its file and row count, instead of failing at the first
    scored batch."""
    from rlflow.engine.data.rewards import BUILTIN

    rw = cfg.reward
    if job_of(cfg) != "rl" or rw.function or cfg.rollout.env:
        return
    for key in keys:
        for f in (f for f in getattr(cfg.data, key) if f != EMBEDDED):
            unknown = {s: n for s, n in _sources(f).items() if s not in BUILTIN}
            if unknown:
                source, rows = next(iter(unknown.items()))
                raise ConfigError(f"data.{key}: {f}: {rows} rows of data_source {source!r}, which no built-in "
                                  f"scorer reads (built-ins: {', '.join(sorted(BUILTIN))}); set "
                                  "reward.function=FILE.py:FUNCTION (docs/howto/reward.md)")


def _sources(path: str) -> Counter[str]:
    """How many rows of a data file name each data_source (rows without one are counted as malformed
    where the file is loaded, not here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if Path(path).suffix == ".parquet":
        try:
            column = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        except (KeyError, pa.ArrowException):
            return Counter()
        return Counter(s for s in column if isinstance(s, str))
    from rlflow.engine.data.prompts import DataError, read_rows

    try:
        rows = read_rows(path)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return Counter(r["data_source"] for r in rows if isinstance(r.get("data_source"), str))
