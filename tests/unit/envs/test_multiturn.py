"""Multi-turn episodes against a scripted engine and a scripted environment: the exact token
stream and masks across turns, budgets and early stops, errors under both on_error policies."""

import pytest

from rlhf.config import RolloutConfig
from rlhf.config.schema import EnvConfig
from rlhf.data.fields import response_mask
from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer
from rlhf.envs.render import TurnRenderer
from rlhf.errors import RLHFError
from rlhf.rollout.multiturn import Episode, env_metrics, episodes_to_batch
from rlhf.rollout.vllm_sampler import Completion
from tests.unit.envs.play import play_episodes
from tests.unit.envs.scripted_env import SPEC

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(vocab_size=384, seed=0)


class ScriptedEngine:
    """Answers each request with 3 tokens derived from its prompt length, then eos (cut at
    max_tokens); records every call."""

    def __init__(self, eos: int):
        self.eos, self.calls = eos, []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for p, sp in zip(prompts, params):
            ids = ([20 + len(p) % 50, 21, 22] + [self.eos])[:sp.max_tokens]
            out.append(Completion(ids, [-0.1 * (k + 1) for k in range(len(ids))], "stop"))
        return out


def play(tok, scripts, *, on_error="raise", max_turns=3, max_episode_tokens=200, timeout_s=20.0,
         num_workers=0):
    cfg = RolloutConfig(max_new_tokens=4, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                        env=EnvConfig(path=SPEC, on_error=on_error, fallback_reward=-1.0,
                                      num_workers=num_workers, timeout_s=timeout_s))
    engine = ScriptedEngine(tok.eos_token_id)
    episodes = [Episode([1, 2, 3], seed=i, name=f"row {i}, sample 0",
                        row={"prompt": "q", "ground_truth": 0, "extra": {"script": s}})
                for i, s in enumerate(scripts)]
    sums = play_episodes(engine, episodes, tok, cfg)
    return episodes, engine, sums


def test_stream_is_model_tokens_as_sampled_then_this_turns_rendering(tok):
    eos = tok.eos_token_id
    episodes, engine, sums = play(tok, [[{"obs": "result 7", "reward": 0.5},
                                         {"obs": [{"role": "tool", "content": "8"}]},
                                         {"reward": 1.0, "done": True}],
                                        [{"done": True, "reward": 2.0}]])
    e = episodes[0]
    obs1 = tok.encode("<|user|>\nresult 7<|eos|><|assistant|>\n", add_special_tokens=False)
    obs2 = tok.encode("<|user|>\n<tool_response>8</tool_response><|eos|><|assistant|>\n",
                      add_special_tokens=False)
    turn1 = [23, 21, 22, eos]  # prompt of 3 tokens
    turn2 = [20 + (3 + 4 + len(obs1)) % 50, 21, 22, eos]
    turn3 = [20 + (3 + 8 + len(obs1) + len(obs2)) % 50, 21, 22, eos]
    assert e.ids == turn1 + obs1 + turn2 + obs2 + turn3
    assert e.model_mask == [True] * 4 + [False] * len(obs1) + [True] * 4 + \
        [False] * len(obs2) + [True] * 4
    assert e.log_probs[4:4 + len(obs1)] == [0.0] * len(obs1)
    assert e.reward == 1.5 and e.turns == 3
    # One engine call per turn for every live episode; each prompt is the stream so far.
    assert [len(c) for c in engine.calls] == [2, 1, 1]
    assert engine.calls[1][0] == [1, 2, 3] + turn1 + obs1
    assert episodes[1].ids == turn1 and episodes[1].reward == 2.0
    metrics = env_metrics(sums)
    assert metrics["env/turns"] == 2.0 and metrics["env/steps"] == 2.0
    assert metrics["env/episode_tokens"] == (len(e.ids) + 4) / 2
    batch = episodes_to_batch(episodes)
    mask = response_mask(batch)
    assert mask.values.tolist() == e.model_mask + [True] * 4
    assert batch["env_reward"].tolist() == [1.5, 2.0]


def test_a_truncated_turn_gets_the_templates_end_of_turn_and_budgets_stop_episodes(tok):
    # max_turns stops an endless episode; the per-episode budget stops another early.
    episodes, _, sums = play(tok, [[{"obs": "x"}] * 5], max_turns=2)
    assert episodes[0].turns == 2
    obs = tok.encode("<|user|>\nx<|eos|><|assistant|>\n", add_special_tokens=False)
    episodes, engine, sums = play(tok, [[{"obs": "x"}] * 5], max_episode_tokens=4 + len(obs) + 2)
    e = episodes[0]
    assert e.turns == 2 and len(e.ids) == 4 + len(obs) + 2
    assert e.ids[-2:] == [20 + (3 + 4 + len(obs)) % 50, 21]  # cut to the room left
    episodes, _, sums = play(tok, [[{"obs": "x"}] * 5], max_episode_tokens=4 + len(obs))
    assert episodes[0].turns == 1 and len(episodes[0].ids) == 4  # no room after the observation
    assert sums["truncated"] == 1
    # After a turn that hit max_tokens without eos, the observation closes it with eos.
    renderer = TurnRenderer(tok)
    assert renderer.text("x", model_ids=[5, 6]) == "<|eos|><|user|>\nx<|eos|><|assistant|>\n"
    assert renderer.text("x", model_ids=[5, tok.eos_token_id]) == "<|user|>\nx<|eos|><|assistant|>\n"


def test_errors_raise_naming_environment_episode_and_cause(tok):
    with pytest.raises(RLHFError, match=r"environment .*ScriptedEnv' failed on episode row 1, "
                                        r"sample 0 in step at turn 0: step raised") as info:
        play(tok, [[{"done": True}], [{"raise": "board on fire"}]])
    assert "board on fire" in str(info.value) and "on_error: fallback" in str(info.value)


def test_fallback_ends_failed_episodes_with_the_fallback_reward(tok):
    episodes, _, sums = play(tok, [[{"obs": "a"}, {"raise": "boom"}], [{"done": True, "reward": 1.0}]],
                             on_error="fallback")
    assert episodes[0].reward == -1.0 and episodes[0].turns == 2
    assert episodes[1].reward == 1.0
    assert sums["errors"] == 1


def test_timeouts_under_both_policies(tok):
    script = [[{"sleep": 30}], [{"done": True}]]
    with pytest.raises(RLHFError, match="did not return within rollout.env.timeout_s=1s"):
        play(tok, script, num_workers=2, timeout_s=1.0)
    episodes, _, sums = play(tok, script, num_workers=2, timeout_s=1.0, on_error="fallback")
    assert sums["timeouts"] == 1 and episodes[0].reward == -1.0 and episodes[0].turns == 1
    assert episodes[1].reward == 0.0
