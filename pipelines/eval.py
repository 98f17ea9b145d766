"""Evaluate a policy: one greedy and k sampled answers per prompt, scored, summarised, tracked.

For every prompt of `data.val_files` (the first `data.val_max_prompts` of them, as training's
validation takes; 0 = all) the model answers once greedily and k times by sampling
(k = `rollout.samples_per_prompt`, with the rollout's temperature, top-p and top-k). Each answer
is scored by the configured reward (`reward.function`, or the built-in scorer of its
`data_source`); an answer is correct when its score is at least 1.0. Reported overall and per
data_source:
- `accuracy`: the fraction of greedy answers that are correct;
- `mean_at_<k>`: the mean score of the sampled answers (mean@k);
- `pass_at_<j>` for j = 1, 2, 4, ..., k: the unbiased pass@j estimate from the k samples.

The same rollout and reward stages as training's validation, on a pool of `placement.workers`
workers (`placement.gpus_per_worker` GPUs each) and through the same calls (`grpo.rollout`); no
trainer is built. A worker that dies, or stops moving for `trainer.stall_timeout_s`, has the
pool rebuilt and the evaluation run again, up to `trainer.max_restarts` times. The results go to
their own MLflow run, tagged `job=eval`, as metrics `eval/<data_source>/<name>` and `eval/<name>`,
with one row per prompt in the `eval/prompts.json` table.

Run: `rlflow eval CHECKPOINT|OUTPUT_DIR|HF_DIR [CONFIG.yaml] [key=value ...]`.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from rlflow.engine.agents.env import offered_tools
from rlflow.engine.batch import Batch
from rlflow.engine.config import Config
from rlflow.engine.data.prompts import load_prompts
from rlflow.engine.tracking import Tracker
from rlflow.pipelines import hangs
from rlflow.pipelines.grpo import summarise
from rlflow.pipelines.runtime import WORKER_LOST, how_lost, launch_scoring, rollout


def generate_and_score(cfg: Config, model_dir: Path, prompts: list) -> tuple[list[Batch], list[Batch]]:
    """The greedy and the sampled batches of `prompts` (in prompt order), on workers rebuilt and
    run again when one is lost."""
    t, restarts = cfg.trainer, 0
    dog = hangs.Watchdog(t.stall_timeout_s, Path(t.output_dir) / "hang")
    while True:
        scoring = None
        try:
            scoring = launch_scoring(cfg, str(model_dir))
            with dog.watching([scoring.pool], [scoring.generator, scoring.reward], f"eval_{restarts}"):
                greedy = rollout(scoring.generator, scoring.reward, prompts, 0, greedy=True)
                sampled = rollout(scoring.generator, scoring.reward, prompts, 0,
                                  samples=cfg.rollout.samples_per_prompt)
            return [b for b in greedy if len(b)], [b for b in sampled if len(b)]
        except WORKER_LOST as e:
            why = hangs.lost(how_lost(e), [scoring.pool] if scoring else [],
                             [scoring.generator, scoring.reward] if scoring else [],
                             Path(t.output_dir) / "hang" / f"eval_{restarts}")
            print(f"rlflow: a worker {why} during the evaluation ({type(e).__name__})", flush=True)
            if restarts >= t.max_restarts:
                raise
            restarts += 1
            print(f"rlflow: restart {restarts}/{t.max_restarts}", flush=True)
        finally:
            if scoring is not None:
                scoring.shutdown()


def evaluate(cfg: Config, model_dir: Path, files: list[str], tracker: Tracker) -> dict[str, float]:
    """Score `model_dir` on `files`; logs and returns the metrics."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, counts = load_prompts(files, tokenizer, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts,
                                   offered_tools(cfg.rollout.env))
    prompts = prompts[:cfg.data.val_max_prompts or None]
    greedy, sampled = generate_and_score(cfg, model_dir, prompts)
    k = cfg.rollout.samples_per_prompt
    greedy_scores = [float(x) for b in greedy for x in b.scores]
    sampled_scores = [row for b in sampled for row in b.scores.view(-1, k).tolist()]
    metrics = summarise("eval/", [p.data_source for p in prompts], greedy_scores, sampled_scores)
    metrics["eval/reward_errors"] = sum(b.metrics.get("reward/errors", 0.0) for b in greedy + sampled)
    tracker.log_metrics({**metrics, **{f"data/{k}": v for k, v in counts.items()}}, step=0)
    responses = [r for b in greedy for r in b.responses]
    tracker.log_table([{"prompt": p.text, "data_source": p.data_source, "ground_truth": p.ground_truth,
                        "greedy_response": t, "greedy_score": g, "sampled_correct": sum(x >= 1.0 for x in s),
                        "samples": len(s)}
                       for p, t, g, s in zip(prompts, responses, greedy_scores, sampled_scores)],
                      "eval/prompts.json")
    return metrics
