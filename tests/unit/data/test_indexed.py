"""Indexed datasets: `rlhf preprocess-data` in, memory-mapped reading out, equal to the
in-memory datasets row for row; blends, resumes and refusals."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from rlhf.cli import main
from rlhf.config.schema import DataConfig, SFTConfig, TinyModelConfig
from rlhf.data.batch_split import split_batch
from rlhf.data.blend import BlendedDataset, split_by_weight
from rlhf.data.dataset import PromptDataset, PromptLoader, build_prompt_dataset, read_rows
from rlhf.data.indexed import IndexedDataset, IndexedPromptDataset
from rlhf.data.preprocess import Job, preprocess
from rlhf.data.sft_rows import IndexedSFTDataset, SFTDataset, SFTKeys, build_sft_dataset
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.errors import RLHFError
from rlhf.preflight import _check_data
from tests.unit.data.test_dataset import arith_rows, write_jsonl, write_parquet

TINY = TinyModelConfig(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1,
                       intermediate_size=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(TINY, tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


def prompt_rows(n, start=0):
    rows = arith_rows(n, start)
    for i, row in enumerate(rows):  # JSONL rows: ground truths of several JSON types
        row["ground_truth"] = [i, str(i)] if i in (0, 3) else row["ground_truth"]
        row["level"] = {"n": i}
    rows[1]["prompt"] = [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "2+2="}]
    return rows


def write_datasets_folder(folder, rows):
    """A folder as `datasets`' save_to_disk writes one: Arrow IPC stream files + state.json."""
    folder.mkdir()
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return folder


def _inherited_by_a_fork(*args, **kwargs):
    raise AssertionError("a preprocessing worker ran the caller's patched tokenise_chunk: it "
                         "was forked from the caller instead of started fresh")


def test_prompts_read_by_memory_map_equal_the_in_memory_rows(tmp_path, model, tokenizer):
    rows = prompt_rows(14)
    files = [write_jsonl(tmp_path / "a.jsonl", rows[:5]),
             write_parquet(tmp_path / "b.parquet", rows[5:9]),
             write_datasets_folder(tmp_path / "c", rows[9:])]
    out = tmp_path / "prompts"
    manifest = preprocess(files, out, Job(kind="prompts", tokenizer_path=model), workers=1,
                          progress=False)
    assert manifest["rows"] == 14 and manifest["dtype"] == "uint16"
    in_memory = PromptDataset.from_files([write_jsonl(tmp_path / "all.jsonl", rows)], tokenizer,
                                         max_prompt_length=64)
    indexed = IndexedPromptDataset(out, tokenizer, max_prompt_length=64)
    assert len(indexed) == len(in_memory) == 14
    idx = torch.tensor([13, 0, 1, 9, 6, 3])
    a, b = indexed.batch(idx), in_memory.batch(idx)
    assert a["extra"] == b["extra"] and a["ground_truth"] == b["ground_truth"]
    assert a["raw_prompt"] == b["raw_prompt"] and a["data_source"] == b["data_source"]
    assert a["prompt_ids"].equal(b["prompt_ids"]) and torch.equal(a["index"], b["index"])
    # Two processes write the same bytes as one (chunks come back in input order). They are
    # fresh interpreters, not forks of this one: nothing of the caller's state reaches them
    # (locks held by its other threads, its signal handlers; here, a function patched to fail).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rlhf.data.preprocess.tokenise_chunk", _inherited_by_a_fork)
        preprocess(files, tmp_path / "two", Job(kind="prompts", tokenizer_path=model),
                   workers=2, progress=False)
    for name in ("tokens.bin", "offsets.npy", "rows.jsonl", "rows_offsets.npy"):
        assert (out / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # Overlong prompts are dropped as the in-memory dataset drops them.
    short = IndexedPromptDataset(out, tokenizer, max_prompt_length=10)
    kept = PromptDataset(read_rows([tmp_path / "all.jsonl"]), tokenizer, max_prompt_length=10)
    assert 0 < short.num_filtered == kept.num_filtered
    assert short.batch(torch.arange(len(short)))["prompt_ids"].equal(kept.prompt_ids)
    with pytest.raises(RLHFError, match="filter_overlong_prompts"):
        IndexedPromptDataset(out, tokenizer, max_prompt_length=10, filter_overlong=False)


def test_bad_input_stops_with_the_row_and_leaves_no_folder(tmp_path, model, tokenizer):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*arith_rows(3), "{not json", *arith_rows(2)])
    out = tmp_path / "out"
    with pytest.raises(RLHFError, match=r"bad.jsonl:4: not valid JSON"):
        preprocess([bad], out, Job(kind="prompts", tokenizer_path=model), progress=False)
    assert list(tmp_path.iterdir()) == [bad]  # neither the folder nor its temporary one
    no_answer = write_jsonl(tmp_path / "na.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(RLHFError, match="na.jsonl:1: no 'ground_truth' field .* pass "
                                        "--ground-truth-key"):
        preprocess([no_answer], out, Job(kind="prompts", tokenizer_path=model), progress=False)
    # A folder without its manifest (a run killed before the rename) is refused, by name.
    (tmp_path / "half").mkdir()
    with pytest.raises(RLHFError, match="not a complete indexed dataset"):
        IndexedPromptDataset(tmp_path / "half", tokenizer, max_prompt_length=64)
    ok = write_jsonl(tmp_path / "ok.jsonl", arith_rows(4))
    assert main(["preprocess-data", str(ok), "--out", str(out), "--tokenizer", model,
                 "--workers", "1", "--no-progress"]) == 0
    assert main(["preprocess-data", str(ok), "--out", str(out), "--tokenizer", model]) == 2
    with pytest.raises(RLHFError, match="is a 'prompts' dataset but a 'sft' one"):
        IndexedSFTDataset(out, tokenizer, max_prompt_length=64)


def test_another_tokenizer_is_refused_by_name(tmp_path, model, tokenizer):
    out = tmp_path / "p"
    preprocess([write_jsonl(tmp_path / "a.jsonl", arith_rows(4))], out,
               Job(kind="prompts", tokenizer_path=model), progress=False)
    other = AutoTokenizer.from_pretrained(model)
    other.chat_template = tokenizer.chat_template.replace("\\n", " ")
    other.name_or_path = "other-model"
    with pytest.raises(RLHFError, match=rf"tokenised with '{model}' but this job's tokenizer is "
                                        r"'other-model', whose chat template differ"):
        IndexedPromptDataset(out, other, max_prompt_length=64)


def test_resume_mid_epoch_sees_the_rows_of_an_uninterrupted_run(tmp_path, model, tokenizer):
    out = tmp_path / "p"
    preprocess([write_jsonl(tmp_path / "a.jsonl", arith_rows(23))], out,
               Job(kind="prompts", tokenizer_path=model), progress=False)

    def loader():  # opened afresh, as a resumed job opens it
        return PromptLoader(IndexedPromptDataset(out, tokenizer, max_prompt_length=64),
                            batch_size=4, seed=5)

    straight = loader()
    seen = [next(straight)["raw_prompt"] for _ in range(9)]  # 5 batches an epoch: crosses one
    first = loader()
    before = [next(first)["raw_prompt"] for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # through a checkpoint file
    del first  # killed
    resumed = loader()
    resumed.load_state_dict(state)
    assert before + [next(resumed)["raw_prompt"] for _ in range(6)] == seen
    assert len(set(sum(seen[:5], []))) == 20  # an epoch visits distinct rows


def read_at_dp(loader, dp, steps):
    """The prompts each step trains on, gathered from the rows the driver's split hands each
    of `dp` groups (rlhf.data.batch_split), with every group's share checked."""
    seen = []
    for _ in range(steps):
        batch = next(loader)
        split = split_batch(batch["prompt_ids"].lengths.tolist(), dp=dp, max_tokens=64)
        shares = [[batch["raw_prompt"][i] for i in rows] for rows in split.rows]
        assert all(shares) and sorted(sum(shares, [])) == sorted(batch["raw_prompt"])
        seen.append(sorted(sum(shares, [])))
    return seen


@pytest.mark.parametrize("saved_dp,resumed_dp", [(2, 1), (1, 2)])
def test_a_resume_at_another_dp_size_reads_the_prompts_not_read_yet(
        tmp_path, model, tokenizer, saved_dp, resumed_dp):
    out = tmp_path / "p"
    preprocess([write_jsonl(tmp_path / "a.jsonl", arith_rows(23))], out,
               Job(kind="prompts", tokenizer_path=model), progress=False)

    def loader():  # the driver's, opened afresh as a resumed job opens it
        return PromptLoader(IndexedPromptDataset(out, tokenizer, max_prompt_length=64),
                            batch_size=4, seed=5)

    straight = read_at_dp(loader(), saved_dp, 10)  # 5 batches an epoch: crosses one
    first = loader()
    before = read_at_dp(first, saved_dp, 3)
    state = json.loads(json.dumps(first.state_dict()))  # through a checkpoint file
    del first  # killed
    resumed = loader()
    resumed.load_state_dict(state)
    after = read_at_dp(resumed, resumed_dp, 7)
    assert before + after == straight
    for epoch in (before + after[:2], after[2:]):  # every prompt of an epoch once
        read = sum(epoch, [])
        assert len(read) == len(set(read)) == 20


def test_a_blend_gives_each_dataset_its_weight_and_names_the_mix(tmp_path, model, tokenizer,
                                                                 capsys):
    folders = []
    for name, n in (("big", 30), ("small", 4)):
        folders.append(tmp_path / name)
        preprocess([write_jsonl(tmp_path / f"{name}.jsonl", arith_rows(n, start=100 * len(name)))],
                   folders[-1], Job(kind="prompts", tokenizer_path=model), progress=False)
    cfg = DataConfig(seed=3, max_prompt_length=64)
    blend = build_prompt_dataset([str(f) for f in folders], tokenizer, cfg, weights=[1.0, 1.0])
    assert isinstance(blend, BlendedDataset) and len(blend) == 34
    assert "small: weight 0.500, 17 of 34 samples from 4 rows (4.25 epochs)" in \
        capsys.readouterr().out
    batch = blend.batch(torch.arange(34))
    small = {p for p in batch["raw_prompt"] if p.startswith("5")}
    assert len(small) == 4 and sum(p in small for p in batch["raw_prompt"]) == 17
    counts = {p: batch["raw_prompt"].count(p) for p in small}
    assert sorted(counts.values()) == [4, 4, 4, 5]  # repeated evenly
    assert sum(p.startswith("3") for p in batch["raw_prompt"]) == 17  # 17 distinct of 30
    assert len({p for p in batch["raw_prompt"] if p.startswith("3")}) == 17
    # A blend's batch is its datasets' rows in the asked order; index holds the blend's ids.
    idx = torch.tensor([20, 3, 33, 3])
    which, rows = blend.rows_of(idx.numpy())
    sub = blend.batch(idx)
    assert torch.equal(sub["index"], idx)
    for k in range(4):
        one = blend.datasets[which[k]].batch(torch.tensor([rows[k]]))
        assert sub["prompt_ids"][k].tolist() == one["prompt_ids"][0].tolist()
    assert split_by_weight(10, [1, 1, 1]) == [4, 3, 3]
    with pytest.raises(RLHFError, match="set data.shuffle: true to mix them"):
        build_prompt_dataset([str(f) for f in folders], tokenizer,
                             DataConfig(shuffle=False), weights=[1.0, 1.0])
    with pytest.raises(RLHFError, match="mixes indexed dataset folders with the files"):
        build_prompt_dataset([str(folders[0]), str(tmp_path / "big.jsonl")], tokenizer, cfg)


def test_sft_rows_read_by_memory_map_equal_the_in_memory_samples(tmp_path, model, tokenizer):
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(6)]
    rows.append({"messages": [{"role": "system", "content": "Use the tool."},
                              {"role": "user", "content": "12*3="},
                              {"role": "assistant", "content": "<tool_call>12*3</tool_call>"},
                              {"role": "tool", "content": "36"},
                              {"role": "assistant", "content": "36"}]})
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    preprocess([path], tmp_path / "sft", Job(kind="sft", tokenizer_path=model), workers=1,
               progress=False)
    indexed = IndexedSFTDataset(tmp_path / "sft", tokenizer, max_prompt_length=64)
    in_memory = SFTDataset(list(read_records(path)), tokenizer, keys=SFTKeys(),
                           max_prompt_length=64)
    idx = torch.tensor([6, 0, 3])
    a, b = indexed.batch(idx), in_memory.batch(idx)
    for key in ("prompt_ids", "response_ids", "response_mask"):
        assert a[key].equal(b[key]), key
    # A prompt/answer row trains on the answer and EOS after the prompt RL rows get.
    rl_row = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "0+1=", "ground_truth": "x"}])
    prompt = PromptDataset(read_rows([rl_row]), tokenizer, max_prompt_length=64).prompt_ids[0]
    assert torch.equal(a["prompt_ids"][1], prompt)
    assert a["response_ids"][1].tolist() == tokenizer("1", add_special_tokens=False)[
        "input_ids"] + [tokenizer.eos_token_id]
    assert a["response_mask"][1].all()
    data = IndexedDataset(tmp_path / "sft", kind="sft")
    assert data.manifest["max_prompt_length"] == max(
        int(np.argmax(data.row_mask(i))) for i in range(len(data)))
    # sft.train_files chooses the reader; the job's checks accept the folder for sft only.
    folder = str(tmp_path / "sft")
    assert isinstance(build_sft_dataset(SFTConfig(train_files=(folder,)), tokenizer,
                                        max_prompt_length=64, seed=0), IndexedSFTDataset)
    assert isinstance(build_sft_dataset(SFTConfig(train_files=(str(path),)), tokenizer,
                                        max_prompt_length=64, seed=0), SFTDataset)
    assert list(_check_data([folder], "sft.train_files", "prompt", "response",
                            messages_key="messages")) == []
    assert "is a 'sft' dataset but a 'prompts' one" in next(
        _check_data([folder], "data.train_files", "prompt", "ground_truth"))


def read_records(path):
    from rlhf.data.dataset import file_records

    return file_records([path])
