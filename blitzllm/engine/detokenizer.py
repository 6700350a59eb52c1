"""Incremental (streaming) detokenization with stop strings: one sequence's sliding window of ids,
the text delta safe to stream and the hold-back of a possible stop string. Knows nothing about
requests or the scheduler (docs/design.md#streaming-text-the-detokenizer).
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Sequence, Union

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first generated ids, for their leading-space context.
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 64


def _make_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Return ``ids -> text`` without tokenization-space cleanup (which is not incremental)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast (Rust) tokenizers
    if backend is not None and callable(getattr(backend, "decode", None)):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                             clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into append-only text deltas. ``tokenizer``: a
    ``transformers`` tokenizer; ``prompt_ids``: their tail gives the first tokens their context;
    ``skip_special_tokens`` as in ``tokenizer.decode``; ``stop``: stop strings, the output cut at
    the first that completes (kept at its end with ``include_stop_str_in_output``); ``min_tokens``:
    a stop string counts only where it ends past the text of the first ``min_tokens`` ids (vLLM's
    min_tokens holds stop strings off as it holds EOS and the stop tokens)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *,
                 skip_special_tokens: bool = True,
                 stop: Union[str, Iterable[str], None] = (),
                 include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        if isinstance(stop, str):
            stop = (stop,)
        self.stop: list[str] = list(dict.fromkeys(s for s in stop or () if s))
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self.min_tokens = min_tokens

        self.stopped: bool = False
        self.stop_reason: Optional[str] = None
        self.finished: bool = False
        self.num_generated_tokens: int = 0

        self._decode = _make_decoder(tokenizer, self.skip_special_tokens)

        context, context_text = self._prompt_context(prompt_ids)

        self._window: list[int] = context        # ids from the prefix offset on
        self._read: int = len(context)           # _window[:_read] is the prefix
        self._prefix_len: int = len(context_text)
        self._taken: int = 0                     # chars past the prefix already moved to _pending
        self._pending: str = ""                  # decoded text not emitted yet (stop lookahead)
        self._no_stop: int = 0                   # _pending[:_no_stop]: min_tokens' text, where no stop may end
        self._out: list[str] = []
        self._out_text: Optional[str] = ""

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        if self._out_text is None:
            self._out_text = "".join(self._out)
            self._out = [self._out_text] if self._out_text else []
        return self._out_text

    def add(self, token_ids: Union[int, Sequence[int]]) -> str:
        """Feed newly generated token ids; return the text delta that is safe to emit now."""
        if self.stopped or self.finished:
            return ""
        if not hasattr(token_ids, "__len__"):  # a single id (int / numpy integer)
            token_ids = (token_ids,)
        if not len(token_ids):
            return ""
        head = min(len(token_ids), self.min_tokens - self.num_generated_tokens)
        if head > 0:  # the first min_tokens ids: no stop string may end in their text
            self.num_generated_tokens += head
            self._window.extend(int(t) for t in token_ids[:head])
            self._advance(final=False)
            self._no_stop = len(self._pending)
            token_ids = token_ids[head:]
            if not len(token_ids):
                return self._emit(final=False)
        self.num_generated_tokens += len(token_ids)
        self._window.extend(int(t) for t in token_ids)
        self._advance(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of generation (length / EOS): flush everything held back and return the delta; an
        incomplete UTF-8 sequence at the very end is emitted as decoded (U+FFFD)."""
        done = self.stopped or self.finished
        self.finished = True
        if done:
            return ""
        self._advance(final=True)
        return self._emit(final=True)

    # ------------------------------------------------------------------ internals

    def _prompt_context(self, prompt_ids: Sequence[int]) -> tuple[list[int], str]:
        """The prompt tail decoded ahead of the output, and its text: the last few tokens, widened
        while they decode to nothing or end in U+FFFD; none if the prompt ends inside a character
        (the output is then decoded on its own)."""
        n = len(prompt_ids)
        if n == 0:
            return [], ""
        for k in (_PROMPT_CONTEXT_TOKENS, 4 * _PROMPT_CONTEXT_TOKENS, _MAX_PROMPT_CONTEXT_TOKENS):
            k = min(k, n)
            context = [int(t) for t in prompt_ids[n - k:]]
            text = self._decode(context)
            if (text and not text.endswith(_REPLACEMENT)) or k == n:
                break
        if text.endswith(_REPLACEMENT):
            return [], ""
        return context, text

    def _advance(self, final: bool) -> None:
        """Decode the window and move the newly stable text into ``_pending``."""
        text = self._decode(self._window)
        start = self._prefix_len + self._taken
        if final or not text.endswith(_REPLACEMENT):
            if len(text) > start:
                self._pending += text[start:]
            if len(text) > self._prefix_len and not final:
                # Character boundary reached: slide the window, the ids just read become the
                # new prefix.
                prefix = self._window[self._read:]
                self._window = prefix
                self._read = len(prefix)
                self._prefix_len = len(self._decode(prefix))
                self._taken = 0
            return
        # The text ends in an incomplete character: take what precedes the trailing U+FFFD run
        # (it cannot change any more) and keep the ids unread until the character completes.
        stable = len(text.rstrip(_REPLACEMENT))
        if stable > start:
            self._pending += text[start:stable]
            self._taken = stable - self._prefix_len

    def _emit(self, final: bool) -> str:
        pending = self._pending
        if not pending:
            return ""
        if self.stop:
            hits = [(i + len(s), i, s) for s in self.stop
                    if (i := pending.find(s, max(0, self._no_stop - len(s) + 1))) >= 0]
            if hits:  # the stop string that completes first (the earlier start on a tie)
                end, begin, s = min(hits, key=lambda h: h[:2])
                delta = pending[:end if self.include_stop_str_in_output else begin]
                self._pending = ""
                self.stopped = True
                self.stop_reason = s
                return self._append(delta)
            if not final:
                hold = self._held_back(pending)
                if hold:
                    self._pending = pending[len(pending) - hold:]
                    self._no_stop = max(0, self._no_stop - (len(pending) - hold))
                    return self._append(pending[:len(pending) - hold])
        self._pending = ""
        self._no_stop = 0
        return self._append(pending)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string. Each
        suffix that starts with the stop's first character is compared: memory and set-up stay
        linear in a stop string's length (a set of all its prefixes grew with its square, which a
        client's 60,000-character stop string turned into gigabytes on the engine thread)."""
        n, best = len(text), 0
        for s in self.stop:
            i = max(n - len(s) + 1, 0)  # a proper prefix: at most len(s) - 1 characters
            while n - i > best:
                i = text.find(s[0], i)
                if i < 0 or n - i <= best:
                    break
                if s.startswith(text[i:]):
                    best = n - i
                    break
                i += 1
        return best

    def _append(self, delta: str) -> str:
        if delta:
            self._out.append(delta)
            self._out_text = None
        return delta

    def __repr__(self) -> str:
        return (f"IncrementalDetokenizer(tokens={self.num_generated_tokens}, "
                f"chars={len(self.output_text)}, stopped={self.stopped}, "
                f"stop_reason={self.stop_reason!r})")
