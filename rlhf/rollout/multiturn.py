"""Multi-turn rollouts, token in / token out.

Many episodes run at once. Each turn, every live episode's prompt + response so far goes to
the engine in ONE generate call; the model's sampled ids are appended exactly as drawn (with
their sampling log-probs), the decoded text goes to the episode's environment (rlhf.envs,
in worker processes), and the observation it answers is rendered for that turn only
(rlhf.envs.render) and appended. Earlier turns are never re-tokenised. An episode stops when
its environment says done, after rollout.max_turns model turns, or when the next observation
would not leave room for a model token within rollout.max_response_tokens.

The whole episode is one response: `model_mask` marks the model's tokens (environment tokens
are context only: no loss, KL, advantage or entropy; rollout_log_probs is 0 there), and
`env_reward` is the sum of the environment's rewards (fallback_reward for a failed episode).
Turn 0 of an episode uses its request seed, so an episode of one turn samples what a
single-turn rollout would; turn t > 0 uses derive_seed(seed, t).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlhf.config import RolloutConfig
from rlhf.data.batch import Batch
from rlhf.data.fields import MODEL_MASK
from rlhf.data.ragged import Ragged
from rlhf.envs.render import TurnRenderer
from rlhf.envs.runner import EnvRunner
from rlhf.errors import RLHFError
from rlhf.rollout.sampling import derive_seed, sampling_params


@dataclass
class Episode:
    """One episode's stream so far: response ids, log-probs and the model-token mask."""

    prompt: list[int]
    seed: int
    name: str  # how errors name it, e.g. "row 3, sample 1"
    row: dict  # prompt, ground_truth, extra for the environment's reset
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    failed: bool = False  # its environment failed (on_error fallback): no more env calls
    metrics: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None, *, model: bool):
        self.ids += list(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.model_mask += [model] * len(ids)


class EpisodeRunner:
    """A rank's multi-turn rollouts: its environment workers, turn renderer and tokenizer (of
    `model_path`), built on the first call."""

    def __init__(self, model_path: str, config: RolloutConfig):
        self.model_path, self.config = model_path, config
        self.env: tuple | None = None  # (EnvRunner, TurnRenderer, tokenizer)

    def play(self, engine, prompts: list[list[int]], seeds: list[int],
             env_rows: list[dict] | None, *, first: int, n: int, greedy: bool,
             config: RolloutConfig | None = None) -> tuple[Batch, dict[str, float]]:
        """An episode per (prompt, seed): the prompts of rows `first`.. of the driver's batch,
        `n` samples each, prompt-major; (their Batch, this rank's metric sums). `config`
        replaces the runner's sampling settings for this call."""
        if env_rows is None or len(env_rows) * n != len(prompts):
            raise ValueError("a multi-turn rollout needs each prompt's row (prompt, "
                             "ground_truth, extra) for its environment")
        if self.env is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            env = self.config.env
            self.env = (EnvRunner(env.path, env.kwargs, num_workers=env.num_workers,
                                  timeout_s=env.timeout_s), TurnRenderer(tokenizer), tokenizer)
        runner, renderer, tokenizer = self.env
        episodes = [Episode(prompt, seed, f"row {first + i // n}, sample {i % n}",
                            env_rows[i // n]) for i, (prompt, seed) in enumerate(zip(prompts, seeds))]
        sums = run_episodes(engine, episodes, runner=runner, renderer=renderer,
                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            config=config or self.config, greedy=greedy)
        return episodes_to_batch(episodes), sums


def run_episodes(sampler, episodes: list[Episode], *, runner: EnvRunner, renderer: TurnRenderer,
                 decode: Callable[[list[int]], str], config: RolloutConfig,
                 greedy: bool) -> dict[str, float]:
    """Play `episodes` to the end in place; returns this rank's metric sums (see env_metrics)."""
    sums: dict[str, float] = defaultdict(float)
    env_seconds = [0.0]

    def call(method: str, payloads: dict[int, dict], turn: int) -> dict:
        start = time.perf_counter()
        outcomes = getattr(runner, method)(payloads)
        env_seconds[0] += time.perf_counter() - start
        for i, outcome in sorted(outcomes.items()):
            if outcome[0] != "ok":
                _fail(episodes[i], outcome, method=method, turn=turn, sums=sums,
                      spec=runner.spec, config=config)
        return outcomes

    call("reset", {i: e.row for i, e in enumerate(episodes)}, 0)
    budget = config.max_response_tokens
    for turn in range(config.max_turns):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        seeds = [episodes[i].seed if turn == 0 else derive_seed(episodes[i].seed, turn)
                 for i in live]
        limits = [min(config.max_new_tokens, budget - len(episodes[i].ids)) for i in live]
        params = sampling_params(config, greedy=greedy, seeds=seeds, max_tokens=limits)
        completions = sampler.generate([episodes[i].prompt + episodes[i].ids for i in live], params)
        for i, c in zip(live, completions, strict=True):
            episodes[i].append(c.token_ids, c.log_probs, model=True)
            episodes[i].turns += 1
            # An episode whose reset failed still gets its one model turn: no empty responses.
            episodes[i].done = episodes[i].failed
        outcomes = call("step", {i: {"text": decode(list(c.token_ids)),
                                     "token_ids": list(c.token_ids)}
                                 for i, c in zip(live, completions) if not episodes[i].done}, turn)
        for i, c in zip(live, completions):
            if outcomes.get(i, ("failed",))[0] == "ok":
                _after_step(episodes[i], outcomes[i][1], list(c.token_ids), renderer=renderer,
                            last_turn=turn == config.max_turns - 1, budget=budget, sums=sums)
    runner.end(range(len(episodes)))
    for e in episodes:
        sums["episodes"] += 1
        sums["turns"] += e.turns
        sums["episode_tokens"] += len(e.ids)
        sums["model_tokens"] += sum(e.model_mask)
        for key, value in e.metrics.items():
            sums["m/" + key] += value
    sums["seconds"] = env_seconds[0]
    return dict(sums)


def _after_step(e: Episode, result, model_ids: list[int], *, renderer: TurnRenderer,
                last_turn: bool, budget: int, sums: dict) -> None:
    e.reward += result.reward
    for key, value in result.metrics.items():
        e.metrics[key] += value
    if result.done or last_turn:
        e.done = True
        return
    if result.observation is None:
        return
    obs = renderer.ids(result.observation, model_ids=model_ids)
    if len(e.ids) + len(obs) >= budget:  # no room left for a model token after it
        e.done = True
        sums["truncated"] += 1
        return
    e.append(obs, None, model=False)


def _fail(e: Episode, outcome: tuple, *, method: str, turn: int, sums: dict, spec: str,
          config: RolloutConfig) -> None:
    kind, cause = outcome
    if config.env.on_error == "raise":
        fix = ("Make the environment faster or raise rollout.env.timeout_s" if kind == "timeout"
               else "Fix the environment")
        raise RLHFError(f"environment {spec!r} failed on episode {e.name} in {method} at turn "
                        f"{turn}: {cause}\n{fix}, or set rollout.env.on_error: fallback to end "
                        f"such episodes with rollout.env.fallback_reward")
    sums["errors" if kind == "error" else "timeouts"] += 1
    e.failed, e.reward = True, config.env.fallback_reward
    e.done = bool(e.ids)


def env_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Metrics from the metric sums of every rank added up (seconds: the slowest rank's):
    env/turns, env/episode_tokens, env/model_tokens (means per episode), env/errors,
    env/timeouts, env/truncated (counts), env/seconds, env/<key> per environment metric (mean
    per episode), and env/tool_success_rate when the environment counts tool calls."""
    episodes = max(sums.get("episodes", 0.0), 1.0)
    out = {f"env/{k}": sums.get(k, 0.0) / episodes
           for k in ("turns", "episode_tokens", "model_tokens")}
    out.update({f"env/{k}": sums.get(k, 0.0) for k in ("errors", "timeouts", "truncated",
                                                       "seconds")})
    out.update({f"env/{k[2:]}": v / episodes for k, v in sums.items() if k.startswith("m/")})
    calls = sums.get("m/tool_calls", 0.0)
    if calls > 0:
        out["env/tool_success_rate"] = 1.0 - sums.get("m/tool_errors", 0.0) / calls
    return out


def episodes_to_batch(episodes: Sequence[Episode]) -> Batch:
    """`response_ids`, `rollout_log_probs` (0 on environment tokens), `model_mask` and
    `env_reward` of finished episodes, in order."""
    return Batch({
        "response_ids": Ragged.from_list([e.ids for e in episodes], dtype=torch.int64),
        "rollout_log_probs": Ragged.from_list([e.log_probs for e in episodes],
                                              dtype=torch.float32),
        MODEL_MASK: Ragged.from_list([e.model_mask for e in episodes], dtype=torch.bool),
        "env_reward": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
    })


def env_rows(batch: Batch) -> list[dict]:
    """What each prompt row's environment is reset with: its prompt, ground truth and extra."""
    missing = [k for k in ("raw_prompt", "ground_truth") if k not in batch]
    if missing:
        raise ValueError(f"a multi-turn rollout needs the batch fields {missing} (rows from "
                         "rlhf.data.dataset) to reset each episode's environment")
    extras = batch["extra"] if "extra" in batch else [{}] * len(batch)
    return [{"prompt": p, "ground_truth": g, "extra": dict(e or {})}
            for p, g, e in zip(batch["raw_prompt"], batch["ground_truth"], extras, strict=True)]
