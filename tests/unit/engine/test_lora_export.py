"""A LoRA policy leaves the engine as a peft adapter folder (peft loads it and computes the
engine's log-probs) or as merged Hugging Face weights, and its checkpoint holds the adapters,
their optimizer state and a fingerprint of the frozen base only."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from rlhf.config.schema import LoraConfig
from rlhf.engine import TrainEngine, make_micro_batches
from rlhf.errors import RLHFError
from rlhf.models.lora import is_lora_param
from rlhf.models.peft_folder import (
    lora_from_peft,
    merged_stream,
    read_adapter_folder,
    write_adapter_folder,
)
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from tests.unit.engine.reference import OPTIM, actor_loss_fn, make_batch

# alpha / r = 2 and q/v/down only: a non-unit scaling and a partial target list must both
# reach peft through adapter_config.json.
LORA = LoraConfig(r=4, lora_alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
TOL = 2e-5  # fp32: our kernels and transformers' differ in summation order only


def _engine(folder, *, optim=OPTIM):
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    return TrainEngine.from_pretrained(folder, mesh=mesh, optim=optim, total_steps=10, lora=LORA)


@torch.no_grad()
def _randomise_adapters(engine, seed=1):
    # peft's init leaves B = 0 (the adapter is the base); random factors make every check bite.
    gen = torch.Generator().manual_seed(seed)
    for name, p in engine.model.named_parameters():
        if is_lora_param(name):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _engine_log_probs(engine, batch) -> list[torch.Tensor]:
    """Per sequence: log-probs of tokens 1..n-1, from the engine's packed forward."""
    mbs = make_micro_batches(batch.prompts, batch.responses, max_tokens=24)
    out = []
    for mb, res in zip(mbs, engine.forward(mbs)):
        bounds = mb.packed.cu_seqlens.tolist()
        for start, stop in zip(bounds[:-1], bounds[1:]):
            out.append(res["log_probs"][start:stop - 1])
    return out


@torch.no_grad()
def _hf_log_probs(model, batch) -> list[torch.Tensor]:
    out = []
    for prompt, response in zip(batch.prompts.to_list(), batch.responses.to_list()):
        seq = torch.cat([prompt, response])
        logp = F.log_softmax(model(seq[None]).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(-1, seq[1:, None])[:, 0])
    return out


def _max_gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_peft_loads_the_exported_adapter_and_matches_the_engine(folder, world, tmp_path):
    engine = _engine(folder, optim=None)
    _randomise_adapters(engine)
    buckets = engine.export_hf_weights(bucket_bytes=1 << 12, select=is_lora_param)
    write_adapter_folder(tmp_path / "adapter", (t for b in buckets for t in b), lora=LORA,
                         base_model=str(folder))

    config, factors = read_adapter_folder(tmp_path / "adapter")
    assert lora_from_peft(config) == LORA
    mine = {n: p for n, p in engine.model.named_parameters() if is_lora_param(n)}
    assert factors.keys() == mine.keys() and len(mine) == 2 * 3 * 2  # 2 layers x 3 modules x A/B
    for name, tensor in factors.items():
        torch.testing.assert_close(tensor, mine[name], atol=0, rtol=0)

    batch = make_batch(3)
    ours = _engine_log_probs(engine, batch)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain = _hf_log_probs(base, batch)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert _max_gap(ours, _hf_log_probs(peft_model, batch)) < TOL
    assert _max_gap(ours, plain) > 100 * TOL  # the adapter matters: the check above bites


def test_merged_export_is_a_plain_hf_model_with_the_engines_log_probs(folder, world):
    engine = _engine(folder, optim=None)
    _randomise_adapters(engine, seed=2)
    # Small buckets: a weight and its factors arrive in different buckets.
    buckets = engine.export_hf_weights(bucket_bytes=1 << 12)
    merged = {name: t.clone() for bucket in merged_stream(buckets, lora=LORA) for name, t in bucket}
    assert not any(is_lora_param(name) for name in merged)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(merged)
    batch = make_batch(4)
    assert _max_gap(_engine_log_probs(engine, batch), _hf_log_probs(model, batch)) < TOL


def _train_step(engine, batch):
    mbs = make_micro_batches(batch.prompts, batch.responses, batch.per_token, max_tokens=24)
    tokens, _ = engine.loss_normalizers(mbs, mask_key="loss_mask")
    engine.forward_backward(mbs, actor_loss_fn(tokens))
    engine.step()


def test_checkpoint_holds_adapters_only_and_resumes_exactly(folder, world, tmp_path):
    engine = _engine(folder)
    _train_step(engine, make_batch(5))
    engine.save_checkpoint(tmp_path / "ckpt")
    # The global tensors DCP holds: the adapters, their moments, the base's fingerprints.
    saved = set(FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    adapters = {n for n, _ in engine.model.named_parameters() if is_lora_param(n)}
    frozen = {n for n, p in engine.model.named_parameters() if not p.requires_grad}
    assert adapters and frozen
    assert saved == ({f"model/{n}" for n in adapters} | {f"lora_base/{n}" for n in frozen}
                     | {f"optim/{m}/{n}" for m in ("exp_avg", "exp_avg_sq") for n in adapters})

    resumed = _engine(folder)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for batch_seed in (6, 7):  # the same next steps on both: bit-identical adapters
        _train_step(engine, make_batch(batch_seed))
        _train_step(resumed, make_batch(batch_seed))
    for (name, a), (_, b) in zip(engine.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)

    other = shutil.copytree(folder, tmp_path / "other")  # another base: one weight changed
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RLHFError, match="another base"):
        _engine(other).load_checkpoint(tmp_path / "ckpt")
