"""Routing replay through the workers' micro-batches (workers/micro_batches.py): routes an MoE
model recorded under one micro-batch plan, stored as the per-position Batch field, are forced
under another plan (other groupings, shared prompts) and give exactly the recorded routing and
log-probs, also after the weights moved (where free routing differs); the router still gets a
gradient under replay."""

import pytest
import torch

from rlhf.config.schema import TinyModelConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.data.routes import ROUTES, routing_agreement
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import load_hf_weights
from rlhf.models.moe import routing_for
from rlhf.models.transformer import CausalLM
from workers.micro_batches import build_micro_batches, routes_field

SPEC = TinyModelConfig(arch="qwen3_moe", num_layers=2, hidden_size=64, num_heads=2,
                       num_kv_heads=1, intermediate_size=96, vocab_size=384,
                       max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny_model(SPEC, tmp_path_factory.mktemp("moe") / "m")
    ours = CausalLM(ModelArgs.from_pretrained(folder))
    load_hf_weights(ours, folder)
    return ours


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 384, (6,), generator=gen)
    prompts = [shared, shared, torch.randint(3, 384, (4,), generator=gen), shared]
    responses = [torch.randint(3, 384, (n,), generator=gen) for n in (5, 3, 7, 2)]
    return Batch({"prompt_ids": Ragged.from_list(prompts),
                  "response_ids": Ragged.from_list(responses)})


def _run(model, mbs, *, record=True):
    """Per micro-batch: outputs {log-probs of the stream, ROUTES}, as the engine gives them."""
    outs = []
    for mb in mbs:
        p = mb.packed
        routing = routing_for(mb.tensors, mb.num_tokens, record=record)
        logits = model(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen, prefix=p.prefix,
                       routing=routing)
        out = {"logits": logits}
        if record:
            out[ROUTES] = routing.routes_tensor(SPEC.num_layers, SPEC.num_experts_per_tok)
        outs.append(out)
    return outs


def _response_log_probs(outs, mbs):
    rows = {}
    for out, mb in zip(outs, mbs):
        logp = torch.log_softmax(out["logits"], -1)
        seqs = mb.packed.cu_seqlens.tolist()
        for j, i in enumerate(mb.sample_ids.tolist()):
            end = seqs[j + 1]
            r = int(mb.packed.response_lens[j])
            tokens = mb.packed.tokens[end - r:end]
            rows[i] = logp[end - r - 1:end - 1].gather(-1, tokens[:, None])[:, 0]
    return [rows[i] for i in sorted(rows)]


def test_recorded_routes_replay_under_another_plan(model):
    # rows 0, 1 and 3 share a prompt; under plan A row 1 reads it from row 0 (its positions
    # there are recorded FREE), under plan B it holds the prompt itself
    batch, share = _batch(), True
    plan_a, plan_b = [[0, 1], [2, 3]], [[0], [1, 2, 3]]
    with torch.no_grad():
        mbs_a = build_micro_batches(batch, plan_a, share_prompts=share)
        outs_a = _run(model, mbs_a)
        recorded = routes_field(outs_a, mbs_a, batch)[ROUTES]
        batch = batch.union(Batch({ROUTES: recorded}))
        mbs_b = build_micro_batches(batch, plan_b, share_prompts=share, replay_routes=True)
        assert ROUTES not in build_micro_batches(batch, plan_b, share_prompts=share)[0].tensors
        outs_b = _run(model, mbs_b)
    replayed = routes_field(outs_b, mbs_b, batch)[ROUTES]
    known = recorded.values >= 0
    assert torch.equal(replayed.values[known], recorded.values[known])
    assert not known[recorded.offsets[1]:recorded.offsets[2]].all()  # row 1's shared prompt
    for a, b in zip(_response_log_probs(outs_a, mbs_a), _response_log_probs(outs_b, mbs_b)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    # The weights move (an update): replay keeps the recorded routing, free routing does not,
    # and the router still learns through the replayed pass.
    moved = CausalLM(model.args)
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in moved.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    free_mbs = build_micro_batches(batch, plan_b, share_prompts=share)
    with torch.no_grad():
        free = routes_field(_run(moved, free_mbs), free_mbs, batch)[ROUTES]
    assert routing_agreement(recorded, free)["token_match"] < 0.9
    outs = _run(moved, mbs_b)
    got = routes_field(outs, mbs_b, batch)[ROUTES].values
    assert torch.equal(got[known], recorded.values[known])
    sum(lp.sum() for lp in _response_log_probs(outs, mbs_b)).backward()
    assert moved.model.layers["0"].mlp.gate.weight.grad.abs().max() > 0
