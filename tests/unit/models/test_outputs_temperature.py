"""Temperature is applied to fp32 logits: bf16 logits give exactly what their fp32 upcast gives,
as vLLM's fp32 sampler does."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.data.packing import pack
from rlhf.models.outputs import head_outputs

VOCAB = 50


def _outputs(logits_TV, packed, temperature):
    model = SimpleNamespace(lm_head=nn.Linear(4, VOCAB))  # a plain (unsharded) LM head
    return head_outputs(model, logits_TV, packed, mesh=None, outputs=("log_probs", "entropy"),
                        temperature=temperature)


def test_bf16_logits_are_divided_by_the_temperature_in_fp32():
    gen = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(0, VOCAB, (k,), generator=gen) for k in (5, 3)])
    logits_TV = (torch.randn(8, VOCAB, generator=gen) * 4).bfloat16()
    temperature = 0.7
    got = _outputs(logits_TV, packed, temperature)
    logp_TV = F.log_softmax(logits_TV.float() / temperature, dim=-1)  # the sampler's
    targets = torch.cat([packed.tokens[1:5], torch.zeros(1, dtype=torch.int64),
                         packed.tokens[6:8], torch.zeros(1, dtype=torch.int64)])
    want = logp_TV.gather(-1, targets[:, None])[:, 0]
    want[[4, 7]] = 0.0  # each sequence's last position predicts nothing
    assert got["log_probs"].dtype == torch.float32
    torch.testing.assert_close(got["log_probs"], want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got["entropy"], -(logp_TV.exp() * logp_TV).sum(-1),
                               atol=1e-5, rtol=0)
    # Dividing in bf16 first rounds the scaled logits: that is visibly different.
    rounded = F.log_softmax((logits_TV / temperature).float(), dim=-1)
    assert (rounded.gather(-1, targets[:, None])[:, 0] - want).abs().max() > 1e-4
