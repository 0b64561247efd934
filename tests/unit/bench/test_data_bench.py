"""`rlhf bench data`'s synthetic folder is one the indexed reader opens, and a child's
measurement reports what it drew."""

import json

import torch

from rlhf.bench.data import _child, write_indexed
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
