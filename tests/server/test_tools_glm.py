"""The ``glm45`` and ``glm47`` tool-call formats (GLM-4.5 / 4.6 and GLM-4.7 / GLM-5, whose
``GlmMoeDsaForCausalLM`` the engine runs) and the ``glm45`` reasoning parser: calls as the
models' chat templates write them (rendered here by templates written in the format of the
published zai-org ones: the name after ``<tool_call>``, then ``<arg_key>`` / ``<arg_value>``
pairs, a non-string value as JSON; GLM-4.5 puts newlines between the parts, GLM-4.7 none),
parsed back to the same calls, typed by the request's schemas, whole and streamed in random
pieces; malformed blocks stay text."""
import json
import random

import jinja2
import pytest

from blitzllm.server.reasoning import PARSERS, make_splitter, split_reasoning
from blitzllm.server.tools import FORMATS, TOOL_PARSERS, ToolCallSplitter, split_tool_calls
from tests.server.test_tools import MM_TOOLS, _streamed

GLM45 = (r"{%- for tc in tool_calls %}{{ '\n<tool_call>' + tc.name }}"
         r"{% for k, v in tc.arguments.items() %}{{ '\n<arg_key>' + k + '</arg_key>\n<arg_value>' }}"
         r"{{ v if v is string else v | tojson }}{{ '</arg_value>' }}{% endfor %}{{ '\n</tool_call>' }}{% endfor %}")
GLM47 = (r"{%- for tc in tool_calls %}{{ '<tool_call>' + tc.name }}"
         r"{% for k, v in tc.arguments.items() %}{{ '<arg_key>' + k + '</arg_key><arg_value>' }}"
         r"{{ v if v is string else v | tojson }}{{ '</arg_value>' }}{% endfor %}{{ '</tool_call>' }}{% endfor %}")
CALLS = [("get_weather", {"city": "New York", "days": 3, "detailed": True, "hours": [9, 12]}),
         ("get_time", {"tz": "line one\nline two"})]


@pytest.mark.parametrize("parser, template", [("glm45", GLM45), ("glm47", GLM47)])
def test_glm_formats(parser, template):
    assert parser in TOOL_PARSERS
    blocks = jinja2.Environment().from_string(template).render(
        tool_calls=[{"name": n, "arguments": a} for n, a in CALLS])
    text = "Checking both." + blocks
    content, calls = split_tool_calls(text, parser, MM_TOOLS)
    assert content == "Checking both." + ("\n\n" if parser == "glm45" else "")   # (text between blocks stays)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    rng = random.Random(3)
    for _ in range(30):
        cut = sorted(rng.sample(range(len(text) + 1), 8))
        joined, streamed = _streamed(ToolCallSplitter(FORMATS[parser], MM_TOOLS), text, cut)
        assert joined == content and [json.loads(c["function"]["arguments"]) for c in streamed] == [a for _, a in CALLS]
    # a string-typed value stays a string, and so does a value of a tool the request does not list
    _, calls = split_tool_calls("<tool_call>get_time<arg_key>tz</arg_key><arg_value>42</arg_value></tool_call>",
                                parser, MM_TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "42"}
    _, calls = split_tool_calls("<tool_call>other<arg_key>n</arg_key><arg_value>42</arg_value></tool_call>",
                                parser, MM_TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": "42"}   # (no schema: a string, as vLLM)
    # a call without arguments; a hermes JSON block and an unclosed one stay text
    _, calls = split_tool_calls("<tool_call>get_time</tool_call>", parser, MM_TOOLS)
    assert calls[0]["function"]["name"] == "get_time" and json.loads(calls[0]["function"]["arguments"]) == {}
    for bad in ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_call>get_time<arg_key>tz"):
        assert split_tool_calls(bad, parser, MM_TOOLS) == (bad, [])


def test_glm45_reasoning():
    """GLM's thinking: a <think> block the output opens is reasoning, and so is the text after a
    <think> the prompt opened (thinking on); without one the answer is content (the template
    closes an empty block when thinking is off)."""
    assert "glm45" in PARSERS
    for prompt, out, want in (("<|assistant|>", "<think>plan</think>answer", ("plan", "answer")),
                              ("<|assistant|><think>", "plan</think>answer", ("plan", "answer")),
                              ("<|assistant|><think></think>", "answer", (None, "answer"))):
        assert split_reasoning(make_splitter("glm45", prompt), out) == want
