"""The boxes an engine checkpoint describes: a flat range of a tensor as rectangles, and the
damage a load reports before reading (tests/dist/test_checkpoint_layouts.py loads across
layouts)."""

import math

import pytest
import torch

from rlhf.engine.checkpoint import flat_boxes
from rlhf.errors import RLHFError
from tests.unit.engine.reference import make_batch
from tests.unit.engine.test_engine import _engine, _train_step


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (4, 1, 3), (1, 1)])
def test_flat_ranges_become_contiguous_boxes_covering_them_once(shape):
    n = math.prod(shape)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            hits = torch.zeros(shape, dtype=torch.int64)
            at = start
            boxes = flat_boxes(shape, start, stop)
            for flat_start, offsets, sizes in boxes:
                assert flat_start == at  # in order, each a contiguous run of the range
                hits[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                at += math.prod(sizes)
            assert at == stop
            flat = hits.view(-1)
            assert (flat[start:stop] == 1).all() and int(flat.sum()) == stop - start
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_truncated_or_missing_data_file_is_named_before_any_read(folder, world, tmp_path):
    engine = _engine(folder)
    _train_step(engine, make_batch(6))
    engine.save_checkpoint(tmp_path / "ckpt")
    data = tmp_path / "ckpt" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(RLHFError, match=rf"__0_0.distcp has {size // 2} bytes .* \(truncated\?\)"):
        _engine(folder).load_checkpoint(tmp_path / "ckpt")
    data.unlink()
    with pytest.raises(RLHFError, match=r"__0_0.distcp is missing: .* copy the whole"):
        _engine(folder).load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(RLHFError, match="holds no engine checkpoint"):
        _engine(folder).load_checkpoint(tmp_path / "nothing")
