"""RolloutReplica: a rank's part in rollout, as the actor worker sees it.

It owns this rank's VllmSampler (built on first use, so a worker that never samples never
imports vLLM), knows whether the engine's weights are behind the policy or were released by a
sleep (rlhf.rollout.residency: only a colocated CUDA engine sleeps), splits prompts among the
ranks of a replica (multi-turn episodes go to rlhf.rollout.multiturn.EpisodeRunner), syncs
new weights into the engine, and reports metrics agreed over all ranks of the worker group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from rlhf.config import RolloutConfig
from rlhf.config.schema import LoraConfig
from rlhf.data.batch import Batch
from rlhf.data.ragged import Ragged
from rlhf.data.routes import ROUTES
from rlhf.models.export import ExportStream, ExportTimes
from rlhf.parallel.collectives import group_size
from rlhf.parallel.mesh import world_unbound
from rlhf.rollout.multiturn import EpisodeRunner, env_metrics
from rlhf.rollout.residency import SleepReport
from rlhf.rollout.sampling import derive_seed, request_seeds, sampling_params
from rlhf.rollout.vllm_sampler import Completion, VllmSampler, vllm_environment
from rlhf.rollout.weights import receipt_metrics

Buckets = Iterable[list[tuple[str, Tensor]]]


@dataclass(frozen=True)
class ReplicaSpec:
    """Where the engine comes from and which ranks it talks to."""

    model_path: str
    config: RolloutConfig  # its `placement` decides whether the engine sleeps between calls
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # longest prompt + response
    world_group: ProcessGroup | None  # every rank of the worker group (metrics, positions)
    replica_group: ProcessGroup | None  # the rollout.tp ranks of this replica (None: just me)
    rank: int = 0  # this process's rank in the job's torch.distributed world
    lora: LoraConfig | None = None  # the actor's adapters: syncs send only them (lora_sync)


class RolloutReplica:
    """This rank's engine, its staleness and its share of every `generate`; lazy."""

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.sampler: VllmSampler | None = None
        self.stale = False  # the engine starts from model_path, the initial policy
        self.calls = 0
        self.episodes = (EpisodeRunner(spec.model_path, spec.config)
                         if spec.config.env.path is not None else None)

    def ensure_sampler(self) -> VllmSampler:
        """Build the engine on first use, with vLLM's environment set only while it builds."""
        if self.sampler is None:
            spec = self.spec
            spread = spec.config.tp > 1  # vLLM's external launcher: the job's ranks
            with vllm_environment(device_type=spec.device.type,
                                  launcher_rank=spec.rank if spread else None,
                                  device_index=spec.device.index or 0), world_unbound():
                self.sampler = VllmSampler(spec.model_path, config=spec.config,
                                           device_type=spec.device.type, dtype=spec.dtype,
                                           max_model_len=spec.max_model_len, lora=spec.lora)
        return self.sampler

    def mark_stale(self) -> None:
        """The policy changed (a training step, a loaded checkpoint): sync before sampling."""
        self.stale = True

    def holds_weights(self) -> bool:
        """Whether the engine still holds the weights it was last given (model_path before any
        sync): False once a sleep released them, until the next sync."""
        return self.sampler is None or self.sampler.has_weights

    # ---- sampling ----------------------------------------------------------------------------

    def generate(self, prompts: Ragged, *, greedy: bool, seed: int | None,
                 env_rows: list[dict] | None = None, sampling: dict | None = None) -> Batch:
        """`response_ids` and `rollout_log_probs` of this rank's prompts (n samples each,
        prompt-major) and metrics over the whole group in meta; collective over the group.
        With rollout.env, each sample is a multi-turn episode started from its `env_rows`
        entry (prompt, ground_truth, extra): see rlhf.rollout.multiturn. `sampling` replaces
        rollout fields for this call (sampled validation: n, temperature, top_p, top_k)."""
        start = time.perf_counter()
        call = self.calls
        self.calls += 1
        mine = [row.tolist() for row in prompts.to_list()]
        first = self._first_position(mine)
        config = self.spec.config if sampling is None else replace(self.spec.config, **sampling)
        n = 1 if greedy else config.n
        rows, skip = self._replica_rows(mine, first)
        call_seed = seed if seed is not None else derive_seed(self.spec.config.seed, call)
        seeds = [s for pos, _ in rows for s in request_seeds(
            call_seed=call_seed, first_prompt=pos, num_prompts=1, n=n)]
        repeated = [prompt for _, prompt in rows for _ in range(n)]
        sampler = self.ensure_sampler()  # on every rank at once: building may be collective
        if self.episodes is not None:  # rollout.tp is 1: no replica peers share the requests
            batch, env_sums = self.episodes.play(sampler, repeated, seeds, env_rows, first=first,
                                                 n=n, greedy=greedy, config=config)
        else:
            params = sampling_params(config, greedy=greedy, seeds=seeds)
            completions = sampler.generate(repeated, params)[skip * n:(skip + len(mine)) * n]
            batch, env_sums = _to_batch(completions, meta={}), None
        slept = sampler.sleep()  # a sleeping engine (colocated, CUDA) releases its weights here
        self.stale = self.stale or not sampler.has_weights
        lengths = batch["response_ids"].lengths
        metrics = self._rollout_metrics(lengths, time.perf_counter() - start)
        if sampler.sleeps:  # the same on every rank: the reductions below are collective
            metrics.update(self._sleep_metrics(slept))
        if env_sums is not None:
            metrics.update(env_metrics(self._sum_over_group(env_sums)))
        return batch.with_meta(metrics=metrics)

    def continue_samples(self, inputs: Ragged, *, max_tokens: list[int],
                         seeds: list[int]) -> Batch:
        """One segment of streaming rollouts (rlhf.trainer.stream), token in, token out: each
        row of `inputs` (a prompt + its sample's tokens so far) gets at most its `max_tokens`
        new tokens, sampled with its own seed. Returns `response_ids` (the new tokens),
        `rollout_log_probs` and `stopped` (the sampler ended the response: EOS or a stop
        string, not a token limit), metrics in meta; collective over the group. The engine
        stays awake: streaming needs rollout.placement separate, whose engines are resident."""
        start = time.perf_counter()
        mine = [row.tolist() for row in inputs.to_list()]
        if len(max_tokens) != len(mine) or len(seeds) != len(mine):
            raise ValueError(f"{len(mine)} inputs with {len(max_tokens)} max_tokens and "
                             f"{len(seeds)} seeds")
        first = self._first_position(mine, check_lengths=False)
        rows, skip = self._replica_rows(list(zip(mine, max_tokens, seeds)), first)
        sampler = self.ensure_sampler()
        params = sampling_params(self.spec.config, greedy=False,
                                 seeds=[seed for _, (_, _, seed) in rows],
                                 max_tokens=[limit for _, (_, limit, _) in rows])
        completions = sampler.generate([ids for _, (ids, _, _) in rows],
                                       params)[skip:skip + len(mine)]
        batch = _to_batch(completions, meta={})
        stopped = torch.tensor([c.finish_reason == "stop" for c in completions], dtype=torch.bool)
        batch = batch.union(Batch({"stopped": stopped}, size=len(batch)))
        metrics = self._rollout_metrics(batch["response_ids"].lengths,
                                        time.perf_counter() - start)
        return batch.with_meta(metrics=metrics)

    def _sum_over_group(self, sums: dict[str, float]) -> dict[str, float]:
        """Every rank's sums added up; "seconds" is the slowest rank's."""
        group = self.spec.world_group
        parts = [sums]
        if group_size(group) > 1:
            parts = [None] * group_size(group)
            dist.all_gather_object(parts, sums, group=group)
        total: dict[str, float] = {}
        for part in parts:
            for key, value in part.items():
                total[key] = (max(total.get(key, 0.0), value) if key == "seconds"
                              else total.get(key, 0.0) + value)
        return total

    def _first_position(self, mine: list, *, check_lengths: bool = True) -> int:
        """Row of this rank's first prompt in the driver's batch: ranks hold contiguous chunks
        in rank order, so it is the number of prompts on lower ranks. Every rank raises the
        same error for a bad prompt on any rank, so none is left waiting in a collective."""
        report = (len(mine), self._length_problem(mine) if check_lengths else None)
        group = self.spec.world_group
        reports = [report]
        if group_size(group) > 1:
            reports = [None] * group_size(group)
            dist.all_gather_object(reports, report, group=group)
        problems = [problem for _, problem in reports if problem]
        if problems:
            raise ValueError(problems[0])
        me = dist.get_rank(group) if len(reports) > 1 else 0
        return sum(count for count, _ in reports[:me])

    def _replica_rows(self, mine: list[list[int]], first: int) -> tuple[list, int]:
        """(position, prompt) rows the whole replica samples (every TP rank of vLLM needs the
        same requests), and how many of them precede this rank's own."""
        rows = [(first + i, p) for i, p in enumerate(mine)]
        group = self.spec.replica_group
        if group_size(group) == 1:
            return rows, 0
        parts = [None] * group_size(group)
        dist.all_gather_object(parts, rows, group=group)
        me = dist.get_rank(group)
        return [r for part in parts for r in part], sum(len(p) for p in parts[:me])

    def _length_problem(self, prompts: list[list[int]]) -> str | None:
        room = self.spec.max_model_len - self.spec.config.max_response_tokens
        lengths = [len(p) for p in prompts]
        if lengths and (max(lengths) > room or min(lengths) == 0):
            return (f"prompts must hold 1 to {room} tokens (data.max_prompt_length), got "
                    f"lengths {min(lengths)}..{max(lengths)}; raise data.max_prompt_length or "
                    "filter the prompts")
        return None

    def _rollout_metrics(self, lengths: Tensor, seconds: float) -> dict[str, float]:
        totals = self._reduce([float(lengths.sum()), float(len(lengths))], dist.ReduceOp.SUM)
        seconds = self._reduce([seconds], dist.ReduceOp.MAX)[0]
        tokens, samples = totals
        return {"rollout/seconds": seconds, "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
                "rollout/response_length_mean": tokens / max(samples, 1.0),
                "rollout/samples": samples}

    def _sleep_metrics(self, slept: SleepReport | None) -> dict[str, float]:
        """What the sleep freed and what vLLM still holds, in GiB: the worst rank's (least
        freed, most kept), the figure to feed back as rollout.sleep_residual_gb. A rank whose
        engine did not sleep this call (None: no prompts reached its replica) adds nothing."""
        inf = float("inf")
        freed = self._reduce([inf if slept is None else slept.freed_bytes / 2**30],
                             dist.ReduceOp.MIN)[0]
        residual = self._reduce([-inf if slept is None else slept.residual_bytes / 2**30],
                                dist.ReduceOp.MAX)[0]
        if freed == inf:  # no rank slept
            return {}
        return {"rollout/sleep_freed_gb": freed, "rollout/sleep_residual_gb": residual}

    def _reduce(self, values: list[float], op) -> list[float]:
        group = self.spec.world_group
        if group_size(group) == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.spec.device)
        dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    # ---- weight sync -------------------------------------------------------------------------

    def sync(self, export: Callable[[], Buckets]) -> dict[str, float]:
        """Push `export()`'s HF-named full tensors (with LoRA, the adapter's factors only) into
        the engine if the policy changed since the last sync or the engine released its
        weights; collective over the group (every
        rank's flags are the same: the ranks of a replica sleep together). The seconds
        split into gathering TP shards, broadcasting pipeline stages and vLLM's reload (each
        the slowest rank's) when the exporter times itself (an `ExportStream`)."""
        if not self.stale:  # a sleep that released the weights marked it stale too
            return {"sync/bytes": 0.0, "sync/seconds": 0.0, "sync/gather_s": 0.0,
                    "sync/broadcast_s": 0.0, "sync/reload_s": 0.0, "sync/skipped": 1.0}
        sampler = self.ensure_sampler()
        start = time.perf_counter()
        moved = [0]
        buckets = export()
        receipts = {}
        if self.spec.lora is not None and self.spec.lora.enabled:
            sampler.load_adapter(_stream(buckets, moved))
        else:
            receipts = receipt_metrics(sampler.load_weights(_stream(buckets, moved)))
            # the fewest a rank tracked and had complete: a rank's shortfall shows
            receipts = dict(zip(receipts, self._reduce(list(receipts.values()),
                                                       dist.ReduceOp.MIN)))
        total = time.perf_counter() - start
        times = buckets.times if isinstance(buckets, ExportStream) else ExportTimes()
        reload = total - times.gather_s - times.broadcast_s
        seconds, gather, broadcast, reload = self._reduce(
            [total, times.gather_s, times.broadcast_s, reload], dist.ReduceOp.MAX)
        self.stale = False
        return {"sync/bytes": float(moved[0]), "sync/seconds": seconds, "sync/gather_s": gather,
                "sync/broadcast_s": broadcast, "sync/reload_s": reload, "sync/skipped": 0.0,
                "sync/gb_per_s": moved[0] / 1e9 / max(seconds, 1e-9), **receipts}


def _stream(buckets: Buckets, moved: list[int]) -> Iterator[tuple[str, Tensor]]:
    # One bucket alive at a time: the exporter gathers the next only when this one is used up.
    for bucket in buckets:
        for name, tensor in bucket:
            moved[0] += tensor.numel() * tensor.element_size()
            yield name, tensor


def _to_batch(completions: list[Completion], *, meta: dict) -> Batch:
    fields = {
        "response_ids": Ragged.from_list([c.token_ids for c in completions], dtype=torch.int64),
        "rollout_log_probs": Ragged.from_list([c.log_probs for c in completions],
                                              dtype=torch.float32),
    }
    if completions and completions[0].routes is not None:  # rollout.routing_replay=rollout
        fields[ROUTES] = Ragged.from_list([c.routes for c in completions], dtype=torch.int16)
    return Batch(meta=meta, fields=fields)
