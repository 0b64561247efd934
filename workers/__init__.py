"""Worker roles that live in Ray actors, one module per role (actor, critic, reference,
reward_model, rollout, sft), and what they share: `base` (the role base and how a role builds
its engine), `micro_batches` (executing the driver's batch split), `updates` (the PPO update loop),
`checkpoint` (checkpoints and Hugging Face export). The Batch fields they exchange with the
driver are listed in rlhf/data/fields.py."""
