"""POST /tokenize and /detokenize (vLLM's): the server's tokenizer on a prompt or chat messages
(rendered as a chat completion would be), and token ids back to text."""
from __future__ import annotations

from fastapi.responses import Response

from .chat_template import prompt_end
from .errors import bad_request
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving import Serving, json_with_ids, pick
from .tools import check_tools
from .vision import chat_images, expand_images

LONG_DECODE = 4096      # /detokenize decodes a list this long through the Rust batch call


async def tokenize_request(s: Serving, req: TokenizeRequest) -> Response:
    s.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        check_tools(req.tools, "none", None)   # (their shape, as chat checks it; no tool choice here)
        images = await chat_images(s, req.messages)   # (a vision model's: their tokens count, as in chat)
        ids, text = await s.chat_prompt(req.messages, prompt_end(req.add_generation_prompt, req.continue_final_message),
                                     req.chat_template_kwargs, req.tools, check_length=False,
                                     template=req.chat_template, images=bool(images))
        if images:
            ids = await expand_images(s, ids, text, images)
    else:
        s.need_tokenizer("nothing to tokenize with")
        s.check_prompt_chars(req.prompt, "prompt")  # (O(1): the length of a str)
        ids = await s.tokens(req.prompt, pick(req.add_special_tokens, True))
    body = await s.cpu(json_with_ids, {"count": len(ids), "max_model_len": s.max_model_len}, "tokens", ids)
    return Response(body, media_type="application/json")


def detokenize_request(s: Serving, req: DetokenizeRequest) -> dict:
    """In a worker thread."""
    s.check_model(req.model)
    tok = s.worker_tokenizer("nothing to detokenize with")
    if any(t < 0 or t >= s.vocab_size for t in req.tokens):
        raise bad_request(f"tokens must be in [0, {s.vocab_size})", param="tokens")
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or len(req.tokens) < LONG_DECODE:
        return {"prompt": tok.decode(req.tokens)}
    # a long list: the Rust batch call, which releases the GIL (tok.decode's does not)
    text = backend.decode_batch([req.tokens], skip_special_tokens=False)[0]
    if getattr(tok, "clean_up_tokenization_spaces", False):
        text = tok.clean_up_tokenization(text)
    return {"prompt": text}
