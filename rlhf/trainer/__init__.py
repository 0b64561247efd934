"""Single-controller training loops (`rlhf train`, `rlhf sft`), their logging and checkpoints."""
