"""Prompt datasets (JSONL, Parquet, chat rows, filtering, bad rows) and the resumable loader."""

import copy
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from rlhf.config.schema import DataConfig, TinyModelConfig
from rlhf.data.batch import Batch
from rlhf.data.dataset import PromptDataset, PromptLoader, build_prompt_dataset
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.errors import RLHFError

TINY = TinyModelConfig(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                       intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = make_tiny_model(TINY, tmp_path_factory.mktemp("tiny") / "model")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def arith_rows(n, start=0):
    return [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": "arith"}
            for i in range(start, start + n)]


def chat_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_jsonl_and_parquet_files_concatenate(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [*arith_rows(2), {"prompt": "hi", "ground_truth": [1, 2],
                                                             "level": 3}])
    b = write_parquet(tmp_path / "b.parquet", arith_rows(3, start=10))
    ds = PromptDataset.from_files([a, b], tokenizer, max_prompt_length=64)
    assert len(ds) == 6 and ds.num_filtered == 0
    assert ds.raw_prompt == ["0+1=", "1+1=", "hi", "10+1=", "11+1=", "12+1="]
    assert ds.ground_truth == ["1", "2", [1, 2], "11", "12", "13"]
    assert ds.data_source == ["arith", "arith", "unknown", "arith", "arith", "arith"]
    assert ds.extra[2] == {"level": 3, "data_source": "unknown"}
    assert ds.extra[0] == {"data_source": "arith"}
    assert ds.locations[2] == f"{a}:3" and ds.locations[4] == f"{b} row 2"


def test_prompts_use_the_chat_template(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12+7=", "ground_truth": "19"},
                                             {"prompt": chat, "ground_truth": "4"}])
    ds = PromptDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert ds.prompt_ids[0].tolist() == chat_ids(tokenizer, [{"role": "user", "content": "12+7="}])
    assert ds.prompt_ids[1].tolist() == chat_ids(tokenizer, chat)
    assert ds.prompt_ids.dtype == torch.int64
    assert tokenizer.decode(ds.prompt_ids[1]).startswith("<|bos|><|system|>\nBe brief.")
    assert ds.raw_prompt == ["12+7=", "2+2="]  # the question, not the rendered template


def test_messages_rows_from_parquet(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "3+4="}]
    path = write_parquet(tmp_path / "c.parquet", [{"messages": chat, "answer": "7"}])
    cfg = DataConfig(prompt_key="messages", ground_truth_key="answer", max_prompt_length=64)
    ds = build_prompt_dataset([path], tokenizer, cfg)
    assert ds.prompt_ids[0].tolist() == chat_ids(tokenizer, chat)
    assert ds.ground_truth == ["7"] and ds.raw_prompt == ["3+4="]


def verl_row(question, answer, index):
    """A row as verl's GSM8K preparation writes it."""
    return {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index}}


def test_verl_parquet_is_read_as_is_with_a_dotted_key(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "verl.parquet", [verl_row("3+4=", "7", 0),
                                                     verl_row("5+5=", "10", 1)])
    cfg = DataConfig(ground_truth_key="reward_model.ground_truth", max_prompt_length=64)
    ds = build_prompt_dataset([path], tokenizer, cfg)
    assert ds.ground_truth == ["7", "10"] and ds.raw_prompt == ["3+4=", "5+5="]
    assert ds.data_source == ["openai/gsm8k"] * 2
    # reward_model is where the answer came from; extra_info stays whole for verl's scorers
    assert ds.extra[1] == {"data_source": "openai/gsm8k", "ability": "math",
                           "extra_info": {"split": "train", "index": 1}}
    nested_prompt = write_jsonl(tmp_path / "n.jsonl", [{"q": {"text": "1+1="}, "a": "2"}])
    assert PromptDataset.from_files([nested_prompt], tokenizer, prompt_key="q.text",
                                    ground_truth_key="a", max_prompt_length=64).raw_prompt == ["1+1="]
    # a top-level field whose name holds a dot wins over the nested reading
    dotted = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "a.b": "top", "a": {"b": "in"}}])
    assert PromptDataset.from_files([dotted], tokenizer, ground_truth_key="a.b",
                                    max_prompt_length=64).ground_truth == ["top"]


def test_missing_dotted_keys_name_the_key_and_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "v.jsonl", [verl_row("1+1=", "2", 0), verl_row("2+2=", "4", 1)])
    with pytest.raises(RLHFError, match=rf"{path}:1: no 'ground_truth' field .*verl's layout: "
                                        r"set data.ground_truth_key: reward_model.ground_truth"):
        PromptDataset.from_files([path], tokenizer, max_prompt_length=64)
    with pytest.raises(RLHFError, match=rf"{path}:1: no 'reward_model.answer' field "
                                        r"\('reward_model' has fields \['ground_truth', 'style'\]"):
        PromptDataset.from_files([path], tokenizer, ground_truth_key="reward_model.answer",
                                 max_prompt_length=64)
    with pytest.raises(RLHFError, match=rf"{path}:1: no 'data_source.name' field: 'data_source' "
                                        r"is a str, not an object"):
        PromptDataset.from_files([path], tokenizer, ground_truth_key="data_source.name",
                                 max_prompt_length=64)
    with pytest.raises(RLHFError, match=r"no 'chat.messages' field .*data.prompt_key"):
        PromptDataset.from_files([path], tokenizer, prompt_key="chat.messages",
                                 ground_truth_key="reward_model.ground_truth",
                                 max_prompt_length=64)


def test_without_a_chat_template_prompts_are_encoded_plainly(tmp_path, plain_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", arith_rows(2))
    ds = PromptDataset.from_files([path], plain_tokenizer, max_prompt_length=64)
    assert ds.prompt_ids[1].tolist() == plain_tokenizer("1+1=")["input_ids"]
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        *arith_rows(1), {"prompt": [{"role": "user", "content": "x"}], "ground_truth": "1"}])
    with pytest.raises(RLHFError, match=rf"{chat}:2: .*no chat template"):
        PromptDataset.from_files([chat], plain_tokenizer, max_prompt_length=64)


def test_overlong_prompts_are_filtered_and_counted(tmp_path, tokenizer, caplog):
    rows = arith_rows(3) + [{"prompt": "1+" * 40 + "1=", "ground_truth": "41"}] * 2
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    limit = max(len(chat_ids(tokenizer, [{"role": "user", "content": r["prompt"]}]))
                for r in rows[:3])
    with caplog.at_level(logging.WARNING, logger="rlhf.data.dataset"):
        ds = PromptDataset.from_files([path], tokenizer, max_prompt_length=limit)
    assert len(ds) == 3 and ds.num_filtered == 2
    assert max(ds.prompt_ids.lengths.tolist()) == limit
    assert "dropped 2 of 5 prompts longer than" in caplog.text
    with pytest.raises(RLHFError, match=rf"{path}:4: the prompt is \d+ tokens, longer than "
                                        rf"data.max_prompt_length={limit} \(2 such rows"):
        PromptDataset.from_files([path], tokenizer, max_prompt_length=limit, filter_overlong=False)
    with pytest.raises(RLHFError, match="empty: all 5 prompts are longer than 2 tokens"):
        PromptDataset.from_files([path], tokenizer, max_prompt_length=2)


GOOD = json.dumps({"prompt": "1+1=", "ground_truth": "2"})


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "1+1=", "ground_truth": ', "not valid JSON"),
    ('["1+1=", "2"]', "expected a JSON object, got a list"),
    ('{"question": "1+1=", "ground_truth": "2"}', "no 'prompt' field"),
    ('{"prompt": 12, "ground_truth": "2"}', "'prompt' must be a string or a list"),
    ('{"prompt": "  ", "ground_truth": "2"}', "'prompt' is an empty string"),
    ('{"prompt": [], "ground_truth": "2"}', "'prompt' is an empty list"),
    ('{"prompt": [{"role": "user"}], "ground_truth": "2"}', "message 0 of 'prompt'"),
    ('{"prompt": ["hi"], "ground_truth": "2"}', "message 0 of 'prompt'"),
    ('{"prompt": "1+1="}', "no 'ground_truth' field"),
    ('{"prompt": "1+1=", "ground_truth": null}', "'ground_truth' is null"),
    ('{"prompt": "1+1=", "ground_truth": "2", "data_source": 5}',
     "'data_source' must be a string"),
    ('{"prompt": [{"role": "robot", "content": "x"}], "ground_truth": "2"}',
     "chat template failed"),
])
def test_malformed_rows_name_file_and_line(tmp_path, tokenizer, line, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", GOOD, line, GOOD])
    with pytest.raises(RLHFError) as info:
        PromptDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert f"{path}:4: " in str(info.value) and problem in str(info.value)


def test_bad_files(tmp_path, tokenizer):
    def error(files):
        with pytest.raises(RLHFError) as info:
            PromptDataset.from_files(files, tokenizer, max_prompt_length=64)
        return str(info.value)

    assert "no data files" in error([])
    assert "does not exist" in error([tmp_path / "missing.jsonl"])
    assert "unsupported data file type '.json'" in error([write_jsonl(tmp_path / "x.json", [])])
    assert "the files hold no rows" in error([write_jsonl(tmp_path / "empty.jsonl", [])])
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    assert f"{not_parquet}: not a readable Parquet file" in error([not_parquet])
    no_truth = write_parquet(tmp_path / "nt.parquet", [{"prompt": "a", "ground_truth": "1"},
                                                       {"prompt": "b", "ground_truth": None}])
    assert f"{no_truth} row 2: 'ground_truth' is null" in error([no_truth])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    assert f"{latin}:2: not UTF-8" in error([latin])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tokenizer):
    path = write_jsonl(tmp_path_factory.mktemp("loader") / "train.jsonl", arith_rows(23))
    return PromptDataset.from_files([path], tokenizer, max_prompt_length=64)


def take(loader, k):
    return [next(loader) for _ in range(k)]


def indices(batches):
    return [b["index"].tolist() for b in batches]


def test_batches_carry_the_dataset_fields(dataset):
    batch = next(PromptLoader(dataset, batch_size=4, seed=1))
    assert isinstance(batch, Batch) and len(batch) == 4
    assert batch.keys() == ["prompt_ids", "raw_prompt", "ground_truth", "data_source", "extra",
                            "index"]
    assert batch["index"].dtype == torch.int64
    for i, sample in enumerate(batch["index"].tolist()):
        assert batch["prompt_ids"][i].tolist() == dataset.prompt_ids[sample].tolist()
        assert batch["raw_prompt"][i] == f"{sample}+1="
        assert batch["ground_truth"][i] == str(sample + 1)
        assert batch["extra"][i] == {"data_source": "arith"}
    batch["extra"][0]["data_source"] = "changed"
    assert dataset.extra[batch["index"][0]]["data_source"] == "arith"


@pytest.mark.parametrize("drop_last", [True, False])
def test_each_epoch_visits_every_sample_once(dataset, drop_last):
    loader = PromptLoader(dataset, batch_size=5, seed=3, drop_last=drop_last)
    per_epoch = 4 if drop_last else 5
    assert loader.batches_per_epoch == per_epoch
    epochs = [sum(indices(take(loader, per_epoch)), []) for _ in range(3)]
    for seen in epochs:
        assert len(seen) == len(set(seen)) == (20 if drop_last else 23)
        assert set(seen) <= set(range(23))
    if not drop_last:
        assert len(indices(take(PromptLoader(dataset, batch_size=5, drop_last=False), 5))[-1]) == 3
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch


def test_seed_reproducibility_and_no_shuffle(dataset):
    same = [indices(take(PromptLoader(dataset, batch_size=4, seed=7), 12)) for _ in range(2)]
    assert same[0] == same[1]
    assert indices(take(PromptLoader(dataset, batch_size=4, seed=8), 12)) != same[0]
    ordered = take(PromptLoader(dataset, batch_size=4, shuffle=False), 6)
    assert sum(indices(ordered[:5]), []) == list(range(20))
    assert indices(ordered[5:]) == [[0, 1, 2, 3]]  # next epoch starts over, in order


@pytest.mark.parametrize("k", [0, 3, 5, 6, 11])
def test_exact_resume(dataset, k):
    original = PromptLoader(dataset, batch_size=4, seed=11)
    take(original, k)
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint would store it
    restored = PromptLoader(dataset, batch_size=4, seed=11)
    restored.load_state_dict(state)
    expected, resumed = take(original, 8), take(restored, 8)
    assert all(a.equal(b) for a, b in zip(expected, resumed))
    assert (restored.epoch, restored.position) == (original.epoch, original.position)


def test_resume_refuses_a_different_setup(dataset):
    state = PromptLoader(dataset, batch_size=4, seed=1).state_dict()
    with pytest.raises(RLHFError, match="seed: saved 1, now 2; batch_size: saved 4, now 5"):
        PromptLoader(dataset, batch_size=5, seed=2).load_state_dict(state)
    # A checkpoint of a version that stored numpy's permutation visited another order.
    del state["order"]
    with pytest.raises(RLHFError, match="order: saved 'numpy permutation', now 'feistel-6-"
                                        "splitmix64'; the saved run visited its prompts in "
                                        "another order"):
        PromptLoader(dataset, batch_size=4, seed=1).load_state_dict(state)
    unshuffled = PromptLoader(dataset, batch_size=4, shuffle=False)
    state = unshuffled.state_dict()
    del state["order"]
    unshuffled.load_state_dict(state)  # in order then as now


def test_loader_needs_one_full_batch(dataset):
    with pytest.raises(RLHFError, match="23 prompts, fewer than one batch of 32"):
        PromptLoader(dataset, batch_size=32)
    assert len(next(PromptLoader(dataset, batch_size=32, drop_last=False))) == 23
