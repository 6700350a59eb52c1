"""Bad input gets a 4xx OpenAI error body naming the field (never a 422 or a 500), and the
server keeps serving: every case is followed by a valid request that succeeds."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import check_error

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def chat(**kw):
    return {"model": "smollm2", "messages": MSG, "max_tokens": 4, **kw}


def cmpl(**kw):
    return {"model": "smollm2", "prompt": "Hi", "max_tokens": 4, **kw}


# (id, path, body: bytes or JSON, status, param or None)
CASES = [
    ("malformed_json", CHAT, b'{"messages": [', 400, None),
    ("non_utf8_body", CMPL, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("empty_body", CMPL, b"", 400, None),
    ("body_not_an_object", CMPL, b"[1, 2, 3]", 400, None),
    ("nan_literal", CMPL, b'{"prompt": "Hi", "temperature": NaN}', 400, None),
    ("float_overflow", CMPL, b'{"prompt": "Hi", "temperature": 1e999}', 400, None),
    ("nested_too_deep", CMPL, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("integer_past_the_digit_limit", CMPL, b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("tool_choice_function_not_an_object", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                      tool_choice={"type": "function", "function": "f"}), 400,
     "tool_choice"),
    ("guided_json_nested_too_deep", CMPL, cmpl(guided_json="[" * 100_000 + "]" * 100_000), 400, "guided_json"),
    ("guided_json_integer_past_the_digit_limit", CMPL, cmpl(guided_json="9" * 5000), 400, "guided_json"),
    ("missing_messages", CHAT, {"model": "smollm2"}, 400, "messages"),
    ("missing_prompt", CMPL, {"model": "smollm2"}, 400, "prompt"),
    ("missing_message_role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    ("messages_wrong_type", CHAT, chat(messages="hello"), 400, "messages"),
    ("messages_empty", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown_role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("image_content_part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages.0.content.0"),   # (a text-only model: the part is named)
    ("temperature_wrong_type", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("max_tokens_wrong_type", CMPL, cmpl(max_tokens="ten"), 400, "max_tokens"),
    ("n_bool", CMPL, cmpl(n=True), 400, "n"),
    ("stop_wrong_type", CHAT, chat(stop=5), 400, "stop"),
    ("stream_wrong_type", CHAT, chat(stream="yes"), 400, "stream"),
    ("prompt_wrong_type", CMPL, cmpl(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt_mixed_list", CMPL, cmpl(prompt=["a", 1]), 400, "prompt"),
    ("temperature_negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature_negative_stream", CHAT, chat(temperature=-1, stream=True), 400, "temperature"),
    ("top_p_zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p_over_one", CMPL, cmpl(top_p=1.5), 400, "top_p"),
    ("top_k_negative", CMPL, cmpl(top_k=-5), 400, "top_k"),
    ("min_p_over_one", CMPL, cmpl(min_p=2.0), 400, "min_p"),
    ("n_zero", CHAT, chat(n=0), 400, "n"),
    ("n_huge", CHAT, chat(n=100000), 400, "n"),
    ("presence_penalty_range", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty_range", CMPL, cmpl(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("repetition_penalty_zero", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    ("max_tokens_zero", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("max_completion_tokens_negative", CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("top_logprobs_too_many", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion_logprobs_too_many", CMPL, cmpl(logprobs=50), 400, "logprobs"),
    ("seed_negative", CMPL, cmpl(seed=-1), 400, "seed"),
    ("stop_empty_string", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("prompt_plus_max_tokens_over_context", CMPL, cmpl(max_tokens=5000), 400, "max_tokens"),
    ("chat_prompt_plus_max_tokens_over_context", CHAT, chat(max_tokens=1020), 400, "max_tokens"),
    ("prompt_too_long", CMPL, cmpl(prompt=[100] * 1100), 400, "prompt"),
    ("prompt_empty", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("token_id_out_of_vocab", CMPL, cmpl(prompt=[1, 10_000_000]), 400, "prompt"),
    ("token_id_negative", CMPL, cmpl(prompt=[-1]), 400, "prompt"),
    ("unknown_model_chat", CHAT, chat(model="gpt-17"), 404, "model"),
    ("unknown_model_completions", CMPL, cmpl(model="gpt-17"), 404, "model"),
    ("detokenize_bad_ids", "/detokenize", {"tokens": [10_000_000]}, 400, "tokens"),
    ("tokenize_nothing", "/tokenize", {}, 400, "prompt"),
    ("tokenize_malformed_tools", "/tokenize", {"messages": MSG, "tools": [{"function": 5}]}, 400, "tools.0"),
    # a request's own Jinja template is refused (vLLM without --trust-request-chat-template), not ignored
    ("chat_request_template", CHAT, chat(chat_template="{{ 'x' }}"), 400, "chat_template"),
    ("tokenize_request_template", "/tokenize", {"messages": MSG, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
]


def still_serving(srv) -> None:
    r = httpx.post(srv.url + CMPL, json=cmpl(max_tokens=1), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(smol_server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(smol_server.url + path, content=body, headers={"content-type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(smol_server.url + path, json=body, timeout=60)
    err = check_error(r, status, param)
    if "over_context" in name or name == "prompt_too_long":
        assert err["code"] == "context_length_exceeded"
    still_serving(smol_server)


def test_unknown_route_and_method(smol_server):
    check_error(httpx.get(smol_server.url + "/v1/nothing"), 404, None)
    check_error(httpx.get(smol_server.url + CHAT), 405, None)
    still_serving(smol_server)


def test_openai_client_sees_bad_request(smol_server):
    c = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model="smollm2", messages=MSG, temperature=-3)
    assert ei.value.status_code == 400 and "temperature" in str(ei.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    still_serving(smol_server)
