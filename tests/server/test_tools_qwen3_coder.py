"""The ``qwen3_coder`` tool-call format (Qwen3.5's and Qwen3-Coder's chat templates ask for it):
calls on the form the template prescribes, typed by the request's schemas, whole and streamed in
random pieces; malformed blocks stay text."""
import json
import random

from blitzllm.server.tools import FORMATS, TOOL_PARSERS, ToolCallSplitter, split_tool_calls
from tests.server.test_tools import MM_TOOLS, _streamed

QC = ("I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n"
      "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nline one\n"
      "line two\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_format():
    assert "qwen3_coder" in TOOL_PARSERS
    content, calls = split_tool_calls(QC, "qwen3_coder", MM_TOOLS)
    assert content == "I'll check both.\n\n"  # (the newline between the blocks stays content too)
    want = [("get_weather", {"city": "New York", "days": 3, "detailed": True, "hours": [9, 12]}),
            ("get_time", {"tz": "line one\nline two"})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    rng = random.Random(2)
    for _ in range(30):
        cut = sorted(rng.sample(range(len(QC) + 1), 8))
        joined, streamed = _streamed(ToolCallSplitter(FORMATS["qwen3_coder"], MM_TOOLS), QC, cut)
        assert joined == content
        assert [json.loads(c["function"]["arguments"]) for c in streamed] == [a for _, a in want]
    # no function inside, or an unclosed block: text as it was
    for bad in ("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<tool_call>\n<function=f>\n"):
        assert split_tool_calls(bad, "qwen3_coder", MM_TOOLS) == (bad, [])
    # a function without parameters
    _, calls = split_tool_calls("<tool_call>\n<function=ping>\n</function>\n</tool_call>", "qwen3_coder")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("ping", "{}")]
