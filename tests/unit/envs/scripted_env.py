"""A scripted environment for the multi-turn tests: the dataset row's `extra["script"]` says,
turn by turn, what to answer (observation, reward, done), or to raise, sleep or exit."""

import os
import time

from rlhf.envs import Env, StepResult

SPEC = f"{__file__}:ScriptedEnv"


class ScriptedEnv(Env):
    """Turn t answers script[t]: {"obs", "reward", "done", "raise", "sleep", "exit"}."""

    def __init__(self, *, bonus: float = 0.0):
        self.bonus = bonus

    def reset(self, *, prompt, ground_truth, extra):
        self.script, self.turn = extra.get("script", []), 0
        if extra.get("reset_raise"):
            raise RuntimeError("reset exploded")
        self.seen = []

    def step(self, *, text, token_ids):
        entry = self.script[self.turn] if self.turn < len(self.script) else {"done": True}
        self.turn += 1
        self.seen.append(list(token_ids))
        if "raise" in entry:
            raise ValueError(entry["raise"])
        if "sleep" in entry:
            time.sleep(entry["sleep"])
        if entry.get("exit"):
            os._exit(3)
        return StepResult(observation=entry.get("obs"), reward=entry.get("reward", 0.0) + self.bonus,
                          done=entry.get("done", False), metrics={"steps": 1.0})


class EchoEnv(Env):
    """Two turns: the first answer is echoed back as "check: ..." ; the second is scored by
    exact match with the ground truth (the end-to-end trainer tests)."""

    def reset(self, *, prompt, ground_truth, extra):
        self.answer, self.turn = str(ground_truth), 0

    def step(self, *, text, token_ids):
        self.turn += 1
        if self.turn == 1:
            return StepResult(observation=f"check: {text.strip()}", metrics={"echoes": 1.0})
        return StepResult(reward=float(text.strip() == self.answer), done=True)


ECHO_SPEC = f"{__file__}:EchoEnv"
