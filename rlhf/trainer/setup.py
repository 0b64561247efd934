"""What a job needs before its workers start: the model folder, the tokenizer, and the worker
class of each role the config implies."""

from __future__ import annotations

from pathlib import Path

from rlhf.config import JobConfig, TinyModelConfig, job_roles
from rlhf.errors import RLHFError


def job_workers(cfg: JobConfig) -> tuple[dict[str, tuple[type, dict]], dict[str, object]]:
    """({role: (worker class, kwargs)}, {role: its config section}) for every role of
    `config.job_roles(cfg)`, in that order: what RoleGroups builds."""
    from workers.actor import ActorWorker
    from workers.critic import CriticWorker
    from workers.reference import ReferenceWorker
    from workers.reward_model import RewardModelWorker
    from workers.rollout import RolloutWorker

    classes = {"actor": ActorWorker, "critic": CriticWorker, "ref": ReferenceWorker,
               "reward": RewardModelWorker, "rollout": RolloutWorker}
    sections = job_roles(cfg)
    return {name: (classes[name], {"config": cfg}) for name in sections}, sections


def ensure_model(path: str | Path, tiny: TinyModelConfig | None) -> Path:
    """`path`, built from `tiny` (model.tiny) first when it holds no config.json."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if tiny is None:
        raise RLHFError(f"{path} holds no model (no config.json); point model.path at a Hugging "
                        "Face folder, or set model.tiny to build a tiny one there")
    from rlhf.demo.tiny_model import make_tiny_model

    print(f"building a tiny {tiny.arch} model in {path}", flush=True)
    return Path(make_tiny_model(tiny, path))


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a local folder (never looked up on a model hub)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise RLHFError(f"tokenizer folder {str(path)!r} does not exist; set model.tokenizer_path "
                        "or model.path to a local folder")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
