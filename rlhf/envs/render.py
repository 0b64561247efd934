"""Observation tokens of one turn, rendered through the chat template for that turn only.

Earlier turns are never re-tokenised: the model's tokens stay exactly as sampled, and only the
text the template writes between the end of the model's turn and the start of the next one is
encoded. That text is found by rendering a fixed two-turn conversation with and without the
observation and taking the difference (what the template writes after an assistant message's
content, minus the EOS the model already sampled, plus the observation's messages and the
next generation prompt).
"""

from __future__ import annotations

from rlhf.envs.base import Observation
from rlhf.errors import RLHFError

_ANCHOR = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\u2063a\u2063"}]


class TurnRenderer:
    """Turns an observation into the token ids appended after a model turn."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.base = tokenizer.apply_chat_template(_ANCHOR, tokenize=False)
        content = _ANCHOR[-1]["content"]
        # What the template writes after an assistant turn's content (its end-of-turn marker).
        self.closing = self.base[self.base.rindex(content) + len(content):]
        self.eos_text = tokenizer.eos_token or ""
        self.eos_id = tokenizer.eos_token_id

    def text(self, observation: Observation, *, model_ids: list[int]) -> str:
        """The template text of one observation after a model turn whose tokens are model_ids."""
        messages = ([{"role": "user", "content": observation}] if isinstance(observation, str)
                    else list(observation))
        full = self.tokenizer.apply_chat_template(_ANCHOR + messages, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self.base):
            raise RLHFError("the chat template renders the earlier turns differently once an "
                            "observation follows them, so a turn cannot be rendered on its own; "
                            f"rendered {full[:200]!r}, expected it to start with {self.base!r}")
        closing = self.closing
        if model_ids and model_ids[-1] == self.eos_id and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]  # the model sampled the end of its turn
        return closing + full[len(self.base):]

    def ids(self, observation: Observation, *, model_ids: list[int]) -> list[int]:
        """Token ids of `text(observation)`, encoded on their own (special tokens atomic)."""
        return self.tokenizer.encode(self.text(observation, model_ids=model_ids),
                                     add_special_tokens=False)
