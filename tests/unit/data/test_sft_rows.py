"""Chat SFT: a transcript's loss mask covers exactly the assistant turns, and the SFT worker's
loss on packed micro-batches equals a per-sample masked reference from transformers."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from rlhf.config import JobConfig, ModelConfig, OptimizerConfig, TinyModelConfig  # noqa: E402
from rlhf.config.schema import SFTConfig, TrainerConfig  # noqa: E402
from rlhf.controller import WorkerContext  # noqa: E402
from rlhf.data.sft_rows import SFTDataset, SFTKeys, transcript_tokens  # noqa: E402
from rlhf.demo.tiny_model import make_tiny_model  # noqa: E402
from rlhf.errors import RLHFError  # noqa: E402
from rlhf.parallel.mesh import ProcessGroupCache  # noqa: E402
from workers.sft import SFTWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TRANSCRIPT = [{"role": "system", "content": "Use the tool."},
              {"role": "user", "content": "12*3="},
              {"role": "assistant", "content": "<tool_call>12*3</tool_call>"},
              {"role": "tool", "content": "36"},
              {"role": "assistant", "content": "36"}]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    spec = TinyModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           intermediate_size=96, max_position_embeddings=128)
    return str(make_tiny_model(spec, tmp_path_factory.mktemp("chat-sft") / "policy"))


@pytest.fixture(scope="module")
def tokenizer(policy):
    return AutoTokenizer.from_pretrained(policy)


def test_only_the_assistant_turns_are_trained_on(tokenizer):
    ids, mask = transcript_tokens(TRANSCRIPT, tokenizer, "row 1")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(TRANSCRIPT, tokenize=False)
    counted = [i for i, m in zip(ids, mask) if m]
    eos = tokenizer.eos_token
    assert tokenizer.decode(counted) == f"<tool_call>12*3</tool_call>{eos}36{eos}"
    # Runs of counted tokens are the two turns: the tool's result and the user are context.
    runs = sum(1 for a, b in zip([False, *mask], mask) if b and not a)
    assert runs == 2
    with pytest.raises(RLHFError, match="row 2: the transcript has no assistant message"):
        transcript_tokens(TRANSCRIPT[:2], tokenizer, "row 2")


def test_sft_loss_equals_the_per_sample_masked_reference(policy, tokenizer,
                                                          single_process_world):
    records = [("a:1", {"messages": TRANSCRIPT}),
               ("a:2", {"messages": [{"role": "user", "content": "7+5="},
                                     {"role": "assistant", "content": "12"},
                                     {"role": "user", "content": "and 3+4="},
                                     {"role": "assistant", "content": "7"}]}),
               ("a:3", {"prompt": "2+2=", "response": "4"})]
    dataset = SFTDataset(records, tokenizer, keys=SFTKeys(), max_prompt_length=64)
    batch = dataset.batch(torch.arange(3))
    cfg = JobConfig(model=ModelConfig(path=policy, tiny=None),
                    sft=SFTConfig(total_steps=1, batch_size=3, max_tokens_per_micro_batch=90,
                                  optim=OptimizerConfig(lr=1e-3, grad_clip=None)),
                    trainer=TrainerConfig(total_steps=1))
    ctx = WorkerContext("unit", "sft", 0, 1, torch.device("cpu"), ProcessGroupCache())
    metrics = SFTWorker(ctx, config=cfg, init_path=policy).train_step(batch)

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(dataset.ids, dataset.mask):
            seq, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
            logp = F.log_softmax(model(seq[None]).logits[0, :-1], dim=-1)
            nll = -logp.gather(-1, seq[1:, None])[:, 0]  # token t from the prefix before it
            total += nll[mask_t[1:]].sum().item()
            count += int(mask_t[1:].sum())
    assert count == int(batch["response_mask"].values.sum()) > 0
    assert metrics["sft/nll"] == pytest.approx(total / count, abs=1e-5)
