"""Build a tiny random-init Hugging Face model folder (weights, config, tokenizer) from a spec.

The folder loads with `AutoModelForCausalLM.from_pretrained`, in vLLM and in the project's
own engine, so tests and the quickstart need no model hub. Weights are float32 and a pure
function of the spec: the same spec gives bit-identical tensors.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from rlhf.config.schema import VLLM_CPU_HEAD_SIZES, TinyModelConfig
from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer
from rlhf.errors import RLHFError
from rlhf.families import model_family
from rlhf.files import atomic_folder
from rlhf.models.moe import split_fused_experts

INIT_STD = 0.02
# Norm scales and biases get small random offsets instead of HF's ones/zeros, so a weight
# mapping that drops or swaps them changes the logits and tests can catch it.
NORM_JITTER = 0.1


def tiny_hf_config(spec: TinyModelConfig, *, bos_id: int, eos_id: int,
                   pad_id: int) -> PretrainedConfig:
    """The transformers config `make_tiny_model` writes for `spec` (also read by the planner)."""
    family = model_family(spec.arch)
    keys = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_embeddings, rms_norm_eps=1e-6, hidden_act=family.hidden_act,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32",
        **family.tiny_config)
    if family.tiny_writes_head_dim:
        # Written even where it equals hidden / heads: real Qwen3 and Gemma decouple the two.
        keys["head_dim"] = spec.head_dim
    if family.is_moe:
        keys.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    moe_intermediate_size=spec.moe_intermediate_size)
    return getattr(transformers, f"{family.hf_prefix}Config")(**keys)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, *, norm_center: float = 1.0) -> None:
    # Our own init with a private generator: independent of transformers' init code and of
    # the global RNG, so the weights depend on the spec alone.
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # a tied weight is listed once
        if name.endswith(".bias"):
            param.normal_(0.0, INIT_STD, generator=gen)
        elif param.dim() == 1:  # RMSNorm scales
            param.normal_(norm_center, NORM_JITTER, generator=gen)
        else:
            param.normal_(0.0, INIT_STD, generator=gen)


def _write_model(spec: TinyModelConfig, folder: Path) -> None:
    tokenizer = train_tiny_tokenizer(vocab_size=spec.vocab_size, seed=spec.seed)
    tokenizer.model_max_length = spec.max_position_embeddings
    ids = dict(bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id,
               pad_id=tokenizer.pad_token_id)
    config = tiny_hf_config(spec, **ids)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, spec.seed, norm_center=model_family(spec.arch).norm_weight_center)
    # Written by hand rather than with model.save_pretrained, which draws a progress bar.
    state_dict = split_fused_experts({name: tensor.contiguous()
                                      for name, tensor in model.state_dict().items()})
    if spec.tie_embeddings:
        del state_dict["lm_head.weight"]  # a tied checkpoint stores the embedding once
    save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=ids["bos_id"], eos_token_id=ids["eos_id"],
                     pad_token_id=ids["pad_id"]).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise RLHFError(f"{out_dir} exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise RLHFError(f"{out_dir} already exists and is not empty; pass --overwrite "
                        f"(overwrite=True) to replace it")


def make_tiny_model(spec: TinyModelConfig, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Write a random-init model folder for spec to out_dir, atomically; return out_dir.

    A non-empty out_dir is replaced only with overwrite=True, once the new folder is complete.
    """
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    if spec.head_dim not in VLLM_CPU_HEAD_SIZES:
        print(f"warning: head size {spec.head_dim} (hidden_size / num_heads) is not one that "
              f"vLLM's CPU attention supports {VLLM_CPU_HEAD_SIZES}; the model works in "
              f"transformers, but vLLM on CPU will refuse it", file=sys.stderr)
    with atomic_folder(out_dir) as tmp:
        _write_model(spec, tmp)
    return out_dir
