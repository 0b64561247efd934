"""`rlhf profile CONFIG`: measure each role's cost model (rlhf.data.cost_model) on its layout.

Per role and phase (forward; forward + backward for trained roles, with the role's recompute),
a grid of packed micro-batch shapes (sequence lengths from 16 tokens to the role's budget,
one to many per micro-batch, and a few mixed ones) runs through the role's real engine and
schedule: one process at tp = pp = 1, else tp * pp gloo (NCCL on GPUs) ranks, each timing its
own compute (wall time less the time blocked on pipeline messages) and peak memory
(torch.cuda's peak on GPUs; on the CPU the profiler's allocation events). With pp > 1 the
cost of a message between stages is what a one-micro-batch pass takes beyond its stages'
compute (`_handoff_cost`; a ping-pong's wire time where none shows). Time and memory are fitted per
stage (non-negative least squares) and written, with the fingerprint of what was measured,
to trainer.cost_model_path (default output_dir/cost_model.json); a role whose fingerprint
still matches is not measured again.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.config import JobConfig
from rlhf.data.cost_model import (
    MEMORY_FEATURES,
    PHASES,
    TIME_FEATURES,
    CostModelFile,
    PhaseCost,
    RoleCost,
    Shape,
    StageCost,
    digest,
    fit_nonnegative,
    linear,
)
from rlhf.plan.inputs import RoleSpec, hardware, role_specs

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Say:
    """Progress lines to stdout or stderr, flushed; picklable, so a measuring rank says them."""

    stream: str = "stdout"

    def __call__(self, line: str) -> None:
        print(line, file=sys.stderr if self.stream == "stderr" else sys.stdout, flush=True)

GRID_LENGTHS = (16, 48, 128, 384, 1024, 3072, 8192)
P2P_FEATURES = ("const", "tokens")


def cost_model_path(cfg: JobConfig) -> Path:
    """Where the job's cost model lives: trainer.cost_model_path, else output_dir/cost_model.json."""
    return Path(cfg.trainer.cost_model_path or Path(cfg.trainer.output_dir) / "cost_model.json")


def machine() -> str:
    """This machine's compute device by name: the GPU's, else the CPU model's."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def threads(cfg: JobConfig) -> int | None:
    """torch threads of one rank on the CPU, as the workers run: trainer.cpus_per_rank, else
    the machine's cores over trainer.ranks_per_node; None on GPUs (torch's default)."""
    if hardware(cfg).device_type == "cuda":
        return None
    return cfg.trainer.cpus_per_rank or max(1, len(os.sched_getaffinity(0))
                                            // cfg.trainer.ranks_per_node)


def fingerprint(spec: RoleSpec, *, cpu_threads: int | None) -> dict:
    """What a role's cost model depends on: model, head, layout, dtype, recompute, token
    budget, machine, CPU threads and torch version. Another one means profiling again."""
    return {"model": dataclasses.asdict(spec.args), "head": spec.head,
            "parallel": dataclasses.asdict(spec.parallel), "dtype": str(spec.dtype),
            "recompute": spec.recompute if spec.trains else "none", "trains": spec.trains,
            "max_tokens": spec.tokens, "machine": machine(), "threads": cpu_threads,
            "torch": torch.__version__}


def job_fingerprints(cfg: JobConfig) -> dict[str, tuple[RoleSpec, dict]]:
    """role key -> (its RoleSpec, its fingerprint) for every role of the job that packs
    micro-batches (`rlhf.plan.inputs.role_specs`)."""
    cpu_threads = threads(cfg)
    return {s.name: (s, fingerprint(s, cpu_threads=cpu_threads))
            for s in role_specs(cfg, hardware(cfg))}


def load_cost_models(cfg: JobConfig) -> dict[str, RoleCost]:
    """Every role's cost model from the job's file, each checked against its fingerprint; a
    ValueError saying to run `rlhf profile` when one is missing or stale."""
    path = cost_model_path(cfg)
    file = CostModelFile.load(path)
    return {key: file.require(key, fp, path=path) for key, (_, fp) in job_fingerprints(cfg).items()}


def grid(max_tokens: int, *, seed: int = 0) -> list[list[int]]:
    """The profiled micro-batches, as their sequence lengths: for each grid length L up to the
    budget, one sequence, and L-long sequences filling half and all of the budget; then four
    of log-uniform mixed lengths."""
    shapes: list[list[int]] = []
    for length in sorted({n for n in GRID_LENGTHS if n < max_tokens} | {max_tokens}):
        for total in (length, max_tokens // 2, max_tokens):
            n = max(1, total // length)
            if [length] * n not in shapes:
                shapes.append([length] * n)
    gen = torch.Generator().manual_seed(seed)
    for fill in (max_tokens // 2, max_tokens, max_tokens // 2, max_tokens):
        lengths, used = [], 0
        while True:
            n = int(torch.exp(torch.empty(()).uniform_(2.5, float(torch.log(torch.tensor(
                float(max(16, max_tokens // 2))))), generator=gen)))
            if used + n > fill:
                break
            lengths.append(n)
            used += n
        shapes.append(lengths or [fill])
    return shapes


def profile(cfg: JobConfig, *, repeats: int = 3, force: bool = False, progress: Progress = Say(),
            roles: Sequence[str] | None = None) -> tuple[CostModelFile, Path]:
    """Measure (or reuse) every role's cost model (or those of `roles`; the file keeps the
    others') and write the job's file; (file, path). `progress` must pickle (ranks call it)."""
    path = cost_model_path(cfg)
    old = CostModelFile.load(path) if not force else CostModelFile()
    out = CostModelFile({k: v for k, v in old.roles.items() if roles is not None
                         and k not in roles})
    measured: dict[str, RoleCost] = {}  # by digest: roles on the same setup share one profile
    folders = ModelFolders(cfg)
    try:
        for key, (spec, fp) in job_fingerprints(cfg).items():
            if roles is not None and key not in roles:
                continue
            reuse = old.matching(key, fp) or measured.get(digest(fp))
            if reuse is not None:
                progress(f"profile: {key}: reusing the cost model measured on this setup")
                out.roles[key] = RoleCost(fp, reuse.phases, reuse.fit)
                continue
            start = time.perf_counter()
            role = measure_role(cfg, spec, fp, repeats=repeats, progress=progress, key=key,
                                folders=folders)
            measured[digest(fp)] = out.roles[key] = role
            errs = ", ".join(f"{ph} {role.fit[ph]['time_median_abs_rel_error']:.1%}"
                             for ph in role.phases)
            progress(f"profile: {key}: done in {time.perf_counter() - start:.0f}s; fit error "
                     f"(median, on the grid): {errs}")
    finally:
        folders.close()
    out.save(path)
    progress(f"profile: wrote {path}")
    return out, path


def measure_role(cfg: JobConfig, spec: RoleSpec, fp: dict, *, repeats: int, progress: Progress,
                 key: str, folders: ModelFolders) -> RoleCost:
    """Time the grid on the role's layout (its model from `folders`) and fit its cost model."""
    shapes = grid(spec.tokens, seed=cfg.trainer.seed)
    phases = PHASES if spec.trains else PHASES[:1]
    jobs = [(phase, [lengths]) for phase in phases for lengths in shapes]
    progress(f"profile: {key}: {len(jobs)} micro-batches x {repeats + 1} runs on tp="
             f"{spec.parallel.tp} cp={spec.parallel.cp} pp={spec.parallel.pp} "
             f"({spec.args.num_layers} layers, width "
             f"{spec.args.hidden_size}, {str(spec.dtype).removeprefix('torch.')})")
    folder = folders.of(spec)
    ranks = run_on_layout(spec, folder, jobs, repeats=repeats, memory=True,
                          threads=fp["threads"],
                          p2p_tokens=_p2p_sizes(spec.tokens), progress=progress, key=key)
    stage_ranks = _stage_ranks(spec)
    costs, fit = {}, {}
    for phase in phases:
        idx = [k for k, (ph, _) in enumerate(jobs) if ph == phase]
        shape_list = [Shape.of(jobs[k][1][0]) for k in idx]
        stages, errors, points = [], [], []
        for r in stage_ranks:
            seconds = [max(ranks[r]["compute"][k], 1e-7) for k in idx]
            peak = [max(ranks[r]["memory"][k], 1.0) for k in idx]
            points.append([[s.tokens, s.seqs, s.sum_sq, s.max_sq, t, b]
                           for s, t, b in zip(shape_list, seconds, peak)])
            time_coefs = fit_nonnegative(shape_list, seconds, TIME_FEATURES)
            stages.append(StageCost(time_coefs, fit_nonnegative(shape_list, peak, MEMORY_FEATURES)))
            errors += [abs(linear(time_coefs, s) / t - 1) for s, t in zip(shape_list, seconds)]
        fit[phase] = {"time_median_abs_rel_error": statistics.median(errors),
                      "time_max_abs_rel_error": max(errors),
                      # per stage: [tokens, seqs, sum_sq, max_sq, seconds, peak bytes]
                      "points": points}
        p2p = {}
        if spec.parallel.pp > 1:
            fit[phase]["pingpong"] = fit_nonnegative(
                [Shape(n, 1, 0, 0) for n, _ in ranks[0]["p2p"]],
                [max(s, 1e-7) for _, s in ranks[0]["p2p"]], P2P_FEATURES)
            p2p, fit[phase]["handoffs"] = _handoff_cost(
                ranks, stage_ranks, idx, shape_list, phase=phase,
                virtual_stages=spec.parallel.pp * spec.parallel.vpp)
        costs[phase] = PhaseCost(tuple(stages), p2p)
    return RoleCost(fp, costs, fit)


def _handoff_cost(ranks: list[dict], stage_ranks: list[int], idx: list[int],
                  shapes: list[Shape], *, phase: str, virtual_stages: int
                  ) -> tuple[dict[str, float], list[list[float]]]:
    """The seconds one stage-to-stage message costs inside the pipeline (const + per token),
    and its points [tokens, seconds]: a one-micro-batch pass runs its stages one after
    another, so its wall time less every stage's compute is its messages' cost. That is more
    than a ping-pong's wire time: the send and receive posting, the receiver's wake-up (long
    on a loaded machine). The ping-pong's fit where the passes show no such cost."""
    messages = (virtual_stages - 1) * (1 if phase == "forward" else 2)
    points = []
    for k, shape in zip(idx, shapes):
        wall = max(ranks[r]["wall"][k] for r in stage_ranks)
        residual = wall - sum(ranks[r]["compute"][k] for r in stage_ranks)
        if residual > 0:
            points.append([float(shape.tokens), residual / messages])
    if len(points) >= 2:
        return fit_nonnegative([Shape(int(n), 1, 0, 0) for n, _ in points],
                               [s for _, s in points], P2P_FEATURES), points
    sizes = ranks[0]["p2p"]
    return fit_nonnegative([Shape(n, 1, 0, 0) for n, _ in sizes],
                           [max(s, 1e-7) for _, s in sizes], P2P_FEATURES), points


def _p2p_sizes(max_tokens: int) -> list[int]:
    return sorted({max(1, max_tokens // 8), max(1, max_tokens // 2), max_tokens})


def _stage_ranks(spec: RoleSpec) -> list[int]:
    """The rank (of the tp * cp * pp measuring ranks) that reports each pipeline stage: tp and
    cp rank 0."""
    from rlhf.parallel.layout import Layout

    layout = Layout.over(spec.parallel.model_ranks, tp=spec.parallel.tp, pp=spec.parallel.pp,
                         cp=spec.parallel.cp)
    return [layout.rank_at(dp=0, pp=s, tp=0) for s in range(spec.parallel.pp)]


class ModelFolders:
    """The roles' HF folders; where absent, with model.tiny, one random tiny model built into a
    temporary folder for all of them (the weights' values do not change the timings)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self._tmp: tempfile.TemporaryDirectory | None = None

    def of(self, spec: RoleSpec) -> str:
        cfg = self.cfg
        path = {"critic": cfg.critic.model_path, "reward": cfg.reward.model_path}.get(spec.name)
        folder = Path(path or cfg.model.path)
        if (folder / "config.json").is_file():
            return str(folder)
        if path is not None or cfg.model.tiny is None:
            raise ValueError(f"{folder} holds no model (no config.json); profiling runs the "
                             "role's real model: point the config at it")
        if self._tmp is None:
            from rlhf.demo.tiny_model import make_tiny_model

            self._tmp = tempfile.TemporaryDirectory()
            make_tiny_model(cfg.model.tiny, Path(self._tmp.name) / "model")
        return str(Path(self._tmp.name) / "model")

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


# ---- measuring on the role's ranks --------------------------------------------------------------

Job = tuple[str, Sequence[Sequence[int]]]  # (phase, micro-batches as sequence lengths)


def run_on_layout(spec: RoleSpec, folder: str, jobs: Sequence[Job], *, repeats: int,
                  threads: int | None, memory: bool = False, p2p_tokens: Sequence[int] = (),
                  progress: Progress | None = None, key: str = "") -> list[dict]:
    """Run each job (a pass over its micro-batches) `repeats` + 1 times on one replica of the
    role's layout; per rank {"compute": median seconds computing, "wall": median wall seconds,
    "walls": each timed run's wall seconds,
    "memory": peak bytes (with `memory`), "p2p": [(tokens, one-way seconds)]} per job;
    `threads`: torch threads per rank (None: torch's default). At cp > 1 the cp ranks share
    each micro-batch, as in a step, so a pass's time is the whole pack's on its cp group."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    world = spec.parallel.model_ranks
    opts = {"path": folder, "head": spec.head, "parallel": spec.parallel,
            "dtype": spec.dtype, "recompute": spec.recompute, "trains": spec.trains,
            "repeats": repeats, "memory": memory, "p2p_tokens": list(p2p_tokens),
            "vocab": spec.args.vocab_size, "threads": threads}
    if world == 1:
        owner = not dist.is_initialized()
        if owner:
            from rlhf.parallel.launch import free_port

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
        before = torch.get_num_threads()
        try:
            return [_measure(0, 1, opts, list(jobs), progress, key)]
        finally:
            torch.set_num_threads(before)
            if owner:
                dist.destroy_process_group()
    from rlhf.parallel.launch import run_distributed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return run_distributed(_measure, world, opts, list(jobs), progress, key, timeout_s=3600.0,
                           backend=backend)


def _measure(rank: int, world: int, opts: dict, jobs: list[Job], progress: Progress | None,
             key: str) -> dict:
    from rlhf.config.schema import OptimizerConfig
    from rlhf.engine import TrainEngine, resolve_device
    from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache

    progress = progress if rank == 0 else None
    if opts["threads"] is not None:
        torch.set_num_threads(opts["threads"])
    parallel = opts["parallel"]
    mesh = ParallelMesh(list(range(world)), tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                        cache=ProcessGroupCache())
    device = resolve_device(None)
    engine = TrainEngine.from_pretrained(
        opts["path"], mesh=mesh, parallel=parallel, head=opts["head"], dtype=opts["dtype"],
        device=device, optim=OptimizerConfig() if opts["trains"] else None,
        recompute=opts["recompute"] if opts["trains"] else "none")
    out: dict = {"compute": [], "wall": [], "walls": [], "memory": [], "p2p": []}
    gen = torch.Generator().manual_seed(0)
    warmed: set[str] = set()
    for k, (phase, micro) in enumerate(jobs):
        mbs = [_micro_batch(lengths, opts["vocab"], gen) for lengths in micro]
        if phase not in warmed:  # allocator, kernels, gloo connections
            _pass(engine, mbs, phase, mesh)
            warmed.add(phase)
        walls, computes = [], []
        for _ in range(opts["repeats"] + 1):
            wall, wait = _pass(engine, mbs, phase, mesh)
            walls.append(wall)
            computes.append(wall - wait)
        out["wall"].append(statistics.median(walls[1:]))
        out["walls"].append(walls[1:])
        out["compute"].append(statistics.median(computes[1:]))
        out["memory"].append(_peak_bytes(engine, mbs, phase, mesh, device) if opts["memory"]
                             else 0)
        if progress is not None and (k + 1) % max(1, len(jobs) // 8) == 0:
            progress(f"profile: {key}: {k + 1}/{len(jobs)} ({phase})")
    if parallel.pp > 1 and opts["p2p_tokens"]:
        out["p2p"] = _p2p(mesh, engine, opts["p2p_tokens"], device)
    return out


def _micro_batch(lengths: Sequence[int], vocab: int, gen: torch.Generator):
    from rlhf.engine import MicroBatch, make_micro_batches

    prompts = [torch.randint(3, vocab, (max(1, n // 4),), generator=gen) for n in lengths]
    responses = [torch.randint(3, vocab, (max(1, n - max(1, n // 4)),), generator=gen)
                 for n in lengths]
    (mb,) = make_micro_batches(prompts, responses, max_tokens=sum(max(n, 2) for n in lengths))
    return MicroBatch(mb.packed, {"mask": mb.predicts_response_T.float()}, mb.sample_ids)


def _loss_fn(head: str):
    key = "log_probs" if head == "lm" else "values"

    def loss_fn(out, mb):
        mask_T = mb.tensors["mask"]
        return (out[key] * mask_T).sum() / max(1.0, float(mask_T.sum())), {}
    return loss_fn


def _pass(engine, mbs, phase: str, mesh) -> tuple[float, float]:
    """(wall seconds, seconds blocked on pipeline messages) of one pass over `mbs`."""
    sync = _sync_fn(engine.device)
    if dist.get_world_size() > 1:
        dist.barrier()  # every stage starts together, as in a step
    sync()
    start = time.perf_counter()
    if phase == "forward":
        engine.forward(mbs)
    else:
        engine.model.train()
        engine.schedule.forward_backward(mbs, _loss_fn(engine.head),
                                         outputs=_outputs(engine.head))
    sync()
    wall = time.perf_counter() - start
    if phase != "forward":
        engine.zero_grad()
    wait = getattr(engine.schedule, "last_wait_s", 0.0)
    return wall, min(wait, wall)


def _outputs(head: str) -> tuple[str, ...]:
    from rlhf.engine.engine import DEFAULT_OUTPUTS

    return DEFAULT_OUTPUTS[head]


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _peak_bytes(engine, mbs, phase: str, mesh, device: torch.device) -> float:
    """Peak bytes allocated during one pass above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _pass(engine, mbs, phase, mesh)
        return float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _pass(engine, mbs, phase, mesh)
    # Every allocation (+bytes) and free (-bytes) in time order: the running sum is the bytes
    # alive, its maximum the peak. (The raw events: parsing them into ops is much slower.)
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    events = results.events() if results is not None else []
    allocations = sorted((e.start_ns(), e.nbytes())  # pyright: ignore[reportAttributeAccessIssue]
                         for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return float(peak)


def _p2p(mesh, engine, sizes: Sequence[int], device: torch.device) -> list[tuple[int, float]]:
    """One-way seconds of an activation (tokens x hidden) from stage 0 to 1: half a ping-pong."""
    first = mesh.rank_at(dp=mesh.dp_rank, pp=0, tp=mesh.tp_rank, cp=mesh.cp_rank)
    second = mesh.rank_at(dp=mesh.dp_rank, pp=1, tp=mesh.tp_rank, cp=mesh.cp_rank)
    me = dist.get_rank()
    dtype = next(engine.model.parameters()).dtype
    out = []
    for tokens in sizes:
        x = torch.zeros(tokens, engine.model.args.hidden_size, dtype=dtype, device=device)
        trips = []
        for _ in range(6):
            start = time.perf_counter()
            if me == first:
                dist.send(x, second)
                dist.recv(x, second)
            elif me == second:
                dist.recv(x, first)
                dist.send(x, first)
            trips.append(time.perf_counter() - start)
        out.append((tokens, statistics.median(trips[1:]) / 2))
    return out
