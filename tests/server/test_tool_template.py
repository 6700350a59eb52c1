"""Issue 36, finding 5: tools sent with tool_choice "auto" to a model whose chat template never
renders them are a 400 naming ``tools`` (the model could not see them); a template that renders
them, and forced choices (decoded by a grammar either way), are fine."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import check_error

from blitzllm.server.chat_template import prompt_end
from blitzllm.server.errors import APIError
from blitzllm.server.protocol import ChatMessage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
END = prompt_end(True, False)   # an opened assistant turn, the default


def test_auto_tools_with_a_template_that_ignores_them_is_a_400(tiny_server):
    """tiny_server runs --enable-auto-tool-choice --tool-call-parser hermes with SmolLM2's chat
    template, which has no tools in it."""
    url, h = tiny_server.url, tiny_server.headers()
    for choice in (None, "auto"):
        body = {"model": "tiny", "messages": MSG, "tools": TOOLS, "max_tokens": 2, **({"tool_choice": choice} if choice else {})}
        err = check_error(httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=60), 400, "tools")
        assert "chat template" in err["message"] and "tool_choice" in err["message"], err
    for choice in ("none", "required"):   # no tools in the prompt; a forced call (a grammar)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "tools": TOOLS,
                                                           "tool_choice": choice, "max_tokens": 2}, headers=h, timeout=60)
        assert r.status_code == 200, (choice, r.text)


def _serving(template: str):
    from types import SimpleNamespace
    from blitzllm.loader.tokenizer import dummy_tokenizer
    from blitzllm.server.serving import Serving
    tok = dummy_tokenizer(512, None)
    tok.chat_template = template
    s = Serving(None, "m")
    s.setup(SimpleNamespace(sampling_defaults={}, max_model_len=4096, model_config=SimpleNamespace(vocab_size=512, is_classifier=False, labels=())), tok)
    return s


def test_render_chat_checks_that_tools_are_rendered():
    msgs = [ChatMessage(role="user", content="hi")]
    ignores = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    renders = "{% if tools %}[{{ tools | tojson }}]{% endif %}" + ignores
    s = _serving(ignores)
    with pytest.raises(APIError) as e:
        s.render_chat(msgs, END, None, TOOLS, require_tools=True)
    assert e.value.status == 400 and e.value.param == "tools"
    assert s.render_chat(msgs, END, None, TOOLS) == "<user>hi"   # (not asked to check)
    s.close()
    s = _serving(renders)
    assert "get_weather" in s.render_chat(msgs, END, None, TOOLS, require_tools=True)
    s.close()
