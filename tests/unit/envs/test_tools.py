"""The tool-call format, its parser, ToolEnv's handling of good and malformed calls, the
calculator, and the tiny chat template's tool turns."""

import pytest

from rlhf.demo.tiny_tokenizer import train_tiny_tokenizer
from rlhf.envs import ToolEnv, parse_tool_calls
from rlhf.envs.tools import CalculatorEnv, calculator, describe_tool


def call(expr: str) -> str:
    return ('<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr
            + '"}}</tool_call>')


def test_parser_reads_calls_in_order_and_names_what_is_malformed():
    text = ("let me compute " + call("12*34") + " and " + call("1+1")
            + '<tool_call>{"name": 3}</tool_call><tool_call>{nope}</tool_call>'
            + '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "y"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "12*34"}, True), ("calculator", {"expression": "1+1"}, True)]
    assert "name" in calls[2].error
    assert "not valid JSON" in calls[3].error
    assert "arguments must be a JSON object" in calls[4].error
    assert "unterminated" in calls[5].error
    assert parse_tool_calls("the answer is 408") == []


def test_calculator_is_exact_and_refuses_anything_but_integer_arithmetic():
    assert calculator("123456789*987654321") == str(123456789 * 987654321)
    assert calculator("(7-10)*3 // 2 % 5") == str((7 - 10) * 3 // 2 % 5)
    for bad in ("__import__('os')", "2**8", "1.5+1", "x+1"):
        with pytest.raises(ValueError):
            calculator(bad)
    assert describe_tool(calculator).startswith("calculator(expression: str) -> str: Evaluate")


def test_tool_env_turns_calls_into_tool_messages_and_counts_errors():
    env = CalculatorEnv()
    env.reset(prompt="12*34=", ground_truth=408, extra={})
    result = env.step(text=call("12*34") + call("1/0") + '<tool_call>{"name": "search"}'
                      '</tool_call><tool_call>{"name": "calculator", "arguments": {"x": 1}}'
                      '</tool_call>', token_ids=[1, 2])
    assert not result.done and result.reward == 0.0
    contents = [m["content"] for m in result.observation]
    assert contents[0] == "408"
    assert all(c.startswith("error: ") for c in contents[1:])
    assert "unknown tool 'search'" in contents[2] and "bad arguments" in contents[3]
    assert {m["role"] for m in result.observation} == {"tool"}
    assert result.metrics == {"tool_calls": 4.0, "tool_errors": 3.0}
    final = env.step(text="the answer is 408", token_ids=[3])
    assert final.done and final.reward == 1.0 and final.metrics["tool_calls"] == 0.0
    assert env.step(text="the answer is 407", token_ids=[3]).reward == 0.0


def test_a_tool_that_raises_is_an_observation_not_a_crash():
    def broken(x: int) -> str:
        """Always fails."""
        raise RuntimeError("backend down")

    class Broken(ToolEnv):
        tools = (broken,)

    result = Broken().step(text='<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>',
                           token_ids=[])
    assert result.observation == [{"role": "tool",
                                   "content": "error: broken raised RuntimeError: backend down"}]


def test_tiny_template_renders_tool_results_as_tool_response_turns():
    tok = train_tiny_tokenizer(vocab_size=384, seed=0)
    text = tok.apply_chat_template([{"role": "user", "content": "12*34="},
                                    {"role": "assistant", "content": call("12*34")},
                                    {"role": "tool", "content": "408"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith(call("12*34") + "<|eos|><|user|>\n<tool_response>408</tool_response>"
                         "<|eos|><|assistant|>\n")
