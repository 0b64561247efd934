"""Run episodes through run_episodes with a real environment runner, as a replica does, for
the unit tests' scripted engines."""

from rlhf.config import RolloutConfig
from rlhf.envs.render import TurnRenderer
from rlhf.envs.runner import EnvRunner
from rlhf.rollout.multiturn import run_episodes


def play_episodes(engine, episodes, tok, cfg: RolloutConfig) -> dict[str, float]:
    """Greedy episodes on cfg.env's environment (its workers closed after); the metric sums."""
    env = cfg.env
    runner = EnvRunner(env.path, env.kwargs, num_workers=env.num_workers, timeout_s=env.timeout_s)
    try:
        return run_episodes(engine, episodes, runner=runner, renderer=TurnRenderer(tok),
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                            config=cfg, greedy=True)
    finally:
        runner.close()
