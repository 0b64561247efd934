"""Translate a verl PPO/GRPO config (its hydra keys) into ours: `rlhf config from-verl`.

`VERL_KEYS` is the one table of what each verl key becomes here, or why it has no
equivalent; the command reads it and the "Coming from verl" docs page prints it
(`key_table_markdown`, kept in step by tests/unit/test_docs.py). Keys a user's file leaves
out take verl's default where it differs from ours (`verl_default`), so the job means the same.
"""

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rlhf.config.loader import (
    apply_override,
    build,
    dump_yaml,
    merge_trees,
    parse_yaml,
    read_yaml_mapping,
)
from rlhf.config.schema import JobConfig
from rlhf.errors import ConfigError

# verl always reads the answer from here (its RLHFDataset; docs/guides/data.md).
VERL_GROUND_TRUTH_KEY = "reward_model.ground_truth"


class NoEquivalent(Exception):
    """A verl value that cannot be carried over; the message says why and what to do."""


class Skip(Exception):
    """A verl value that needs no key here (ours already means the same)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """What converters may read besides their own value: every verl key, flattened."""

    flat: dict[str, Any]
    notes: list[str]


Convert = Callable[[Any, Source], Any]


def _same(value: Any, source: Source) -> Any:
    return value


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """One verl key: the keys it sets here (none: no equivalent), how its value converts,
    and a note for the table (why, or what differs)."""

    verl: str
    ours: tuple[str, ...] = ()
    note: str = ""
    convert: Convert = _same
    verl_default: Any = None
    """verl's value when the file leaves the key out, where it differs from our default."""


def _skip(value: Any, source: Source) -> Any:
    raise Skip


def _if_val_sampling(value: Any, source: Source) -> Any:
    """val_kwargs apply only with do_sample: greedy validation (verl's default) is always
    reported here."""
    if not source.flat.get(_VAL_KWARGS + "do_sample"):
        raise Skip
    return value


def _freq(value: Any, source: Source) -> int:
    """verl's -1 (or null) means never; ours is 0."""
    return 0 if value is None or value < 0 else int(value)


def _recompute(value: Any, source: Source) -> str:
    return "full" if value else "none"


def _compile(value: Any, source: Source) -> str:
    """verl compiles on the GPU when true; auto does so here (and not on the CPU)."""
    return "auto" if value else "off"


_KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
             "low_var_kl": "k3", "k3": "k3"}


def _kl_name(value: Any, source: Source) -> str:
    if value not in _KL_NAMES:
        raise NoEquivalent(f"{value!r}: the estimators here are k1, k2, k3 and abs "
                           f"(verl's kl, mse, low_var_kl, abs)")
    return _KL_NAMES[value]


def _policy_loss(value: Any, source: Source) -> str:
    names = {"vanilla": "ppo", "gspo": "gspo"}
    if value not in names:
        raise NoEquivalent(f"{value!r}: the policy losses here are ppo (verl's vanilla), gspo, "
                           f"cispo, or your own (docs/guides/algorithms.md)")
    return names[value]


def _schedule(value: Any, source: Source) -> str:
    if value not in ("constant", "cosine"):
        raise NoEquivalent(f"{value!r}: the schedules here are constant, linear and cosine")
    return value


def _positive_or_skip(value: Any, source: Source) -> Any:
    if value is None or value <= 0:
        raise Skip
    return value


def _warmup_ratio(value: Any, source: Source) -> Any:
    if not value:
        raise Skip
    raise NoEquivalent(f"{value}: warmup is in steps here; set actor.optim.warmup_steps to "
                       f"{value} x trainer.total_steps")


def _modules(value: Any, source: Source) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _loggers(value: Any, source: Source) -> list[str]:
    ours = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
    given = [value] if isinstance(value, str) else list(value)
    dropped = [name for name in given if name not in ours]
    if dropped:
        source.notes.append(f"trainer.logger: {dropped} left out; the loggers here are "
                            f"{', '.join(ours)}")
    return [name for name in given if name in ours] + (["jsonl"] if "jsonl" not in given else [])


def _resume(value: Any, source: Source) -> str:
    if value == "resume_path":
        path = source.flat.get("trainer.resume_from_path")
        if not path:
            raise NoEquivalent("resume_path without trainer.resume_from_path")
        return path
    modes = {"auto": "auto", "disable": "never"}
    if value not in modes:
        raise NoEquivalent(f"{value!r}: trainer.resume here is auto, never or a checkpoint folder")
    return modes[value]


def _only(expected: Any, why: str) -> Convert:
    """A key whose only value here is `expected`: skipped when it has it, noted otherwise."""
    def convert(value: Any, source: Source) -> Any:
        if value == expected:
            raise Skip
        raise NoEquivalent(f"{value!r}: {why}")
    return convert


def _count_rows(files: Any) -> int | None:
    """Rows of the JSONL/Parquet training files when all are on this machine, else None."""
    names = [files] if isinstance(files, str) else list(files or [])
    if not names:
        return None
    total = 0
    for name in names:
        path = Path(os.path.expanduser(name))
        if not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415 - only to count a Parquet file's rows

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            with open(path, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


def _total_steps(value: Any, source: Source) -> int:
    if source.flat.get("trainer.total_training_steps"):
        raise Skip  # verl lets total_training_steps win; so does its own entry below
    batch = source.flat.get("data.train_batch_size", 1024)
    rows = _count_rows(source.flat.get("data.train_files"))
    if rows is None:
        raise NoEquivalent(f"{value} epochs: training here is counted in steps; set "
                           f"trainer.total_steps to {value} x (rows of data.train_files // "
                           f"{batch}) (the files are not on this machine to count)")
    steps = value * (rows // batch)
    source.notes.append(f"trainer.total_epochs={value}: {rows} training rows // batch {batch} "
                        f"x {value} epochs = trainer.total_steps {steps}")
    return steps


def _reward_function(value: Any, source: Source) -> list[dict]:
    if not value:
        raise Skip
    name = source.flat.get("custom_reward_function.name") or "compute_score"
    return [{"path": f"{value}:{name}", "convention": "verl"}]


def _reward_model(value: Any, source: Source) -> Any:
    if not source.flat.get("reward_model.enable"):
        raise Skip
    return value


_VAL_KWARGS = "actor_rollout_ref.rollout.val_kwargs."
_SHARDING = ("this engine shards by tp/pp with ZeRO-1 (and offload) instead of FSDP; set "
             "ROLE.parallel.tp/pp (docs/guides/coming-from-verl.md#sharding)")
_TOKENS = "micro-batches here are cut by a token budget (ROLE.max_tokens_per_micro_batch)"

VERL_KEYS: tuple[VerlKey, ...] = (
    # ---- data
    VerlKey("data.train_files", ("data.train_files",)),
    VerlKey("data.val_files", ("data.val_files",)),
    VerlKey("data.prompt_key", ("data.prompt_key",)),
    VerlKey("data.train_batch_size", ("data.train_batch_size",), verl_default=1024),
    VerlKey("data.val_batch_size", ("data.val_batch_size",), convert=_positive_or_skip),
    VerlKey("data.max_prompt_length", ("data.max_prompt_length",)),
    VerlKey("data.max_response_length", ("rollout.max_new_tokens",)),
    VerlKey("data.filter_overlong_prompts", ("data.filter_overlong_prompts",)),
    VerlKey("data.shuffle", ("data.shuffle",)),
    VerlKey("data.seed", ("data.seed",), convert=_positive_or_skip),
    VerlKey("data.reward_fn_key", note="the data source is always the row's data_source field",
            convert=_only("data_source", "the data source is always the row's data_source")),
    VerlKey("data.truncation", note="over-long prompts are dropped "
            "(data.filter_overlong_prompts) or stop the job; never truncated",
            convert=_only("error", "prompts are never truncated here")),
    # ---- the policy model
    VerlKey("actor_rollout_ref.model.path", ("model.path",),
            note="a local Hugging Face folder (hub names are not downloaded)"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", ("actor.recompute",),
            note="true = full (attention_block recomputes less)", convert=_recompute),
    VerlKey("actor_rollout_ref.actor.use_torch_compile", ("actor.compile",),
            note="true = auto (compiled on CUDA: norms, RoPE, activation, the head's chunks)",
            convert=_compile),
    VerlKey("actor_rollout_ref.model.use_remove_padding",
            note="always on: sequences are packed without padding",
            convert=_only(True, "sequences are always packed without padding")),
    VerlKey("actor_rollout_ref.model.lora_rank", ("actor.lora.r",)),
    VerlKey("actor_rollout_ref.model.lora_alpha", ("actor.lora.lora_alpha",)),
    VerlKey("actor_rollout_ref.model.target_modules", ("actor.lora.target_modules",),
            convert=_modules),
    # ---- the actor
    VerlKey("actor_rollout_ref.actor.strategy", note=_SHARDING),
    VerlKey("actor_rollout_ref.actor.optim.lr", ("actor.optim.lr",)),
    VerlKey("actor_rollout_ref.actor.optim.weight_decay", ("actor.optim.weight_decay",)),
    VerlKey("actor_rollout_ref.actor.optim.lr_warmup_steps", ("actor.optim.warmup_steps",),
            note="-1 (use the ratio) leaves ours at 0", convert=_positive_or_skip),
    VerlKey("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
            note="warmup is in steps: actor.optim.warmup_steps", convert=_warmup_ratio),
    VerlKey("actor_rollout_ref.actor.optim.warmup_style", ("actor.optim.schedule",),
            convert=_schedule),
    VerlKey("actor_rollout_ref.actor.optim.lr_scheduler_type", ("actor.optim.schedule",),
            convert=_schedule),
    VerlKey("actor_rollout_ref.actor.optim.min_lr_ratio", ("actor.optim.min_lr_ratio",),
            convert=lambda value, source: 0.0 if value is None else value),
    VerlKey("actor_rollout_ref.actor.grad_clip", ("actor.optim.grad_clip",)),
    VerlKey("actor_rollout_ref.actor.ppo_mini_batch_size", ("actor.ppo_mini_batch_size",),
            note="prompts per optimizer step in both", verl_default=256),
    VerlKey("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", note=_TOKENS),
    VerlKey("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            ("actor.max_tokens_per_micro_batch",)),
    VerlKey("actor_rollout_ref.actor.use_dynamic_bsz", note="always on: " + _TOKENS),
    VerlKey("actor_rollout_ref.actor.ppo_epochs", ("algorithm.ppo_epochs",)),
    VerlKey("actor_rollout_ref.actor.clip_ratio",
            ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high")),
    VerlKey("actor_rollout_ref.actor.clip_ratio_low", ("algorithm.clip_ratio_low",)),
    VerlKey("actor_rollout_ref.actor.clip_ratio_high", ("algorithm.clip_ratio_high",)),
    VerlKey("actor_rollout_ref.actor.clip_ratio_c", ("algorithm.clip_ratio_c",)),
    VerlKey("actor_rollout_ref.actor.entropy_coeff", ("algorithm.entropy_coeff",)),
    VerlKey("actor_rollout_ref.actor.use_kl_loss", ("algorithm.use_kl_loss",)),
    VerlKey("actor_rollout_ref.actor.kl_loss_coef", ("algorithm.kl_loss_coef",)),
    VerlKey("actor_rollout_ref.actor.kl_loss_type", ("algorithm.kl_loss_type",),
            note="kl = k1, mse = k2, low_var_kl = k3", convert=_kl_name),
    VerlKey("actor_rollout_ref.actor.loss_agg_mode", ("algorithm.loss_agg_mode",)),
    VerlKey("actor_rollout_ref.actor.policy_loss.loss_mode", ("algorithm.policy_loss",),
            note="vanilla = ppo", convert=_policy_loss),
    VerlKey("actor_rollout_ref.actor.fsdp_config.param_offload", ("actor.offload.params",)),
    VerlKey("actor_rollout_ref.actor.fsdp_config.optimizer_offload",
            ("actor.offload.optimizer",)),
    VerlKey("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            note="no Ulysses; sequence parallelism here rides on tp "
                 "(actor.parallel.sequence_parallel)",
            convert=_only(1, "no Ulysses sequence parallelism; use actor.parallel.tp with "
                             "sequence_parallel")),
    VerlKey("actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
            ("actor.parallel.tp",)),
    VerlKey("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
            ("actor.parallel.pp",)),
    VerlKey("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
            ("actor.parallel.vpp",), convert=_positive_or_skip),
    VerlKey("actor_rollout_ref.actor.megatron.expert_model_parallel_size", ("actor.parallel.ep",)),
    VerlKey("actor_rollout_ref.actor.megatron.sequence_parallel",
            ("actor.parallel.sequence_parallel",)),
    # ---- rollout
    VerlKey("actor_rollout_ref.rollout.name", note="vLLM only",
            convert=_only("vllm", "rollouts here are vLLM")),
    VerlKey("actor_rollout_ref.rollout.n", ("rollout.n",)),
    VerlKey("actor_rollout_ref.rollout.tensor_model_parallel_size", ("rollout.tp",)),
    VerlKey("actor_rollout_ref.rollout.temperature", ("rollout.temperature",)),
    VerlKey("actor_rollout_ref.rollout.top_p", ("rollout.top_p",)),
    VerlKey("actor_rollout_ref.rollout.top_k", ("rollout.top_k",)),
    VerlKey("actor_rollout_ref.rollout.gpu_memory_utilization",
            ("rollout.gpu_memory_utilization",)),
    VerlKey("actor_rollout_ref.rollout.max_num_seqs", ("rollout.max_num_seqs",)),
    VerlKey("actor_rollout_ref.rollout.enforce_eager", ("rollout.enforce_eager",)),
    VerlKey("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", note=_TOKENS),
    VerlKey(_VAL_KWARGS + "do_sample", note="false: greedy validation only, always reported "
            "here; true: the val_kwargs below set trainer.val_sampling", convert=_skip),
    VerlKey(_VAL_KWARGS + "n", ("trainer.val_sampling.n",), convert=_if_val_sampling),
    VerlKey(_VAL_KWARGS + "temperature", ("trainer.val_sampling.temperature",),
            convert=_if_val_sampling),
    VerlKey(_VAL_KWARGS + "top_p", ("trainer.val_sampling.top_p",), convert=_if_val_sampling),
    VerlKey(_VAL_KWARGS + "top_k", ("trainer.val_sampling.top_k",), convert=_if_val_sampling),
    VerlKey("actor_rollout_ref.ref.fsdp_config.param_offload", ("ref.offload.params",)),
    VerlKey("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", note=_TOKENS),
    # ---- critic (gae)
    VerlKey("critic.model.path", ("critic.model_path",)),
    VerlKey("critic.optim.lr", ("critic.optim.lr",)),
    VerlKey("critic.ppo_mini_batch_size", ("critic.ppo_mini_batch_size",),
            note="verl's default is the actor's, carried over for gae when unset"),
    VerlKey("critic.ppo_max_token_len_per_gpu", ("critic.max_tokens_per_micro_batch",)),
    VerlKey("critic.cliprange_value", ("algorithm.value_clip",)),
    VerlKey("critic.model.enable_gradient_checkpointing", ("critic.recompute",),
            convert=_recompute),
    VerlKey("critic.model.fsdp_config.param_offload", ("critic.offload.params",)),
    VerlKey("critic.model.fsdp_config.optimizer_offload", ("critic.offload.optimizer",)),
    # ---- algorithm
    VerlKey("algorithm.adv_estimator", ("algorithm.adv_estimator",),
            note="gae, grpo, rloo, reinforce_plus_plus(_baseline) by the same names"),
    VerlKey("algorithm.gamma", ("algorithm.gamma",)),
    VerlKey("algorithm.lam", ("algorithm.lam",)),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", ("algorithm.norm_adv_by_std",)),
    VerlKey("algorithm.use_kl_in_reward", ("algorithm.kl_in_reward",)),
    VerlKey("algorithm.kl_penalty", ("algorithm.kl_penalty",), convert=_kl_name),
    VerlKey("algorithm.kl_ctrl.type", ("algorithm.kl_ctrl",)),
    VerlKey("algorithm.kl_ctrl.kl_coef", ("algorithm.kl_coef",)),
    VerlKey("algorithm.kl_ctrl.target_kl", ("algorithm.kl_target",)),
    VerlKey("algorithm.kl_ctrl.horizon", ("algorithm.kl_horizon",)),
    # ---- rewards
    VerlKey("custom_reward_function.path", ("reward.functions",),
            note="with .name: [{path: FILE:NAME, convention: verl}], called unchanged",
            convert=_reward_function),
    VerlKey("custom_reward_function.name", note="joined to custom_reward_function.path",
            convert=_skip),
    VerlKey("reward_model.model.path", ("reward.model_path",),
            note="when reward_model.enable", convert=_reward_model),
    VerlKey("reward_model.enable", note="set by reward.model_path",
            convert=_skip),
    # ---- trainer
    VerlKey("trainer.nnodes", ("trainer.nnodes",)),
    VerlKey("trainer.n_gpus_per_node", ("trainer.ranks_per_node",), verl_default=8),
    VerlKey("trainer.total_epochs", ("trainer.total_steps",),
            note="epochs x (training rows // data.train_batch_size), counted when the files "
                 "are here", convert=_total_steps, verl_default=30),
    VerlKey("trainer.total_training_steps", ("trainer.total_steps",),
            convert=_positive_or_skip),
    VerlKey("trainer.test_freq", ("trainer.val_every",), note="-1 = 0 (never)", convert=_freq),
    VerlKey("trainer.save_freq", ("trainer.save_every",), note="-1 = 0 (only at the end)",
            convert=_freq),
    VerlKey("trainer.val_before_train", ("trainer.val_before_train",)),
    VerlKey("trainer.critic_warmup", ("trainer.critic_warmup",)),
    VerlKey("trainer.project_name", ("trainer.wandb_project",)),
    VerlKey("trainer.experiment_name", ("trainer.experiment_name",)),
    VerlKey("trainer.logger", ("trainer.loggers",), note="jsonl is always added",
            convert=_loggers),
    VerlKey("trainer.default_local_dir", ("trainer.output_dir",)),
    VerlKey("trainer.resume_mode", ("trainer.resume",), note="disable = never; resume_path = "
            "trainer.resume_from_path", convert=_resume),
    VerlKey("trainer.resume_from_path", note="read by trainer.resume_mode",
            convert=_skip),
    VerlKey("trainer.max_actor_ckpt_to_keep", ("trainer.max_keep",), convert=_positive_or_skip),
    VerlKey("trainer.device", ("trainer.device",), verl_default="cuda"),
)


@dataclasses.dataclass(frozen=True)
class Translation:
    """Our config tree, which verl key set which of ours, and what was left out and why."""

    tree: dict
    mapped: list[tuple[str, tuple[str, ...]]]
    no_equivalent: list[tuple[str, str]]
    unknown: list[str]
    notes: list[str]


def flatten(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested mapping; lists are leaves."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flatten(value, dotted + ".")
        else:
            yield dotted, value


def translate(verl_tree: Mapping) -> Translation:
    """Our config tree for a verl config (nested, or dotted keys as in its overrides)."""
    flat = dict(flatten(verl_tree))
    source = Source(flat=flat, notes=[])
    tree: dict = {"data": {"ground_truth_key": VERL_GROUND_TRUTH_KEY}}
    mapped, no_equivalent = [], []
    for entry in VERL_KEYS:
        if entry.verl in flat:
            value = flat[entry.verl]
        elif entry.verl_default is not None:
            value = entry.verl_default
            source.notes.append(f"{entry.verl} not set: verl's default {value} carried over")
        else:
            continue
        try:
            converted = entry.convert(value, source)
        except Skip:
            continue
        except NoEquivalent as why:
            no_equivalent.append((entry.verl, str(why)))
            continue
        if not entry.ours:
            no_equivalent.append((entry.verl, entry.note))
            continue
        for key in entry.ours:
            tree = merge_trees(tree, _nested(key, converted))
        mapped.append((entry.verl, entry.ours))
    critic, actor = tree.get("critic", {}), tree.get("actor", {})
    if (tree.get("algorithm", {}).get("adv_estimator", "gae") == "gae"
            and "ppo_mini_batch_size" not in critic and "ppo_mini_batch_size" in actor):
        tree = merge_trees(tree, {"critic": {"ppo_mini_batch_size": actor["ppo_mini_batch_size"]}})
    known = {entry.verl for entry in VERL_KEYS}
    unknown = sorted(key for key in flat if key not in known)
    if "reward" not in tree:
        source.notes.append("no custom_reward_function: verl scores by data_source with its "
                            "built-in scorers; name ours in reward.functions, e.g. "
                            "rlhf.rewards.gsm8k:score (GSM8K) or rlhf.rewards.math:boxed (MATH)")
    model = flat.get("actor_rollout_ref.model.path")
    if isinstance(model, str) and not Path(os.path.expanduser(model)).exists() \
            and not model.startswith(("/", ".", "~")):
        source.notes.append(f"model.path {model!r} looks like a hub name; download it to a "
                            f"folder (huggingface-cli download {model} --local-dir DIR) and "
                            f"point model.path there")
    return Translation(tree=tree, mapped=mapped, no_equivalent=no_equivalent, unknown=unknown,
                       notes=source.notes)


def _nested(dotted: str, value: Any) -> dict:
    tree: dict = {}
    apply_override(tree, f"{dotted}={json.dumps(value)}")
    return tree


def read_verl_config(path: Path, overrides: list[str]) -> dict:
    """A verl YAML file (nested or dotted keys) with verl-style key=value overrides on top."""
    tree = read_yaml_mapping(path)
    flat = dict(flatten(tree))
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {override!r} must look like verl.key=value, e.g. "
                              f"actor_rollout_ref.rollout.n=8")
        flat[key.strip().removeprefix("+")] = parse_yaml(raw) if raw.strip() else None
    return flat


def check_translation(translation: Translation) -> str | None:
    """Why the translated tree does not load as a JobConfig yet, or None when it does."""
    from rlhf.config.checks import check_config  # noqa: PLC0415

    try:
        check_config(build(JobConfig, translation.tree, base=JobConfig()))
    except ConfigError as e:
        return str(e)
    return None


def render(translation: Translation, *, source_name: str) -> str:
    """The translated config as YAML, headed by comments on where each key came from."""
    lines = [f"# Translated from verl's {source_name} by `rlhf config from-verl`.",
             f"# data.ground_truth_key: {VERL_GROUND_TRUTH_KEY} reads verl's rows as they are."]
    lines += [f"#   {verl} -> {', '.join(ours)}" for verl, ours in translation.mapped]
    if translation.no_equivalent:
        lines.append("# No equivalent here (left out):")
        lines += [f"#   {verl}: {why}" for verl, why in translation.no_equivalent]
    if translation.unknown:
        lines.append(f"# Not in the translation table (left out): "
                     f"{', '.join(translation.unknown)}")
    lines += [f"# Note: {note}" for note in translation.notes]
    return "\n".join(lines) + "\n" + dump_yaml(translation.tree)


def key_table_markdown() -> str:
    """The table of VERL_KEYS as Markdown, for the "Coming from verl" page."""
    rows = ["| verl key | here | note |", "|---|---|---|"]
    for entry in VERL_KEYS:
        ours = ", ".join(f"`{key}`" for key in entry.ours) or "(none)"
        note = entry.note
        if entry.verl_default is not None:
            note = f"{note}; " if note else ""
            note += f"verl's default {entry.verl_default} is carried over when unset"
        rows.append(f"| `{entry.verl}` | {ours} | {note} |")
    return "\n".join(rows) + "\n"
