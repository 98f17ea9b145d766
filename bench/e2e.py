"""End-to-end GRPO step: rlflow's real pipeline against TRL's GRPOTrainer, side by side, same settings.

    python bench/e2e.py --shape qwen2.5-0.5b,qwen2.5-1.5b        # one H200: the headline numbers
    python bench/e2e.py --shape qwen2.5-0.5b --lengths fixed,mix   # both shapes of work, side by side
    python bench/e2e.py --shape tiny --prompts 4 --samples 2 --prompt-len 16 --new 8 --steps 3 --warmup 1  # CPU smoke

One step, in both frameworks: `--prompts` prompts x `--samples` samples at temperature 1, in one of
three shapes of work (`--lengths`):
- `fixed`: each prompt exactly `--prompt-len` tokens and each completion exactly `--new` tokens
  (the EOS token lies outside the model's vocabulary, so it is never sampled);
- `mix`: real work's shape (bench/length_mix.py): prompt lengths drawn log-normally up to
  `--prompt-len`, and each answer ending (EOS inside the vocabulary) at a length drawn per prompt
  and sample up to `--new`, forced the same way in both frameworks; the bench checks that each
  logged the drawn prompt and answer tokens;
- `reasoning`: the same, with reasoning RL's answers (a median near 500 tokens, a longer tail;
  `--new 2048` caps them as the reasoning shape of docs/benchmarks.md does).
Each is scored by the one reward in
`bench/e2e_reward.py`, group-normalised advantages, one PPO epoch in one mini-batch (one optimizer
step per generation batch), token-mean PPO-clip loss (TRL's `dapo`), no KL and no reference model
(TRL `beta=0`), the same constant lr, bf16 weights on the GPU (fp32 on CPU). Random weights in a
Qwen2.5 shape (bench/shapes.py) and a byte-level BPE tokenizer whose tokens cover every id
(`build_tokenizer`), saved once as a HF directory that both load by path (no download).

- rlflow: the real job, `python -m rlflow.pipelines.cli train <generated yaml>` (Ray, compiled DAG,
  MLflow), then the per-step metrics read back from its MLflow store (`timing_s/*`, `perf/*`).
- `--variant NAME:SETTINGS` (repeatable): rlflow jobs of their own, side by side, each with its
  settings over `--rlflow-set`'s (e.g. a rollout pool of its own generating one step ahead, or two
  data-parallel ranks), reported against the first: step rate and tokens/s/GPU (over the GPUs the
  job's pools take), the mean weight-version staleness of its samples, each GPU's busy share over
  the timed steps (nvidia-smi's utilization, polled), and the peak memory of each phase.
- TRL: `GRPOTrainer` in its own process (bench/e2e_trl.py: separate CUDA state and peak memory), transformers
  `generate` (no vLLM), one process per `--trl-modes` entry: `default` is TRL's defaults,
  `fast` the fastest knobs that need no extra package (see TRL_MODES). Its micro-batch starts at
  `--trl-micro` sequences and halves on CUDA OOM: the largest that fits is used and reported.
  (`fast` adds a static KV cache, which fails on TRL 1.16 in bf16; see TRL_MODES.)

Step time: the driver's step for rlflow (`timing_s/step`), on_step_begin -> on_step_end
(synchronised) for TRL. Generation: rlflow's `timing_s/gen`; TRL's `_generate` (prompts to decoded
completions, as rlflow's gen), timed synchronised. Training = step - generation (old logprobs,
reward, advantages, forward/backward, optimizer). tokens/s/GPU = (prompt + completion tokens) /
step time. The first `--warmup` steps (compilation, CUDA-graph capture) are dropped, the median of
the rest reported. Peak memory: the device's memory in use, polled with nvidia-smi while each job
runs (the same measure for both); TRL's torch max_memory_allocated too. Prints a markdown table
and writes JSON to `--out` ($OUT/e2e.json when $OUT is set, else bench/out/e2e.json).


Floors (CUDA): each rlflow phase's median beside what it cannot beat on this device, and the
update's MFU (bench/floors.py says what each floor counts), from two rates measured once before the jobs.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml
from floors import against_floors, phase_floors, print_floors
from length_mix import Mix, answer_length, hook_dir, mean_answer, prompt_lengths, reasoning_mix
from shapes import QWEN25, TINY  # bench/shapes.py: bench/ is sys.path[0] when a script here runs

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SHAPES = {**QWEN25, "tiny": TINY}
EXPERIMENT = "e2e"
# TRL 1.16 knobs that speed up GRPOTrainer without an extra package. Not here: vLLM (use_vllm; its own
# package), liger kernels (use_liger_kernel; liger-kernel), flash-attn or hub kernels
# (model_init_kwargs attn_implementation; a package or a download). per_device_train_batch_size is
# `--trl-micro`, largest that fits; generation runs the whole 512-completion batch in one call anyway.
TRL_MODES: dict[str, dict[str, Any]] = {
    "default": {},  # TRL's defaults: gradient checkpointing on, dynamic KV cache, eager
    "no-ckpt": dict(gradient_checkpointing=False),  # no recompute in backward
    # + static KV cache in generate; on TRL 1.16 in bf16 it fails in the cache update (index_copy_: Float
    # cache, BFloat16 states), measured on an H200, so it is not in the default modes
    "fast": dict(gradient_checkpointing=False, cache_implementation="static"),
    "cb": dict(gradient_checkpointing=False, use_transformers_continuous_batching=True),  # generate_batch
    "compile": dict(gradient_checkpointing=False, cache_implementation="static", torch_compile=True),
}


# -- inputs: one model directory and one prompt file for both frameworks ---------------------

def build_tokenizer(vocab: int, eos_inside: bool = False):
    """A byte-level BPE tokenizer whose tokens cover every model id: the 256 byte symbols, then " a"
    .. " zzz" and as many 4-letter words " aaaa", " aaab", .. as fit, then pad. EOS gets id `vocab`,
    outside the model's logits, so neither framework samples it and every completion runs full length;
    with `eos_inside`, id `vocab - 2`, before pad, where a forced end can pick it.

    Built as the Qwen2 tokenizer class that transformers 5 loads for any qwen2 model directory
    whatever the file says, so both frameworks tokenize alike; a word with a leading space is one token."""
    from tokenizers import pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    words = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    first_special = vocab - 2 if eos_inside else vocab - 1
    for n in range(1, 5):
        for letters in itertools.islice(itertools.product(string.ascii_lowercase, repeat=n),
                                        first_special - len(words)):
            word = "\u0120" + "".join(letters)  # the byte-level symbol of a space
            words[word] = len(words)
            merges.append((word[:-1], word[-1]))
    words |= {"<pad>": vocab - 1, "<eos>": first_special if eos_inside else vocab}
    tok = Qwen2Tokenizer(vocab=words, merges=merges, unk_token="<eos>", eos_token="<eos>", pad_token="<pad>")
    tok.padding_side = "left"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # rlflow templates; TRL does not
    return tok


def build_inputs(root: Path, shape: str, args: argparse.Namespace, dtype: torch.dtype,
                 device: str = "cpu") -> tuple[Path, Path, Path]:
    """(model dir, train prompts, validation prompt): random weights, and prompts of exactly
    `--prompt-len` tokens (with `args.mix`, of the drawn lengths) through both frameworks' paths
    (plain tokenizer and rlflow's template). The weights are drawn on `device` (the CPU keeps this
    process free of a CUDA context, but takes minutes for a 7B shape)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    vocab = SHAPES[shape]["vocab_size"]
    mix = getattr(args, "mix", None)
    tok = build_tokenizer(vocab, eos_inside=mix is not None)
    eos = tok.eos_token_id if mix else None
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(4096, args.prompt_len + args.new),
                      eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tok = AutoTokenizer.from_pretrained(model_dir)  # check what both frameworks will load
    rng = random.Random(args.seed)
    first = tok.convert_tokens_to_ids("\u0120aaaa")  # the first 4-letter word: one token each
    word = lambda: tok.convert_ids_to_tokens(rng.randrange(first, min(vocab - 1, tok.eos_token_id)))[1:]  # noqa: E731
    count = args.prompts + 1
    lengths = prompt_lengths(count, args.prompt_len, args.seed) if mix else [args.prompt_len] * count
    texts = ["".join(" " + word() for _ in range(n)) for n in lengths]
    for text, n in zip(texts, lengths):
        templated = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        got = {len(tok(t, add_special_tokens=add)["input_ids"]) for t in (text, templated) for add in (False, True)}
        if got != {n} or tok.decode(tok(text)["input_ids"]) != text:
            raise SystemExit(f"a prompt tokenizes to {got} tokens, not {n}")
    rows = [{"prompt": t, "data_source": "e2e", "reward_model": {"ground_truth": ""}} for t in texts]
    files = root / "train.jsonl", root / "val.jsonl"
    for path, part in zip(files, (rows[:-1], rows[-1:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return model_dir, *files


# -- measurement helpers ---------------------------------------------------------------------

class DevicePeak:
    """Memory in use and busy time of every GPU (NVML, via nvidia-smi, twice a second) while a child
    process runs: one measure for both frameworks, whose processes (Ray workers included) this one
    cannot look into. `gib`: the highest any one GPU reached; `busy(t0, t1)`: each GPU's mean
    utilization (the share of time a kernel ran) between two wall-clock times."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[tuple[float, float]]]] = []  # (time, [(MiB used, util %) per GPU])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def read() -> list[tuple[float, float]] | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
            return [(float(used), float(util)) for used, util in (line.split(",") for line in out.strip().splitlines())]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            got = self.read()
            if got is None:
                return
            self.samples.append((time.time(), got))

    def __enter__(self) -> DevicePeak:
        if torch.cuda.is_available():
            # the previous job's processes (Ray workers) may still be exiting: let them free the GPUs first
            deadline = time.monotonic() + 60
            while max(used for used, _ in self.read() or [(0.0, 0.0)]) > 2048 and time.monotonic() < deadline:
                time.sleep(1)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def gib(self) -> float | None:
        used = [mib for _, gpus in self.samples for mib, _ in gpus]
        return max(used) / 1024 if used else None

    def busy(self, t0: float, t1: float) -> list[float]:
        inside = [gpus for t, gpus in self.samples if t0 <= t <= t1]
        return [statistics.mean(g[i][1] for g in inside) / 100 for i in range(len(inside[0]))] if inside else []


def run_logged(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run `cmd` from the repo root with its output in `log`, printing its wall time (to size a
    run's device time); (exit code, last 4000 characters)."""
    start = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    print(f"  {log.stem}'s job took {time.perf_counter() - start:.0f} s", flush=True)
    return rc, log.read_text()[-4000:]


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def summarise(steps: list[dict[str, float]], warmup: int, gpus: int = 1) -> dict[str, Any]:
    """Medians over the steps after warm-up, and what every step generated."""
    timed = steps[warmup:]
    med = lambda f: statistics.median(f(s) for s in timed)  # noqa: E731
    return {"step_s": med(lambda s: s["step_s"]), "gen_s": med(lambda s: s["gen_s"]), "gpus": gpus,
            "train_s": med(lambda s: s["step_s"] - s["gen_s"]),
            "tok_s_gpu": med(lambda s: s["tokens"] / s["step_s"] / gpus),
            "completion_len": [s["completion_len"] for s in steps], "prompt_len": [s["prompt_len"] for s in steps],
            "steps": steps}


# -- rlflow: the real job, read back from MLflow ---------------------------------------------

def rlflow_conf(args: argparse.Namespace, cuda: bool, model: Path, train: Path, val: Path, out: Path,
                variant: list[str] = (), experiment: str = EXPERIMENT) -> dict:
    gpu = dict(placement=dict(gpus_per_worker=1), model=dict(dtype="bfloat16"), rollout=dict(dtype="bfloat16"))
    conf = {
        "model": dict(path=str(model)),
        "data": dict(train_files=[str(train)], val_files=[str(val)], prompts_per_step=args.prompts,
                     max_prompt_tokens=args.prompt_len, overlong_prompts="error", val_max_prompts=1),
        "rollout": dict(samples_per_prompt=args.samples, max_new_tokens=args.new, temperature=1.0),
        "actor": dict(lr=args.lr, mini_batch_prompts=args.prompts, ppo_epochs=1,
                      micro_batch_tokens_per_gpu=micro_tokens(args)),
        "reward": dict(function=f"{BENCH / 'e2e_reward.py'}:rlflow_score"),
        # validation only at the end (it always runs there), greedy, on one prompt
        "trainer": dict(total_steps=args.steps, val_every=0, val_samples=0, output_dir=str(out),
                        experiment=experiment, resume="never", max_restarts=0, seed=args.seed,
                        log_checkpoint=False),  # the final checkpoint is saved, not copied into the run
    }
    for section, values in (gpu if cuda else {}).items():
        conf.setdefault(section, {}).update(values)
    for item in [*(getattr(args, "rlflow_set", None) or []), *variant]:  # --rlflow-set, then the variant's
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        conf.setdefault(section, {})[name] = yaml.safe_load(value)
    return conf


def micro_tokens(args: argparse.Namespace) -> int | str:
    """actor.micro_batch_tokens_per_gpu: auto (the trainer plans it from free memory) unless given."""
    if not args.rlflow_micro_tokens:
        return "auto"
    return max(args.rlflow_micro_tokens, args.prompt_len + args.new)  # rlflow needs room for one sequence


def gpus_used(conf_path: Path) -> int:
    """GPUs a job's pools take: the hybrid pool's and each GPU role's pool of its own."""
    from rlflow.engine.config import load_config

    cfg = load_config(conf_path)
    p = cfg.placement
    pools = 1 + sum(role in p.own_pool for role in ("rollout", "reference", "critic")) + \
        int("reward" in p.own_pool and bool(cfg.reward.model))
    return max(1, round(p.workers * p.gpus_per_worker * pools))


def non_defaults(conf_path: Path) -> dict[str, Any]:
    """The resolved config's keys that differ from rlflow's defaults."""
    from rlflow.engine.config import Config, load_config, to_dict
    from rlflow.engine.tracking import flatten

    got, default = flatten(to_dict(load_config(conf_path))), flatten(to_dict(Config()))
    return {k: v for k, v in got.items() if v != default[k]}


def tracking_uri(work: Path) -> str:
    # mlflow-skinny has no SQL store (no sqlalchemy): use a file store there
    return f"sqlite:///{work}/mlflow.db" if importlib.util.find_spec("sqlalchemy") else f"file://{work}/mlruns"


def read_metrics(uri: str, experiment: str = EXPERIMENT, finished: bool = True,
                 times: dict[int, float] | None = None) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of the only run in the bench's experiment (which must have
    finished, unless `finished` is false); `times` gets each step's wall-clock end (when its
    `timing_s/step` was logged)."""
    from mlflow import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the skinny package's store (see tracking_uri)
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    if finished and run.info.status != "FINISHED":
        raise SystemExit(f"rlflow's run ended {run.info.status}")
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    if times is not None:
        times.update({m.step: m.timestamp / 1e3 for m in history.get("timing_s/step", [])})
    return {k: {m.step: m.value for m in ms} for k, ms in history.items()}


def run_rlflow(args: argparse.Namespace, cuda: bool, model: Path, train: Path, val: Path, work: Path,
               name: str, variant: list[str]) -> dict:
    """One rlflow job named `name`, with the settings `variant` (one `--variant`'s) over the bench's."""
    slug = "".join(c if c.isalnum() else "_" for c in name)
    experiment = f"{EXPERIMENT}-{slug}"
    conf = work / f"rlflow_{slug}.yaml"
    conf.write_text(yaml.safe_dump(rlflow_conf(args, cuda, model, train, val, work / f"rlflow_{slug}_out", variant,
                                               experiment), sort_keys=False))
    settings, gpus = non_defaults(conf), gpus_used(conf) if cuda else 1
    print(f"  rlflow {name}{f' on {gpus} GPU(s)' if cuda else ''}, settings (non-default):",
          ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)
    uri = tracking_uri(work)
    env = child_env(MLFLOW_TRACKING_URI=uri, MLFLOW_ALLOW_FILE_STORE="true")
    if args.mix:  # the engine's sequences end at the drawn lengths, in every process of the job
        env.update(hook_dir(work / "length_mix_hook", args.mix)[1])
    log = work / f"rlflow_{slug}.log"
    with DevicePeak() as peak:
        rc, tail = run_logged([sys.executable, "-m", "rlflow.pipelines.cli", "train", str(conf)], log, env)
    for line in log.read_text().splitlines():  # the trainer's memory plan (engine/train/memory.py)
        if "trainer: micro-batches of" in line:
            print(f"  {line.strip()}", flush=True)
    if rc:
        raise SystemExit(f"rlflow ({name}) failed (exit {rc}); log {log}:\n{tail}")
    ends: dict[int, float] = {}
    m = read_metrics(uri, experiment, times=ends)
    steps = [{"step_s": m["timing_s/step"][i], "gen_s": m["timing_s/gen"][i], "tokens": m["perf/total_num_tokens"][i],
              "old_log_prob_s": m["timing_s/old_log_prob"][i], "update_s": m["timing_s/update_actor"][i],
              "completion_len": m["response_length/mean"][i], "prompt_len": m["prompt_length/mean"][i]}
             for i in range(1, args.steps + 1)]
    out = summarise(steps, args.warmup, gpus)
    if "timing_s/ref" in m:  # a reference model's forward, timed on its own
        for i, s in enumerate(steps, 1):
            s["ref_s"] = m["timing_s/ref"][i]
    logged = [max(v.values()) for k, v in m.items() if k.startswith("perf/max_memory_allocated_gb")]
    steady = range(args.warmup + 1, args.steps + 1)
    first = ends[steady[0]] - m["timing_s/step"][steady[0]]  # the first timed step's start
    out.update(busy=peak.busy(first, ends[args.steps]),  # each GPU's, over the timed steps
               staleness=statistics.median(m["async/staleness/mean"][i] for i in steady)
               if "async/staleness/mean" in m else 0.0)
    planned = m.get("actor/micro_batch_tokens", {})
    ckpt = " ckpt" if max(m.get("actor/activation_checkpointing", {0: 0}).values()) else ""
    micro = f"{int(max(planned.values()))}{ckpt} (planned)" if planned and micro_tokens(args) == "auto" else \
        f"{micro_tokens(args)}{ckpt}"
    out.update(framework="rlflow", mode=name, micro_batch=f"{micro} tokens",
               peak_gib=peak.gib, alloc_gib=max(logged) if logged else None, settings=settings,
               phase_alloc_gib={k.rpartition("/")[2]: max(v.values()) for k, v in m.items()
                                if k.startswith("perf/max_memory_allocated_gb/")},
               weight_sync_gb=max(m.get("perf/weight_sync_gb", {0: 0.0}).values()),
               phases={k: statistics.median(s[k] for s in steps[args.warmup:])
                       for k in ("old_log_prob_s", "ref_s", "update_s") if k in steps[0]})
    print(f"  rlflow {name}: step {out['step_s']:.3f} s = gen {out['gen_s']:.3f} + old logprobs "
          f"{out['phases']['old_log_prob_s']:.3f} + update {out['phases']['update_s']:.3f} + the rest (reward, "
          f"advantages, dispatch); staleness {out['staleness']:.2f}; GPUs busy "
          + (", ".join(f"{b:.0%}" for b in out["busy"]) or "-") + "; peak allocated by phase (GiB) "
          + (", ".join(f"{k} {v:.1f}" for k, v in out["phase_alloc_gib"].items()) or "-"), flush=True)
    return out


# -- TRL: GRPOTrainer in its own process --------------------------------------------------------

def trl_kwargs(args: argparse.Namespace, cuda: bool, mode: str, micro: int, out: Path) -> dict[str, Any]:
    batch = args.prompts * args.samples
    return dict(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=args.samples, max_completion_length=args.new, num_iterations=1, beta=0.0,
        learning_rate=args.lr, lr_scheduler_type="constant", max_steps=args.steps, temperature=1.0,
        loss_type="dapo", scale_rewards="group", epsilon=0.2, bf16=cuda, use_cpu=not cuda, use_vllm=False,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=args.seed,
        dataloader_num_workers=0, **TRL_MODES[mode])


def run_trl(args: argparse.Namespace, cuda: bool, mode: str, model: Path, train: Path, work: Path) -> dict:
    """One TRL mode; its micro-batch halves on CUDA OOM until it fits."""
    batch = args.prompts * args.samples
    micro = math.gcd(batch, args.trl_micro)  # divides the batch: one optimizer step per generation
    while True:
        spec = work / f"trl_{mode}.json"
        result = work / f"trl_{mode}_result.json"
        kwargs = trl_kwargs(args, cuda, mode, micro, work / f"trl_{mode}_out")
        spec.write_text(json.dumps({"model": str(model), "train": str(train), "kwargs": kwargs,
                                    "result": str(result), "mix": args.mix and asdict(args.mix)}))
        print(f"  TRL {mode}: micro-batch {micro} x {batch // micro} accumulation steps; GRPOConfig "
              + ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "output_dir"), flush=True)
        with DevicePeak() as peak:
            rc, tail = run_logged([sys.executable, str(BENCH / "e2e_trl.py"), str(spec)],
                                  work / f"trl_{mode}.log", child_env())
        if rc == 0:
            break
        if "out of memory" in tail.lower() and micro > 1 and batch % (micro // 2) == 0:
            print(f"  TRL {mode}: out of memory at micro-batch {micro}; halving", flush=True)
            micro //= 2
            continue
        raise SystemExit(f"TRL ({mode}) failed (exit {rc}); log {work / f'trl_{mode}.log'}:\n{tail}")
    got = json.loads(result.read_text())
    out = summarise(got["steps"], args.warmup)
    out.update(framework="TRL", mode=mode, micro_batch=f"{micro} seqs", peak_gib=peak.gib,
               alloc_gib=got["alloc_gib"], settings={k: v for k, v in kwargs.items() if k != "output_dir"})
    print(f"  TRL {mode}: step {out['step_s']:.3f} s = gen {out['gen_s']:.3f} + the rest; "
          f"{out['tok_s_gpu']:.0f} tok/s/GPU", flush=True)
    return out


# -- floors: what each phase cannot beat on this device ------------------------------------------

def device_rates() -> dict[str, float]:
    """This device's HBM TB/s and bf16 matmul TFLOP/s (bench/shapes.py: a 1 GiB copy, an 8192^3
    matmul), measured in a child process: this one stays free of a CUDA context, which the jobs'
    memory plans and peaks would count."""
    code = "import json, shapes; print(json.dumps(dict(tbps=shapes.copy_tbps(), tflops=shapes.matmul_tflops())))"
    out = subprocess.run([sys.executable, "-c", code], cwd=BENCH, env=child_env(), capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


# -- report ------------------------------------------------------------------------------------

def check_lengths(rows: list[dict], args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """Both frameworks did the same work: every prompt and every completion at full length, or, on
    the length mix, at the drawn lengths (every step runs every prompt; an answer may still end
    earlier on a sampled EOS, about one token in the vocabulary size: 1% is allowed)."""
    for r in rows:
        print(f"  {r['framework']} {r['mode']}: mean prompt length per step {r['prompt_len']}, "
              f"mean completion length per step {r['completion_len']}")
        if args.mix:
            want_p, want_c = sum(map(len, prompts)) / len(prompts), mean_answer(args.mix, prompts, args.samples)
            longest = max(answer_length(args.mix, p, j) for p in prompts for j in range(args.samples))
            print(f"    drawn: mean prompt length {want_p:.2f}, mean completion length {want_c:.2f}, longest "
                  f"{longest}")
            if any(abs(p - want_p) > 1e-6 for p in r["prompt_len"]) or \
                    any(not 0.99 * want_c <= c <= want_c + 1e-6 for c in r["completion_len"]):
                raise SystemExit(f"{r['framework']} ({r['mode']}) did not run the drawn lengths")
            continue
        if set(r["prompt_len"]) != {args.prompt_len} or set(r["completion_len"]) != {args.new}:
            raise SystemExit(f"{r['framework']} ({r['mode']}) did not run {args.prompt_len}-token prompts to "
                             f"{args.new}-token completions: prompts {r['prompt_len']}, "
                             f"completions {r['completion_len']}")


def table(rows: list[dict]) -> str:
    gib = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    lines = ["| shape | lengths | framework | mode | GPUs | micro-batch | step s | gen s | train s | tok/s/GPU "
             "| peak GiB (device) | alloc GiB | rlflow / best TRL |", "|---" * 13 + "|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['lengths']} | {r['framework']} | {r['mode']} | {r['gpus']} | "
                     f"{r['micro_batch']} | {r['step_s']:.3f} | "
                     f"{r['gen_s']:.3f} | {r['train_s']:.3f} | {r['tok_s_gpu']:,.0f} | {gib(r['peak_gib'])} | "
                     f"{gib(r['alloc_gib'])} | {r.get('ratio', '')} |")
    return "\n".join(lines)


def bench_shape(shape: str, lengths: str, args: argparse.Namespace, cuda: bool) -> list[dict]:
    dtype = torch.bfloat16 if cuda else torch.float32
    mixes = {"mix": Mix(args.seed, args.new), "reasoning": reasoning_mix(args.seed, args.new)}
    args = argparse.Namespace(**vars(args), mix=mixes.get(lengths))
    with tempfile.TemporaryDirectory(prefix=f"e2e_{shape}_") as tmp:
        work = Path(tmp)
        model, train, val = build_inputs(work, shape, args, dtype, "cuda" if cuda and args.init_on_gpu else "cpu")
        print(f"{shape}, {lengths} lengths: {args.prompts} prompts x {args.samples} samples, {args.prompt_len} -> "
              f"{args.new} tokens{' at most' if args.mix else ''}, {dtype}, {args.steps} steps ({args.warmup} "
              f"warm-up), work dir {work}", flush=True)
        rows = [run_rlflow(args, cuda, model, train, val, work, name, settings) for name, settings in args.variants]
        rows += [run_trl(args, cuda, mode, model, train, work) for mode in args.trl_modes]
        prompts = train_prompt_ids(model, train)
        check_lengths(rows, args, prompts)
    if args.rates:  # CUDA: each rlflow phase beside its floor
        from transformers import Qwen2Config

        answers = [answer_length(args.mix, p, j) if args.mix else args.new
                   for p in prompts for j in range(args.samples)]
        for r in rows[:len(args.variants)]:
            lora = bool(r["settings"].get("actor.lora_rank"))
            r["floors"] = against_floors(r, phase_floors(Qwen2Config(**SHAPES[shape]), list(map(len, prompts)),
                                                         answers, lora, args.rates), args.warmup)
            r["update_flops"] = 4 if lora else 6
            r["update_mfu"] = 1 / r["floors"]["update_s"]["ratio"]
            print_floors(r, args.rates)
    if len(args.variants) > 1:
        base = rows[0]
        print(f"  against {base['mode']}: " + "; ".join(
            f"{r['mode']} {base['step_s'] / r['step_s']:.2f}x the step rate, {r['tok_s_gpu'] / base['tok_s_gpu']:.2f}x "
            "the tokens/s/GPU" for r in rows[1:len(args.variants)]), flush=True)
    best = max((r["tok_s_gpu"] for r in rows if r["framework"] == "TRL"), default=None)
    for r in rows:
        r["shape"], r["lengths"] = shape, lengths
        r["ratio"] = f"{r['tok_s_gpu'] / best:.2f}x" if best and r["framework"] == "rlflow" else ""
    return rows


def train_prompt_ids(model: Path, train: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(json.loads(line)["prompt"])["input_ids"] for line in train.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help=f"repeatable or comma list of {sorted(SHAPES)}")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=256, help="tokens per completion (EOS never sampled); the mix's cap")
    ap.add_argument("--lengths", default="fixed",
                    help="comma list of fixed | mix | reasoning (bench/length_mix.py)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rlflow-micro-tokens", type=int, default=0,
                    help="rlflow actor.micro_batch_tokens_per_gpu; 0 = auto, planned by the trainer from the "
                         "GPU's free memory (the earlier fixed default was 32768, TRL's 64 x 512)")
    ap.add_argument("--rlflow-set", action="append", metavar="SECTION.KEY=VALUE",
                    help="an rlflow config setting for its job, e.g. actor.compile_layers=true (repeatable)")
    ap.add_argument("--variant", action="append", metavar="NAME[:SETTINGS]",
                    help="an rlflow job of its own, run side by side with the others: its name, then its "
                         "space-separated settings over --rlflow-set's, e.g. 'one_step: placement.own_pool=[rollout] "
                         "trainer.max_staleness=1' (repeatable; default: one job)")
    ap.add_argument("--init-on-gpu", action="store_true",
                    help="draw the random weights on the GPU (a 7B shape takes minutes on the CPU)")
    ap.add_argument("--trl-micro", type=int, default=64, help="TRL's first micro-batch try, in sequences")
    ap.add_argument("--trl-modes", default="default,no-ckpt",
                    help=f"comma list of {sorted(TRL_MODES)}; empty runs rlflow alone")
    ap.add_argument("--out", default=str(Path(os.environ["OUT"]) / "e2e.json") if os.environ.get("OUT")
                    else str(BENCH / "out" / "e2e.json"))
    args = ap.parse_args()
    shapes = [s for arg in args.shape or ["qwen2.5-0.5b,qwen2.5-1.5b"] for s in arg.split(",") if s]
    args.trl_modes = [m for m in args.trl_modes.split(",") if m]
    args.lengths = [m for m in args.lengths.split(",") if m]
    args.variants = [(name.strip(), settings.split()) for name, _, settings in map(lambda v: v.partition(":"),
                                                                                   args.variant or [])] \
        or [("compiled DAG", [])]  # no --variant: one job with the bench's settings
    if len({name for name, _ in args.variants}) != len(args.variants) or any(not n for n, _ in args.variants):
        raise SystemExit(f"--variant names must be given and differ: {[n for n, _ in args.variants]}")
    unknown = set(shapes) - set(SHAPES) | set(args.trl_modes) - set(TRL_MODES) | \
        set(args.lengths) - {"fixed", "mix", "reasoning"}
    if unknown:
        raise SystemExit(f"unknown shape or TRL mode: {sorted(unknown)}")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.trl_modes and importlib.util.find_spec("trl") is None:  # before the rlflow jobs, not after them
        raise SystemExit("TRL is not installed: pip install -e '.[bench]', or --trl-modes '' for rlflow alone")
    cuda = torch.cuda.is_available()
    if {"mix", "reasoning"} & set(args.lengths) and "cb" in args.trl_modes:
        raise SystemExit("TRL's cb mode (generate_batch) takes no logits processor: the mix cannot force its ends")
    args.rates = device_rates() if cuda else None  # for the floors, once, before the jobs
    rows = [r for shape in shapes for lengths in args.lengths for r in bench_shape(shape, lengths, args, cuda)]
    print("\n" + table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args),
                               "device": device_name(cuda), "results": rows}, indent=1))
    print(f"\nwrote {out}")


def device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "cuda"


if __name__ == "__main__":
    main()
