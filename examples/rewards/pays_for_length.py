"""A reward hacked on purpose: it pays for length, whatever the answer says.

Train with it beside (or instead of) the task's own reward and the policy learns to ramble:
`rlhf report OUTPUT_DIR` shows the cause in its sample tables, where the best rewarded rows are
the longest responses, truncated at rollout.max_new_tokens, with a high reward/length_bonus and
a zero reward/exact_match (docs/guides/see-a-run.md).
"""

MAX_CHARS = 10  # the pay stops growing here (the quickstart answers in up to 8 tokens)


def length_bonus(*, prompt, response, ground_truth, extra):
    """1.0 for a response of MAX_CHARS characters or more, less for a shorter one."""
    return min(len(response), MAX_CHARS) / MAX_CHARS
