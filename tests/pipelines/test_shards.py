import torch

from rlflow.engine.batch import Batch
from rlflow.pipelines.driver import even_cut
from rlflow.pipelines.grpo import balanced_shards
from rlflow.pipelines.runtime import shards


def test_balanced_shards_keep_groups_whole_and_even_out_each_mini_batch():
    lengths = [900, 950, 60, 70, 500, 55, 480, 65]  # response tokens per prompt group of 2 rows
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths for _ in range(2)])
    batch = Batch(torch.arange(16)[:, None], torch.ones(16, 1, dtype=torch.long), 2, [""] * 16, [""] * 16,
                  [None] * 16, response_ids=torch.zeros(16, width, dtype=torch.long), response_mask=mask)
    ranks = balanced_shards(batch, 2, 4)  # mini-batches of 4 groups, 2 per rank
    rows = [r.prompt_ids[:, 0].tolist() for r in ranks]
    assert sorted(rows[0] + rows[1]) == list(range(16))
    assert all(r[i] // 2 == r[i + 1] // 2 for r in rows for i in range(0, 8, 2))  # a group's rows stay together
    # the k-th mini-batch of each rank: the two long groups go to different ranks (contiguous: 3704 vs 264)
    tokens = [[float(r.prompt_mask[k].sum() + r.response_mask[k].sum()) for r in ranks]
              for k in (slice(0, 4), slice(4, 8))]
    assert tokens == [[2024, 1944], [1114, 1094]]


def test_prompt_shards_keep_every_prompt_in_order():
    assert shards(list(range(8)), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards(list(range(5)), 2) == [[0, 1], [2, 3, 4]]  # validation sets need not divide
    assert shards([0], 2) == [[], [0]]


def test_an_even_cut_says_what_it_leaves_out(capsys):
    assert even_cut(list(range(5)), 2, "validation pairs") == ([0, 1, 2, 3], 1)
    assert "validation pairs: 1 of 5 left out" in capsys.readouterr().out
    assert even_cut(list(range(4)), 2, "validation pairs") == ([0, 1, 2, 3], 0)
    assert capsys.readouterr().out == ""
