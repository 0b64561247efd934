"""Whole PPO/GRPO steps: our trainer against a single-process transformers baseline.

Runs `--warmup + --steps` steps of the real PPOTrainer (local Ray, the worker groups `rlhf
train` builds) and, after each of them, one step of a plain transformers GRPO loop
(rlhf.bench.step_baseline) on the same model, prompts, sizes and total threads, in the driver
process while our ranks wait. The two systems take turns step by step, so a change in the
machine's load during the run slows both alike. Prints JSON lines: one per system (generated
tokens/s, seconds per phase, CPU utilisation per phase: the ranks' CPU seconds over wall
seconds and the cores they hold, and MFU per phase against one core's matmul rate measured
between the steps: rlhf.bench.flops) and a summary with the ratio and the MFU our step would
need for twice the baseline's tokens/s.
Warm-up steps are excluded. Models: `tiny24m` (8 layers, width 512, 8 heads / 4 kv heads,
vocab 512, GRPO with a k3 KL loss, 16 prompts x 4 samples x 32 new tokens) or `quickstart`
(the quickstart's model and batch sizes, with the same GRPO k3 loss in both systems; with
`--quickstart-config configs/quickstart_moe.yaml` its MoE model and expert parallelism, and
our line adds all_to_all_s and all_to_all_share: a rank's seconds in the expert all-to-alls
and their share of the step).

With `--async`: synchronous, one-step-off and streaming steps, side by side. The runs use the
same job (model, prompts, sizes) on one training rank and one rollout rank of its own
(rollout.placement separate), one after the other on one local Ray cluster: first
trainer.async_mode off (sample, then train), then one_step (sample batch k+1 while batch k
trains), then streaming (segments of --segment-tokens, partial rollouts, finished groups
handed over as they complete), whose ranks are the first run's processes kept warm
(rlhf.controller.warm). Prints one JSON line per run (mean seconds per timed step and per
phase, trained tokens/s, each side's idle seconds per step, response lengths) and a summary:
the synchronous run's generate and train times, their sum and their max (the step time a
perfect overlap reaches), each async mode's step time and trained tokens/s against sync's.
`--long-tail RATE` makes response lengths long-tailed: the random model's responses end at
stop strings (rollout.stop) drawn from its vocabulary so that about RATE of its tokens end one,
nearly geometric lengths whose longest in a batch is several times the median.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import cast

from rlhf.config import TinyModelConfig

TINY24M = TinyModelConfig(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                          intermediate_size=1408, vocab_size=512, max_position_embeddings=512)
FEW_SHOT_MAX, FEW_SHOT_TOKENS = 32, 12  # --few-shot: examples per prompt; tokens budgeted for each
# The view methods that run on the ranks, and the trainer's timing/* phase each one is.
RANK_PHASES = {"sync_weights": "sync_weights", "generate": "generate",
               "compute_log_prob": "old_log_prob", "compute_ref_log_prob": "ref",
               "compute_values": "values", "update_critic": "update_critic",
               "update_actor": "update_actor"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("tiny24m", "quickstart"), default="tiny24m")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per system (default 10: one step of either system "
                             "can be slowed by the machine)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--prompts", type=int, help="prompts per step (default: per model)")
    parser.add_argument("--samples", type=int, help="samples per prompt (default: per model)")
    parser.add_argument("--new-tokens", type=int, help="max new tokens (default: per model)")
    parser.add_argument("--few-shot", type=int, default=0,
                        help="put K solved problems before every prompt: longer prompts, as RL "
                             "prompts with instructions or examples are (default 0)")
    parser.add_argument("--ranks", type=int, default=2, help="colocated ranks of our run")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                        help="cores both systems use (Ray's CPUs; the baseline's threads)")
    parser.add_argument("--layers", type=int, help="override the model's layer count (tests)")
    parser.add_argument("--hidden", type=int, help="override the model's width (tests)")
    parser.add_argument("--quickstart-config", default="configs/quickstart.yaml",
                        help="--model quickstart: the config it takes the model and micro-batch "
                             "budget from (default configs/quickstart.yaml)")
    parser.add_argument("--async", dest="run_async", action="store_true",
                        help="instead: synchronous vs one-step-off-policy vs streaming steps on "
                             "one training rank and one rollout rank")
    parser.add_argument("--segment-tokens", type=int, default=16,
                        help="--async: trainer.stream_segment_tokens of the streaming run "
                             "(default 16)")
    parser.add_argument("--long-tail", type=float, default=0.0,
                        help="long-tailed response lengths: the share of vocabulary tokens that "
                             "end a response (stop strings), e.g. 0.04; 0 = off (default)")


def run(args: argparse.Namespace) -> int:
    if args.run_async:
        return run_async(args)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("error: --steps must be at least 1 and --warmup at least 0")
    if not 0 <= args.few_shot <= FEW_SHOT_MAX:
        raise SystemExit(f"error: --few-shot must be between 0 and {FEW_SHOT_MAX}")
    if args.cores < args.ranks:
        raise SystemExit(f"error: --cores {args.cores} is fewer than --ranks {args.ranks}; "
                         "every rank needs a core")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _job_config(args, Path(tmp))
        ours, baseline = _run_both(cfg, warmup=args.warmup)
    lines = [{"system": "ours", **_summary(ours, args.steps)},
             {"system": "transformers", **_summary(baseline, args.steps)}]
    ratio = lines[0]["generated_tokens_per_s"] / max(lines[1]["generated_tokens_per_s"], 1e-9)
    lines.append({"summary": args.model, "ours_over_transformers": round(ratio, 3),
                  "timed_steps": args.steps, "warmup_steps": args.warmup,
                  "cores": ours["cores"], "few_shot": args.few_shot,
                  "matmul_gflops_per_core": round(ours["matmul_gflops_per_core"], 1),
                  # the same samples take the same model FLOPs in both (rlhf.bench.flops)
                  "mfu_needed_for_2x": round(2 * baseline["mfu"]["step"], 3)})
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0


def _summary(result: dict, steps: int) -> dict:
    step_s = result["seconds"]["step"]
    extra = {}
    if "all_to_all_s" in result:  # a rank's seconds in expert all-to-alls, and their share
        extra = {"all_to_all_s": round(result["all_to_all_s"], 4),
                 "all_to_all_share": round(result["all_to_all_s"] / step_s, 4)}
    return {"cores": result["cores"], **extra,
            "generated_tokens_per_s": round(result["generated_tokens"] / step_s, 2),
            "generated_tokens": result["generated_tokens"],
            "seconds_per_step": round(step_s / steps, 4),
            "seconds": {k: round(v, 4) for k, v in result["seconds"].items()},
            "cpu_util": {k: round(v, 3) for k, v in result["cpu_util"].items()},
            # three significant figures: a tiny model's phase under load must not print 0
            "mfu": {k: float(f"{v:.3g}") for k, v in result["mfu"].items()}}


# ---- our trainer --------------------------------------------------------------------------------


@contextmanager
def _local_ray(cfg):
    """cfg's local Ray cluster, started here unless one runs (then shut down after). Meanwhile
    this process's stdout goes to stderr: Ray prints there what the workers print (vLLM's
    notices), and the benchmark's stdout holds its JSON lines only."""
    import ray

    from rlhf.trainer.jobs import init_ray

    started = not ray.is_initialized()
    with redirect_stdout(sys.stderr):
        init_ray(cfg, env_address=None)
        try:
            yield
        finally:
            if started:
                ray.shutdown()


def fit_job(cfg, *, warmup: int, views: Callable | None = None,
            after_step: Callable[[int], None] | None = None) -> list[dict]:
    """Run cfg's PPOTrainer (the one `rlhf train` runs) under `_local_ray` and return the
    records of the steps after `warmup`. views(groups), if given, returns the worker views the
    trainer calls (to wrap them); after_step goes to `fit`."""
    from rlhf.trainer.jobs import RoleGroups, job_workers, load_tokenizer
    from rlhf.trainer.ppo import PPOTrainer

    with _local_ray(cfg):
        roles, role_configs = job_workers(cfg)
        groups = RoleGroups(cfg, roles, job_name=cfg.trainer.experiment_name,
                            role_configs=cast(dict, role_configs))
        try:
            trainer = PPOTrainer(cfg, groups.views if views is None else views(groups),
                                 tokenizer=load_tokenizer(cfg.model.path),
                                 job_name=cfg.trainer.experiment_name, progress=False)
            return trainer.fit(after_step)[warmup:]
        finally:
            groups.shutdown()


def _run_both(cfg, *, warmup: int) -> tuple[dict, dict]:
    """cfg.trainer.total_steps steps of our trainer, with the ranks' CPU use metered, and after
    each one a step of the baseline on the same prompts, with as many threads as our ranks
    hold cores. Returns both systems' totals over the steps after `warmup`."""
    from rlhf.bench.flops import MatmulRate, forward_flops_per_token, step_mfu
    from rlhf.bench.step_baseline import BaselineTrainer, summarise
    from rlhf.models.config import ModelArgs

    prompts, answers = _step_prompts(cfg)
    built, baseline_steps = {}, []  # made once the ranks exist
    rate = MatmulRate()  # measured after each step, while the ranks wait

    def views(groups):
        built["cores"] = sum(int(g.pool.bundle["CPU"]) * g.pool.world_size
                               for g in groups.groups)
        built["meter"] = RankCpuMeter(_rank_pids(), cores=built["cores"], skip_steps=warmup)
        built["baseline"] = BaselineTrainer(
            model_path=cfg.model.path, samples=cfg.rollout.n,
            new_tokens=cfg.rollout.max_new_tokens, kl_coef=cfg.algorithm.kl_loss_coef,
            lr=cfg.actor.optim.lr, threads=built["cores"])
        return {name: MeteredView(view, built["meter"]) for name, view in groups.views.items()}

    def after_step(step: int) -> None:  # fit's steps count from 1
        result = built["baseline"].step(prompts[step - 1], answers[step - 1])
        if step > warmup:
            baseline_steps.append(result)
        rate.measure()

    records = fit_job(cfg, warmup=warmup, views=views, after_step=after_step)
    cores, meter = built["cores"], built["meter"]
    samples = cfg.data.train_batch_size * cfg.rollout.n
    seconds = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("timing/"):
                seconds[key.removeprefix("timing/")] = seconds.get(key.removeprefix("timing/"),
                                                                   0.0) + value
    generated = sum(round(r["response_length/mean"] * samples) for r in records)
    ours = {"cores": cores, "generated_tokens": generated, "seconds": seconds,
            "cpu_util": meter.utilisation()}
    if any("actor/all_to_all_s" in r for r in records):  # expert parallelism (an MoE actor)
        ours["all_to_all_s"] = sum(r["actor/all_to_all_s"] for r in records)
    baseline = {"cores": cores, **summarise(baseline_steps, cores)}
    # MFU: both systems' forward tokens are the timed steps' prompts once plus their responses
    # (attention over the mean sample length, prompt plus response)
    timed = [p for step in prompts[warmup:warmup + len(records)] for p in step]
    prompt_tokens = sum(len(p) for p in timed)
    model_args = ModelArgs.from_pretrained(cfg.model.path)
    for result in (ours, baseline):
        responses = result["generated_tokens"]
        mean_len = (prompt_tokens + responses / cfg.rollout.n) / len(timed)
        result["mfu"] = step_mfu(
            flops_per_token=forward_flops_per_token(model_args, seq_len=mean_len),
            tokens=prompt_tokens + responses, seconds=result["seconds"], cores=cores,
            gflops_per_core=rate.best)
    ours["matmul_gflops_per_core"] = rate.best
    return ours, baseline


class RankCpuMeter:
    """`with meter("generate"):` adds the ranks' CPU seconds and the wall seconds of the call.

    Steps are counted by their sync_weights call (each step makes exactly one, first); the
    first `skip_steps` steps are not recorded.
    """

    def __init__(self, pids: list[int], *, cores: int, skip_steps: int):
        import psutil

        self.procs = [psutil.Process(pid) for pid in pids]
        self.cores, self.skip_steps, self.steps = cores, skip_steps, 0
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def _cpu_seconds(self) -> float:
        total = 0.0
        for proc in self.procs:
            times = proc.cpu_times()
            total += times.user + times.system
        return total

    @contextmanager
    def __call__(self, phase: str):
        if phase == "sync_weights":
            self.steps += 1
        cpu0, wall0 = self._cpu_seconds(), time.perf_counter()
        try:
            yield
        finally:
            if self.steps > self.skip_steps:
                self.cpu[phase] = self.cpu.get(phase, 0.0) + self._cpu_seconds() - cpu0
                self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - wall0

    def utilisation(self) -> dict[str, float]:
        """CPU seconds over (wall seconds x cores) per phase: 1.0 is every core busy."""
        return {k: self.cpu[k] / (self.wall[k] * self.cores) for k in self.wall if self.wall[k]}


class MeteredView:
    """A role view whose rank-side calls (RANK_PHASES) run under a RankCpuMeter."""

    def __init__(self, view, meter: RankCpuMeter):
        self._view, self._meter = view, meter

    def __getattr__(self, name: str):
        attr = getattr(self._view, name)
        phase = RANK_PHASES.get(name)
        if phase is None or not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._meter(phase):
                return attr(*args, **kwargs)
        return call


def _rank_pids() -> list[int]:
    """The Ray worker processes of this driver's local cluster that host our ranks."""
    import psutil

    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "ColocatedWorker" in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    if not pids:
        raise RuntimeError("found no ColocatedWorker process under this driver; rlhf bench "
                           "step measures ranks of the local Ray cluster it starts itself")
    return pids


# ---- the baseline -------------------------------------------------------------------------------


def _step_prompts(cfg) -> tuple[list[list[list[int]]], list[list]]:
    """Per step, the prompt ids and answers our trainer's loader gives it (in order, unshuffled)."""
    from rlhf.data.dataset import PromptDataset, build_prompt_dataset
    from rlhf.trainer.jobs import load_tokenizer

    data = build_prompt_dataset(cfg.data.train_files, load_tokenizer(cfg.model.path), cfg.data)
    assert isinstance(data, PromptDataset)  # the JSONL file _job_config wrote
    size, steps = cfg.data.train_batch_size, cfg.trainer.total_steps
    ids = [row.tolist() for row in data.prompt_ids.to_list()]
    prompts = [ids[i * size:(i + 1) * size] for i in range(steps)]
    answers = [data.ground_truth[i * size:(i + 1) * size] for i in range(steps)]
    return prompts, answers


# ---- the job ------------------------------------------------------------------------------------


def _job_config(args, root: Path):
    from rlhf.config import config_from_dict, load_config
    from rlhf.demo.arithmetic_data import ArithTask, write_arith_dataset
    from rlhf.demo.tiny_model import make_tiny_model

    total = args.warmup + args.steps
    if args.model == "quickstart":
        if not Path(args.quickstart_config).is_file():
            raise SystemExit(f"error: --model quickstart reads the quickstart's config, and "
                             f"{args.quickstart_config} does not exist; run from the repository "
                             "root or pass --quickstart-config PATH")
        base = load_config(args.quickstart_config, [])
        spec, prompts, samples, new_tokens = base.model.tiny, 32, 8, 16
        if spec is None:
            raise SystemExit(f"error: --model quickstart builds the model {args.quickstart_config}"
                             " describes in model.tiny, and it has none; pass a config with "
                             "model.tiny")
        budget = base.actor.max_tokens_per_micro_batch
        ep = base.actor.parallel.ep  # an MoE quickstart's expert parallelism
    else:
        spec, prompts, samples, new_tokens, budget, ep = TINY24M, 16, 4, 32, 4096, 1
    prompts, samples = args.prompts or prompts, args.samples or samples
    new_tokens = args.new_tokens or new_tokens
    shape = {k: v for k, v in (("num_layers", args.layers), ("hidden_size", args.hidden)) if v}
    if shape:
        heads = (args.hidden or spec.hidden_size) // spec.head_dim
        shape.update(num_heads=heads, num_kv_heads=max(1, heads // 2))
    spec = TinyModelConfig(**{**spec.__dict__, **shape})
    model = make_tiny_model(spec, root / f"{args.model}-model")
    if not 0 <= args.long_tail < 1:
        raise SystemExit(f"error: --long-tail must be in [0, 1), got {args.long_tail}")
    train = root / "train.jsonl"
    write_arith_dataset(train, task=ArithTask(), n=prompts * total, seed=0, split="train")
    if args.few_shot:
        _prepend_examples(train, args.few_shot)
    tree = {
        "model": {"path": str(model)},
        "actor": {"ppo_mini_batch_size": prompts, "max_tokens_per_micro_batch": budget,
                  "optim": {"lr": 1.0e-6}, "parallel": {"ep": ep}},
        "ref": {"max_tokens_per_micro_batch": budget},
        "reward": {"functions": [{"path": "rlhf.rewards.arith:exact_match"}], "num_workers": 0},
        "rollout": {"n": samples, "max_new_tokens": new_tokens, "temperature": 1.0,
                    "cpu_kv_cache_gb": 0.25, "max_num_seqs": prompts * samples,
                    "stop": long_tail_stops(model, args.long_tail)},
        "algorithm": {"adv_estimator": "grpo", "kl_in_reward": False, "use_kl_loss": True,
                      "kl_loss_type": "k3", "kl_loss_coef": 0.01, "ppo_epochs": 1},
        "data": {"train_files": [str(train)],
                 "max_prompt_length": 64 + FEW_SHOT_TOKENS * args.few_shot,
                 "train_batch_size": prompts, "shuffle": False},
        "trainer": {"output_dir": str(root / "run"), "total_steps": total, "val_every": 0,
                    "save_every": 0, "device": "cpu", "ranks_per_node": args.ranks,
                    "ray_metrics": False, "experiment_name": f"bench-step-{os.getpid()}"},
        "ray": {"num_cpus": args.cores},
    }
    return config_from_dict(tree)


def long_tail_stops(model: Path, rate: float) -> list[str]:
    """Stop strings that end a response at about `rate` of a random model's tokens: the text
    of that share of its vocabulary, tokens of 3 or more letters (no shorter text, so a stop
    string is rarely written across two tokens). [] when rate is 0."""
    if rate == 0:
        return []
    from rlhf.trainer.jobs import load_tokenizer

    tokenizer = load_tokenizer(model)
    words = sorted({text for i in range(len(tokenizer))
                    if (text := tokenizer.decode([i]).strip()).isalpha() and len(text) >= 3})
    want = max(1, round(rate * len(tokenizer)))
    if len(words) < want:
        raise SystemExit(f"error: --long-tail {rate} needs {want} word tokens, the model's "
                         f"vocabulary has {len(words)}; lower --long-tail")
    return words[::len(words) // want][:want]


def _prepend_examples(path: Path, k: int) -> None:
    """Rewrite the prompts of a JSONL file with k solved problems (other rows') before each."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    solved = [f"{row['prompt']}{row['ground_truth']}" for row in rows]
    for i, row in enumerate(rows):
        examples = [solved[(i + 1 + j) % len(rows)] for j in range(k)]
        row["prompt"] = " ".join([*examples, row["prompt"]])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---- --async: synchronous against one-step-off and streaming steps --------------------------

ASYNC_PHASES = ("step", "generate", "sync_weights", "wait_rollout", "update_actor", "ref", "reward")


ASYNC_MODES = ("off", "one_step", "streaming")


def run_async(args: argparse.Namespace) -> int:
    """Synchronous against one-step-off-policy and streaming steps (`--async`)."""
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("error: --steps must be at least 1 and --warmup at least 0")
    if args.segment_tokens < 1:
        raise SystemExit("error: --segment-tokens must be at least 1")
    if args.cores < 2:
        raise SystemExit("error: --async needs --cores of at least 2 (a training rank and a "
                         "rollout rank)")
    from rlhf.controller.warm import keep_ranks_warm

    args = argparse.Namespace(**{**vars(args), "ranks": 1})
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        base = _job_config(args, Path(tmp))
        # One cluster for both runs (their Ray settings are the same); the second run's ranks
        # are the first one's processes (rlhf.controller.warm), with torch and vLLM imported.
        with _local_ray(base), keep_ranks_warm():
            for mode in ASYNC_MODES:
                cfg = _separate(base, mode, Path(tmp) / mode,
                                segment_tokens=args.segment_tokens)
                lines.append({"system": f"async_mode={mode}",
                              **_run_async_mode(cfg, warmup=args.warmup)})
    sync, overlap, streaming = lines
    generate = sync["seconds"]["generate"]
    train = sync["seconds"]["step"] - generate - sync["seconds"]["sync_weights"]
    lines.append({
        "summary": args.model, "sync_s_per_step": sync["seconds"]["step"],
        "one_step_s_per_step": overlap["seconds"]["step"],
        "streaming_s_per_step": streaming["seconds"]["step"],
        "speedup": round(sync["seconds"]["step"] / overlap["seconds"]["step"], 3),
        "streaming_speedup": round(sync["seconds"]["step"] / streaming["seconds"]["step"], 3),
        # trained tokens/s over sync's: the issue's yardstick (steps may train unlike sizes)
        "one_step_tokens_ratio": _ratio(overlap, sync), "streaming_tokens_ratio":
            _ratio(streaming, sync),
        "generate_s": round(generate, 4), "train_s": round(train, 4),
        "sum_generate_train_s": round(generate + train, 4),
        "max_generate_train_s": round(max(generate, train), 4),
        "timed_steps": args.steps, "warmup_steps": args.warmup, "cores": args.cores,
        "segment_tokens": args.segment_tokens, "long_tail": args.long_tail,
        "load_avg_1m": round(os.getloadavg()[0], 2)})
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0


def _ratio(line: dict, sync: dict) -> float:
    return round(line["trained_tokens_per_s"] / max(sync["trained_tokens_per_s"], 1e-9), 3)


def _separate(cfg, mode: str, out: Path, *, segment_tokens: int = 16):
    """`cfg` on one training rank and one rollout rank, with trainer.async_mode `mode`."""
    from rlhf.config import config_from_dict, config_to_dict

    tree = config_to_dict(cfg)
    tree["rollout"].update(placement="separate", world_size=1)
    tree["trainer"].update(async_mode=mode, ranks_per_node=1, output_dir=str(out),
                           experiment_name=f"{cfg.trainer.experiment_name}-{mode}")
    if mode == "streaming":
        tree["trainer"].update(stream_segment_tokens=segment_tokens)
    return config_from_dict(tree)


def _run_async_mode(cfg, *, warmup: int) -> dict:
    """The job's PPOTrainer steps; mean seconds per timed step of each phase."""
    records = fit_job(cfg, warmup=warmup)

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in records) / len(records), 4)

    seconds = {p: mean(f"timing/{p}") for p in ASYNC_PHASES}
    step_s = sum(r["timing/step"] for r in records)
    out = {"seconds": seconds,
           "rollout_seconds": mean("rollout/seconds"), "sync_gb_per_s": mean("sync/gb_per_s"),
           "trained_tokens_per_s": round(sum(r["tokens/total"] for r in records)
                                         / max(step_s, 1e-9), 2),
           "response_length_mean": mean("response_length/mean"),
           "response_length_max": max(r["response_length/max"] for r in records)}
    if cfg.trainer.async_mode == "off":  # each side waits while the other works
        out.update(actor_wait_s=round(seconds["generate"] + seconds["sync_weights"], 4),
                   rollout_idle_s=round(seconds["step"] - seconds["generate"]
                                        - seconds["sync_weights"], 4))
    else:
        out.update(actor_wait_s=mean("timing/wait_rollout"),
                   rollout_idle_s=mean("async/rollout_idle_s"))
    if cfg.trainer.async_mode == "one_step":
        out.update(staleness_mean=mean("async/staleness_mean"))
    if cfg.trainer.async_mode == "streaming":
        out.update(token_staleness_p100=mean("async/token_staleness_p100"),
                   interrupted_samples=mean("async/interrupted_samples"))
    return out
