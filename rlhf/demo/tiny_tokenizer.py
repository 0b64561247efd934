"""A small byte-level BPE tokenizer trained on generated text, for the project's tiny models.

Byte-level BPE encodes any unicode text and decodes it back exactly; digits are split one
per token so arithmetic is learnable. Chat turns look like

    <|bos|><|system|>\\nBe brief.<|eos|><|user|>\\n12+7=<|eos|><|assistant|>\\n19<|eos|>

Every turn ends with the eos token, so a model's generated assistant turn stops at eos. Tool
calls and results follow the <tool_call>/<tool_response> convention (see CHAT_TEMPLATE).
No token is added automatically when encoding plain text (the template writes bos).
"""

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhf.demo.arithmetic_data import ArithTask, generate_problems, sample_text
from rlhf.errors import ConfigError

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

# A "tool" message (a tool's result, rlhf/envs/tools.py) is a user turn holding
# <tool_response>RESULT</tool_response>; the model calls tools by writing
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> in its own turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role ' ~ message['role'] ~ "
    "'; use system, user, assistant or tool') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|user|>\\n<tool_response>' ~ message['content'] ~ '</tool_response>' ~ eos_token -}}"
    "{%- else -%}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ message['content'] ~ eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Words for English-like filler text, so common words and spaces get merges of their own.
_WORDS = {
    "det": ["the", "a", "this", "that", "every", "one", "some", "no"],
    "noun": ["model", "answer", "number", "question", "student", "teacher", "sum", "result",
             "word", "reward", "policy", "step", "cat", "river", "city", "book", "problem",
             "value", "token", "day", "friend", "table", "list", "test", "game", "light"],
    "verb": ["finds", "checks", "writes", "reads", "adds", "takes", "gives", "sees", "makes",
             "learns", "counts", "keeps", "solves", "returns", "knows", "needs", "likes"],
    "adj": ["small", "large", "correct", "wrong", "quick", "slow", "new", "old", "simple",
            "good", "short", "long", "happy", "bright", "exact", "next", "first", "last"],
    "adv": ["quickly", "slowly", "again", "today", "always", "often", "carefully", "now"],
    "prep": ["with", "from", "in", "on", "for", "after", "before", "under", "near", "about"],
}
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer with just the number.",
                   "Be brief.", "Solve the problem.")
# Problem mixes for training text: the default task plus wider ones, so the merges of "+",
# "-", "*" and "=" do not depend on the dataset a user later draws.
_TEXT_TASKS = (ArithTask(), ArithTask(ops="+-*", max_value=100, terms=3),
               ArithTask(ops="+-*", max_value=9, terms=4))


def _sentence(rng: random.Random) -> str:
    def pick(kind):
        return rng.choice(_WORDS[kind])

    words = [pick("det"), pick("adj"), pick("noun"), pick("verb"), pick("det"), pick("noun")]
    if rng.random() < 0.5:
        words += [pick("prep"), pick("det"), pick("noun")]
    if rng.random() < 0.3:
        words.append(pick("adv"))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 999)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".!?")


def _training_text(seed: int, *, n: int = 3000) -> list[str]:
    """Arithmetic prompts and answers, chat-turn bodies and English-like sentences."""
    rng = random.Random(seed)
    texts = []
    for i, task in enumerate(_TEXT_TASKS):
        texts += sample_text(task, n=n, seed=seed * 31 + i)
    # Chat turns as the template lays them out; the markers themselves are atomic tokens,
    # so only the text between them is trained on.
    for problem in generate_problems(ArithTask(), n=n // 3, seed=seed * 31 + 7):
        texts += ["\n" + problem["prompt"], "\n" + problem["ground_truth"],
                  "\n" + rng.choice(_SYSTEM_PROMPTS)]
    texts += [_sentence(rng) for _ in range(n)]
    texts += ["\n".join(_sentence(rng) for _ in range(3)) for _ in range(n // 10)]
    return texts


def train_tiny_tokenizer(*, vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of at most vocab_size tokens; the same arguments give the same one."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ConfigError(f"vocab_size must be at least {smallest}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # Digits are split before the byte-level step so no merge ever joins two digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(_training_text(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS), chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)
