import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def test_rlflow_data_converts_and_reports_counts(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "2 apples and 3 more?", "answer": "2+3=5\n#### 5"}, {"question": "no answer", "answer": "x"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = subprocess.run([str(BIN / "rlflow"), "data", "gsm8k", str(src), str(tmp_path / "out.parquet")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 of 2 rows" in proc.stdout and "skipped=1" in proc.stdout
    bad = subprocess.run([str(BIN / "rlflow"), "data", "gsm8k", str(tmp_path / "missing.jsonl"),
                          str(tmp_path / "o.parquet")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr


def test_config_errors_exit_2_with_the_closest_key(tmp_path):
    proc = subprocess.run([str(BIN / "rlflow"), "config", "trainer.total_step=3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "trainer.total_steps" in proc.stderr



def rlflow(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "rlflow"), *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, **env})


def test_recipes_by_name_from_any_directory(tmp_path):
    """From a directory outside the repo: the list, a recipe by name or by --config resolved as its
    job, and a bare key or an unknown name refused in one line."""
    import yaml

    from rlflow.engine import recipes

    listed = rlflow("recipes", cwd=tmp_path)
    assert listed.returncode == 0 and all(f"{name} " in listed.stdout for name in recipes.shipped())
    for args in (["demo-sft"], ["--config", "demo-sft"], ["--config", str(ROOT / "conf" / "demo-sft.yaml")]):
        shown = rlflow("config", *args, "trainer.total_steps=5", cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        cfg = yaml.safe_load(shown.stdout)
        assert (cfg["algorithm"]["name"], cfg["trainer"]["total_steps"], cfg["actor"]["lr"]) == ("sft", 5, 1e-3)
    for args, said in ((["train", "actor.lr"], "'actor.lr' is a config key without a value: write actor.lr=VALUE"),
                       (["train", "gsm9k"], "no recipe or file named 'gsm9k'"),
                       (["sft", "demo-dpo"], "demo-dpo is a recipe for dpo, not sft: run `rlflow dpo demo-dpo`"),
                       (["config", "rollout.n=8"], "verl's rollout.n is rollout.samples_per_prompt here")):
        refused = rlflow(*args, cwd=tmp_path)
        [line] = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and line.startswith("rlflow: config error: ") and said in line, line


def test_a_users_model_where_no_gpu_is_visible_resolves_to_the_cpu_in_float32(tmp_path, model_dir):
    import yaml

    shown = rlflow("config", f"model.path={model_dir}", "data.train_files=[a.parquet]", "data.val_files=[b.parquet]",
                   cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    cfg = yaml.safe_load(shown.stdout)
    assert (cfg["model"]["dtype"], cfg["rollout"]["dtype"], cfg["placement"]["gpus_per_worker"]) == \
        ("float32", "float32", 0.0)
    assert (cfg["rollout"]["max_new_tokens"], cfg["actor"]["lr"]) == (1024, 1e-6) and shown.stderr == ""
    toy = rlflow("config", f"model.path={model_dir}", "data.train_files=[a.parquet]", "data.val_files=[b.parquet]",
                 "rollout.max_new_tokens=8", cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert toy.returncode == 0 and "rlflow: warning: rollout.max_new_tokens=8 cuts a real model's answers" in toy.stderr


def bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, what the one error line must name) for inputs that cannot be read."""
    (tmp / "no_tokenizer").mkdir()
    (tmp / "no_tokenizer" / "config.json").write_text("{}")
    (tmp / "rows.txt").write_text("x\n")
    (tmp / "text.parquet").write_text('{"prompt": "1+1="}\n')  # text renamed to .parquet
    (tmp / "empty.parquet").write_bytes(b"")
    (tmp / "broken.py").write_text("import not_a_module_anywhere\n")
    (tmp / "envs.py").write_text("class Parser:\n    tool_parser = 'xml'\n\nclass Tools:\n    tools = [print]\n")
    mystery = '{"prompt": "?", "data_source": "mystery", "reward_model": {"ground_truth": 1}}\n'
    (tmp / "mystery.jsonl").write_text(mystery * 3)
    data = ["data.train_files=[embedded]", "data.val_files=[embedded]"]
    (tmp / "mine.yaml").write_text("actor:\n  lr: 1.0e-6\n")
    (tmp / "no_data.yaml").write_text("model:\n  path: embedded\n")  # a recipe of the user's: no demo under it
    return [
        ([str(tmp / "mine.yaml")], "model.path is not set: name a HF model directory or a Hub id"),
        ([str(tmp / "no_data.yaml")], "data.train_files is empty"),
        ([f"model.path={tmp}", *data], "no config.json"),
        ([f"model.path={tmp / 'no_tokenizer'}", *data], "no tokenizer"),
        ([f"data.val_files=[{tmp / 'mystery.jsonl'}]"], f"data.val_files: {tmp / 'mystery.jsonl'}: 3 rows of "
                                                       "data_source 'mystery', which no built-in scorer reads"),
        (["data.val_files=[/nope.jsonl]"], "/nope.jsonl: no such file"),
        ([f"data.train_files=[{tmp / 'rows.txt'}]"], "unsupported file type"),
        ([f"data.train_files=[{tmp / 'text.parquet'}]"],
         f"data.train_files: {tmp / 'text.parquet'}: not a readable parquet file: Parquet magic bytes not found"),
        ([f"data.val_files=[{tmp / 'empty.parquet'}]"], f"data.val_files: {tmp / 'empty.parquet'}: not a readable"),
        ([f"reward.function={tmp / 'broken.py'}:f"], "No module named 'not_a_module_anywhere'"),
        (["reward.function=os.path:sep"], "not a function"),
        (["reward.model=/nope"], "reward.model=/nope: no such directory"),
        (["trainer.resume=/nope"], "trainer.resume=/nope: not a usable checkpoint: no such directory"),
        ([f"trainer.resume={tmp}"], "no COMPLETE marker"),  # before the warm start, not after it
        (["rollout.env=nomod:Env"], "rollout.env=nomod:Env: cannot import environment module 'nomod'"),
        ([f"rollout.env={tmp / 'missing.py'}:Env"], "environment file not found"),
        (["rollout.env=rlflow.engine.agents.env:NoSuchEnv"], "has no 'NoSuchEnv'"),
        ([f"rollout.env={tmp / 'envs.py'}:Parser"], "tool_parser='xml' is not one of hermes, compact"),
        ([f"rollout.env={tmp / 'envs.py'}:Tools"], "tools must be engine.agents.tools.Tool"),
    ]


def test_each_unreadable_input_is_named(tmp_path):
    from rlflow.engine.config import ConfigError
    from rlflow.pipelines.cli import check_inputs, parse

    for args, expected in bad_inputs(tmp_path):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            check_inputs(parse(args))
    check_inputs(parse([]))  # the embedded default needs nothing on disk
    check_inputs(parse([f"data.val_files=[{tmp_path / 'mystery.jsonl'}]", "reward.function=os.path:join"]))


def test_unreadable_inputs_are_one_line_before_mlflow_and_ray_start(tmp_path):
    """Through the real CLI: exit 2, one line, and no MLflow store (the tracker starts before Ray)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    model = tmp_path / "model"  # a HF-looking directory, so eval gets as far as its data
    model.mkdir()
    (model / "config.json").write_text("{}")
    truncated = tmp_path / "truncated.parquet"  # a parquet file cut short, as by an interrupted copy
    pd.DataFrame({"prompt": ["1+1="] * 100}).to_parquet(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    for command, args, expected in [
        ("train", ["model.path=/nonexistent", "data.train_files=[embedded]", "data.val_files=[embedded]"],
         "model.path=/nonexistent: no such directory"),
        ("train", ["reward.function=nomod:f"], "reward.function=nomod:f: cannot import reward function module 'nomod'"),
        ("train", ["data.train_files=[/nope.parquet]"], "data.train_files: /nope.parquet: no such file"),
        ("eval", [str(model), "data.val_files=[/nope.parquet]"], "data.val_files: /nope.parquet: no such file"),
        ("train", [f"data.train_files=[{truncated}]"], f"data.train_files: {truncated}: not a readable parquet file"),
    ]:
        proc = subprocess.run([str(BIN / "rlflow"), command, *args, f"trainer.output_dir={tmp_path / 'out'}"],
                              capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        [line] = proc.stderr.splitlines()
        assert line.startswith("rlflow: config error: ") and expected in line, (args, line)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "out").exists()


def test_a_refused_row_is_one_data_error_line(tmp_path):
    """data.overlong_prompts=error through the real CLI: exit 2 and one line naming the file and line,
    no traceback. The rows are tokenized on the driver once Ray is up, so this starts Ray (~20 s)."""
    rows = [{"prompt": f"{a}+{a}=", "data_source": "arith", "reward_model": {"ground_truth": str(2 * a)}}
            for a in range(8)]
    rows[6]["prompt"] = "1" * 300
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    args = [f"data.train_files=[{data}]", f"data.val_files=[{data}]", "data.overlong_prompts=error",
            "warmstart.steps=0", f"trainer.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run([str(BIN / "rlflow"), "train", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("rlflow:")]
    assert line.startswith(f"rlflow: data error: {data}:7: prompt is 300 tokens, over max_prompt_tokens="), line


def test_a_failing_reward_with_on_error_raise_is_one_line_naming_the_users_line(tmp_path):
    """reward.on_error=raise through the real CLI: the error comes from a Ray worker inside the
    compiled step; the terminal gets one line with the sample, the error and the user's file:line."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1 / 0\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    args = [str(ROOT / "conf" / "smoke.yaml"), f"reward.function={reward}:compute_score", "reward.on_error=raise",
            "warmstart.steps=0", f"trainer.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run([str(BIN / "rlflow"), "train", *args], capture_output=True, text=True, timeout=180,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("rlflow:")]
    assert line == (f"rlflow: reward function failed on sample 0 (data_source='arith'): ZeroDivisionError: "
                    f"division by zero ({reward}:2); the run is marked FAILED"), line


def test_lora_settings_and_checkpoints_of_the_other_kind_fail_before_work_starts(tmp_path, model_dir):
    """Checked on the driver, the model built on the meta device: a target that matches nothing, a
    rank above a layer's width, and a checkpoint to resume whose weights are of the other kind."""
    from rlflow.engine import checkpoint
    from rlflow.engine.config import ConfigError
    from rlflow.pipelines.cli import check_lora, parse

    out = f"trainer.output_dir={tmp_path}"
    for args, expected in [(["actor.lora_rank=8", "actor.lora_targets=[nope_proj]"], "matches no module"),
                           (["actor.lora_rank=100"], "larger than model.layers.0.self_attn.k_proj (128 -> 64)")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            check_lora(parse([*args, out]), str(model_dir))
    assert check_lora(parse(["actor.lora_rank=8", out]), str(model_dir)) > 0  # the adapters' parameters

    def sealed(step: int, adapter_rank: int) -> None:  # a checkpoint as the driver seals one
        tmp = checkpoint.begin(tmp_path / "checkpoints", step)
        if adapter_rank:
            (tmp / "adapter").mkdir()
            (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({"r": adapter_rank}))
        checkpoint.commit(tmp_path / "checkpoints", tmp, step, {"step": step}, keep_last=2)

    sealed(2, 8)
    with pytest.raises(ConfigError, match="holds LoRA adapters of rank 8, but actor.lora_rank=0"):
        check_lora(parse([out]), str(model_dir))
    with pytest.raises(ConfigError, match="holds LoRA adapters of rank 8, but actor.lora_rank=16"):
        check_lora(parse(["actor.lora_rank=16", out]), str(model_dir))
    check_lora(parse(["actor.lora_rank=8", out]), str(model_dir))  # the same kind resumes
    sealed(4, 0)
    with pytest.raises(ConfigError, match="holds full weights, but actor.lora_rank=8"):
        check_lora(parse(["actor.lora_rank=8", out]), str(model_dir))


def test_help_says_how_to_configure_and_version_names_the_package():
    from rlflow.pipelines.cli import package_version

    helped = subprocess.run([str(BIN / "rlflow"), "train", "--help"], capture_output=True, text=True, timeout=60)
    text = " ".join(helped.stdout.split())
    assert helped.returncode == 0 and "the embedded demo" in text and "docs/config.md" in text, helped.stdout
    version = subprocess.run([str(BIN / "rlflow"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"rlflow {package_version()}" and package_version() != "(not installed)"


def test_the_view_line_fits_the_tracking_store():
    from rlflow.pipelines.cli import view_command

    assert view_command("sqlite:///x/mlflow.db") == "mlflow ui --backend-store-uri sqlite:///x/mlflow.db"
    assert view_command("http://127.0.0.1:5000").startswith("open http://127.0.0.1:5000")  # mlflow ui refuses it
