"""`rlhf bench data`'s synthetic folder is one the indexed reader opens, and a child's
measurement reports what it drew, the stored epoch order a row each, the computed one a batch."""

import json

import torch

from rlhf.bench.data import _child, _order_child, write_indexed
from rlhf.data.indexed import IndexedPromptDataset


def test_the_synthetic_folder_reads_back_and_is_measured(tmp_path):
    write_indexed(tmp_path / "idx", 50, seed=1)
    dataset = IndexedPromptDataset(tmp_path / "idx", None, max_prompt_length=64)
    batch = dataset.batch(torch.tensor([49, 0]))
    assert batch["raw_prompt"] == ["49+1=", "0+1="] and batch["ground_truth"] == ["50", "1"]
    lengths = batch["prompt_ids"].lengths.tolist()
    assert all(8 <= n < 24 for n in lengths)
    result = _child("indexed", str(tmp_path / "idx"), 8, str(tmp_path))
    assert result["rows"] == 50 and result["startup_s"] >= 0
    assert json.loads(json.dumps(result)) == result


def test_the_order_children_hold_a_row_each_or_one_batch():
    stored = _order_child("stored-order", 1000, 8)
    computed = _order_child("computed-order", 1000, 8)
    assert (stored["held"], computed["held"]) == (1000, 8)
    assert stored["rows"] == computed["rows"] == 1000 and computed["seconds"] >= 0
