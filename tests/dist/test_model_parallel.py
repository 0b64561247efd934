"""Whole models under tensor/sequence parallelism against transformers and against tp=1.

The references are computed here, in the pytest process: HF's model run sequence by sequence
(logits, next-token log-probs, entropy, grads of one loss) and our unsharded ValueModel for the
critic. Each spawned run (4 ranks for the layout matrix, 2 for colocated roles) performs every
check and returns max abs errors; the tests below assert on them (fp32, within 1e-5).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config.schema import OptimizerConfig, ParallelConfig, TinyModelConfig
from rlhf.data.packing import pack, shifted_targets
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine
from rlhf.errors import ConfigError
from rlhf.models.build import build_model
from rlhf.models.config import ModelArgs
from rlhf.models.export import export_full_hf_weights
from rlhf.models.gate_up import paired_weight
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.outputs import forward_packed, model_outputs, sp_pad, vocab_shard
from rlhf.models.tp_sharding import apply_tp, check_tp_compatible
from rlhf.models.transformer import MLP, CausalLM, ValueModel
from rlhf.parallel import collectives as C
from rlhf.parallel.launch import run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

TOL = 1e-5
FLAGS = ("local_shapes_ok", "gate_up_paired")  # checks every rank must pass (not errors)
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, intermediate_size=96,
             max_position_embeddings=64)
# name -> (arch, tied, kv heads, vocab). kv=2 allows tp <= 2; vocab 515 divides by neither 2 nor 4.
VARIANTS = {
    "llama-untied": ("llama", False, 2, 384), "llama-tied": ("llama", True, 4, 384),
    "qwen2-untied": ("qwen2", False, 4, 384), "qwen2-tied": ("qwen2", True, 2, 384),
    "qwen3-untied": ("qwen3", False, 4, 384), "qwen3-tied": ("qwen3", True, 2, 384),
    "llama-v515-untied": ("llama", False, 4, 515), "qwen3-v515-tied": ("qwen3", True, 4, 515),
    "gemma-v515-tied": ("gemma", True, 4, 515),  # scaled embedding, (1 + w) norms, GeGLU
}
# Token counts 47, 46, 43: never a multiple of 4, sometimes not of 2; a length-1 sequence each.
LENGTHS = [[1, 13, 7, 22, 4], [5, 1, 18, 11, 3, 8], [30, 2, 9, 1, 1]]
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (tp, sequence_parallel)


def _layouts(kv_heads):
    return [(tp, sp) for tp, sp in LAYOUTS if kv_heads % tp == 0]


def _batch(index, vocab, pad_id):
    """Random tokens without the pad id: HF's nn.Embedding(padding_idx=pad_id) gives that row no
    gradient from lookups, while our packed model (no padding) treats it as any other token."""
    gen = torch.Generator().manual_seed(index)
    seqs = [torch.randint(0, vocab - 1, (n,), generator=gen) for n in LENGTHS[index % len(LENGTHS)]]
    return [s + (s >= pad_id).long() for s in seqs]


def _loss(log_probs_T, entropy_T, valid_T, seed):
    """A weighted mix of next-token log-probs and entropies: exercises both backward paths."""
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(valid_T.numel(), generator=gen) for _ in range(2))
    return (w1 * log_probs_T * valid_T).sum() / valid_T.sum() + (w2 * entropy_T).mean()


def _hf_reference(folder, seqs, seed):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packed = pack(seqs)
    logits_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
    targets_T, valid_T = shifted_targets(packed)
    logp_TV = torch.log_softmax(logits_TV, -1)
    log_probs_T = logp_TV.gather(-1, targets_T[:, None])[:, 0] * valid_T
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    _loss(log_probs_T, entropy_T, valid_T, seed).backward()
    return dict(logits=logits_TV.detach(), log_probs=log_probs_T.detach(),
                entropy=entropy_T.detach(), valid=valid_T,
                grads={n: p.grad.clone() for n, p in hf.named_parameters()})


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for index, (name, (arch, tied, kv, vocab)) in enumerate(VARIANTS.items()):
        spec = TinyModelConfig(arch=arch, tie_embeddings=tied, num_kv_heads=kv, vocab_size=vocab,
                               seed=index, **SMALL)
        folder = make_tiny_model(spec, root / name)
        pad_id = json.loads((folder / "config.json").read_text())["pad_token_id"]
        seqs = _batch(index, vocab, pad_id)
        out[name] = dict(folder=str(folder), seqs=seqs, layouts=_layouts(kv),
                         ref=_hf_reference(folder, seqs, seed=index))
    return out


class _Errors(dict):
    """Max abs error per named comparison; refuses an all-zero reference (it proves nothing)."""

    def cmp(self, name, got, want):
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        if not want.abs().max() > 0:
            raise AssertionError(f"{name}: the reference is all zeros")
        err = (got.detach().float() - want.float()).abs().max().item()
        self[name] = max(self.get(name, 0.0), err)


def _meshes(world):
    cache = ProcessGroupCache()
    return {tp: ParallelMesh(list(range(world)), tp=tp, cache=cache) for tp in (1, 2, 4)}


def _full_logits(model, packed, mesh, tp):
    with torch.no_grad():
        local_TV = forward_packed(model, packed, mesh=mesh, tp=tp)
    shard = vocab_shard(model, mesh)
    return C.all_gather(local_TV, dim=-1, group=shard["group"])[:, : shard["real_vocab_size"]]


def _engine(folder, mesh, parallel, head, **kw):
    """The built model inside a training engine: the grad sync training runs."""
    return TrainEngine(build_model(folder, mesh=mesh, parallel=parallel, head=head, **kw), mesh,
                       optim=OptimizerConfig())


def _synced_grads(engine, loss):
    """Full grads of `loss`, which every DP replica computes whole (so 1/dp of it each)."""
    (loss / engine.mesh.dp_size).backward()
    engine.sync_grads()
    grads = engine.full_grads()
    engine.zero_grad()
    return grads


def _check_lm(folder, seqs, ref, mesh, sp, seed):
    """Every check of one model in one layout; returns {check: max error}."""
    e = _Errors()
    engine = _engine(folder, mesh, ParallelConfig(tp=mesh.tp_size, sequence_parallel=sp), "lm")
    model = engine.model
    packed = pack(seqs)
    valid_T = ref["valid"]
    logits_TV = _full_logits(model, packed, mesh, engine.tp)
    e.cmp("logits", logits_TV, ref["logits"])
    out = model_outputs(model, packed, mesh=mesh, tp=engine.tp)
    e.cmp("log_probs", out["log_probs"], ref["log_probs"])
    e.cmp("entropy", out["entropy"], ref["entropy"])
    # vocab-parallel functions against the full-vocab computation on the very same logits
    logp_TV = torch.log_softmax(logits_TV, -1)
    targets_T, _ = shifted_targets(packed)
    e.cmp("vp_log_probs", out["log_probs"], logp_TV.gather(-1, targets_T[:, None])[:, 0] * valid_T)
    e.cmp("vp_entropy", out["entropy"], -(logp_TV.exp() * logp_TV).sum(-1))
    grads = _synced_grads(engine, _loss(out["log_probs"], out["entropy"], valid_T, seed))
    if grads.keys() != ref["grads"].keys():
        raise AssertionError(f"grad names differ: {sorted(grads.keys() ^ ref['grads'].keys())}")
    e["grads"] = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)
    e["export_exact"] = _export_errors(engine, folder)
    e["local_shapes_ok"] = _local_shapes_ok(engine, mesh.tp_size)
    # The checks above ran the dense MLPs' one-GEMM path (rlhf.models.gate_up) on each TP shard.
    e["gate_up_paired"] = all(paired_weight(m.gate_proj.weight, m.up_proj.weight) is not None
                              for m in model.modules() if isinstance(m, MLP))
    return e


def _export_errors(engine, folder):
    """Number of mismatches between the gathered export and the original safetensors."""
    original = load_file(f"{folder}/model.safetensors")
    bucket_bytes = 64 * 1024
    exported, bad = {}, 0
    for bucket in export_full_hf_weights(engine.model, engine.table, engine.mesh,
                                         bucket_bytes=bucket_bytes):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        bad += size > bucket_bytes and len(bucket) > 1
        exported.update(bucket)
    bad += exported.keys() != original.keys()
    bad += sum(not torch.equal(exported[n], original[n]) for n in original if n in exported)
    return bad


def _local_shapes_ok(engine, tp):
    """Split parameters hold 1/tp of their (padded) dim: nothing was built at full size."""
    params = dict(engine.model.named_parameters())
    split = [e for e in engine.table if e.shard is not None]
    return all(params[e.name].shape[e.shard.dim] * tp == -(-e.shard.full_size // tp) * tp
               for e in split) and (tp == 1 or len(split) > 0)


def _matrix(rank, world, cases):
    meshes = _meshes(world)
    results = {}
    for index, (name, case) in enumerate(cases.items()):
        for tp, sp in case["layouts"]:
            results[name, tp, sp] = dict(
                _check_lm(case["folder"], case["seqs"], case["ref"], meshes[tp], sp, seed=index))
    return results


@pytest.fixture(scope="module")
def matrix(cases):
    per_rank = run_distributed(_matrix, 4, cases, timeout_s=150)
    merged = {}
    for results in per_rank:
        for key, errors in results.items():
            slot = merged.setdefault(key, {})
            for check, value in errors.items():
                slot[check] = (slot.get(check, True) and value if check in FLAGS
                               else max(slot.get(check, 0), value))
    return merged


MATRIX_IDS = [(name, tp, sp) for name, (_, _, kv, _) in VARIANTS.items()
              for tp, sp in _layouts(kv)]


@pytest.mark.parametrize("key", MATRIX_IDS,
                         ids=[f"{n}-tp{tp}{'-sp' if sp else ''}" for n, tp, sp in MATRIX_IDS])
def test_model_matches_hf_in_every_layout(matrix, key):
    errors = matrix[key]
    for check in ("logits", "log_probs", "entropy", "vp_log_probs", "vp_entropy", "grads"):
        assert errors[check] < TOL, (check, errors)
    assert errors["export_exact"] == 0, errors
    assert errors["local_shapes_ok"], errors
    assert errors["gate_up_paired"], errors


def test_matrix_covers_tp4_sequence_parallel_and_padded_vocab(matrix):
    assert ("qwen3-v515-tied", 4, True) in matrix and ("llama-v515-untied", 2, True) in matrix
    assert {tp for _, tp, _ in matrix} == {1, 2, 4}


# ---- critic and colocated roles on 2 ranks -------------------------------------------------------


def _value_reference(folder, seqs):
    """Our unsharded ValueModel, no process group: values and grads of a weighted sum."""
    model = ValueModel(ModelArgs.from_pretrained(folder))
    load_hf_weights(model, folder, value_head_seed=7)
    p = pack(seqs)
    values_T = model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)
    w_T = torch.randn(values_T.numel(), generator=torch.Generator().manual_seed(9))
    (w_T * values_T).sum().backward()
    return dict(values=values_T.detach(), w=w_T,
                grads={n: q.grad.clone() for n, q in model.named_parameters()})


def _check_value(engine, seqs, ref, e, tag):
    values_T = model_outputs(engine.model, pack(seqs), mesh=engine.mesh, tp=engine.tp,
                             outputs=("values",))["values"]
    e.cmp(f"{tag}_values", values_T, ref["values"])
    grads = _synced_grads(engine, (ref["w"] * values_T).sum())
    assert grads.keys() == ref["grads"].keys(), sorted(grads.keys() ^ ref["grads"].keys())
    e[f"{tag}_grads"] = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)


def _colocated(rank, world, actor_case, critic_case, value_ref):
    cache = ProcessGroupCache()
    actor_mesh = ParallelMesh([0, 1], tp=2, cache=cache)
    critic_mesh = ParallelMesh([0, 1], tp=1, cache=cache)  # dp=2
    actor_engine = _engine(actor_case["folder"], actor_mesh,
                           ParallelConfig(tp=2, sequence_parallel=True), "lm")
    actor = actor_engine.model
    critic_sp = _engine(critic_case["folder"], actor_mesh,
                        ParallelConfig(tp=2, sequence_parallel=True), "value", value_head_seed=7)
    critic = _engine(critic_case["folder"], critic_mesh, ParallelConfig(tp=1), "value",
                     value_head_seed=7)
    e = _Errors()
    seqs, ref = actor_case["seqs"], actor_case["ref"]
    before = model_outputs(actor, pack(seqs), mesh=actor_mesh, tp=actor_engine.tp)["log_probs"]
    _check_value(critic, critic_case["seqs"], value_ref, e, "critic_tp1")
    _check_value(critic_sp, critic_case["seqs"], value_ref, e, "critic_tp2_sp")
    out = model_outputs(actor, pack(seqs), mesh=actor_mesh,
                        tp=actor_engine.tp)  # actor again, after both critics
    e.cmp("actor_log_probs_before", before, ref["log_probs"])
    e.cmp("actor_log_probs_after", out["log_probs"], ref["log_probs"])
    grads = _synced_grads(actor_engine, _loss(out["log_probs"], out["entropy"], ref["valid"],
                                              actor_case["seed"]))
    e["actor_grads"] = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)
    hot = model_outputs(actor, pack(seqs), mesh=actor_mesh, tp=actor_engine.tp,
                        temperature=0.7)
    logp_TV = torch.log_softmax(ref["logits"] / 0.7, -1)
    targets_T, _ = shifted_targets(pack(seqs))
    e.cmp("temperature_log_probs", hot["log_probs"],
          logp_TV.gather(-1, targets_T[:, None])[:, 0] * ref["valid"])
    e.cmp("temperature_entropy", hot["entropy"], -(logp_TV.exp() * logp_TV).sum(-1))
    # apply_tp on a materialised model (each rank slices the full weights it already holds)
    full = CausalLM(ModelArgs.from_pretrained(actor_case["folder"]))
    load_hf_weights(full, actor_case["folder"])
    full_tp = apply_tp(full, actor_mesh, sequence_parallel=True)
    assert full.lm_head.weight is full.model.embed_tokens.weight  # re-tied to the shard
    out = model_outputs(full, pack(seqs), mesh=actor_mesh, tp=full_tp)
    e.cmp("apply_tp_log_probs", out["log_probs"], ref["log_probs"])
    e.cmp("apply_tp_entropy", out["entropy"], ref["entropy"])
    return dict(e)


def test_critic_tp2_sp_equals_tp1_and_roles_share_ranks(cases):
    """Actor (tp=2, SP) and critics (tp=2 SP; tp=1 dp=2) over the same 2 ranks, interleaved;
    also temperature-scaled outputs and apply_tp on an already materialised model."""
    names = list(VARIANTS)
    actor = dict(cases["qwen3-tied"], seed=names.index("qwen3-tied"))
    critic = cases["llama-v515-untied"]  # a padded vocabulary under the critic's SP layout
    value_ref = _value_reference(critic["folder"], critic["seqs"])
    per_rank = run_distributed(_colocated, 2, actor, critic, value_ref, timeout_s=90)
    for errors in per_rank:
        assert set(errors) == {"critic_tp1_values", "critic_tp1_grads", "critic_tp2_sp_values",
                               "critic_tp2_sp_grads", "actor_log_probs_before",
                               "actor_log_probs_after", "actor_grads", "apply_tp_log_probs",
                               "apply_tp_entropy", "temperature_log_probs", "temperature_entropy"}
        assert max(errors.values()) < TOL, errors


# ---- no process group needed ------------------------------------------------------------------


def test_sp_pad_appends_one_dummy_sequence():
    packed = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    padded = sp_pad(packed, 4)
    assert padded.tokens.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 8] and padded.cu_seqlens.dtype == torch.int32
    assert padded.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert padded.max_seqlen == 3
    assert sp_pad(packed, 5) is packed


def test_tp_must_divide_heads_and_mlp_width():
    args = ModelArgs.from_hf_config({"model_type": "llama", "vocab_size": 384, "hidden_size": 64,
                                     "intermediate_size": 96, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2})
    check_tp_compatible(args, 2)
    with pytest.raises(ConfigError, match="tp=4 does not divide num_key_value_heads=2"):
        check_tp_compatible(args, 4)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        check_tp_compatible(args, 3)
