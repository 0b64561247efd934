"""A reward with a spread on any response: the share of its characters that are digits.

The long-context example (configs/long_context.yaml) trains an untrained tiny model on responses
held to full length; a task reward would be zero for every sample and leave GRPO without an
advantage. This one differs between samples of a group from the first step, so every step
has a real policy gradient over the long sequences.
"""


def digit_share(*, prompt, response, ground_truth, extra):
    """Digits over characters of the response (0.0 for an empty one)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
