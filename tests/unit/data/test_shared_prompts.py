"""Shared prompts: the samples of one prompt packed with the prompt held once give the same
outputs and gradients as the same samples packed whole (rlhf.data.packing, the attention
kernels, the planner's units)."""

import pytest
import torch

from rlhf.data.batch_split import share_units, split_batch
from rlhf.data.packing import pack_prompt_response, response_values, shared_prompt_lens
from rlhf.models.attention import sdpa_split, sdpa_varlen
from rlhf.models.config import ModelArgs
from rlhf.models.outputs import model_outputs
from rlhf.models.transformer import CausalLM, ValueModel

VOCAB = 61
ARGS = ModelArgs(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 max_position_embeddings=64)


class _Mesh:  # one rank: all model_outputs reads
    tp_size = 1


def grouped(groups, seed=0):
    """Prompts and responses for groups [(prompt length, [response lengths])], prompt-major."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for plen, rlens in groups:
        prompt = torch.randint(0, VOCAB, (plen,), generator=gen)
        for rlen in rlens:
            prompts.append(prompt.clone())
            responses.append(torch.randint(0, VOCAB, (rlen,), generator=gen))
    return prompts, responses


# Runs of 3, a 1-token prompt (nothing to share), a lone sample, empty and 1-token responses.
GROUPS = [(5, [3, 0, 4]), (1, [2, 2]), (7, [1]), (4, [5, 1, 3, 2])]


def test_who_shares():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    # Runs are consecutive: an equal prompt after another one starts a run of its own.
    rows = [a, a, b, b, torch.tensor([9]), torch.tensor([9]), a, b.clone(), a]
    assert shared_prompt_lens(rows) == [0, 2, 0, 1, 0, 0, 0, 0, 0]


def test_layout_holds_each_prompt_once():
    prompts, responses = grouped(GROUPS)
    whole = pack_prompt_response(prompts, responses)
    packed = pack_prompt_response(prompts, responses, share_prompts=True)
    saved = sum(shared_prompt_lens(prompts))
    assert saved == 2 * 4 + 3 * 3
    assert packed.tokens.shape[0] == whole.tokens.shape[0] - saved
    # A later sample of a run holds its prompt's last token and continues its positions.
    starts = packed.cu_seqlens.long()
    assert packed.prompt_lens.tolist() == [5, 1, 1, 1, 1, 7, 4, 1, 1, 1]
    assert packed.position_ids[starts[1]].item() == 4
    assert packed.prefix.lens.tolist() == [0, 4, 4, 0, 0, 0, 0, 3, 3, 3]
    assert packed.prefix.starts[1].item() == packed.prefix.starts[2].item() == 0
    assert packed.prefix.starts[7].item() == starts[6].item()
    # Without a run nothing is shared and the packing is the plain one.
    plain = pack_prompt_response(prompts[:1], responses[:1], share_prompts=True)
    assert plain.prefix is None


def _qkv(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_tokens, heads, 8, generator=gen, dtype=torch.float64,
                        requires_grad=True) for heads in (4, 2, 2)]


def test_kernel_equals_the_reference_with_prefixes():
    prompts, responses = grouped(GROUPS)
    packed = pack_prompt_response(prompts, responses, share_prompts=True)
    results = []
    for kernel in (sdpa_split, sdpa_varlen):
        q, k, v = _qkv(packed.tokens.shape[0], seed=3)
        out = kernel(q, k, v, cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                     causal=True, scale=0.3, prefix=packed.prefix)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_outputs_and_grads_equal_the_whole_packing(head):
    torch.manual_seed(0)
    model = (CausalLM if head == "lm" else ValueModel)(ARGS)
    prompts, responses = grouped(GROUPS, seed=1)
    names = ("log_probs", "entropy") if head == "lm" else ("values",)

    def run(share):
        model.zero_grad()
        packed = pack_prompt_response(prompts, responses, share_prompts=share)
        out = model_outputs(model, packed, mesh=_Mesh(), outputs=names)
        rows = {k: response_values(v, packed, next_token=head == "lm") for k, v in out.items()}
        loss = sum((r.values * torch.linspace(0.5, 2, r.values.numel())).sum()
                   for r in rows.values())
        loss.backward()
        return rows, {n: p.grad.clone() for n, p in model.named_parameters()}

    (whole, whole_grads), (shared, shared_grads) = run(False), run(True)
    for name in names:
        assert torch.equal(whole[name].offsets, shared[name].offsets)
        torch.testing.assert_close(shared[name].values, whole[name].values, rtol=0, atol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=0, atol=1e-5)


def test_planner_keeps_runs_together_and_counts_their_packed_tokens():
    prompts, responses = grouped([(6, [2, 3, 1, 4]), (3, [5, 5]), (8, [2, 2, 2, 2])])
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    shared = shared_prompt_lens(prompts)
    assert share_units(lengths, shared, max_tokens=64) == [((0, 1, 2, 3), 6 + 10 + 3),
                                                           ((4, 5), 3 + 10 + 1),
                                                           ((6, 7, 8, 9), 8 + 8 + 3)]
    # A run over the budget is cut; the piece after the cut holds the whole prompt again.
    assert share_units(lengths, shared, max_tokens=12) == [((0, 1), 8 + 4), ((2, 3), 7 + 5),
                                                           ((4,), 8), ((5,), 8),
                                                           ((6,), 10), ((7,), 10),
                                                           ((8,), 10), ((9,), 10)]
    for dp in (1, 2):
        split = split_batch(lengths, dp=dp, max_tokens=24, mini_size=None, shared=shared)
        plain = split_batch(lengths, dp=dp, max_tokens=24, mini_size=None)
        assert split.mini_batch_rows(0) == plain.mini_batch_rows(0) == list(range(10))
        for g, group in enumerate(split.groups):
            rows = split.rows[g]
            for mb, count in zip(group.mini_batches[0], group.token_counts[0]):
                ids = [rows[i] for i in mb]
                packed = pack_prompt_response([prompts[i] for i in ids],
                                              [responses[i] for i in ids], share_prompts=True)
                assert packed.tokens.shape[0] == count <= 24
    # A sample cap counts samples, so the plan is per sample (packing may still share).
    capped = split_batch(lengths, dp=1, max_tokens=64, max_seqs=2, shared=shared)
    assert all(len(mb) <= 2 for mb in capped.groups[0].mini_batches[0])
