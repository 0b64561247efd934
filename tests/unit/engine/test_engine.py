"""TrainEngine at tp=1 in a one-process gloo world, against references written by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf.config.schema import OptimizerConfig
from rlhf.engine import Recomputed, TrainEngine, make_micro_batches
from rlhf.errors import RLHFError
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import (
    OPTIM,
    actor_loss_fn,
    critic_loss_fn,
    exported,
    load_plain,
    make_batch,
    max_param_error,
    reference_step,
)

TOL = 1e-6


def _engine(folder, *, head="lm", optim=OPTIM, device="cpu", **kw):
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    return TrainEngine.from_pretrained(folder, mesh=mesh, head=head, optim=optim, total_steps=10,
                                       device=device, **kw)


def _mbs(batch, max_tokens=24):
    return make_micro_batches(batch.prompts, batch.responses, batch.per_token,
                              max_tokens=max_tokens)


def _train_step(engine, batch, *, max_tokens=24, head="lm"):
    mbs = _mbs(batch, max_tokens)
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    make_loss = actor_loss_fn if head == "lm" else critic_loss_fn
    metrics = engine.forward_backward(mbs, make_loss(tokens))
    return metrics, engine.step()


def test_forward_log_probs_and_entropy_equal_transformers(folder, world):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = make_batch(1)
    mbs = _mbs(batch, max_tokens=20)
    assert len(mbs) > 1
    outs = _engine(folder, optim=None).forward(mbs)
    checked = 0
    for mb, out in zip(mbs, outs):
        for seq, start, stop in zip(mb.packed.tokens.split(mb.packed.seq_lens.tolist()),
                                    mb.packed.cu_seqlens[:-1].tolist(),
                                    mb.packed.cu_seqlens[1:].tolist()):
            with torch.no_grad():
                logp_SV = F.log_softmax(hf(seq[None]).logits[0].float(), dim=-1)
            want = logp_SV[:-1].gather(-1, seq[1:, None])[:, 0]
            torch.testing.assert_close(out["log_probs"][start:stop - 1], want, atol=1e-5, rtol=0)
            assert out["log_probs"][stop - 1] == 0  # the last position predicts nothing
            want_ent = -(logp_SV.exp() * logp_SV).sum(-1)
            torch.testing.assert_close(out["entropy"][start:stop], want_ent, atol=1e-5, rtol=0)
            checked += 1
    assert checked == len(batch.prompts)


def test_forward_values_equal_the_plain_value_model(folder, world):
    batch = make_batch(2)
    mbs = _mbs(batch)
    outs = _engine(folder, head="value", optim=None, seed=3).forward(mbs)
    plain = load_plain(folder, "value", value_head_seed=3).eval()
    for mb, out in zip(mbs, outs):
        p = mb.packed
        with torch.no_grad():
            want = plain(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)
        torch.testing.assert_close(out["values"], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_one_step_equals_the_hand_written_reference(folder, world, head):
    batch = make_batch(3)
    ref = reference_step(folder, batch, head=head)
    assert ref["grad_norm"] > OPTIM.grad_clip  # clipping is active
    engine = _engine(folder, head=head)
    metrics, stats = _train_step(engine, batch, head=head)
    assert metrics["num_micro_batches"] > 1
    assert metrics["loss"] == pytest.approx(ref["loss"], abs=TOL)
    assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    assert stats["lr"] == OPTIM.lr
    assert max_param_error(exported(engine), ref["params"]) < TOL


def test_micro_batch_split_does_not_change_the_step(folder, world):
    batch = make_batch(4)
    params = []
    for max_tokens in (16, 1000):
        engine = _engine(folder)
        _train_step(engine, batch, max_tokens=max_tokens)
        params.append(exported(engine))
    assert max_param_error(params[0], params[1]) < TOL


def test_loss_normalizers_count_masked_or_all_response_positions(folder, world):
    batch = make_batch(5)
    engine = _engine(folder, optim=None)
    mbs = _mbs(batch)
    masks = batch.per_token["loss_mask"]
    want_seqs = sum(bool(masks[i].any()) for i in range(len(masks)))
    assert engine.loss_normalizers(mbs, mask_key="loss_mask") == (int(masks.values.sum()),
                                                                   want_seqs)
    lengths = batch.responses.lengths
    assert engine.loss_normalizers(mbs, mask_key=None) == (int(lengths.sum()),
                                                           int((lengths > 0).sum()))


def test_metrics_sum_the_loss_and_average_the_rest(folder, world):
    engine = _engine(folder)
    mbs = _mbs(make_batch(5))
    seen = []

    def loss_fn(outputs, mb):
        seen.append(mb.num_tokens)
        return outputs["log_probs"].sum() * 0 + mb.num_tokens, {"tokens": mb.num_tokens}

    metrics = engine.forward_backward(mbs, loss_fn)
    assert metrics["loss"] == sum(seen)
    assert metrics["tokens"] == pytest.approx(sum(seen) / len(seen))
    assert metrics["num_micro_batches"] == len(mbs)


def test_resumed_engine_continues_bit_identically(folder, world, tmp_path):
    first, second = make_batch(6), make_batch(7)
    engine = _engine(folder)
    _train_step(engine, first)
    path = engine.save_checkpoint(tmp_path / "ckpt")
    # One rank: engine.json, DCP's metadata and the rank's one data file.
    assert path.is_file() and sorted(p.name for p in path.parent.iterdir()) == [
        ".metadata", "__0_0.distcp", path.name]
    _, want_stats = _train_step(engine, second)
    want = engine.state_dict()

    resumed = _engine(folder)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step_count == 1
    _, stats = _train_step(resumed, second)
    got = resumed.state_dict()
    assert stats == want_stats
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got["optimizer"][key], want["optimizer"][key]), key
        assert want["optimizer"][key].abs().sum() > 0, key
    assert got["step"] == 2


def test_checkpoint_of_another_layout_is_refused(folder, world, tmp_path):
    engine = _engine(folder)
    state = engine.state_dict()
    state["layout"] = dict(state["layout"], tp=2)
    with pytest.raises(RLHFError, match="reshard over data parallelism only"):
        engine.load_state_dict(state)
    with pytest.raises(RLHFError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "nothing")


def _unwrapped(module):
    return module.inner if isinstance(module, Recomputed) else module


@pytest.mark.parametrize("mode", ["full", "attention_block"])
def test_recompute_gives_identical_grads(folder, world, mode):
    batch = make_batch(8)
    grads, calls = [], []
    for recompute in ("none", mode):
        engine = _engine(folder, recompute=recompute)
        count = [0]
        layer = _unwrapped(engine.model.model.layers["0"])
        # the first module each recomputed region runs (recomputation may stop early)
        first = (layer.input_layernorm if mode == "full"
                 else _unwrapped(layer.self_attn).q_proj)
        first.register_forward_pre_hook(
            lambda *_, count=count: count.__setitem__(0, count[0] + 1))
        mbs = _mbs(batch)
        tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
        engine.forward_backward(mbs, actor_loss_fn(tokens))
        grads.append(engine.full_grads())
        calls.append(count[0] / len(mbs))
    assert calls == [1, 2]  # run again in backward
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("mode", ["full", "attention_block"])
def test_recompute_wraps_modules_and_keeps_state_dict_names(folder, world, mode):
    plain = _engine(folder, optim=None).model
    model = _engine(folder, optim=None, recompute=mode).model
    layer = model.model.layers["0"]
    assert isinstance(layer if mode == "full" else layer.self_attn, Recomputed)
    assert model.state_dict().keys() == plain.state_dict().keys()
    model.load_state_dict(plain.state_dict())  # strict: every key lands in the wrapped model
    with pytest.raises(ValueError, match="'attention_block'"):
        _engine(folder, optim=None, recompute="selective")


def test_learning_rate_follows_the_schedule_across_steps(folder, world):
    optim = OptimizerConfig(lr=1e-3, warmup_steps=2, schedule="linear", min_lr_ratio=0.5)
    engine = _engine(folder, optim=optim)
    lrs = [_train_step(engine, make_batch(s))[1]["lr"] for s in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3 - 0.5e-3 * (2 - 2) / 8])
    assert engine.step_count == 3


def _flat_params(engine):
    return torch.cat([p.detach().reshape(-1).float() for p in engine.model.parameters()])


def test_bf16_model_keeps_fp32_master_weights(folder, world):
    # lr far below bf16's resolution at the weights' scale: only fp32 masters can hold the update
    optim = OptimizerConfig(lr=1e-6, weight_decay=0.0, grad_clip=None)
    engine = _engine(folder, optim=optim, dtype="bfloat16")
    state = engine.state_tensors()
    [master], [grads] = state["masters"], state["grads"]
    before = master.clone()
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert master.dtype == grads.dtype == torch.float32
    assert torch.equal(master, _flat_params(engine))
    mbs = _mbs(make_batch(9))
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    engine.forward_backward(mbs, actor_loss_fn(tokens))
    assert grads.abs().sum() > 0  # accumulated in fp32, not on the parameters
    assert all(p.grad is None for p in engine.model.parameters())
    engine.step()
    moved = (master - before).abs().max().item()
    assert 0.5e-6 < moved < 1.1e-6  # Adam's first step moves by about lr
    assert torch.equal(_flat_params(engine), master.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_tensors_are_allocated_once_and_sized_as_planned(folder, world, dtype):
    from rlhf.engine.zero import state_bytes
    engine = _engine(folder, dtype=dtype)
    before = {k: [id(t) for t in ts] for k, ts in engine.state_tensors().items()}
    numels = [p.numel() for p in engine.model.parameters()]
    param_bytes = 4 if dtype == "float32" else 2
    held = {k: sum(t.numel() * t.element_size() for t in ts)
            for k, ts in engine.state_tensors().items()}
    assert held == state_bytes(numels, param_bytes=param_bytes, shards=1)
    assert held["optimizer"] == 8 * sum(numels) and held["grads"] == 4 * sum(numels)
    _train_step(engine, make_batch(13))
    _train_step(engine, make_batch(14))
    assert {k: [id(t) for t in ts] for k, ts in engine.state_tensors().items()} == before
    assert engine.state_tensors()["optimizer"][0].abs().sum() > 0
    forward_only = _engine(folder, optim=None).state_tensors()
    assert [len(forward_only[k]) for k in ("grads", "masters", "optimizer")] == [0, 0, 0]


def test_misuse_is_reported(folder, world):
    forward_only = _engine(folder, optim=None)
    with pytest.raises(RuntimeError, match="optim=None"):
        forward_only.step()
    engine = _engine(folder)
    mbs = _mbs(make_batch(10))
    loss = actor_loss_fn(100)
    engine.forward_backward(mbs, loss)
    with pytest.raises(RuntimeError, match="twice"):
        engine.forward_backward(mbs, loss)
    with pytest.raises(ValueError, match="float16 training"):
        _engine(folder, dtype="float16")
    with pytest.raises(ValueError, match="0-d loss"):
        engine.zero_grad()
        engine.forward_backward(mbs, lambda out, mb: (out["log_probs"], {}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_dtype_is_bf16_with_fp32_masters(folder, world):
    batch = make_batch(12)
    engine = _engine(folder, device=None)  # auto: this rank's CUDA device, bfloat16
    assert engine.device.type == "cuda"
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    cpu_out = _engine(folder, optim=None).forward(_mbs(batch))
    cuda_out = engine.forward(_mbs(batch))
    for want, got in zip(cpu_out, cuda_out):
        torch.testing.assert_close(got["log_probs"].cpu(), want["log_probs"], atol=0.1, rtol=0)
    _, stats = _train_step(engine, batch)
    assert math.isfinite(stats["grad_norm"])
    [master] = engine.state_tensors()["masters"]
    assert master.dtype == torch.float32 and master.device.type == "cuda"
    assert torch.equal(_flat_params(engine), master.to(torch.bfloat16).float())
