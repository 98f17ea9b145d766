"""The `rlflow` command line.

    rlflow train [RECIPE] [key=value ...]   run a recipe, by name or YAML file (its job: RL, SFT or DPO);
                                            no recipe and no model.path: the embedded demo
    rlflow dpo [RECIPE] [key=value ...]     DPO on preference pairs
    rlflow sft [RECIPE] [key=value ...]     supervised fine-tuning on chat or prompt/response rows
    rlflow config [RECIPE] [key=value ...]  print the resolved config as YAML, for the recipe's job
    rlflow recipes                          the shipped recipes, one line each
    rlflow export CHECKPOINT|OUTPUT_DIR DEST      write a checkpoint's policy as a HF directory
    rlflow data {gsm8k,math} [SRC] DST      GSM8K/MATH rows as rlflow rows (no SRC: from the Hub, into DST/)
    rlflow eval MODEL [RECIPE] [key=value ...]  accuracy, mean@k, pass@k of a checkpoint or HF dir

A recipe may also be given as `--config RECIPE`.

The driver owns the MLflow run (attaching to MLFLOW_RUN_ID when `mlflow run` set it, or to the
run of the checkpoint it resumes), starts or joins Ray (RAY_ADDRESS joins a cluster, as under
`ray job submit`), runs the optional warm-start, then the algorithm's pipeline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from rlflow.engine import checkpoint, hub, recipes
from rlflow.engine.config import (
    EMBEDDED,
    Config,
    ConfigError,
    doubts,
    estimator_of,
    load_config,
    to_dict,
    visible_gpus,
)
from rlflow.engine.tracking import Tracker
from rlflow.pipelines.inputs import check_inputs, resolve_files, resolve_inputs

# Progress bars of datasets, transformers and huggingface_hub, here and in the Ray workers of a
# local cluster (they inherit this environment; conf/ray/runtime_env.yaml sets them on a cluster).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


def quiet_libraries() -> None:
    """Keep the terminal to rlflow's lines and the libraries' warnings: no progress bars, no MLflow
    INFO lines, no notice on each start that the local Ray cluster uses its default token
    authentication. RLFLOW_LOG_LEVEL=debug keeps all of it. Call it before datasets and the HF
    libraries are imported: they read their progress-bar switches at import."""
    if os.environ.get("RLFLOW_LOG_LEVEL", "").lower() == "debug":
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith(RAY_TOKEN_NOTICE))


def loopback_only() -> None:
    """Keep a Ray cluster that rlflow starts itself (no RAY_ADDRESS) on loopback, before Ray is
    imported. Ray binds its servers (GCS, raylet, agents, workers) to the node's address, and turns
    127.0.0.1 into the machine's outward address unless it is told there is no cluster, its switch
    for laptops; gloo and NCCL open their sockets on the interface named, and vLLM's engine its
    own group's store at VLLM_HOST_IP. A user's own setting wins."""
    if os.environ.get("RAY_ADDRESS"):
        return
    import psutil

    lo = next((name for name, addrs in psutil.net_if_addrs().items()
               if any(a.address == "127.0.0.1" for a in addrs)), "lo")
    for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": lo,
                       "NCCL_SOCKET_IFNAME": lo, "VLLM_HOST_IP": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)


def prepare_environment() -> None:
    """What a job's process sets before the libraries load: MLflow's HTTP client fails fast (it
    retries a dead server for minutes per call by default; the tracker buffers through outages
    instead), quiet libraries, and a Ray cluster of its own on loopback only."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    quiet_libraries()
    loopback_only()


def split_args(args: list[str]) -> list[str]:
    """Drop empty arguments and split one argument holding several `k=v` (MLproject quotes
    `-P overrides="a=1 b=2"` into one word); a lone `key=a b` stays whole."""
    out = []
    for arg in args:
        words = shlex.split(arg) if arg.strip() else []
        out += words if len(words) > 1 and all("=" in w for w in words) else [arg] * bool(words)
    return out


def parse(args: list[str], job: str | None = None, config: str | None = None, gpus: int | None = None) -> Config:
    """Config from `[RECIPE] key=value ...` (or `config`, the recipe of `--config`) for the command's
    job: rl, sft or dpo; None: the recipe's. `gpus`: how many the run can use (None: this machine's)."""
    args = split_args(args)
    if config is None and args and "=" not in args[0]:
        config, args = args[0], args[1:]
    return load_config(config, args, job, gpus)


def configure(args: list[str], job: str | None = None, config: str | None = None) -> Config:
    """`parse` for a run: its `auto` settings for the GPUs it can use (the Ray cluster's, under
    RAY_ADDRESS), and a warning for each setting that looks like a mistake."""
    gpus = cluster_gpus()
    cfg = parse(args, job, config, gpus)
    for line in doubts(cfg, visible_gpus() if gpus is None else gpus):
        print(f"rlflow: warning: {line}", file=sys.stderr, flush=True)
    return cfg


def cluster_gpus() -> int | None:
    """GPUs of the Ray cluster RAY_ADDRESS names, which `auto` settings serve (joined here, as the
    run joins it next); None without one: the run starts its own, on this machine."""
    if not os.environ.get("RAY_ADDRESS"):
        return None
    import ray

    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    return int(ray.cluster_resources().get("GPU", 0))


def init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    p = cfg.placement
    needed = p.workers * (1 + len(p.own_pool))
    # Bound to loopback (with `loopback_only`): nothing rlflow starts listens on other interfaces.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False,
             logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    if ray.util.get_node_ip_address() != "127.0.0.1":  # Ray was imported before `loopback_only` ran
        print(f"rlflow: warning: the local Ray cluster listens on {ray.util.get_node_ip_address()}, "
              "not on loopback only", flush=True)


def check_lora(cfg: Config, model_path: str) -> int:
    """LoRA settings the model cannot take, and a checkpoint to resume whose weights are of the
    other kind (adapters for a full-weight run, or the reverse, or another rank): one line each,
    before any worker starts. The model is built on the meta device, without its weights. Returns
    how many parameters a checkpoint holds: the adapters' (0 without LoRA: the model's, counted elsewhere)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlflow.engine.train import lora

    a = cfg.actor
    trained = 0
    if a.lora_rank:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        try:
            lora.add_adapters(model, lora.lora_config(a.lora_rank, a.lora_alpha, a.lora_targets))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        found = checkpoint.find_resume(Path(cfg.trainer.output_dir) / "checkpoints", cfg.trainer.resume)
    except FileNotFoundError:
        return trained
    if found and lora.adapter_rank(found) != a.lora_rank:
        have = f"LoRA adapters of rank {lora.adapter_rank(found)}" if lora.adapter_rank(found) else "full weights"
        raise ConfigError(f"the checkpoint to resume, {found}, holds {have}, but actor.lora_rank={a.lora_rank}: "
                          "resume with the setting it was trained with, or start a new trainer.output_dir")
    return trained


def resumed_run_id(cfg: Config) -> str | None:
    """The MLflow run of the checkpoint `trainer.resume` will pick, so metrics continue there."""
    try:
        found = checkpoint.find_resume(Path(cfg.trainer.output_dir) / "checkpoints", cfg.trainer.resume)
    except FileNotFoundError:
        return None
    return checkpoint.read_driver_state(found).get("run_id") if found else None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except OSError:
        return ""


def check_disk(cfg: Config, model_path: str, tracker: Tracker, adapters: int = 0) -> None:
    """Say at the start, not at the final save hours later, when the checkpoints may not fit. A
    LoRA policy's checkpoints hold its `adapters` parameters, not the model's."""
    model = checkpoint.model_parameters(model_path)
    critic = model if estimator_of(cfg.algorithm.advantage).critic else 0  # the policy's backbone, its own AdamW
    copies = int(cfg.trainer.log_checkpoint and tracker.local_artifacts())
    why = checkpoint.disk_shortfall(Path(cfg.trainer.output_dir) / "checkpoints", (adapters or model) + critic,
                                    cfg.trainer.keep_last, copies)
    if why:
        print(f"rlflow: warning: {why}", flush=True)


def train(cfg: Config) -> dict[str, str]:
    from rlflow.pipelines import dpo, driver, grpo, sft

    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    settings = to_dict(cfg)  # as the user gave them: a Hub id stays an id in the run's params
    cfg, model_path, files = resolve_inputs(cfg)
    adapters = check_lora(cfg, model_path)
    previous = resumed_run_id(cfg)
    if previous and "MLFLOW_RUN_ID" not in os.environ:
        os.environ["MLFLOW_RUN_ID"] = previous
    pinned = hub.commit(model_path)  # a Hub model: the commit every worker loads
    tags = {"algorithm": cfg.algorithm.name, "model": cfg.model.path, "git_commit": git_commit(),
            "dataset_hash": dataset_hash(files["train"]), **({"model_commit": pinned} if pinned else {})}
    tracker = Tracker(cfg.trainer.experiment, cfg.trainer.run_name or None, tags=tags)
    status = "FAILED"
    try:
        tracker.log_params(settings)
        tracker.log_dict(settings, "config.yaml")
        tracker.log_datasets(files)
        check_disk(cfg, model_path, tracker, adapters)
        init_ray(cfg)
        if cfg.algorithm.name == "sft":  # the supervised training is the run: no warm start before it
            export = sft.train(cfg, model_path, files, tracker)
        elif cfg.algorithm.name == "dpo":  # preference pairs; its warm start learns their chosen answers
            model_path = dpo.warm_start(cfg, model_path, files["train"], tracker) if cfg.warmstart.steps else model_path
            export = dpo.train(cfg, model_path, files, tracker)
        else:
            if cfg.warmstart.steps:
                model_path = sft.warm_start(cfg, model_path, files["train"], tracker, files.get("demos"))
            export = grpo.train(cfg, model_path, files, tracker)
        if cfg.trainer.register_model:
            version = tracker.register_model(str(export), cfg.trainer.register_model)
            print(f"rlflow: registered {export} as model '{cfg.trainer.register_model}' version {version}")
        status = "FINISHED"
    except (KeyboardInterrupt, driver.Stopped):
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)
    export = export.resolve()
    summary = {"run_id": tracker.run_id, "tracking_uri": tracker.tracking_uri, "model": str(export)}
    print(f"\nrlflow: run {tracker.run_id} finished; tracking URI {tracker.tracking_uri}; "
          f"final model at {export}\n  view it: {view_command(tracker.tracking_uri)}")
    return summary


def view_command(tracking_uri: str) -> str:
    """How to look at the run: a tracking server's own address, or `mlflow ui` over a local store."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri} (the MLflow server's UI)"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def find_model(source: str) -> Path:
    """The HF directory `source` names: a complete checkpoint, the newest one under a run's
    output_dir, a HF model directory (checkpoints are HF directories too), or a Hub id, fetched."""
    if hub.is_id(source):
        try:
            return Path(hub.fetch(source))
        except hub.HubError as e:
            raise FileNotFoundError(str(e)) from None
    path = Path(source)
    if (path / "checkpoints").is_dir():
        found = checkpoint.find_resume(path / "checkpoints", "auto")
        path = found or path
    if (path / "COMPLETE").is_file():
        reason = checkpoint.problem(path)
        if reason:
            raise FileNotFoundError(f"{path}: {reason}")
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"{source} is neither a complete checkpoint, a run directory holding one, "
                                "nor a HF model directory")
    return path


def export(source: str, dest: str) -> Path:
    """A checkpoint (or the newest complete one under a run's output_dir) as a HF directory. A LoRA
    checkpoint's is the merged model, with the PEFT adapter in `adapter/` (as a run's final export)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.engine.train import lora

    path = find_model(source)
    if lora.adapter_rank(path):
        from peft import PeftModel

        adapter = path / lora.ADAPTER_DIR
        base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload() \
            .save_pretrained(dest)
        shutil.copytree(adapter, Path(dest) / lora.ADAPTER_DIR, dirs_exist_ok=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(dest)
    else:
        AutoModelForCausalLM.from_pretrained(path).save_pretrained(dest)
        AutoTokenizer.from_pretrained(path).save_pretrained(dest)
    print(f"rlflow: exported {path} to {dest}")
    return path


def eval_files(model_dir: Path, cfg: Config) -> list[str]:
    """`rlflow eval`'s data files. The embedded held-out set is that of the run `model_dir` belongs
    to, its nearest ancestor holding `embedded/` (OUTPUT_DIR for OUTPUT_DIR/checkpoints/step_N or
    OUTPUT_DIR/hf_model): another run's set, built with another trainer.seed, overlaps this run's
    training prompts. A `trainer.output_dir` given explicitly picks the set instead."""
    from dataclasses import replace

    if EMBEDDED not in cfg.data.val_files:
        return resolve_files(cfg)["val"]
    here = model_dir.resolve()
    run_dir = next((d for d in (here, *here.parents) if (d / "embedded").is_dir()), None)
    if run_dir and cfg.trainer.output_dir == Config().trainer.output_dir:
        cfg = replace(cfg, trainer=replace(cfg.trainer, output_dir=str(run_dir)))
    files = resolve_files(cfg)["val"]
    if run_dir is None:
        print(f"rlflow: warning: {model_dir} is in no run directory; evaluating on the embedded held-out set "
              f"of trainer.output_dir={cfg.trainer.output_dir}, trainer.seed={cfg.trainer.seed}, which may "
              "overlap the model's training data unless they are its run's", flush=True)
    else:
        print(f"rlflow: evaluating on the embedded held-out set of {cfg.trainer.output_dir}: {', '.join(files)}",
              flush=True)
    return files


def run_eval(source: str, cfg: Config) -> dict[str, float]:
    """`rlflow eval`: score a model on `data.val_files` in its own tracked run; prints a summary."""
    from rlflow.pipelines.eval import evaluate

    model_dir = find_model(source)
    files = eval_files(model_dir, cfg)
    tracker = Tracker(cfg.trainer.experiment, cfg.trainer.run_name or f"eval {model_dir.name}",
                      tags={"job": "eval", "model": str(model_dir.resolve()), "git_commit": git_commit(),
                            "dataset_hash": dataset_hash(files)})
    status = "FAILED"
    try:
        d = to_dict(cfg)
        tracker.log_params({"eval": {"source": source, "model_dir": str(model_dir.resolve())},
                            "model": {"dtype": cfg.model.dtype}, **{k: d[k] for k in ("data", "rollout", "reward")}})
        tracker.log_datasets({"eval": files})
        init_ray(cfg)
        adapters = not (model_dir / "config.json").is_file()  # a LoRA checkpoint: merged into its base first
        with tempfile.TemporaryDirectory(prefix="rlflow-eval-") as merged:
            if adapters:
                export(str(model_dir), merged)
            metrics = evaluate(cfg, Path(merged) if adapters else model_dir, files, tracker)
        status = "FINISHED"
    finally:
        tracker.finish(status)
    k = cfg.rollout.samples_per_prompt
    print(f"{'data_source':<24}{'prompts':>8}{'accuracy':>10}{f'mean@{k}':>10}{'pass@1':>10}{f'pass@{k}':>10}")
    for prefix in sorted(key[:-len("accuracy")] for key in metrics if key.endswith("/accuracy")):
        name = prefix[len("eval/"):-1] or "all"
        print(f"{name:<24}{metrics[prefix + 'prompts']:>8.0f}" + "".join(
            f"{metrics[prefix + key]:>10.3f}" for key in ("accuracy", f"mean_at_{k}", "pass_at_1", f"pass_at_{k}")))
    print(f"rlflow: eval run {tracker.run_id} in experiment '{cfg.trainer.experiment}'; "
          f"tracking URI {tracker.tracking_uri}")
    return metrics


def dataset_hash(files: list[str]) -> str:
    """A short content hash of the training files, so runs on the same data can be grouped."""
    digest = hashlib.sha256()
    for f in sorted(files):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:12]


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlflow")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def one_line(e: BaseException, command: str) -> tuple[str, int] | None:
    """(the line, the exit code) an error the user can act on ends a command with, instead of a
    traceback; None for any other error."""
    from rlflow.engine.data.prompts import DataError  # imports datasets: after quiet_libraries
    from rlflow.engine.data.rewards import RewardError
    from rlflow.pipelines import driver

    if isinstance(e, ConfigError):  # found once the inputs are read (LoRA against the model, a checkpoint)
        return f"rlflow: config error: {e}", 2
    if isinstance(e, DataError):  # a data file unreadable, or a row refused (data.overlong_prompts=error)
        return f"rlflow: data error: {e}", 2
    if isinstance(e, RewardError):  # reward.on_error=raise; Ray's wrapper carries the user's error as its cause
        return f"rlflow: {getattr(e, 'cause', e)}; the run is marked FAILED", 1
    if command == "eval":
        return (f"rlflow: {e}", 2) if isinstance(e, FileNotFoundError) else None
    if isinstance(e, driver.Stopped):
        return f"rlflow: {e}; the same command resumes from it", 128 + e.signum  # the shell's code for that signal
    if isinstance(e, KeyboardInterrupt):
        return ("\nrlflow: interrupted; what was running is lost, the same command resumes from the last "
                "checkpoint (if one was written)", 128 + signal.SIGINT)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlflow", description=__doc__.split("\n")[0],
                                     epilog="docs: README.md and docs/ (docs/config.md lists every key)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    overrides = ("RECIPE: a shipped recipe's name (`rlflow recipes`) or a YAML file of differences from the "
                 "defaults; key=value: dotted overrides applied after it, e.g. trainer.total_steps=200 "
                 "data.train_files=[a.parquet,b.parquet] (every key: docs/config.md, or `rlflow config`)")
    for name, text in (("train", "run a recipe (RL, or its own job); no recipe and no model: the embedded demo"),
                       ("dpo", "DPO on preference pairs"), ("sft", "supervised fine-tuning on chat or "
                                                                    "prompt/response rows"),
                       ("config", "print the resolved config, for the recipe's job")):
        cmd = sub.add_parser(name, help=text, description=text, epilog=overrides)
        cmd.add_argument("args", nargs="*", metavar="[RECIPE] key=value")
        cmd.add_argument("--config", metavar="RECIPE", help="the recipe, a name or a YAML file")
    sub.add_parser("recipes", help="list the shipped recipes")
    exp = sub.add_parser("export", help="write a checkpoint's policy as a HF directory")
    exp.add_argument("source", help="a checkpoint directory, or a run's trainer.output_dir")
    exp.add_argument("dest")
    data = sub.add_parser("data", help="GSM8K/MATH rows as rlflow rows: a file converted, or the Hub's fetched")
    data.add_argument("format", choices=["gsm8k", "math"])
    data.add_argument("paths", nargs="+", metavar="[SRC] DST",
                      help="SRC DST: convert a jsonl/json/parquet file to DST (.parquet or .jsonl); DST alone: "
                           "fetch the format's Hub dataset and write DST/train.parquet and DST/test.parquet")
    data.add_argument("--data-source", default=None,
                      help="the rows' data_source, which picks the built-in scorer (default: openai/gsm8k or math)")
    data.add_argument("--instruction", default=None, help="appended to each question")
    data.add_argument("--split", default="train", help="recorded in each converted row's extra_info")
    ev = sub.add_parser("eval", help="accuracy, mean@k and pass@k of a checkpoint or HF directory on data.val_files",
                        epilog=overrides)
    ev.add_argument("source", help="a checkpoint, a run's trainer.output_dir, a HF model directory or a Hub id")
    ev.add_argument("args", nargs="*", metavar="[RECIPE] key=value")
    ev.add_argument("--config", metavar="RECIPE", help="the recipe, a name or a YAML file")
    ns = parser.parse_args(argv)
    prepare_environment()
    if ns.command == "recipes":
        print(recipes.listing())
        return 0
    if ns.command == "data":
        return data_command(ns)
    if ns.command == "export":
        try:
            export(ns.source, ns.dest)
        except FileNotFoundError as e:
            print(f"rlflow: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = configure(ns.args, ns.command if ns.command in ("dpo", "sft") else None, ns.config)
        if ns.command != "config":
            check_inputs(cfg, model=ns.command != "eval")
    except (ConfigError, FileNotFoundError) as e:
        print(f"rlflow: config error: {e}", file=sys.stderr)
        return 2
    if ns.command == "config":
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    try:
        if ns.command == "eval":
            run_eval(ns.source, cfg)
        else:
            train(cfg)
    except (Exception, KeyboardInterrupt) as e:
        said = one_line(e, ns.command)
        if said is None:
            raise
        print(said[0], file=sys.stderr)
        return said[1]
    return 0


def data_command(ns: argparse.Namespace) -> int:
    """`rlflow data FORMAT [SRC] DST`: a file converted, or the format's Hub dataset fetched and converted."""
    from rlflow.engine.data.convert import convert, fetch

    if len(ns.paths) > 2:
        print(f"rlflow: data takes [SRC] DST, got {len(ns.paths)} paths", file=sys.stderr)
        return 2
    try:
        if len(ns.paths) == 2:
            written = {ns.paths[1]: convert(ns.paths[0], ns.paths[1], ns.format, ns.data_source, ns.instruction,
                                            ns.split)}
        else:
            print(f"rlflow: fetching the {ns.format} dataset from the Hugging Face Hub into its cache", flush=True)
            splits = fetch(ns.format, ns.paths[0], ns.data_source, ns.instruction)
            written = {str(Path(ns.paths[0]) / f"{split}.parquet"): counts for split, counts in splits.items()}
    except (ValueError, FileNotFoundError) as e:
        print(f"rlflow: {e}", file=sys.stderr)
        return 2
    for dst, counts in written.items():
        print(f"rlflow: wrote {counts['written']} of {counts['rows']} rows to {dst}; "
              + ", ".join(f"{k}={v}" for k, v in counts.items() if k.startswith("skipped")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
