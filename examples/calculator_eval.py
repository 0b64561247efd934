"""Greedy held-out evaluation of a model on the calculator example, with its tool metrics.

`rlhf train` validates with val/accuracy only; this plays the same greedy episodes (the
multi-turn rollout's own run_episodes, the config's environment and turn limits) with a
`transformers` model instead of vLLM and prints one JSON line: accuracy, tool calls per
episode, the tool-call success rate (calls that ran without error), the share of episodes whose
first call computes the right value, and turns per episode.

    .venv/bin/python examples/calculator_eval.py MODEL_DIR [--config configs/calculator.yaml]
        [--data FILE.jsonl] [--no-tool]

--no-tool plays single-turn episodes (max_turns 1), for a model that answers directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from transformers import AutoModelForCausalLM

from rlhf.config import load_config
from rlhf.data.dataset import PromptDataset, read_rows
from rlhf.envs.render import TurnRenderer
from rlhf.envs.runner import EnvRunner
from rlhf.envs.tools import calculator, parse_tool_calls
from rlhf.rollout.multiturn import Episode, env_metrics, run_episodes
from rlhf.rollout.vllm_sampler import Completion
from rlhf.trainer.jobs import load_tokenizer


class GreedyHFEngine:
    """run_episodes' engine on a `transformers` model: greedy, batched, left-padded."""

    def __init__(self, model, *, pad_id: int, eos_id: int, batch_size: int = 64):
        self.model, self.pad_id, self.eos_id, self.batch_size = model, pad_id, eos_id, batch_size

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: list) -> list[Completion]:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            limit = max(p.max_tokens for p in params[start:start + self.batch_size])
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            new = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=limit, eos_token_id=self.eos_id,
                                      pad_token_id=self.pad_id)[:, width:]
            for row, p in zip(new.tolist(), params[start:start + self.batch_size]):
                row = row[:p.max_tokens]
                if self.eos_id in row:
                    row = row[:row.index(self.eos_id) + 1]
                out.append(Completion(row, [0.0] * len(row), "stop"))
        return out


def right_first_call(episode: Episode, tokenizer, ground_truth: str) -> bool:
    """Whether the episode's first model turn calls the calculator on the right value."""
    first = episode.ids[:episode.model_mask.index(False)] if False in episode.model_mask \
        else episode.ids
    calls = parse_tool_calls(tokenizer.decode(first, skip_special_tokens=True))
    if not calls or calls[0].error or calls[0].name != "calculator":
        return False
    try:
        return calculator(**calls[0].arguments) == ground_truth
    except Exception:
        return False


def evaluate(model_dir: str, *, config: str, data: str | None, no_tool: bool) -> dict:
    cfg = load_config(config)
    rollout = cfg.rollout
    if no_tool:
        rollout = dataclasses.replace(rollout, max_turns=1)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    files = [data] if data else list(cfg.data.val_files)
    dataset = PromptDataset(read_rows(files), tokenizer,
                            max_prompt_length=cfg.data.max_prompt_length)
    episodes = [Episode(p.tolist(), seed=i, name=f"row {i}",
                        row={"prompt": dataset.raw_prompt[i], "ground_truth": g, "extra": {}})
                for i, (p, g) in enumerate(zip(dataset.prompt_ids.to_list(),
                                               dataset.ground_truth))]
    runner = EnvRunner(rollout.env.path, rollout.env.kwargs, num_workers=0)
    try:
        sums = run_episodes(GreedyHFEngine(model, pad_id=tokenizer.pad_token_id,
                                           eos_id=tokenizer.eos_token_id),
                            episodes, runner=runner, renderer=TurnRenderer(tokenizer),
                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                            config=rollout, greedy=True)
    finally:
        runner.close()
    metrics = env_metrics(sums)
    right = [right_first_call(e, tokenizer, str(g)) for e, g in zip(episodes,
                                                                   dataset.ground_truth)]
    return {"model": model_dir, "episodes": len(episodes),
            "accuracy": sum(e.reward for e in episodes) / len(episodes),
            "tool_calls": metrics.get("env/tool_calls", 0.0),
            "tool_success_rate": metrics.get("env/tool_success_rate"),
            "right_first_call": sum(right) / len(right),
            "turns": metrics["env/turns"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--config", default="configs/calculator.yaml")
    parser.add_argument("--data", default=None, help="JSONL rows; default: data.val_files")
    parser.add_argument("--no-tool", action="store_true", help="single-turn episodes")
    args = parser.parse_args()
    print(json.dumps(evaluate(args.model_dir, config=args.config, data=args.data,
                              no_tool=args.no_tool)))


if __name__ == "__main__":
    main()
