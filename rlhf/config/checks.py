"""Checks that span sections or need the model's shape; `load_config` runs them all.

Every problem is reported at once, each naming its dotted key(s) and the fix. Model-shape
checks read the few numbers they need from model.path/config.json when the folder exists,
else from model.tiny, else are skipped.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf.config.roles import CRITIC, REWARD, ROLLOUT, AlgorithmNeeds, job_roles
from rlhf.config.schema import (
    VLLM_CPU_HEAD_SIZES,
    ForwardRoleConfig,
    JobConfig,
    TinyModelConfig,
    TrainRoleConfig,
)
from rlhf.errors import ConfigError
from rlhf.families import find_family, model_family


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """Shape of a model as far as parallel plans and sequence lengths care."""

    source: str
    """Where the numbers come from, for messages (a config.json path or 'model.tiny')."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""


def read_model_facts(path: str | None, tiny: TinyModelConfig | None, key: str) -> ModelFacts | None:
    """Facts from `path`/config.json if the folder exists, else from `tiny`, else None.

    `key` is the dotted config key of `path`, for messages.
    """
    folder = Path(path) if path else None
    if folder is not None and folder.exists():
        return _facts_from_json(folder / "config.json", key)
    if tiny is None:
        return None
    return ModelFacts(source="model.tiny", num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                      num_kv_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                      intermediate_size=tiny.intermediate_size,
                      max_position_embeddings=tiny.max_position_embeddings,
                      num_experts=tiny.num_experts if model_family(tiny.arch).is_moe else 0)


def _facts_from_json(config_json: Path, key: str) -> ModelFacts:
    try:
        hf = json.loads(config_json.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{key}: {str(config_json.parent)!r} exists but has no config.json; "
                          f"point {key} at a Hugging Face model folder") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read {str(config_json)!r}: {exc}") from None
    required = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size",
                "max_position_embeddings")
    missing = [name for name in required if not isinstance(hf.get(name), int)]
    if missing:
        raise ConfigError(f"{key}: {str(config_json)!r} lacks integer {', '.join(missing)}; "
                          f"is it a Llama-family model?")
    heads = hf["num_attention_heads"]
    family = find_family(hf.get("model_type"))  # None: refused when the model is built
    head_dim = hf.get("head_dim")
    if "head_dim" not in hf and family is not None:
        head_dim = family.head_dim  # the config class's default (None: hidden / heads)
    return ModelFacts(source=str(config_json), num_layers=hf["num_hidden_layers"],
                      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                      head_dim=head_dim or hf["hidden_size"] // heads,
                      intermediate_size=hf["intermediate_size"],
                      max_position_embeddings=hf["max_position_embeddings"],
                      num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0)
                      if family is not None and family.is_moe else 0)


def check_config(cfg: JobConfig) -> None:
    """Raise one ConfigError listing every cross-section problem of `cfg`; return if none.

    The roles the algorithm's registry entries call for (the critic) are checked by
    `rlhf.algorithms.algorithm_needs` through `role_problems`: this leaf cannot ask them."""
    policy = read_model_facts(cfg.model.path, cfg.model.tiny, "model.path")
    problems = [*_check_inputs(cfg), *_check_rollout(cfg, policy)]
    problems += role_problems(cfg, job_roles(cfg, AlgorithmNeeds()))
    raise_problems(problems)


def raise_problems(problems: list[str]) -> None:
    """One ConfigError listing every problem; nothing when there is none."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems in the config:\n"
                          + "\n".join(f"  - {p}" for p in problems))


def role_problems(cfg: JobConfig, roles: dict) -> list[str]:
    """Problems of the model roles in `roles` (name -> section, as job_roles gives them; the
    rollout pool is _check_rollout's): layout against ranks and model, batches, warmup."""
    policy = read_model_facts(cfg.model.path, cfg.model.tiny, "model.path")
    problems = []
    for name, role in roles.items():
        if name == ROLLOUT:
            continue
        facts = policy
        if name == CRITIC and cfg.critic.model_path is not None:
            facts = read_model_facts(cfg.critic.model_path, None, "critic.model_path")
        elif name == REWARD:
            facts = read_model_facts(cfg.reward.model_path, None, "reward.model_path")
        problems += _check_warmup(cfg, name, role)
        problems += _check_role(cfg, name, role, facts)
        problems += _check_role_batches(cfg, name, role)
    return problems


def _check_inputs(cfg: JobConfig) -> Iterator[str]:
    if not cfg.data.train_files:
        yield "data.train_files is empty; list the training JSONL or Parquet file(s)"
    if not cfg.reward.functions and cfg.reward.model_path is None and cfg.rollout.env.path is None:
        yield ("reward.functions is empty and reward.model_path is null; give at least one "
               "reward function (e.g. [{path: 'pkg.module:function'}]), a reward model or an "
               "environment (rollout.env.path)")
    if cfg.trainer.val_every > 0 and not cfg.data.val_files:
        yield (f"trainer.val_every={cfg.trainer.val_every} needs data.val_files; list the "
               f"validation file(s) or set trainer.val_every=0")


def _check_rollout(cfg: JobConfig, policy: ModelFacts | None) -> Iterator[str]:
    rollout, algo = cfg.rollout, cfg.algorithm
    yield from _check_rollout_placement(cfg)
    if cfg.trainer.device == "cpu" and rollout.tp != 1:
        yield f"rollout.tp={rollout.tp} but trainer.device is cpu, where vLLM runs with tp 1"
    if rollout.routing_replay == "rollout" and cfg.trainer.device == "cpu":
        yield ("rollout.routing_replay=rollout takes the routes from vLLM, which returns them "
               "only on CUDA (trainer.device is cpu); use rollout.routing_replay=trainer")
    if rollout.routing_replay != "off" and cfg.actor.parallel.pp > 1:
        yield (f"rollout.routing_replay={rollout.routing_replay} with actor.parallel.pp="
               f"{cfg.actor.parallel.pp}: the routes of a batch are recorded and replayed on "
               "one pipeline stage; use actor.parallel.pp=1 or routing_replay=off")
    if algo.overlong_buffer > rollout.max_new_tokens:
        yield (f"algorithm.overlong_buffer={algo.overlong_buffer} exceeds rollout.max_new_tokens="
               f"{rollout.max_new_tokens}; the penalty ramp must fit inside the response")
    if policy is None:
        return
    sequence = cfg.data.max_prompt_length + rollout.max_response_tokens
    if sequence > policy.max_position_embeddings:
        yield (f"data.max_prompt_length + {_response_key(rollout)} = {sequence} exceeds the "
               f"model's max_position_embeddings {policy.max_position_embeddings} "
               f"({policy.source}); shorten one of them")
    if policy.num_heads % rollout.tp:
        yield (f"rollout.tp={rollout.tp} does not divide the model's {policy.num_heads} "
               f"attention heads ({policy.source})")
    if cfg.trainer.device == "cpu" and policy.head_dim not in VLLM_CPU_HEAD_SIZES:
        yield (f"model head size {policy.head_dim} ({policy.source}) has no vLLM CPU kernel "
               f"(trainer.device is cpu); use one of {list(VLLM_CPU_HEAD_SIZES)}")


def _response_key(rollout) -> str:
    """The key that bounds a response: a turn without an environment, an episode with one."""
    if rollout.env.path is None:
        return "rollout.max_new_tokens"
    if rollout.max_episode_tokens is None:
        return "rollout.max_turns * rollout.max_new_tokens"
    return "rollout.max_episode_tokens"


def _check_rollout_placement(cfg: JobConfig) -> Iterator[str]:
    rollout, trainer = cfg.rollout, cfg.trainer
    if rollout.placement == "separate":
        # world_size is set whenever placement is separate (RolloutConfig refuses otherwise)
        if rollout.world_size is not None and rollout.world_size % rollout.tp:
            yield (f"rollout.world_size={rollout.world_size} is not a multiple of rollout.tp="
                   f"{rollout.tp}: each replica takes rollout.tp ranks; make world_size a "
                   f"multiple of {rollout.tp}")
    else:
        actor_world = cfg.role_world_size(cfg.actor)
        if actor_world % rollout.tp:
            yield (f"rollout.tp={rollout.tp} does not divide the actor's {actor_world} ranks; "
                   f"choose a divisor of {actor_world}")
    if trainer.async_mode != "off" and rollout.placement != "separate":
        yield (f"trainer.async_mode={trainer.async_mode} overlaps generation with training, "
               "which needs rollout ranks of their own: set rollout.placement=separate and "
               "rollout.world_size, or trainer.async_mode=off")
    if trainer.async_mode != "off" and cfg.algorithm.dynamic_sampling != "off":
        yield (f"algorithm.dynamic_sampling={cfg.algorithm.dynamic_sampling} refills a step's "
               f"batch with fresh rollouts, which trainer.async_mode={trainer.async_mode} does "
               "not do (one batch sampled ahead per step): set one of them to off")
    if trainer.async_mode == "streaming" and rollout.min_new_tokens:
        yield ("rollout.min_new_tokens holds back the end of a whole response, which streaming "
               "rollouts generate in segments: set it to 0 or trainer.async_mode to another mode")
    if trainer.async_mode == "off" and trainer.max_staleness != 1:
        yield (f"trainer.max_staleness={trainer.max_staleness} only applies to "
               "trainer.async_mode=bounded; set async_mode=bounded or remove max_staleness")


def _check_warmup(cfg: JobConfig, name: str, role: ForwardRoleConfig) -> Iterator[str]:
    if isinstance(role, TrainRoleConfig) and role.optim.warmup_steps >= cfg.trainer.total_steps:
        yield (f"{name}.optim.warmup_steps={role.optim.warmup_steps} must be below "
               f"trainer.total_steps={cfg.trainer.total_steps}; shorten the warmup")


def _check_role(cfg: JobConfig, name: str, role: ForwardRoleConfig,
                facts: ModelFacts | None) -> Iterator[str]:
    parallel = role.parallel
    world = cfg.role_world_size(role)
    where = (f"{name}.world_size={world}" if role.placement == "separate" else
             f"the shared pool of {world} ranks (trainer.nnodes * trainer.ranks_per_node)")
    axes = "tp * cp * pp" if parallel.cp > 1 else "tp * pp"
    if world % parallel.model_ranks:
        product = " * ".join(f"{name}.parallel.{a}" for a in axes.split(" * "))
        yield (f"{product} = {parallel.model_ranks} does not divide "
               f"{where}; change the layout or the number of ranks")
    elif world // parallel.model_ranks % parallel.ep:
        dp = world // parallel.model_ranks
        yield (f"{name}.parallel.ep={parallel.ep} does not divide the {dp} data-parallel ranks of "
               f"{name} ({where} / ({axes})); expert parallelism is carved out of data "
               "parallelism, so choose an ep that divides dp")
    if parallel.ep > 1 and cfg.trainer.micro_batching == "cost_model":
        yield (f"{name}.parallel.ep={parallel.ep} needs every rank of an ep group to run as many "
               "micro-batches, which trainer.micro_batching=cost_model does not plan; use "
               "token_budget")
    if (cfg.trainer.pipeline_schedule == "auto" and parallel.vpp > 1
            and parallel.layers_per_stage is not None):
        yield (f"{name}.parallel.layers_per_stage fixes {parallel.pp * parallel.vpp} virtual "
               "stages, so trainer.pipeline_schedule=auto cannot switch to 1F1B; remove "
               "layers_per_stage or set pipeline_schedule=configured")
    if role.dtype == "float16" and cfg.trainer.device == "cpu":
        yield f"{name}.dtype=float16 is not supported on cpu; use float32, bfloat16 or auto"
    sequence = cfg.data.max_prompt_length + cfg.rollout.max_response_tokens
    if role.max_tokens_per_micro_batch < sequence:
        yield (f"{name}.max_tokens_per_micro_batch={role.max_tokens_per_micro_batch} is below "
               f"data.max_prompt_length + {_response_key(cfg.rollout)} = {sequence}, so a whole "
               f"sequence may not fit; raise it to at least {sequence}")
    if facts is not None:
        yield from _check_parallel_vs_model(name, role, facts)


def _check_parallel_vs_model(name: str, role: ForwardRoleConfig, facts: ModelFacts) -> Iterator[str]:
    parallel, src = role.parallel, facts.source
    for what, count in (("attention heads", facts.num_heads), ("kv heads", facts.num_kv_heads),
                        ("MLP intermediate size", facts.intermediate_size)):
        if count % parallel.tp:
            yield (f"{name}.parallel.tp={parallel.tp} does not divide the model's {count} {what} "
                   f"({src}); choose a divisor")
    problem = parallel.ulysses_problem(facts.num_heads, facts.num_kv_heads)
    if problem is not None:
        yield (f"{name}.parallel.cp_attention=ulysses splits the attention heads over the cp "
                   f"ranks, but the model's {problem} ({src}); set {name}.parallel.cp_attention="
                   "all_gather (any number of heads) or choose a cp that divides them")
    if parallel.ep > 1 and not facts.num_experts:
        yield (f"{name}.parallel.ep={parallel.ep} needs a mixture-of-experts model, but {src} has "
               "no experts; set ep to 1")
    elif facts.num_experts % parallel.ep:
        yield (f"{name}.parallel.ep={parallel.ep} does not divide the model's {facts.num_experts} "
               f"experts ({src}); choose a divisor so every rank holds the same number")
    stages = parallel.pp * parallel.vpp
    if facts.num_layers < stages:
        yield (f"{name}.parallel.pp * {name}.parallel.vpp = {stages} exceeds the model's "
               f"{facts.num_layers} layers ({src}); every virtual stage needs a layer")
    if parallel.layers_per_stage is not None and sum(parallel.layers_per_stage) != facts.num_layers:
        yield (f"{name}.parallel.layers_per_stage sums to {sum(parallel.layers_per_stage)} but the "
               f"model has {facts.num_layers} layers ({src})")


def _check_role_batches(cfg: JobConfig, name: str, role: ForwardRoleConfig) -> Iterator[str]:
    parallel = role.parallel
    world = cfg.role_world_size(role)
    if world % parallel.model_ranks:
        return  # reported by _check_role; DP size is undefined
    dp = world // parallel.model_ranks
    n, batch = cfg.rollout.n, cfg.data.train_batch_size
    if not isinstance(role, TrainRoleConfig):
        if batch * n % dp:
            yield (f"data.train_batch_size * rollout.n = {batch * n} samples do not split evenly "
                   f"over the {dp} data-parallel ranks of {name}")
        return
    mini = role.ppo_mini_batch_size
    if batch % mini:
        yield (f"data.train_batch_size={batch} is not divisible by {name}.ppo_mini_batch_size="
               f"{mini}; make the mini-batch a divisor of the batch")
        return
    if mini * n % dp:
        yield (f"{name}.ppo_mini_batch_size * rollout.n = {mini * n} samples do not split evenly "
               f"over the {dp} data-parallel ranks of {name}")
        return
    per_rank = mini * n // dp
    if role.micro_batch_size is not None and per_rank % role.micro_batch_size:
        yield (f"{name}.micro_batch_size={role.micro_batch_size} does not divide the {per_rank} "
               f"samples of a mini-batch on one data-parallel rank "
               f"({name}.ppo_mini_batch_size * rollout.n / {dp})")
