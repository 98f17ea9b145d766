"""engine/data/prompts.py: row parsing and skip accounting, file formats, and loader order and resume."""

from __future__ import annotations

import json
import logging
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlflow.engine.batch import RolloutRequest
from rlflow.engine.data import task
from rlflow.engine.data.prompts import (
    DataError,
    Example,
    Pair,
    Prompt,
    PromptLoader,
    embedded_files,
    examples_batch,
    load_examples,
    load_pairs,
    load_prompts,
    pairs_batch,
    read_rows,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # Saved and reloaded once: the pipeline always loads the tokenizer from a HF directory.
    path = tmp_path_factory.mktemp("tok")
    task.build_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def row(content="1+2=", truth="3", source="arith", **extra) -> dict:
    return {"prompt": [{"role": "user", "content": content}], "data_source": source,
            "reward_model": {"ground_truth": truth}, "extra_info": {"index": 0}, **extra}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def check_counts(counts: dict[str, int]) -> None:
    assert counts["rows"] == counts["kept"] + counts["overlong"] + counts["malformed"]


def test_parquet_and_jsonl_give_identical_prompts(tmp_path, tokenizer) -> None:
    rows = [row(f"{a}+{a}=", str(2 * a)) for a in range(5)]
    pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    from_parquet, counts = load_prompts([str(tmp_path / "p.parquet")], tokenizer, 64)
    from_jsonl, _ = load_prompts([write_jsonl(tmp_path / "p.jsonl", rows)], tokenizer, 64)
    assert from_parquet == from_jsonl
    assert counts == {"rows": 5, "kept": 5, "overlong": 0, "malformed": 0}
    assert from_parquet[3] == Prompt(tokenizer.encode("3+3=", add_special_tokens=False),
                                     "arith", "6", {"index": 0}, "3+3=")


def test_chat_template_and_string_prompts(tmp_path, tokenizer) -> None:
    rows = [{**row(), "prompt": [{"role": "system", "content": "Add. "}, {"role": "user", "content": "4+5="}]},
            {**row(), "prompt": "7+1=", "reward_model": {"ground_truth": 8}}]  # plain string, int answer
    prompts, _ = load_prompts([write_jsonl(tmp_path / "t.jsonl", rows)], tokenizer, 64)
    # The embedded template concatenates message contents; no specials are added around them.
    assert [tokenizer.decode(p.ids) for p in prompts] == ["Add. 4+5=", "7+1="]
    assert [p.text for p in prompts] == ["Add. 4+5=", "7+1="]
    assert prompts[1].ground_truth == "8"
    assert tokenizer.eos_token_id not in prompts[0].ids


def test_malformed_rows_are_counted_by_reason(tmp_path, tokenizer, caplog) -> None:
    no_reward = row()
    del no_reward["reward_model"]
    rows = [row(), no_reward, {**row(), "prompt": 5}, {**row(), "prompt": {"role": "user"}},
            {**row(), "prompt": []}, {**row(), "prompt": "  "}, {**row(), "prompt": [{"role": "user"}]},
            {**row(), "data_source": None}, {**row(), "extra_info": "not a dict"}, row("9+9=", "18")]
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        prompts, counts = load_prompts([write_jsonl(tmp_path / "m.jsonl", rows)], tokenizer, 64)
    assert [p.text for p in prompts] == ["1+2=", "9+9="]
    assert counts == {"rows": 10, "kept": 2, "overlong": 0, "malformed": 8,
                      "malformed/missing_ground_truth": 1, "malformed/prompt_type": 2,
                      "malformed/empty_prompt": 2, "malformed/message_content": 1,
                      "malformed/data_source": 1, "malformed/extra_info_type": 1}
    assert len([r for r in caplog.records if r.name == "rlflow.data"]) == 1


def test_text_that_is_not_utf8_is_skipped(tmp_path, tokenizer) -> None:
    message = pa.struct([("role", pa.string()), ("content", pa.binary())])
    table = pa.table({
        "prompt": pa.array([[{"role": "user", "content": b"2+2="}], [{"role": "user", "content": b"\xff="}]],
                           type=pa.list_(message)),
        "data_source": ["arith", "arith"],
        "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}],
    })
    pq.write_table(table, tmp_path / "b.parquet")
    prompts, counts = load_prompts([str(tmp_path / "b.parquet")], tokenizer, 64)
    assert [p.text for p in prompts] == ["2+2="]  # valid UTF-8 bytes are decoded, not dropped
    assert counts["malformed/bad_text"] == 1


def test_overlong_is_skipped_or_raises_never_truncated(tmp_path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "o.jsonl", [row("1+1="), row("12345+1="), row("2+2=")])
    prompts, counts = load_prompts([path], tokenizer, max_prompt_tokens=4)
    assert [p.text for p in prompts] == ["1+1=", "2+2="]
    assert counts["overlong"] == 1 and all(len(p.ids) <= 4 for p in prompts)
    check_counts(counts)
    with pytest.raises(DataError, match=r"o.jsonl:2: prompt is 8 tokens.*max_prompt_tokens=4"):
        load_prompts([path], tokenizer, max_prompt_tokens=4, overlong="error")


def test_a_refused_row_is_named_where_a_user_can_find_it(tmp_path, tokenizer) -> None:
    """jsonl: the file's 1-based line, counting the blank and bad lines dropped before it;
    parquet: the 0-based row index, said to be one."""
    path = tmp_path / "o.jsonl"
    good, long = json.dumps(row("1+1=")), json.dumps(row("12345+1="))
    path.write_text("\n".join([good, "", "{not json", good, long]) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:5: prompt is 8 tokens"):
        load_prompts([str(path)], tokenizer, max_prompt_tokens=4, overlong="error")
    pd.DataFrame([row("1+1="), row("2+2="), row("12345+1=")]).to_parquet(tmp_path / "o.parquet")
    with pytest.raises(DataError, match=r"o.parquet row 2 \(0-based\): prompt is 8 tokens"):
        load_prompts([str(tmp_path / "o.parquet")], tokenizer, max_prompt_tokens=4, overlong="error")


def test_mixed_formats_concatenate_in_file_order(tmp_path, tokenizer) -> None:
    json_path = tmp_path / "a.json"
    json_path.write_text(json.dumps([row("1+1="), {**row(), "prompt": 3}]))
    pd.DataFrame([row("2+2=")]).to_parquet(tmp_path / "b.parquet")
    files = [str(json_path), str(tmp_path / "b.parquet"), write_jsonl(tmp_path / "c.jsonl", [row("3+3=")])]
    prompts, counts = load_prompts(files, tokenizer, 64)
    assert [p.text for p in prompts] == ["1+1=", "2+2=", "3+3="]
    assert counts["rows"] == 4 and counts["malformed"] == 1


def test_unusable_inputs_raise(tmp_path, tokenizer) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 1}, {**row(), "prompt": []}])
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts([bad], tokenizer, 64)
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts([write_jsonl(tmp_path / "long.jsonl", [row("1234567890=")])], tokenizer, 4)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        load_prompts([str(tmp_path / "missing.parquet")], tokenizer, 64)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts([str(tmp_path / "x.csv")], tokenizer, 64)


def test_jsonl_lines_that_are_not_objects_are_counted_and_named(tmp_path, tokenizer, caplog) -> None:
    path = tmp_path / "j.jsonl"
    good = [json.dumps(row(f"{a}+1=", str(a + 1))) for a in range(3)]
    path.write_text("\n".join([good[0], good[1][:20], "", "[1, 2]", good[2]]) + "\n")  # truncated, blank, a list
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        prompts, counts = load_prompts([str(path)], tokenizer, 64)
    assert [p.text for p in prompts] == ["0+1=", "2+1="]
    assert counts == {"rows": 4, "kept": 2, "overlong": 0, "malformed": 2, "malformed/bad_json": 2}
    check_counts(counts)
    [record] = [r for r in caplog.records if r.name == "rlflow.data"]
    assert f"bad_json at {path}:2, {path}:4" in record.getMessage()
    assert len(read_rows(str(path))) == 2  # what the tracker logs as the run's dataset: the rows that parse


def test_a_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, tokenizer) -> None:
    (tmp_path / "c.parquet").write_bytes(b"not a parquet file")
    (tmp_path / "c.json").write_text('[{"prompt": "1+1=", ')
    for name in ("c.parquet", "c.json"):
        with pytest.raises(DataError) as raised:
            load_prompts([str(tmp_path / name)], tokenizer, 64)
        message = str(raised.value)
        assert message.startswith(f"could not read {tmp_path / name} as ") and "\n" not in message
        assert "DatasetGenerationError" not in message  # the innermost error, not the chain's repr


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt([i], "arith", str(i), None, str(i)) for i in range(n)]


def ids(batch: list[Prompt]) -> list[int]:
    return [p.ids[0] for p in batch]


def test_loader_is_deterministic_and_seed_dependent() -> None:
    runs = [[ids(PromptLoader(make_prompts(20), 4, seed).next_batch())] for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    plain = PromptLoader(make_prompts(6), 3, seed=0, shuffle=False)
    assert [ids(plain.next_batch()) for _ in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_loader_epoch_rollover_drops_the_remainder() -> None:
    loader = PromptLoader(make_prompts(10), 4, seed=3)
    epoch0 = ids(loader.next_batch()) + ids(loader.next_batch())
    assert loader.state_dict() == {"epoch": 0, "position": 8, "seed": 3}
    epoch1 = ids(loader.next_batch()) + ids(loader.next_batch())
    assert loader.state_dict() == {"epoch": 1, "position": 8, "seed": 3}
    assert len(set(epoch0)) == len(set(epoch1)) == 8  # no repeats within an epoch
    assert epoch0 != epoch1  # a fresh permutation each epoch
    with pytest.raises(ValueError, match="batch_size"):
        PromptLoader(make_prompts(3), 4, seed=0)


def test_loader_resumes_exactly_from_state_dict() -> None:
    a = PromptLoader(make_prompts(13), 4, seed=7)
    for _ in range(5):  # crosses an epoch boundary (3 full batches per epoch)
        a.next_batch()
    b = PromptLoader(make_prompts(13), 4, seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as a checkpoint would store it
    assert [ids(a.next_batch()) for _ in range(3)] == [ids(b.next_batch()) for _ in range(3)]


def test_loader_peeks_batches_ahead_without_moving() -> None:
    """Generation running ahead submits the coming steps' prompts before any step takes them."""
    loader = PromptLoader(make_prompts(13), 4, seed=7)
    loader.next_batch()
    state = loader.state_dict()
    peeked = [ids(loader.peek_batch(skip)) for skip in range(4)]  # crosses an epoch boundary
    assert loader.state_dict() == state
    assert peeked == [ids(loader.next_batch()) for _ in range(4)]


def test_embedded_files_build_once_and_load(tmp_path, tokenizer) -> None:
    paths = embedded_files(tmp_path, seed=0)
    assert paths == {"train": str(tmp_path / "data/train.parquet"), "val": str(tmp_path / "data/val.parquet")}
    stamp = Path(paths["train"]).stat().st_mtime_ns
    assert embedded_files(tmp_path, seed=0) == paths and Path(paths["train"]).stat().st_mtime_ns == stamp
    prompts, counts = load_prompts([paths["val"]], tokenizer, 64)
    assert counts["kept"] == counts["rows"] == 256 and prompts[0].data_source == "arith"


def pair(prompt="1+2=", chosen="3", rejected="4", **extra) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


def test_pair_loader_counts_malformed_and_overlong_rows(tmp_path, tokenizer, caplog) -> None:
    rows = [pair(data_source="arith"), pair(prompt=[{"role": "user", "content": "2+2="}], chosen="4", rejected="5"),
            pair(chosen=None), pair(rejected=None), pair(chosen="3", rejected=" 3 "), pair(chosen="  "),
            pair(prompt=[]), pair(prompt="9" * 20), pair(rejected="12345678")]
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        pairs, counts = load_pairs([write_jsonl(tmp_path / "p.jsonl", rows)], tokenizer, 8, 4)
    assert counts == {"rows": 9, "kept": 2, "overlong": 2, "malformed": 5, "malformed/chosen": 1,
                      "malformed/rejected": 1, "malformed/same_answer": 1, "malformed/empty_chosen": 1,
                      "malformed/empty_prompt": 1}
    check_counts(counts)
    assert "skipped 7 of 9 pair rows" in caplog.text
    eos = tokenizer.eos_token_id
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert pairs[0] == Pair(enc("1+2="), enc("3") + [eos], enc("4") + [eos], "arith", "1+2=")
    assert pairs[1].data_source == "preference" and pairs[1].rejected == enc("5") + [eos]
    with pytest.raises(ValueError, match=r"p.jsonl:8: prompt is 20 tokens.*pairs are never truncated"):
        load_pairs([str(tmp_path / "p.jsonl")], tokenizer, 8, 4, overlong="error")


def test_sft_loader_takes_response_rows_and_ground_truth_rows(tmp_path, tokenizer, caplog) -> None:
    sft = lambda **kw: {"prompt": "2+2=", "response": "4", **kw}  # noqa: E731
    rows = [sft(), sft(prompt=[{"role": "user", "content": "5+"}, {"role": "user", "content": "6="}], response="11"),
            row(truth=7), sft(response=None), sft(response="  "), sft(prompt=[]),
            sft(data_source=1), sft(response="12345678"), sft(prompt="9" * 20)]
    with caplog.at_level(logging.WARNING, logger="rlflow.data"):
        examples, counts = load_examples([write_jsonl(tmp_path / "s.jsonl", rows)], tokenizer, 8, 4)
    assert counts == {"rows": 9, "kept": 3, "overlong": 2, "malformed": 4, "malformed/no_response_or_ground_truth": 1,
                      "malformed/empty_response": 1, "malformed/empty_prompt": 1, "malformed/data_source": 1}
    check_counts(counts)
    assert "skipped 6 of 9 example rows" in caplog.text
    eos = tokenizer.eos_token_id
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert examples == [Example(enc("2+2="), enc("4") + [eos]), Example(enc("5+6="), enc("11") + [eos]),
                        Example(enc("1+2="), enc("7") + [eos])]  # the ground truth 7 (an int) as the response
    with pytest.raises(ValueError, match=r"s.jsonl:8: response is 9 tokens.*examples are never truncated"):
        load_examples([str(tmp_path / "s.jsonl")], tokenizer, 8, 4, overlong="error")


def test_a_multi_turn_demonstration_trains_its_assistant_turns_only(tmp_path, tokenizer) -> None:
    """A `response` of chat turns: each assistant turn is its content and eos, trained; a tool turn
    between is rendered by the chat template (the embedded one brackets it), not trained."""
    turns = [{"role": "assistant", "content": "<<calc:6*7>>"}, {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "42"}]
    rows = [{"prompt": "6*7=", "response": turns}, {"prompt": "1*1=", "response": [{"role": "tool", "content": "1"}]}]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    examples, counts = load_examples([write_jsonl(tmp_path / "d.jsonl", rows)], tokenizer, 16, 32, tools=tools)
    assert counts["malformed/no_assistant_turn"] == 1
    eos, enc = tokenizer.eos_token_id, lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    call, result, answer = enc("<<calc:6*7>>") + [eos], enc("[42]"), enc("42") + [eos]
    assert examples[0] == Example(enc("<calc>6*7="), call + result + answer,
                                  [1.0] * len(call) + [0.0] * len(result) + [1.0] * len(answer))
    batch = examples_batch(examples + [Example(enc("2+2="), enc("4") + [eos])], 0)
    assert batch.loss_mask[0, :len(call) + len(result) + len(answer)].tolist() == examples[0].trained
    assert batch.loss_mask[1].tolist() == batch.response_mask[1].tolist(), "a plain example trains every token"


def test_sft_reads_trls_messages_and_prompt_completion_rows(tmp_path, tokenizer) -> None:
    """TRL's dataset shapes: a conversation (`messages`: the turns before the first assistant turn
    are the prompt), and prompt/completion as strings or as chat messages."""
    user = lambda c: {"role": "user", "content": c}  # noqa: E731
    bot = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    rows = [{"messages": [user("2+2="), bot("4")]},
            {"prompt": "2+2=", "completion": "4"},
            {"prompt": [user("2+2=")], "completion": [bot("4")]},
            {"messages": [user("2+2="), bot("4"), user("5+5="), bot("10")]},
            {"messages": [user("2+2=")]}, {"messages": [bot("4"), user("x")]}]
    examples, counts = load_examples([write_jsonl(tmp_path / "t.jsonl", rows)], tokenizer, 16, 64)
    assert (counts["kept"], counts["malformed/no_assistant_turn"], counts["malformed/no_prompt"]) == (4, 1, 1)
    eos, enc = tokenizer.eos_token_id, lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    four = enc("4") + [eos]
    assert examples[1] == Example(enc("2+2="), four)
    assert examples[0] == examples[2] == Example(enc("2+2="), four, [1.0] * len(four))
    from rlflow.engine.data.prompts import Renderer  # the second user turn, rendered as an episode's observation

    between, ten = Renderer(tokenizer, None)([user("5+5=")], ended=True), enc("10") + [eos]
    assert examples[3] == Example(enc("2+2="), four + between + ten,
                                  [1.0] * len(four) + [0.0] * len(between) + [1.0] * len(ten))


def test_dpo_reads_trls_conversational_pairs(tmp_path, tokenizer) -> None:
    """The answers as chat messages: with an explicit prompt, or with the prompt implicit in the
    turns both conversations share; each gives the same pair as the plain row."""
    user = lambda c: {"role": "user", "content": c}  # noqa: E731
    bot = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    rows = [pair(), {"prompt": [user("1+2=")], "chosen": [bot("3")], "rejected": [bot("4")]},
            {"chosen": [user("1+2="), bot("3")], "rejected": [user("1+2="), bot("4")]},
            {"chosen": [user("1+2="), bot("3")], "rejected": [user("1+3="), bot("4")]},
            {"chosen": [user("1+2="), user("3")], "rejected": [user("1+2="), bot("4")]},
            {"prompt": [user("1+2=")], "chosen": [bot("3"), bot("3")], "rejected": [bot("4")]}]
    pairs, counts = load_pairs([write_jsonl(tmp_path / "c.jsonl", rows)], tokenizer, 8, 4)
    assert (counts["kept"], counts["malformed/no_shared_prompt"], counts["malformed/answer_not_assistant"],
            counts["malformed/answer_turns"]) == (3, 1, 1, 1)
    assert pairs[0] == pairs[1] == pairs[2]


def test_pairs_batch_keeps_each_pair_together(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    pairs = [Pair([5, 6, 7], [8, eos], [9, 9, eos], "a", "x"), Pair([5], [8, 8, 8, eos], [9, eos], "b", "y")]
    b = pairs_batch(pairs, 0)
    assert b.group_size == 2 and len(b) == 4 and b.data_source == ["a", "a", "b", "b"]
    ids, mask, _ = b.sequences()
    real = [ids[i][mask[i].bool()].tolist() for i in range(4)]
    assert real == [[5, 6, 7, 8, eos], [5, 6, 7, 9, 9, eos], [5, 8, 8, 8, eos], [5, 9, eos]]


def test_embedded_pairs_match_the_embedded_prompts(tmp_path) -> None:
    prompts = pd.read_parquet(task.build_data(tmp_path / "d", n_train=300, n_val=40)["train"])
    pairs = pd.read_parquet(task.build_pairs(tmp_path / "p", n_train=300, n_val=40)["train"])
    assert [p[0]["content"] for p in prompts["prompt"]] == [p[0]["content"] for p in pairs["prompt"]]
    assert [r["ground_truth"] for r in prompts["reward_model"]] == pairs["chosen"].tolist()
    assert all(c != r and r.isdigit() and len(r) == len(c) == 3 for c, r in zip(pairs["chosen"], pairs["rejected"]))
    unpadded = pd.read_parquet(task.build_pairs(tmp_path / "u", n_train=300, n_val=40, pad=False)["train"])
    assert all(c != r and r.isdigit() and (r == "0" or r[0] != "0")
               for c, r in zip(unpadded["chosen"], unpadded["rejected"]))


def test_embedded_problems_are_zero_padded_sums(tmp_path) -> None:
    rows = pd.read_parquet(task.build_data(tmp_path / "d", n_train=300, n_val=40)["train"])
    for prompt, truth in zip(rows["prompt"], rows["reward_model"]):
        a, b = prompt[0]["content"].rstrip("=").split("+")
        assert len(a) == len(b) == 2 and truth["ground_truth"] == f"{int(a) + int(b):03d}"
    assert task.problem(7, 45, 2) == ("07+45=", "052") and task.problem(7, 45, 2, pad=False) == ("7+45=", "52")


def test_a_worker_taking_its_first_prompts_does_not_import_the_file_readers():
    """Stage workers get Prompt objects pickled in a step's requests and never read a file: the
    unpickling imports engine.data.prompts, which must not import `datasets` (half a second, paid
    inside the first step of every start)."""
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print('datasets' in sys.modules)"
    request = RolloutRequest([Prompt([1, 2], "src", "3", None, "text")], 0)
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(request), capture_output=True,
                         check=True, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.decode().strip() == "False"
