"""Chat messages through the model's chat template: the request's messages as the template's
conversation (text parts joined, an assistant's earlier calls and reasoning_content kept; an
assistant turn built part by part from the Responses and Messages APIs' items) and the
rendering, with the request's ``chat_template_kwargs`` and ``tools``. Errors are the
client's 400s. Runs in the server's worker threads (``serving.py``); knows nothing of HTTP
beyond its errors.
"""
from __future__ import annotations

from .errors import bad_request
from .tools import template_messages

# apply_chat_template's own arguments, which chat_template_kwargs may not override
_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
                  "padding", "truncation", "max_length", "tools", "documents", "chat_template",
                  "continue_final_message", "return_assistant_tokens_mask", "tokenizer_kwargs"}
# what a message hands the template besides its role and content (vLLM passes the same)
_KEPT = ("name", "tool_calls", "tool_call_id", "reasoning_content")


def conversation(messages, images: bool = False) -> list:
    """``ChatMessage``s as the template's list of dicts: text parts joined; with ``images`` (a
    vision model's chat), a message with ``image_url`` / ``video_url`` parts keeps its parts as the
    template's ``{"type": "text"}``, ``{"type": "image"}`` and ``{"type": "video"}`` items, which
    it renders as the placeholders."""
    conv = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if images and part.type in ("image_url", "video_url"):
                    parts.append({"type": part.type[:5]})
                    continue
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages.{i}.content: only text{', image_url and video_url' if images else ''} parts are "
                                      f"supported, got type {part.type!r}", param=f"messages.{i}.content")
                parts.append({"type": "text", "text": part.text})
            has_image = any(p["type"] != "text" for p in parts)
            content = parts if has_image else "\n".join(p["text"] for p in parts)
        entry = {"role": m.role, "content": content or ""}
        for key in _KEPT:
            if getattr(m, key) is not None:
                entry[key] = getattr(m, key)
        conv.append(entry)
    return template_messages(conv)


def add_assistant_part(messages: list, part: str, value) -> None:
    """``value`` as ``part`` of the assistant turn in progress (the last message, when it is an
    assistant's without that part yet; calls join those before them), else of a new one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and (part == "tool_calls" or last.get(part) is None):
        if part == "tool_calls":
            last[part] = (last.get(part) or []) + value
        else:
            last[part] = value
        return
    messages.append({"role": "assistant", part: value})


def request_template(template, trusted: bool):
    """A request's own chat template (vLLM's ``chat_template`` field): rendered with
    --trust-request-chat-template, else a 400, as vLLM answers: a client's Jinja would run on the
    server, and ignoring it would render another prompt than the client asked for."""
    if template is not None and not trusted:
        raise bad_request("a chat template in the request is not accepted without --trust-request-chat-template: "
                          "the model's own renders the messages", param="chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise bad_request("chat_template must be a non-empty Jinja template", param="chat_template")
    return template


def prompt_end(add_generation_prompt, continue_final_message) -> dict:
    """How the rendered conversation ends, from a request's two flags (None: their defaults): an
    opened assistant turn, the final message left open (vLLM's ``continue_final_message``: the
    model continues it), or neither."""
    add, cont = add_generation_prompt is not False, bool(continue_final_message)
    if add and cont:
        raise bad_request("continue_final_message needs add_generation_prompt false (the final message is "
                          "continued, no new turn opened)", param="continue_final_message")
    return {"add_generation_prompt": add, "continue_final_message": cont}


def render(tok, conv: list, end: dict, template_kwargs, tools, require_tools: bool, template=None) -> str:
    """The template's text of ``conv`` (through ``template`` where given, a request's own), ending
    as ``end`` (``prompt_end``) says. ``require_tools``
    (tool_choice "auto": the model must see the tools to call them): a 400 when the template
    renders the same text without them."""
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & _TEMPLATE_ARGS)
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    kwargs.update(end)
    if template is not None:
        kwargs["chat_template"] = template
    try:
        text = tok.apply_chat_template(conv, tokenize=False, **kwargs, **({"tools": tools} if tools else {}))
        bare = tok.apply_chat_template(conv, tokenize=False, **kwargs) if tools and require_tools else None
    except Exception as e:  # jinja errors from the template (e.g. role order): the input's fault
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
    if bare == text:
        raise bad_request("this model's chat template does not render tools, so the model would never see "
                          "them: send tool_choice 'none' (no tools), force a call with tool_choice 'required' or "
                          "a named function (a grammar decodes it), or serve a chat template that renders tools",
                          param="tools")
    return text
