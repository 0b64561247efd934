"""Routing replay's data path and config (rlhf/data/routes.py, rlhf/rollout/routing.py): which
source the config names and the error when vLLM cannot be it, vLLM's per-sample routes padded
to prompt + response, routes into a packed stream (shared prompts too) and back, and the
agreement figures, checked against hand-computed numbers."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf.config import RolloutConfig
from rlhf.config.loader import load_config
from rlhf.config.schema import EnvConfig
from rlhf.data.packing import pack_prompt_response
from rlhf.data.ragged import Ragged
from rlhf.data.routes import FREE, routes_to_stream, routing_agreement, stream_to_routes
from rlhf.errors import ConfigError
from rlhf.rollout.replica import _to_batch
from rlhf.rollout.routing import check_replay_model
from rlhf.rollout.vllm_sampler import _completion, vllm_args

L, K = 2, 2  # layers, top-k
QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_source_config_and_errors():
    on_cpu = dict(on_cuda=False, dtype=torch.float32, max_model_len=32)
    assert "enable_return_routed_experts" not in vllm_args(RolloutConfig(), **on_cpu)
    assert "enable_return_routed_experts" not in vllm_args(
        RolloutConfig(routing_replay="trainer"), **on_cpu)
    with pytest.raises(ConfigError, match="routing_replay=trainer"):
        vllm_args(RolloutConfig(routing_replay="rollout"), **on_cpu)
    cuda = vllm_args(RolloutConfig(routing_replay="rollout"), on_cuda=True,
                     dtype=torch.bfloat16, max_model_len=32)
    assert cuda["enable_return_routed_experts"] is True
    with pytest.raises(ConfigError, match="multi-turn"):
        RolloutConfig(routing_replay="rollout", env=EnvConfig(path="x.py:Env"))
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(None, ["rollout.routing_replay=vllm"])
    check_replay_model(RolloutConfig(routing_replay="trainer"), is_moe=True)
    with pytest.raises(ConfigError, match="policy is dense"):
        check_replay_model(RolloutConfig(routing_replay="trainer"), is_moe=False)


def test_job_checks(tmp_path):
    base = [f"model.path={tmp_path / 'model'}"]  # no folder: the checks read model.tiny
    assert load_config(QUICKSTART, base + ["rollout.routing_replay=trainer"])
    with pytest.raises(ConfigError, match="trainer.device is cpu"):
        load_config(QUICKSTART, base + ["rollout.routing_replay=rollout"])
    with pytest.raises(ConfigError, match="actor.parallel.pp=2"):
        load_config(QUICKSTART, base + ["rollout.routing_replay=trainer", "actor.parallel.pp=2"])


def test_moe_quickstart_config_loads(tmp_path):
    # a folder as transformers saves Qwen3-MoE: the expert count under num_local_experts
    folder = tmp_path / "sft_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 32, "intermediate_size": 256,
        "max_position_embeddings": 512, "num_local_experts": 8, "num_experts_per_tok": 2}))
    cfg = load_config(QUICKSTART.with_name("quickstart_moe.yaml"), [f"model.path={folder}"])
    assert cfg.actor.parallel.ep == 2 and cfg.rollout.routing_replay == "trainer"


def test_vllm_routes_become_a_batch_field():
    # vLLM routes every position it fed: prompt + response minus the last sampled token
    prompt_len, ids = 3, [7, 8]
    seen = np.arange((prompt_len + 1) * L * K).reshape(prompt_len + 1, L, K) % 4
    sample = SimpleNamespace(token_ids=ids, finish_reason="stop", routed_experts=seen,
                             logprobs=[{7: SimpleNamespace(logprob=-1.0)},
                                       {8: SimpleNamespace(logprob=-2.0)}])
    done = _completion(sample, prompt_len=prompt_len)
    assert done.routes.shape == (prompt_len + 2, L, K) and done.routes.dtype == torch.int16
    assert torch.equal(done.routes[:-1], torch.as_tensor(seen, dtype=torch.int16))
    assert (done.routes[-1] == FREE).all()
    batch = _to_batch([done, done], meta={})
    assert batch["routed_experts"].lengths.tolist() == [5, 5]
    plain = _completion(SimpleNamespace(token_ids=ids, finish_reason="stop",
                                        logprobs=sample.logprobs), prompt_len=prompt_len)
    assert plain.routes is None and "routed_experts" not in _to_batch([plain], meta={}).keys()


def _routes(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return Ragged.from_list([torch.randint(0, 8, (n, L, K), generator=gen, dtype=torch.int16)
                             for n in lengths])


@pytest.mark.parametrize("share", [False, True])
def test_routes_into_the_stream_and_back(share):
    prompts = Ragged.from_list([torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]),
                                torch.tensor([9, 4])])
    responses = Ragged.from_list([torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 4, 4])])
    full = prompts.lengths + responses.lengths
    routes = _routes(full.tolist(), seed=0)
    packed = pack_prompt_response(prompts, responses, share_prompts=share)
    stream = routes_to_stream(routes, packed)
    assert stream.shape == (packed.tokens.shape[0], L, K) and stream.dtype == torch.int64
    rows = routes.to_list()
    # each sequence's stream rows are the last positions of its routes (shared: row 1 keeps
    # only its prompt's last token)
    kept = [rows[0], rows[1][2:] if share else rows[1], rows[2]]
    assert torch.equal(stream, torch.cat(kept).long())
    back = stream_to_routes(stream, packed, full)
    assert torch.equal(back.offsets, routes.offsets)
    expect = [r.clone() for r in rows]
    if share:
        expect[1][:2] = FREE  # the positions row 1 read from row 0
    assert torch.equal(back.values, torch.cat(expect))
    with pytest.raises(ValueError, match="positions"):
        routes_to_stream(_routes([2, 2, 2], seed=1), packed)


def test_agreement_by_hand():
    recorded = Ragged.from_list([torch.tensor([[[0, 1], [2, 3]], [[4, 5], [FREE, FREE]]]),
                                 torch.tensor([[[1, 2], [3, 4]]])])
    chosen = Ragged.from_list([torch.tensor([[[1, 0], [2, 3]], [[4, 6], [0, 1]]]),
                               torch.tensor([[[1, 2], [3, 5]]])])
    # positions: (agree, agree in order-free sets) | (layer 0 differs; layer 1 free) | (differs)
    got = routing_agreement(recorded, chosen)
    assert got == {"tokens": 3.0, "token_match": 1 / 3, "layer_match": 3 / 5}
