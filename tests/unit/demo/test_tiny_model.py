"""Tiny model folders load in transformers, match their spec and are reproducible."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlhf.config.schema import TinyModelConfig
from rlhf.demo import tiny_model
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.demo.tiny_tokenizer import ROLE_TOKENS, train_tiny_tokenizer
from rlhf.errors import RLHFError
from rlhf.families import FAMILIES, model_family
from tests.ray_echo import ray_echo_muted

ARCHS = [f.name for f in FAMILIES if not f.is_moe]  # MoE folders: tests/unit/models/test_moe.py
# Head size 16 is fine for transformers; only vLLM on CPU needs >= 32.
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
             vocab_size=384, max_position_embeddings=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One model folder per (arch, tied), built once for the whole file."""
    root = tmp_path_factory.mktemp("tiny")
    return {(arch, tied): make_tiny_model(TinyModelConfig(arch=arch, tie_embeddings=tied, **SMALL),
                                          root / f"{arch}-{tied}")
            for arch in ARCHS for tied in (False, True)}


@pytest.fixture(scope="module")
def tokenizer(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders["llama", False])


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_folder_loads_and_matches_spec(folders, tokenizer, arch, tied):
    spec = TinyModelConfig(arch=arch, tie_embeddings=tied, **SMALL)
    model = _load(folders[arch, tied])
    config = model.config
    assert config.model_type == arch
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.tie_word_embeddings) == (2, 64, 4, 2, 96, 384, tied)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (spec.num_heads * spec.head_dim, spec.hidden_size)
    assert attn.k_proj.weight.shape == (spec.num_kv_heads * spec.head_dim, spec.hidden_size)
    assert model.model.embed_tokens.weight.shape == (spec.vocab_size, spec.hidden_size)
    family = model_family(arch)
    if family.tiny_writes_head_dim:  # Qwen2 has no head_dim field: its head size is hidden / heads
        assert config.head_dim == spec.head_dim
    has_bias = family.attention_bias == "qkv"  # the others' biases follow attention_bias: off
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert (proj.bias is not None) == has_bias
    assert hasattr(attn, "q_norm") == hasattr(attn, "k_norm") == family.qk_norm
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared == tied
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids


@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_reload_gives_identical_logits(folders, arch, tmp_path):
    model = _load(folders[arch, arch == "qwen3"])
    model.save_pretrained(tmp_path / "copy")
    reloaded = _load(tmp_path / "copy")
    batch = torch.randint(0, 384, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(batch).logits, reloaded(batch).logits)


def test_weights_are_a_function_of_the_spec(folders, tmp_path):
    first = load_file(folders["llama", False] / "model.safetensors")
    again = make_tiny_model(TinyModelConfig(**SMALL), tmp_path / "again")
    other = make_tiny_model(TinyModelConfig(**SMALL, seed=1), tmp_path / "other")
    second, third = load_file(again / "model.safetensors"), load_file(other / "model.safetensors")
    assert first.keys() == second.keys() == third.keys()
    assert all(t.dtype == torch.float32 for t in first.values())
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not any(torch.equal(first[k], third[k]) for k in first)


def test_refuses_non_empty_folder_and_overwrite_replaces_it(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(RLHFError, match="--overwrite"):
        make_tiny_model(TinyModelConfig(**SMALL), out)
    assert (out / "keep.txt").read_text() == "old"
    make_tiny_model(TinyModelConfig(**SMALL), out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folders left


def test_empty_folder_is_filled_without_overwrite(tmp_path):
    (tmp_path / "model").mkdir()
    assert (make_tiny_model(TinyModelConfig(**SMALL), tmp_path / "model") / "config.json").exists()


def test_failure_leaves_previous_folder_untouched(tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def write_then_fail(spec, folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny_model, "_write_model", write_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny_model(TinyModelConfig(**SMALL), out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    with pytest.raises(RuntimeError):
        make_tiny_model(TinyModelConfig(**SMALL), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_warns_about_head_sizes_vllm_cpu_lacks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tiny_model, "_write_model", lambda spec, folder: None)  # only the check
    with ray_echo_muted():
        make_tiny_model(TinyModelConfig(**SMALL), tmp_path / "a")
        assert "head size 16" in capsys.readouterr().err
        head_32 = TinyModelConfig(**{**SMALL, "num_heads": 2, "num_kv_heads": 1})
        make_tiny_model(head_32, tmp_path / "b")
        assert capsys.readouterr().err == ""


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_tokenizer_round_trips_any_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_round_trips_mixed_scripts(tokenizer):
    for text in ["naïve café", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 end", "tabs\tand\r\nnewlines\n\n",
                 "  leading and trailing  ", "Ünïcödé ٣٤٥ ①②", "-17*3+0="]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_digits_are_one_token_each(tokenizer):
    ids = tokenizer("x1234567890y 12+345=-7")["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == list("1234567890") + list("12345") + ["7"]


def test_tokenizer_special_tokens_are_distinct_single_tokens(tokenizer):
    specials = [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, *ROLE_TOKENS]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in specials]
    assert len(set(ids)) == len(specials)
    assert tokenizer("".join(specials))["input_ids"] == ids
    assert tokenizer("12+7=")["input_ids"][0] != tokenizer.bos_token_id  # no automatic bos


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>\nBe brief.<|eos|><|user|>\n12+7=<|eos|><|assistant|>\n"
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain == prompt.removesuffix("<|assistant|>\n")
    full = messages + [{"role": "assistant", "content": "19"}]
    ids = tokenizer.apply_chat_template(full, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).endswith("<|assistant|>\n19<|eos|>")
    assert ids[-1] == tokenizer.eos_token_id  # generation of an assistant turn stops at eos
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tokenizer_fits_vocab_and_is_deterministic(tokenizer):
    assert len(tokenizer) <= SMALL["vocab_size"]
    assert len(tokenizer.get_vocab()) == len(tokenizer)
    a = train_tiny_tokenizer(vocab_size=384, seed=0)
    b = train_tiny_tokenizer(vocab_size=384, seed=0)
    c = train_tiny_tokenizer(vocab_size=384, seed=5)
    assert a.get_vocab() == b.get_vocab() == tokenizer.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert c.backend_tokenizer.to_str() != a.backend_tokenizer.to_str()
