"""The calculator example's SFT traces are, token for token, the episodes the multi-turn
rollout builds: a scripted engine replays the trace's model turns against the real
CalculatorEnv, and the episode's response equals what `rlhf sft` trains on."""

import json

import pytest

from rlhf.config import RolloutConfig
from rlhf.config.schema import EnvConfig
from rlhf.data.dataset import PromptDataset, read_rows
from rlhf.demo.calculator_data import CalcTask, tool_call_text, write_calc_dataset
from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer
from rlhf.envs.tools import calculator
from rlhf.rollout.multiturn import Episode
from rlhf.rollout.vllm_sampler import Completion
from rlhf.trainer.sft import response_ids
from tests.unit.envs.play import play_episodes

pytestmark = pytest.mark.timeout(120)
SPEC = "rlhf.envs.tools:CalculatorEnv"


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(vocab_size=384, seed=0)


class ReplayEngine:
    """Answers episode i's turn t with turns[i][t]; records the prompts it was given."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.calls = turns, []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        turn = len(self.calls) - 1
        return [Completion(self.turns[i][turn], [-0.5] * len(self.turns[i][turn]), "stop")
                for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["sft", "format"])
def test_sft_trace_is_the_rollouts_episode(tmp_path, tok, kind):
    path = tmp_path / f"{kind}.jsonl"
    write_calc_dataset(path, task=CalcTask(), n=6, seed=4, kind=kind, tokenizer=tok)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rows = read_rows([path], prompt_key="prompt", ground_truth_key="response")
    prompts = [p.tolist() for p in PromptDataset(rows, tok, max_prompt_length=64)
               .prompt_ids.to_list()]
    traces = response_ids([r["response"] for r in records], tok).to_list()

    eos = tok.eos_token_id
    turns = []
    for record in records:  # what a policy that learned the trace samples, turn by turn
        expression = json.loads(record["response"].split("<tool_call>")[1]
                                .split("</tool_call>")[0])["arguments"]["expression"]
        result = calculator(expression)
        turns.append([tok.encode(tool_call_text(expression), add_special_tokens=False) + [eos],
                      tok.encode(result, add_special_tokens=False) + [eos]])
    engine = ReplayEngine(turns)
    episodes = [Episode(prompts[i], seed=i, name=f"row {i}, sample 0",
                        row={"prompt": r["prompt"], "ground_truth": r["ground_truth"],
                             "extra": {}})
                for i, r in enumerate(records)]
    cfg = RolloutConfig(max_new_tokens=72, max_turns=2, max_episode_tokens=128,
                        env=EnvConfig(path=SPEC, num_workers=0, timeout_s=10.0))
    sums = play_episodes(engine, episodes, tok, cfg)
    assert len(engine.calls) == 2 and sums["m/tool_calls"] == len(records)
    assert sums["m/tool_errors"] == 0
    for e, trace, (call, answer), record in zip(episodes, traces, turns, records):
        assert e.ids == trace.tolist()
        assert e.model_mask == [True] * len(call) + [False] * (len(trace) - len(call)
                                                               - len(answer)) + [True] * len(answer)
        assert e.turns == 2 and e.done
        assert e.reward == float(tok.decode(answer, skip_special_tokens=True)
                                 == record["ground_truth"])
    if kind == "sft":
        assert all(e.reward == 1.0 for e in episodes)


def test_prompt_tokens_are_those_of_the_rl_rows(tmp_path, tok):
    """SFT prompts and RL prompts of the same problem tokenise alike (one chat template)."""
    write_calc_dataset(tmp_path / "s.jsonl", task=CalcTask(), n=4, seed=0, kind="sft",
                       tokenizer=tok)
    write_calc_dataset(tmp_path / "r.jsonl", task=CalcTask(), n=4, seed=0)
    sft = PromptDataset(read_rows([tmp_path / "s.jsonl"], ground_truth_key="response"), tok,
                        max_prompt_length=64)
    rl = PromptDataset(read_rows([tmp_path / "r.jsonl"]), tok, max_prompt_length=64)
    assert [p.tolist() for p in sft.prompt_ids.to_list()] == \
        [p.tolist() for p in rl.prompt_ids.to_list()]


def test_a_malformed_expression_fails_without_a_syntax_warning():
    """A sampled call such as "3or 4" reaches ast.parse, which warns "invalid decimal literal"
    (on the console of every env worker) before the calculator rejects it; it must not."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="unsupported expression"):
            calculator("3or 4")
    assert not [w for w in caught if issubclass(w.category, SyntaxWarning)]


@pytest.mark.parametrize("kind", ["sft", "format"])
def test_a_transcript_row_trains_on_the_episodes_model_turns_only(tmp_path, tok, kind):
    """`--messages` rows, rendered by `rlhf sft`, are the prompt plus the rollout's episode token
    for token (the trace of the `response` rows), with the loss on the model's turns only:
    the episode's model_mask."""
    from rlhf.data.sft_rows import SFTDataset, SFTKeys

    write_calc_dataset(tmp_path / "r.jsonl", task=CalcTask(), n=5, seed=2, kind=kind,
                       tokenizer=tok)
    write_calc_dataset(tmp_path / "m.jsonl", task=CalcTask(), n=5, seed=2, kind=kind,
                       messages=True)
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    rows = [(f"m:{i}", json.loads(line)) for i, line in
            enumerate((tmp_path / "m.jsonl").read_text().splitlines())]
    prompts = PromptDataset(read_rows([tmp_path / "r.jsonl"], ground_truth_key="response"), tok,
                            max_prompt_length=64).prompt_ids.to_list()
    traces = response_ids([r["response"] for r in records], tok).to_list()
    chats = SFTDataset(rows, tok, keys=SFTKeys(), max_prompt_length=64)
    eos = tok.eos_token_id
    for (_, row), prompt, trace, ids, mask in zip(rows, prompts, traces, chats.ids, chats.mask):
        assert ids.tolist() == prompt.tolist() + trace.tolist()
        call = tok.encode(row["messages"][1]["content"], add_special_tokens=False) + [eos]
        answer = tok.encode(row["messages"][3]["content"], add_special_tokens=False) + [eos]
        tool = len(trace) - len(call) - len(answer)
        assert mask.tolist() == ([False] * len(prompt) + [True] * len(call) + [False] * tool
                                 + [True] * len(answer))
