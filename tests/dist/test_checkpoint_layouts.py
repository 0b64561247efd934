"""Engine checkpoints saved in one layout and loaded into another (4 gloo processes, one launch).

For each case an engine in layout A takes a step and saves; an engine in layout B loads that
checkpoint and takes a second step, which must equal two uninterrupted steps in layout B
within fp32 tolerance (weights and grad norm): tp2 x dp2 with ZeRO-1 -> tp1 x pp2,
pp2 x vpp2 x dp2 (ZeRO-1, tied embeddings) -> tp2 x dp2, LoRA at tp2 x dp2 -> tp1. The tied
model has an odd vocabulary, so tp=2 pads it and the padding must stay out of the checkpoint.
The pp2 x vpp2 save is written in the background while A takes another step, which must not
reach the checkpoint.
Each checkpoint is also exported from its own metadata (no engine) and must equal the export
of the engine that loaded it. A format-2 checkpoint (the files per (pp, tp) coordinate that
runs wrote before DCP), written here by the old writer, still resumes at its own layout and
continues bit for bit.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import rlhf.engine.checkpoint as ckpt
from rlhf.config.schema import LoraConfig, ParallelConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.errors import RLHFError
from rlhf.files import atomic_write
from rlhf.models.build import build_model
from rlhf.models.hf_io import hf_config
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import OPTIM, SMALL, actor_loss_fn, exported, make_batch

TOL = 1e-5
SEEDS, N_SAMPLES, MAX_SEQS = (31, 32), 8, 2
BUCKET = 3000  # elements: ZeRO-1 pieces cut parameters mid-row
MODELS = {"llama": dict(arch="llama", tie_embeddings=False),
          "qwen3-tied-odd": dict(arch="qwen3", tie_embeddings=True, vocab_size=SMALL["vocab_size"] + 1)}
LORA = LoraConfig(r=4, lora_alpha=8.0)
# case -> model, (ranks, ParallelConfig kwargs) of A and of B, LoRA
CASES = {
    "tp2-dp2-zero1-to-tp1-pp2": ("llama", (4, dict(tp=2)), (2, dict(pp=2)), False),
    "pp2-vpp2-dp2-to-tp2-dp2": ("qwen3-tied-odd", (4, dict(pp=2, vpp=2)), (4, dict(tp=2)), False),
    "lora-tp2-dp2-to-tp1": ("llama", (4, dict(tp=2)), (1, {}), True),
    # cp ranks hold ZeRO-1 pieces too (the partition spans dp x cp): the plan exchange must
    # reach them, and a cp run resumes without cp
    "cp2-dp2-zero1-to-tp2": ("llama", (4, dict(cp=2)), (2, dict(tp=2)), False),
}
BACKGROUND = "pp2-vpp2-dp2-to-tp2-dp2"  # the case whose save is written in the background


def _engine(folder, ranks, parallel_kw, lora, cache):
    parallel = ParallelConfig(**parallel_kw)
    mesh = ParallelMesh(list(range(ranks)), tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                        cache=cache)
    if not mesh.is_member:
        return None
    built = build_model(folder, mesh=mesh, parallel=parallel, head="lm",
                        lora=LORA if lora else None)
    optim = dataclasses.replace(OPTIM, distributed=mesh.dp_size > 1)
    return TrainEngine(built, mesh, optim=optim, total_steps=10, bucket_numel=BUCKET)


def _step(engine, seed):
    batch = make_batch(seed, n=N_SAMPLES)
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=1000,
                             max_seqs=MAX_SEQS)
    local = mbs[engine.mesh.dp_rank::engine.mesh.dp_size]
    tokens, _ = engine.loss_normalizers(local, mask_key="loss_mask")
    engine.forward_backward(local, actor_loss_fn(tokens))
    return engine.step()["grad_norm"]


def _save_format2(engine, folder):
    """The writer of format 2 as runs used it before DCP (files per (pp, tp), per dp shard)."""
    state, mesh = engine.state_dict(), engine.mesh
    optim = state["optimizer"]
    if optim["shards"] > 1:
        with atomic_write(ckpt.optimizer_file(folder, mesh), "wb") as f:
            torch.save(optim, f)
        state = {**state, "optimizer": {"shards": optim["shards"], "sharded": True}}
    if mesh.dp_rank == 0:
        with atomic_write(ckpt.shard_file(folder, mesh), "wb") as f:
            torch.save({**state, ckpt.EXPERTS_KEY: False}, f)
    dist.barrier()


def _run_all(rank, world, folders, root):
    cache = ProcessGroupCache()
    results = {}
    for name, (model, (ranks_a, kw_a), (ranks_b, kw_b), lora) in CASES.items():
        folder, saved = folders[model], f"{root}/{name}"
        out = results[name] = {}
        first = _engine(folder, ranks_a, kw_a, lora, cache)
        if first is not None:
            _step(first, SEEDS[0])
            if name == BACKGROUND:  # written by a thread while A trains on: still step 1's state
                write = first.start_checkpoint(saved, background=True)
                _step(first, SEEDS[1])
                write.finish()
            else:
                first.save_checkpoint(saved)
            if name == "tp2-dp2-zero1-to-tp1-pp2":  # and in format 2, resumed at its layout
                _save_format2(first, f"{saved}-format2")
                old = _engine(folder, ranks_a, kw_a, lora, cache)
                assert old is not None  # the same ranks as `first`
                old.load_checkpoint(f"{saved}-format2")
                out["format2"] = (_step(old, SEEDS[1]), exported(old))
                out["uninterrupted_a"] = (_step(first, SEEDS[1]), exported(first))
        dist.barrier()
        resumed = _engine(folder, ranks_b, kw_b, lora, cache)
        if resumed is not None:
            resumed.load_checkpoint(saved)
            out["step_count"] = resumed.step_count
            out["loaded"] = exported(resumed)  # today's export, on the workers' layout
            if rank == 0:
                out["config"] = hf_config(resumed.model, folder)
                out["from_metadata"] = _export_from_metadata(saved, f"{saved}-hf", folder)
            out["resumed"] = (_step(resumed, SEEDS[1]), exported(resumed))
        plain = _engine(folder, ranks_b, kw_b, lora, cache)
        if plain is not None:
            out["uninterrupted"] = [_step(plain, s) for s in SEEDS][-1], exported(plain)
        if rank == 0:
            out["keys"] = set(dcp_keys(saved))
            out["shapes"] = dcp_shapes(saved)
    return results


def _export_from_metadata(saved, out, config_source):
    """`export_hf_folder` of checkpoint `saved` in files of about 40 KB (several per model):
    its tensors, config.json and file count; or the refusal of a LoRA checkpoint."""
    try:
        ckpt.export_hf_folder(saved, out, config_source=config_source, bucket_bytes=40_000)
    except RLHFError as e:
        return str(e)
    files = sorted(Path(out).glob("*.safetensors"))
    tensors = {}
    for path in files:
        tensors.update({k: v.float() for k, v in load_file(path).items()})
    return tensors, json.loads((Path(out) / "config.json").read_text()), len(files)


def dcp_keys(folder):
    return FileSystemReader(folder).read_metadata().state_dict_metadata


def dcp_shapes(folder):
    return {k: tuple(md.size) for k, md in dcp_keys(folder).items()
            if isinstance(md, TensorStorageMetadata)}  # all of them: the planner writes tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    folders = {name: str(make_tiny_model(TinyModelConfig(**{**SMALL, "num_layers": 4, **spec}),
                                         root / name)) for name, spec in MODELS.items()}
    return run_distributed(_run_all, 4, folders, str(root / "ckpt"), timeout_s=600), folders


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_loads_into_another_layout_and_steps_like_it(runs, name):
    per_rank, _ = runs
    ranks_b = CASES[name][2][0]
    for rank in range(ranks_b):
        got = per_rank[rank][name]
        assert got["step_count"] == 1, rank
        (norm, params), (want_norm, want) = got["resumed"], got["uninterrupted"]
        assert norm == pytest.approx(want_norm, rel=1e-5), rank
        assert params.keys() == want.keys()
        for key, tensor in want.items():
            assert (params[key] - tensor).abs().max() < TOL, (rank, key)


def test_global_tensors_have_hf_shapes_without_padding_and_ties_once(runs):
    per_rank, _ = runs
    shapes = per_rank[0]["pp2-vpp2-dp2-to-tp2-dp2"]["shapes"]
    vocab = MODELS["qwen3-tied-odd"]["vocab_size"]
    assert shapes["model/model.embed_tokens.weight"] == (vocab, SMALL["hidden_size"])
    assert shapes["optim/exp_avg/model.embed_tokens.weight"] == (vocab, SMALL["hidden_size"])
    assert not any("lm_head" in key for key in shapes)  # the tied head is the embedding
    lora_keys = per_rank[0]["lora-tp2-dp2-to-tp1"]["keys"]
    assert lora_keys and all(k.startswith("lora_base/") or "lora_" in k for k in lora_keys)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_export_from_the_metadata_equals_the_loaded_engines_export(runs, name):
    """rlhf export-hf without workers: the checkpoint's own tensors, written by file, against
    today's export of an engine that loaded it (tp gathers, pp broadcasts, padding cut)."""
    got = runs[0][0][name]
    if CASES[name][3]:  # LoRA: adapters only, the base is needed
        assert "holds LoRA adapters only" in got["from_metadata"]
        return
    tensors, config, files = got["from_metadata"]
    assert files > 1 and tensors.keys() == got["loaded"].keys()
    for key, want in got["loaded"].items():
        assert torch.equal(tensors[key], want), key
    assert config == got["config"]


def test_a_format2_checkpoint_still_resumes_at_its_layout(runs):
    per_rank, _ = runs
    for rank in range(4):
        got = per_rank[rank]["tp2-dp2-zero1-to-tp1-pp2"]
        (norm, params), (want_norm, want) = got["format2"], got["uninterrupted_a"]
        assert norm == want_norm, rank
        for key, tensor in want.items():
            assert torch.equal(params[key], tensor), (rank, key)


def test_a_format2_checkpoint_exists_in_the_old_shape(runs):
    """The old writer made what runs wrote before: per-(pp, tp) files and ZeRO-1 shards."""
    _, folders = runs
    old = Path(folders["llama"]).parent / "ckpt" / "tp2-dp2-zero1-to-tp1-pp2-format2"
    assert sorted(p.name for p in old.iterdir()) == [
        "engine_pp00_tp00.pt", "engine_pp00_tp01.pt", "optim_pp00_tp00_dp000.pt",
        "optim_pp00_tp00_dp001.pt", "optim_pp00_tp01_dp000.pt", "optim_pp00_tp01_dp001.pt"]
