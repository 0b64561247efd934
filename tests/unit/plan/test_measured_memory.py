"""The planner against what the code allocates on the CPU: the live-bytes high-water mark of
the log-prob/entropy head and of one micro-batch's forward/backward of a tiny model, counted
by a dispatch-mode tracker, within 10% of the plan (fp32 and bf16, several shapes).

Attention runs through a CPU stand-in that keeps what flash-attn's varlen kernel keeps, the
kernel the planner's activation estimate describes."""

import pytest
import torch

import rlhf.models.attention as attention
from rlhf.config.schema import OffloadConfig, OptimizerConfig, ParallelConfig
from rlhf.engine.engine import TrainEngine
from rlhf.engine.micro_batch import make_micro_batches
from rlhf.models.build import BuiltModel
from rlhf.models.config import ModelArgs
from rlhf.models.transformer import CausalLM
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.plan.inputs import RoleSpec
from rlhf.plan.memory import stage_memory
from tests.unit.engine.reference import GlooWorld
from tests.unit.plan.flash_standin import flash_like_varlen
from tests.unit.plan.live_bytes import LiveBytes

TOLERANCE = 0.10


def _args(vocab: int, hidden: int, inter: int, layers: int = 2) -> ModelArgs:
    return ModelArgs.from_hf_config(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=1e4))


def _spec(args: ModelArgs, dtype, tokens: int, recompute: str = "none") -> RoleSpec:
    return RoleSpec(name="actor", head="lm", args=args, parallel=ParallelConfig(), world_size=1,
                    colocated=True, dtype=dtype, trains=True, recompute=recompute, tokens=tokens,
                    shards=1, offload=OffloadConfig())


def test_the_tracker_counts_new_storages_only_and_frees_them():
    weight = torch.randn(64, 64)
    with LiveBytes() as m:
        view = weight.t()  # a view of a storage made before: nothing new
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(500, dtype=torch.float32)
        del a
        c = torch.empty(250, dtype=torch.float32)
        assert m.live == (500 + 250) * 4
    assert m.peak == 1500 * 4 and view.shape == (64, 64) and b.numel() + c.numel() == 750


CASES = [  # tokens, vocab, hidden, intermediate, dtype, recompute
    (512, 2048, 128, 344, torch.float32, "none"),
    (1024, 4096, 256, 688, torch.float32, "attention_block"),
    (1024, 4096, 256, 688, torch.float32, "full"),
    (512, 2048, 128, 344, torch.bfloat16, "none"),
    (1024, 4096, 256, 688, torch.bfloat16, "none"),
    (1024, 4096, 256, 688, torch.bfloat16, "full"),
]


def measure_micro_batch(args: ModelArgs, dtype, tokens: int, recompute: str, *,
                        seq_len: int = 128) -> tuple[int, int]:
    """(update peak, forward-only peak) in bytes beyond the engine's state, one micro-batch
    whose loss uses the log-probs and keeps the entropy as a metric (entropy_coeff 0)."""
    with GlooWorld():
        torch.manual_seed(0)
        model = CausalLM(args).to(dtype)
        engine = TrainEngine(BuiltModel.unsharded(model),
                             ParallelMesh([0], cache=ProcessGroupCache()),
                             optim=OptimizerConfig(), recompute=recompute)
        gen = torch.Generator().manual_seed(0)
        n, prompt = tokens // seq_len, seq_len // 4
        (mb,) = make_micro_batches(
            [torch.randint(0, args.vocab_size, (prompt,), generator=gen) for _ in range(n)],
            [torch.randint(0, args.vocab_size, (seq_len - prompt,), generator=gen)
             for _ in range(n)], max_tokens=tokens)

        def loss_fn(out, mb):
            loss = -(out["log_probs"] * mb.predicts_response_T).sum() / tokens
            return loss, {"entropy": out["entropy"].detach().mean()}

        outputs = ("log_probs", "entropy")
        engine.forward_backward([mb], loss_fn, outputs=outputs)  # the grad buffer exists
        engine.zero_grad()
        with LiveBytes() as update:
            engine.forward_backward([mb], loss_fn, outputs=outputs)
        with LiveBytes() as forward, torch.no_grad():
            engine.forward([mb], outputs=outputs)
    return update.peak, forward.peak


@pytest.mark.parametrize("tokens,vocab,hidden,inter,dtype,recompute", CASES)
def test_one_micro_batch_forward_backward_peak_is_planned_within_10_percent(
        monkeypatch, tokens, vocab, hidden, inter, dtype, recompute):
    args = _args(vocab, hidden, inter)
    (stage,) = stage_memory(_spec(args, dtype, tokens, recompute))  # before the gloo world
    monkeypatch.setattr(attention, "pick_kernel", lambda *a, **k: flash_like_varlen)
    update, forward = measure_micro_batch(args, dtype, tokens, recompute)
    planned = stage.activations + stage.logits  # the update phase beyond the state
    assert abs(update / planned - 1) <= TOLERANCE, (update, planned)
    assert abs(forward / stage.forward - 1) <= TOLERANCE, (forward, stage.forward)


HEAD_CASES = [  # tokens, local columns, real columns, dtype, temperature, chunk elements
    (256, 4096, 4096, torch.float32, 1.0, 2**25),  # one chunk
    (256, 4096, 4096, torch.bfloat16, 0.7, 2**25),
    (512, 8192, 8000, torch.bfloat16, 1.0, 2**18),  # chunked, padding columns
    (300, 5000, 5000, torch.float32, 0.6, 2**16),  # chunked, uneven last chunk
]


@pytest.mark.parametrize("tokens,columns,real,dtype,temperature,chunk", HEAD_CASES)
def test_head_workspace_is_the_live_peak_of_the_head(tokens, columns, real, dtype,
                                                      temperature, chunk):
    from rlhf.parallel.vocab_parallel import head_workspace, vocab_parallel_log_probs_entropy

    logits = torch.randn(tokens, columns).to(dtype)
    targets = torch.randint(0, real, (tokens,))
    kw = dict(group=None, vocab_start=0, vocab_end=columns, real_vocab_size=real,
              temperature=temperature, chunk_elements=chunk)
    with LiveBytes() as update:
        x = logits.clone().requires_grad_()  # the LM head's output
        log_probs, entropy = vocab_parallel_log_probs_entropy(x, targets, **kw)
        (log_probs.sum() + entropy.sum()).backward()
        del x, log_probs, entropy
    with LiveBytes() as forward, torch.no_grad():
        x = logits.clone()
        log_probs, entropy = vocab_parallel_log_probs_entropy(x, targets, **kw)
        del x, log_probs, entropy
    for peak, backward in ((update.peak, True), (forward.peak, False)):
        planned = sum(head_workspace(tokens=tokens, columns=columns, real_columns=real,
                                     dtype=dtype, backward=backward,
                                     chunk_elements=chunk).values())
        assert abs(peak / planned - 1) <= TOLERANCE, (backward, peak, planned)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,columns,dtype", [(16384, 38016, torch.bfloat16),
                                                  (4096, 32768, torch.float32)])
def test_head_workspace_is_the_cuda_peak_of_the_head(tokens, columns, dtype):
    from rlhf.parallel.vocab_parallel import head_workspace, vocab_parallel_log_probs_entropy

    device = torch.device("cuda")
    logits = (torch.randn(tokens, columns, device=device) * 3).to(dtype)
    targets = torch.randint(0, columns, (tokens,), device=device)
    kw = dict(group=None, vocab_start=0, vocab_end=columns, real_vocab_size=columns,
              temperature=0.7)
    for backward in (True, False):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.set_grad_enabled(backward):
            x = logits.clone().requires_grad_(backward)
            log_probs, entropy = vocab_parallel_log_probs_entropy(x, targets, **kw)
            if backward:
                (log_probs.sum() + entropy.sum()).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del x, log_probs, entropy
        planned = sum(head_workspace(tokens=tokens, columns=columns, real_columns=columns,
                                     dtype=dtype, backward=backward).values())
        assert abs(peak / planned - 1) <= TOLERANCE, (backward, peak, planned)
