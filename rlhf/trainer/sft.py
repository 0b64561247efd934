"""`rlhf sft`: supervised fine-tuning on prompt/answer rows or chat transcripts (rlhf.data.sft_rows)
with the SFTWorker role."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.config import JobConfig, sft_output_path
from rlhf.data.batch import Batch
from rlhf.data.batch_split import BatchSplit, split_role_batch
from rlhf.data.dataset import PromptLoader
from rlhf.data.fields import sample_lengths
from rlhf.data.packing import shared_prompt_lens
from rlhf.data.ragged import Ragged
from rlhf.data.sft_rows import build_sft_dataset
from rlhf.errors import RLHFError
from rlhf.files import atomic_folder
from rlhf.trainer.jobs import RoleGroups, ensure_model, load_tokenizer
from rlhf.trainer.metrics import MetricsLogger


def response_ids(texts: list, tokenizer) -> Ragged:
    """The answer tokens of each text followed by EOS: what the policy learns to emit (the
    response of a prompt/answer row, rlhf.data.sft_rows)."""
    if tokenizer.eos_token_id is None:
        raise RLHFError("the tokenizer has no eos token; SFT appends it to every answer")
    ids = tokenizer([str(t) for t in texts], add_special_tokens=False)["input_ids"]
    return Ragged.from_list([row + [tokenizer.eos_token_id] for row in ids], dtype=torch.int64)


def run_sft(cfg: JobConfig, *, job_name: str, progress: bool = True) -> list[dict]:
    """Fine-tune sft.init_path (or model.path) for sft.total_steps; write sft_output_path."""
    sft = cfg.sft
    if sft.total_steps == 0 or not sft.train_files:
        raise RLHFError("rlhf sft needs sft.train_files and sft.total_steps > 0; set them in "
                        "the config or as overrides (sft.total_steps=200)")
    out = sft_output_path(cfg)
    if (out / "config.json").exists():
        raise RLHFError(f"{out} already holds a model; delete it or set sft.output_path")
    init = ensure_model(sft.init_path or cfg.model.path, cfg.model.tiny)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or init)
    dataset = build_sft_dataset(sft, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                seed=cfg.data.seed)
    loader = PromptLoader(dataset, batch_size=sft.batch_size, shuffle=True, seed=cfg.data.seed)
    from workers.sft import SFTWorker

    groups = RoleGroups(cfg, {"sft": (SFTWorker, {"config": cfg, "init_path": str(init)})},
                        job_name=job_name, role_configs={"sft": sft})
    logger = MetricsLogger(Path(cfg.trainer.output_dir) / "sft", total_steps=sft.total_steps,
                           start_step=0, job_name=job_name, progress=progress)
    records = []
    try:
        view = groups.views["sft"]
        for step in range(1, sft.total_steps + 1):
            batch = next(loader)  # prompt_ids, response_ids and the loss mask
            metrics = view.train_step(batch, split=_ep_split(batch, sft, dp=view.layout.dp))
            if step % sft.log_every == 0 or step == sft.total_steps:
                records.append(logger.log(step, metrics))
        with atomic_folder(out) as tmp:
            view.export_hf(str(tmp), str(init))
    finally:
        logger.close()
        groups.shutdown()
    return records


def _ep_split(batch: Batch, sft, *, dp: int) -> BatchSplit | None:
    """At ep > 1 the driver splits the batch, as the PPO step does: only its split gives every
    rank of an ep group as many micro-batches (the experts' all-to-all needs every rank at
    each exchange). At ep = 1 each DP group splits its own chunk (None)."""
    if sft.parallel.ep == 1:
        return None
    return split_role_batch(sample_lengths(batch), sft, dp=dp, what="sft.batch_size",
                            shared=shared_prompt_lens(batch["prompt_ids"]))
