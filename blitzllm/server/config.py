"""The server's settings (``blitz serve``'s options past the engine's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DEFAULT_MAX_BODY = 8 << 20
DEFAULT_MAX_STORED = 1024  # stored /v1/responses answers (server/responses_store.py)


@dataclass(frozen=True)
class ServeConfig:
    engine_kwargs: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    served_model_aliases: tuple = ()       # more names of --served-model-name, listed and accepted
    max_waiting_requests: int = 1024
    max_request_bytes: int = DEFAULT_MAX_BODY
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    max_stored_responses: int = DEFAULT_MAX_STORED
    return_tokens_as_token_ids: bool = False
    lora_modules: tuple = ()               # ((name, path), ...) of --lora-modules
    allow_runtime_lora_updating: bool = False
    trust_request_chat_template: bool = False   # a request's own chat_template is rendered (else a 400)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens in chat / completions
    allowed_media_domains: tuple = ()      # the hosts image URLs are fetched from (empty: any, as vLLM's default)
    # CORS (vLLM's flags), off unless --allowed-origins names some: a server on loopback should not
    # answer every web page's scripts by default
    allowed_origins: tuple = ()
    allowed_methods: tuple = ("*",)
    allowed_headers: tuple = ("*",)
    allow_credentials: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.engine_kwargs.get("model", "smollm2"))
