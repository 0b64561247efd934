"""Weight loading (slices, stages, value heads), export and saving; see test_model_config.py."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf.config.schema import TinyModelConfig
from rlhf.data.packing import pack
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.errors import RLHFError
from rlhf.models.config import ModelArgs
from rlhf.models.hf_io import VALUE_HEAD_INIT_STD, load_hf_weights
from rlhf.models.transformer import CausalLM, ValueModel
from tests.unit.models.hf_folder import export_hf_weights, save_hf_folder

SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)
# One tie setting per arch keeps the build short; test_transformer covers all combinations.
ARCH_TIED = [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", True),
             ("llama", True), ("gemma", True)]
TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {(arch, tied): make_tiny_model(TinyModelConfig(arch=arch, tie_embeddings=tied, **SMALL),
                                          root / f"{arch}-{tied}")
            for arch, tied in ARCH_TIED}


def _write_classifier(folder, cls_name, num_labels, seed=0):
    """A random-init Llama*Classification folder written by save_pretrained; returns the model."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, num_labels=num_labels)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # HF zero-inits biases; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def value_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm") / "seqcls"
    return folder, _write_classifier(folder, "LlamaForSequenceClassification", 1)


@pytest.fixture(scope="module")
def packed():
    gen = torch.Generator().manual_seed(0)
    lengths = [1] + torch.randint(1, 21, (4,), generator=gen).tolist()
    seqs = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen) for n in lengths]
    return seqs, pack(seqs)


def _run(model, p):
    with torch.no_grad():
        return model.eval()(p.tokens, p.position_ids, p.cu_seqlens, p.max_seqlen)


def _loaded(cls, folder, **kwargs):
    model = cls(ModelArgs.from_pretrained(folder))
    load_hf_weights(model, folder, **kwargs)
    return model


def _hf_values(hf, seqs):
    with torch.no_grad():
        return torch.cat([hf.score(hf.model(s[None]).last_hidden_state)[0, :, 0] for s in seqs])


# ---- value heads ---------------------------------------------------------------------------


def test_value_head_folder_matches_hf_score(value_folder, packed):
    folder, hf = value_folder
    seqs, p = packed
    model = _loaded(ValueModel, folder)
    values_T = _run(model, p)
    assert values_T.shape == (p.tokens.numel(),)
    assert (values_T - _hf_values(hf, seqs)).abs().max() < TOL


def test_token_classification_head_with_bias(tmp_path, packed):
    seqs, p = packed
    hf = _write_classifier(tmp_path / "tokcls", "LlamaForTokenClassification", 1)
    model = _loaded(ValueModel, tmp_path / "tokcls")
    assert model.args.score_bias and model.score.bias is not None
    assert (_run(model, p) - _hf_values(hf, seqs)).abs().max() < TOL


def test_value_head_with_two_labels_is_refused(tmp_path):
    _write_classifier(tmp_path / "two", "LlamaForSequenceClassification", 2)
    with pytest.raises(RLHFError, match="num_labels=2"):
        _loaded(ValueModel, tmp_path / "two")


def test_fresh_value_head_on_causal_lm_folder(folders, packed):
    folder = folders["llama", False]
    model = ValueModel(ModelArgs.from_pretrained(folder))
    assert load_hf_weights(model, folder, value_head_seed=5) == ["score.weight"]
    again = ValueModel(ModelArgs.from_pretrained(folder))
    load_hf_weights(again, folder, value_head_seed=5)
    other = ValueModel(ModelArgs.from_pretrained(folder))
    load_hf_weights(other, folder, value_head_seed=6)
    weight = model.score.weight.detach()
    assert torch.equal(weight, again.score.weight) and not torch.equal(weight, other.score.weight)
    assert 0.5 * VALUE_HEAD_INIT_STD < weight.std() < 2 * VALUE_HEAD_INIT_STD
    body = _loaded(CausalLM, folder).model  # the body is the causal LM's
    assert torch.equal(model.model.layers["1"].mlp.up_proj.weight,
                       body.layers["1"].mlp.up_proj.weight)


def test_causal_lm_refuses_value_head_folder(value_folder):
    with pytest.raises(RLHFError, match=r"ValueModel.*score\.weight"):
        _loaded(CausalLM, value_folder[0])


# ---- slices and pipeline stages ------------------------------------------------------------

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def _shard_half(model, rank):
    """Replace modules by rank's half the way the TP sharding would: rows of column-parallel ones,
    input columns of row-parallel ones (embedding and LM head by vocabulary rows)."""
    for name, module in list(model.named_modules()):
        kind = name.rsplit(".", 1)[-1]
        if kind not in COLUMN + ROW:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if kind == "embed_tokens":
            new = torch.nn.Embedding(module.num_embeddings // 2, module.embedding_dim)
        elif kind in COLUMN:
            new = torch.nn.Linear(module.in_features, module.out_features // 2,
                                  bias=module.bias is not None)
        else:
            new = torch.nn.Linear(module.in_features // 2, module.out_features,
                                  bias=module.bias is not None)
        setattr(parent, kind, new)


def test_shard_fn_reads_the_requested_slices(folders):
    folder = folders["qwen2", True]  # biases (sliced with their rows) and a tied head
    full = load_file(folder / "model.safetensors")
    seen = {}

    def shard_fn(name, shape):
        seen[name] = shape
        kind = name.split(".")[-2]
        if kind in COLUMN:
            return (0, shape[0] // 2, shape[0])
        if kind in ROW and name.endswith("weight"):
            return (1, shape[1] // 2, shape[1])
        return None

    model = CausalLM(ModelArgs.from_pretrained(folder))
    _shard_half(model, rank=1)
    model.tie_weights()
    load_hf_weights(model, folder, shard_fn=shard_fn)
    assert seen.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        assert seen[name] == tuple(full[name].shape)
        spec = shard_fn(name, tuple(full[name].shape))
        expected = full[name] if spec is None else full[name].narrow(spec[0], spec[1],
                                                                     spec[2] - spec[1])
        assert torch.equal(param, expected), name
    assert model.model.layers["0"].self_attn.q_proj.weight.shape == (32, 64)


def test_wrong_slice_shape_names_the_parameter(folders):
    folder = folders["llama", False]
    model = CausalLM(ModelArgs.from_pretrained(folder))
    with pytest.raises(RLHFError, match=r"model\.norm\.weight.*shape"):
        load_hf_weights(model, folder, shard_fn=lambda n, s: (0, 0, 3) if n == "model.norm.weight"
                        else None)


def test_a_shard_ending_at_the_tensor_end_may_be_padded(folders):
    """The last shards of a padded vocabulary: the real rows are copied, the padding zeroed."""
    folder = folders["llama", False]
    config = json.loads((folder / "config.json").read_text())
    vocab = config["vocab_size"]
    model = CausalLM(ModelArgs.from_hf_config({**config, "vocab_size": vocab + 5}))
    vocab_rows = ("model.embed_tokens.weight", "lm_head.weight")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in vocab_rows:
            params[name].fill_(7.0)  # stands for the uninitialised memory of to_empty
    load_hf_weights(model, folder, shard_fn=lambda n, s: (0, 0, s[0]) if n in vocab_rows else None)
    full = load_file(folder / "model.safetensors")
    for name in vocab_rows:
        assert torch.equal(params[name][:vocab], full[name])
        assert not params[name][vocab:].any()
    # A slice that stops short of the tensor's end is no padding: still a shape error.
    with pytest.raises(RLHFError, match=r"embed_tokens\.weight.*shape"):
        load_hf_weights(model, folder,
                        shard_fn=lambda n, s: (0, 0, s[0] - 1) if n in vocab_rows else None)


def test_pipeline_stages_load_their_part_and_compose(folders, packed):
    folder = folders["llama", True]  # tied: the last stage takes lm_head from the embedding
    _, p = packed
    args = ModelArgs.from_pretrained(folder)
    first = CausalLM(args, layer_range=(0, 1), has_head=False)
    last = CausalLM(args, layer_range=(1, 2), has_embedding=False)
    load_hf_weights(first, folder)
    load_hf_weights(last, folder)
    assert {n.split(".")[2] for n, _ in last.named_parameters() if ".layers." in n} == {"1"}
    full = _loaded(CausalLM, folder)
    assert torch.equal(last.lm_head.weight, full.model.embed_tokens.weight)
    hidden_TH = _run(first, p)
    with torch.no_grad():
        staged = last.eval()(hidden_TH, p.position_ids, p.cu_seqlens, p.max_seqlen)
    assert torch.equal(staged, _run(full, p))


# ---- missing / unexpected tensors ----------------------------------------------------------


def _edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(folders, tmp_path):
    folder = _edited_copy(folders["llama", False], tmp_path / "m",
                          lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(RLHFError, match=r"lacks .*model\.layers\.1\.mlp\.down_proj\.weight"):
        _loaded(CausalLM, folder)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.extra.weight",
                                   "model.layers.2.mlp.up_proj.weight"])
def test_unexpected_tensor_is_named(folders, tmp_path, extra):
    folder = _edited_copy(folders["llama", False], tmp_path / "u",
                          lambda t: t.__setitem__(extra, torch.zeros(2)))
    with pytest.raises(RLHFError, match=f"does not have.*{extra}"):
        _loaded(CausalLM, folder)


def test_untied_lm_head_is_required_and_tied_one_may_be_present(folders, tmp_path):
    folder = _edited_copy(folders["llama", False], tmp_path / "nohead",
                          lambda t: t.pop("lm_head.weight"))
    with pytest.raises(RLHFError, match=r"lm_head\.weight"):
        _loaded(CausalLM, folder)
    tied = folders["llama", True]
    both = _edited_copy(tied, tmp_path / "both", lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = _loaded(CausalLM, both)
    assert torch.equal(model.lm_head.weight, load_file(tied / "model.safetensors")[
        "model.embed_tokens.weight"])


def test_shape_mismatch_is_named(folders):
    folder = folders["llama", False]
    config = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_hf_config({**config, "intermediate_size": 80})
    with pytest.raises(RLHFError, match=r"gate_proj\.weight.*\(96, 64\).*\(80, 64\)"):
        load_hf_weights(CausalLM(args), folder)


def test_folder_without_safetensors(folders, tmp_path):
    args = ModelArgs.from_pretrained(folders["llama", False])
    with pytest.raises(RLHFError, match="safetensors"):
        load_hf_weights(CausalLM(args), tmp_path)


# ---- export and save -----------------------------------------------------------------------


@pytest.mark.parametrize("arch_tied", ARCH_TIED, ids=[f"{a}-{t}" for a, t in ARCH_TIED])
def test_export_round_trip_is_bit_exact(folders, arch_tied):
    folder = folders[arch_tied]
    original = load_file(folder / "model.safetensors")
    model = _loaded(CausalLM, folder)
    bucket_bytes = 40_000
    buckets = list(export_hf_weights(model, bucket_bytes=bucket_bytes))
    exported = [pair for bucket in buckets for pair in bucket]
    assert len(buckets) > 1
    for bucket in buckets:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert len(bucket) == 1 or nbytes <= bucket_bytes
    names = [name for name, _ in exported]
    assert len(names) == len(set(names)) and set(names) == original.keys()
    for name, tensor in exported:
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name


def test_save_hf_folder_loads_in_transformers_and_back(folders, tmp_path, packed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seqs, p = packed
    src = folders["qwen2", True]
    model = _loaded(CausalLM, src)
    out = save_hf_folder(model, tmp_path / "saved", config_source=src, max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").exists()  # small shards force an index
    assert (AutoTokenizer.from_pretrained(out).get_vocab()
            == AutoTokenizer.from_pretrained(src).get_vocab())
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_TV = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert (_run(model, p) - ref_TV).abs().max() < TOL
    reloaded = _loaded(CausalLM, out)  # through the index file
    for (name, a), (_, b) in zip(model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(RLHFError, match="already holds weights"):
        save_hf_folder(model, out, config_source=src)


def test_saved_value_model_loads_as_sequence_classifier(folders, tmp_path, packed):
    from transformers import AutoModelForSequenceClassification

    seqs, p = packed
    src = folders["llama", False]
    model = ValueModel(ModelArgs.from_pretrained(src))
    load_hf_weights(model, src)  # fresh head on a causal-LM body: a new critic
    out = save_hf_folder(model, tmp_path / "critic", config_source=src)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    assert (_run(model, p) - _hf_values(hf, seqs)).abs().max() < TOL
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_save_refuses_a_pipeline_stage(folders, tmp_path):
    args = ModelArgs.from_pretrained(folders["llama", False])
    with pytest.raises(RLHFError, match="pipeline stage"):
        save_hf_folder(CausalLM(args, layer_range=(0, 1), has_head=False), tmp_path / "x",
                       config_source=folders["llama", False])


# ---- the config the loader reads -----------------------------------------------------------


@pytest.mark.parametrize("arch_tied", ARCH_TIED[:4], ids=[a for a, _ in ARCH_TIED[:4]])
def test_args_agree_with_transformers_config(folders, arch_tied):
    from transformers import AutoConfig

    folder = folders[arch_tied]
    args, hf = ModelArgs.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    assert args.model_type == hf.model_type
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.hidden_size,
            args.intermediate_size, args.vocab_size, args.tie_word_embeddings) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size,
        hf.intermediate_size, hf.vocab_size, hf.tie_word_embeddings)
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert args.head_dim == hf_head_dim
    assert args.rope_theta == hf.rope_parameters["rope_theta"] and args.rope_scaling is None
    assert args.qkv_bias == (arch_tied[0] == "qwen2") and args.qk_norm == (arch_tied[0] == "qwen3")
