"""`rlhf export-hf` from a checkpoint's metadata, its files shared out over processes: each
writes every `parts`-th file, and two processes write the folder one writes
(tests/dist/test_checkpoint_layouts.py compares it with the workers' export in every layout)."""

from safetensors.torch import load_file

import rlhf.engine.checkpoint as ckpt
from tests.unit.engine.test_engine import _engine


def _folder_tensors(folder):
    files = sorted(folder.glob("*.safetensors"))
    return {name: t for path in files for name, t in load_file(path).items()}, files


def test_processes_write_their_share_of_the_files_and_the_same_folder(folder, world, tmp_path):
    engine = _engine(folder)
    engine.save_checkpoint(tmp_path / "ckpt")
    plan = ckpt.hf_export_plan(tmp_path / "ckpt", bucket_bytes=100_000)
    assert len(plan) >= 3
    shares = []
    for part in range(2):
        (tmp_path / f"part{part}").mkdir()
        ckpt.write_hf_weight_files(tmp_path / "ckpt", tmp_path / f"part{part}", plan, part,
                                   parts=2)
        shares.append(sorted(p.name for p in (tmp_path / f"part{part}").iterdir()))
    assert shares == [[f for f, _ in plan[0::2]], [f for f, _ in plan[1::2]]]

    one = ckpt.export_hf_folder(tmp_path / "ckpt", tmp_path / "one", config_source=folder,
                                bucket_bytes=100_000)
    two = ckpt.export_hf_folder(tmp_path / "ckpt", tmp_path / "two", config_source=folder,
                                bucket_bytes=100_000, processes=2)
    (want, want_files), (got, got_files) = _folder_tensors(one), _folder_tensors(two)
    assert [p.name for p in got_files] == [p.name for p in want_files] == [f for f, _ in plan]
    assert got.keys() == want.keys() == {n for _, names in plan for n in names}
    for name, tensor in want.items():
        assert tensor.equal(got[name]), name
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    assert (two / "model.safetensors.index.json").read_text() == \
        (one / "model.safetensors.index.json").read_text()
