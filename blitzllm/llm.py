"""The offline API: ``LLM(...).generate(prompts, sampling_params)``, ``.chat(messages, sampling_params)``,
``.embed(prompts, pooling_params)``, ``.classify(prompts)`` and ``.score(data_1, data_2)``.
With ``tensor_parallel_size`` > 1, ``close()`` (or ``with LLM(...) as llm``) stops the
worker processes; they also stop when this process exits."""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence, Union

from . import envs
from .engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_beam_width
from .engine.engine import Engine, EngineArgs
from .engine.intake import logprobs_cap, truncated
from .engine.media import split_images
from .engine.video import as_video, videos_of
from .engine.pooling import cosine, pair_ids, score_pairs
from .engine.request import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                             EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput, gather,
                             gathered)
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2", dtype=None, device: Optional[str] = None,
                 load_format: str = "auto", max_model_len: Optional[int] = None,
                 kv_cache_blocks: Optional[int] = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None, seed: int = 0,
                 num_layers: Optional[int] = None, enforce_eager: bool = False, attention_backend: str = "auto",
                 weight_dtype: Optional[str] = None, speculative_config=None, tensor_parallel_size: int = 1,
                 **kwargs):
        self.engine = Engine(EngineArgs(
            model=model, dtype=dtype, device=device, load_format=load_format, max_model_len=max_model_len,
            kv_cache_blocks=kv_cache_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, seed=seed,
            num_layers=num_layers, enforce_eager=enforce_eager, attention_backend=attention_backend,
            weight_dtype=weight_dtype, speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size, **kwargs))
        self._ids = itertools.count()
        # per live request of this LLM, the events a step made for it that its caller has not taken
        # yet: one engine serves every open stream and generate() call, each takes its own events
        self._inbox: dict[str, list] = {}

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op with one rank)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's: the engine's tokenizer (transformers'; None for a model without one)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` / ``stream`` use when given no params: SamplingParams' defaults
        with the model's generation config over them (``generation_config``, as vLLM)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 lora_request=None) -> list[RequestOutput]:
        """``prompts``: a prompt or a list of them; a prompt is a string, a list of token ids, or
        vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``, with ``"multi_modal_data":
        {"image": a PIL image or a list, "video": a video or a list}`` beside for a vision model (one
        placeholder in the prompt per image, e.g. Qwen3.5's ``<|vision_start|><|image_pad|><|vision_end|>``,
        and per video, ``<|vision_start|><|video_pad|><|vision_end|>``; a video as
        ``engine/video.py``'s ``as_video`` takes it). One SamplingParams for all, or one per prompt.
        ``priority``: one per prompt (lower first), with ``scheduling_policy="priority"``. ``lora_request``: a ``LoRARequest`` for all prompts, or a
        list of one (or None, the base model) per prompt, with ``enable_lora=True``."""
        prompts = _prompt_list(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        plist = _params_list(params, prompts, SamplingParams)
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompts)}), got {priority!r}")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request entries for {len(prompts)} prompts")
        rids, acc = self._run("gen", prompts, plist, [p.n for p in plist], priority, loras, use_tqdm)
        outs = []
        for rid, prompt, p in zip(rids, prompts, plist):
            comps = [CompletionOutput(i, "".join(s["text"]), s["ids"],
                                      s["lps"] if p.logprobs is not None else None, s["reason"], s["stop"],
                                      _cumulative(s["ids"], s["lps"]) if p.logprobs is not None else None)
                     for i, s in enumerate(acc[rid])]
            text = prompt.prompt if isinstance(prompt, PromptInput) else prompt
            outs.append(RequestOutput(rid, text if isinstance(text, str) else None, acc[rid][0]["prompt_ids"], comps,
                                      True, num_cached_tokens=acc[rid][0]["cached"], prompt_logprobs=acc[rid][0]["plp"]))
        return outs

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): per prompt (as ``generate`` takes them) the
        ``params.beam_width`` best beams, best first; ``lora_request``: one adapter for all."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        eng = self.engine
        check_beam_width(params.beam_width, logprobs_cap(eng.args.max_logprobs, eng.model_config.vocab_size))
        prompts = _prompt_list(prompts)
        if any(isinstance(p, PromptInput) for p in prompts):
            raise ValueError("beam_search takes text or token-id prompts; images (multi_modal_data) and "
                             "cache_salt need generate")
        searches = [BeamSearch(eng.tokenize(p), params, eng.eos_token_ids, eng.max_model_len) for p in prompts]
        step = searches[0].step_params() if searches else None
        while live := [(s, b) for s in searches for b in s.live()]:
            outs = self.generate([b.tokens for _, b in live], step, use_tqdm=False, lora_request=lora_request)
            for s in searches:
                n = len(s.beams)
                s.advance([o.outputs[0].logprobs[0] for o in outs[:n]])
                outs = outs[n:]
        decode = (lambda ids: eng.tokenizer.decode(ids, skip_special_tokens=True)) if eng.tokenizer else (lambda ids: "")
        return [BeamSearchOutput(s.best(decode)) for s in searches]

    def embed(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as ``generate`` takes them): the model's final hidden
        states pooled as ``pooling_params`` and the engine's pooler config say (by default the last
        token's, L2-normalized). One PoolingParams for all, or one per prompt."""
        prompts = _prompt_list(prompts)
        plist = _params_list(pooling_params if pooling_params is not None else PoolingParams(), prompts,
                             PoolingParams)
        rids, acc = self._run("embd", prompts, plist, [1] * len(plist), use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(acc[rid][0]["embedding"]), acc[rid][0]["prompt_ids"], True)
                for rid in rids]

    def classify(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` on a sequence classifier: per prompt (as ``generate`` takes them)
        its class probabilities, the model's head on the last token's final hidden state through
        softmax (a sigmoid with one label; raw logits with ``PoolingParams(use_activation=False)``).
        One PoolingParams for all, or one per prompt (their ``truncate_prompt_tokens``)."""
        prompts = _prompt_list(prompts)
        plist = [replace(p, task="classify") for p in _params_list(pooling_params or PoolingParams(), prompts,
                                                                   PoolingParams)]
        rids, acc = self._run("cls", prompts, plist, [1] * len(plist), use_tqdm=use_tqdm)
        return [ClassificationRequestOutput(rid, ClassificationOutput(acc[rid][0]["embedding"]),
                                            acc[rid][0]["prompt_ids"], True)
                for rid in rids]

    def score(self, data_1, data_2, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: per pair, on an embedding model the cosine similarity of the two
        prompts' embeddings (``embed``'s); on a classifier of one label (a cross-encoder) its
        sigmoid on the pair as one sequence (the tokenizer's pair encoding). ``data_1`` one prompt
        (against each of ``data_2``) or as many as ``data_2`` (pairwise)."""
        left, right = score_pairs(data_1, data_2)
        if self.engine.model_config.is_classifier:
            return self._cross_encode(left, right, truncate_prompt_tokens, use_tqdm)
        key = [p if isinstance(p, str) else repr(p) for p in left + right]   # (each distinct prompt embedded once)
        first = {}
        for k, p in zip(key, left + right):
            first.setdefault(k, p)
        outs = self.embed(list(first.values()), PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens),
                          use_tqdm=use_tqdm)
        by = dict(zip(first, outs))
        n = len(left)
        return [ScoringRequestOutput(f"score-{next(self._ids)}",
                                     ScoringOutput(cosine(by[a].outputs.embedding, by[b].outputs.embedding)),
                                     by[a].prompt_token_ids + by[b].prompt_token_ids, True)
                for a, b in zip(key[:n], key[n:])]

    def _cross_encode(self, left: list, right: list, truncate_prompt_tokens: Optional[int], use_tqdm: bool) -> list:
        """``score`` on a cross-encoder: one pooling request (task "score") per pair."""
        ids = [pair_ids(self.engine.tokenizer, _unwrap(a), _unwrap(b)) for a, b in zip(left, right)]
        params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        rids, acc = self._run("score", ids, [params] * len(ids), [1] * len(ids), use_tqdm=use_tqdm)
        return [ScoringRequestOutput(rid, ScoringOutput(acc[rid][0]["embedding"][0]),
                                     truncated(p, truncate_prompt_tokens, self.engine.max_model_len), True)
                for rid, p in zip(rids, ids)]

    def _run(self, kind: str, prompts: list, plist: list, counts: list, priority=None, loras=None,
             use_tqdm: bool = False) -> tuple:
        """Add one request per prompt (all or none: a refused one aborts those added; ``priority``
        and ``loras``: one per prompt, or None) and step until each of its ``counts`` sequences
        finished; (request ids, per id the ``gathered()`` of each sequence). ``use_tqdm``: a
        progress bar of the finished prompts on stderr (vLLM's; off with BLITZ_NO_PROGRESS)."""
        rids = []
        try:
            for prompt, p, prio, lora in zip(prompts, plist, priority or [0] * len(prompts),
                                             loras or [None] * len(prompts)):
                rid = f"{kind}-{next(self._ids)}"
                text, extra = _parts(prompt)
                self.engine.add_request(rid, text, p, priority=prio, lora_request=lora, **extra)
                rids.append(rid)
        except ValueError:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        acc = {rid: [gathered() for _ in range(n)] for rid, n in zip(rids, counts)}
        for rid in rids:   # (as the engine holds them: truncated, images' placeholders expanded; None for embeddings)
            acc[rid][0]["prompt_ids"] = self.engine.requests[rid][0].known_prompt_ids
        left, unfinished, out_tokens = sum(counts), dict(zip(rids, counts)), 0
        bar = _progress_bar(len(rids)) if use_tqdm else None
        try:
            self._inbox.update((rid, []) for rid in rids)
            while left:
                for ev in self._events(rids):
                    gather(acc[ev.request_id][ev.index], ev)
                    out_tokens += len(ev.new_token_ids)
                    if ev.finish_reason is None:
                        continue
                    left -= 1
                    unfinished[ev.request_id] -= 1
                    if bar is not None and not unfinished[ev.request_id]:
                        bar.update(1)
                        elapsed = max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} toks/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
            for rid in rids:
                self._inbox.pop(rid, None)
                self.engine.abort_request(rid)   # (a no-op once finished)
        return rids, acc

    def stream(self, prompt, sampling_params: Optional[SamplingParams] = None, lora_request=None) -> Iterator[str]:
        """One prompt's text as it is generated: yields each step's new text (first sample of
        ``sampling_params.n``); the request is aborted if the caller stops early."""
        rid = f"gen-{next(self._ids)}"
        text, extra = _parts(_unwrap(prompt))
        self.engine.add_request(rid, text, sampling_params or self.get_default_sampling_params(),
                                lora_request=lora_request, **extra)
        self._inbox[rid] = []
        done = False
        try:
            while not done:
                for ev in self._events([rid]):
                    if ev.index == 0:
                        done = ev.finish_reason is not None
                        if ev.text:
                            yield ev.text
        finally:
            # also when sample 0 is done: the other samples of n > 1 may still run, and left in the
            # engine their events would reach the next generate() (a KeyError there)
            self._inbox.pop(rid, None)
            self.engine.abort_request(rid)

    def _events(self, rids) -> list:
        """The next events of requests ``rids``: those waiting in their inboxes, else one engine
        step's. A step's events for the other live requests (an open stream's, a generate()'s
        around it) wait in theirs: each caller of step() took them all before, so interleaved
        streams lost each other's text and a generate() inside a stream met a KeyError."""
        if not any(self._inbox[r] for r in rids):
            if not self.engine.has_unfinished():
                raise RuntimeError(f"requests {list(rids)} are unfinished in an idle engine")
            for ev in self.engine.step():
                box = self._inbox.get(ev.request_id)
                if box is not None:
                    box.append(ev)
        out = []
        for r in rids:
            out += self._inbox[r]
            self._inbox[r] = []
        return out

    def tokenize(self, text: str) -> list:
        return self.engine.tokenize(text)

    def _chat_text(self, messages: list, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, tools: Optional[list] = None,
                   chat_template_kwargs: Optional[dict] = None) -> str:
        """The conversation rendered by the chat template (``apply_chat_template``'s options)."""
        tok = self.engine.tokenizer
        if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
            raise ValueError("this model has no chat template")
        _check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        if not isinstance(chat_template_kwargs or {}, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"chat_template_kwargs must be a dict of names, got {chat_template_kwargs!r}")
        ours = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    tools=tools or None, chat_template=chat_template)
        clash = sorted(set(kwargs) & {*ours, "tokenize", "conversation", "return_dict"})
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, **ours, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's errors and the template's own raise_exception
            raise ValueError(f"the chat template rejected the messages: {type(e).__name__}: {e}") from None
        return text

    def apply_chat_template(self, messages: list, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: Optional[list] = None, chat_template_kwargs: Optional[dict] = None) -> list:
        """One conversation's prompt ids through the chat template (the tokenizer's, or
        ``chat_template``), with vLLM's ``LLM.chat`` options: ``continue_final_message`` leaves the
        final message open for the model to continue (with ``add_generation_prompt`` false),
        ``tools`` and ``chat_template_kwargs`` (e.g. Qwen3's ``{"enable_thinking": False}``) reach
        the template."""
        # (apply_chat_template(tokenize=True) adds no special tokens to the rendered text either)
        text = self._chat_text(messages, chat_template, add_generation_prompt, continue_final_message, tools,
                               chat_template_kwargs)
        return self.engine.tokenizer(text, add_special_tokens=False).input_ids

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             lora_request=None, **template) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of conversations; a list of outputs
        either way. ``template``: ``apply_chat_template``'s options (vLLM's names). ``lora_request``:
        as ``generate``'s (one for all conversations or one per conversation)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            _check_messages(conv)
            intake = self.engine.image_intake
            conv, images = split_images(conv, video_sample=intake.video_processor.indices if intake else None)
            if not images:
                prompts.append(self.apply_chat_template(conv, **template))
                continue
            text = self._chat_text(conv, **template)
            if intake is not None:   # (videos' frame groups written into the text, as transformers does)
                images = intake.inputs(images)
                text = intake.expand_text(text, images)
            prompts.append(PromptInput(self.engine.tokenizer(text, add_special_tokens=False).input_ids, images))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while a request holds KV blocks."""
        return self.engine.reset_prefix_cache()


def _progress_bar(total: int):
    """vLLM's "Processed prompts" bar on stderr (None with BLITZ_NO_PROGRESS)."""
    if envs.get("BLITZ_NO_PROGRESS"):
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True, file=sys.stderr)


def _prompt_list(prompts) -> list:
    """A prompt or a list of them (see ``generate``) -> a list of texts and token id lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, or a list of those, "
                         f"got {type(prompts).__name__}")
    return [_unwrap(p) for p in prompts]


def _params_list(params, prompts: list, kind: type) -> list:
    """One ``kind`` (SamplingParams, PoolingParams) for every prompt, or a list of one per prompt."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"got {len(plist)} {kind.__name__} for {len(prompts)} prompts")
    if not all(isinstance(p, kind) for p in plist):
        raise ValueError(f"params must be {kind.__name__}, got {sorted({type(p).__name__ for p in plist})}")
    return plist


@dataclass(frozen=True)
class PromptInput:
    """A prompt (text or token ids; None for ``prompt_embeds``) with what vLLM's prompt dicts add:
    its images (``multi_modal_data``), its ``cache_salt``, or embeddings in place of the prompt."""
    prompt: Union[str, list, None]
    images: Optional[list] = None
    cache_salt: Optional[str] = None
    prompt_embeds: object = None


_PROMPT_EXTRAS = ("multi_modal_data", "cache_salt")


def _unwrap(prompt):
    """vLLM's prompt dicts -> the text or the token ids inside (a PromptInput with images, a salt
    or embeddings)."""
    if not isinstance(prompt, dict):
        return prompt
    rest = {k: v for k, v in prompt.items() if k not in _PROMPT_EXTRAS}
    (key, value), = rest.items() if len(rest) == 1 else ((None, None),)
    if not (key == "prompt" and isinstance(value, str) or key == "prompt_token_ids" and isinstance(value, list)
            or key == "prompt_embeds"):
        raise ValueError("prompts must be a string, a list of token ids, or a dict of one key: 'prompt' (a string), "
                         "'prompt_token_ids' (a list of token ids) or 'prompt_embeds' (a tensor), and "
                         f"'multi_modal_data' or 'cache_salt'; got a dict of {sorted(map(str, prompt))}")
    mm, salt = prompt.get("multi_modal_data"), prompt.get("cache_salt")
    if key == "prompt_embeds":
        if value is None:
            raise ValueError("prompt_embeds must be a tensor, got None")
        return PromptInput(None, None, salt, value)
    if mm is None and salt is None:
        return value
    images = None
    if mm is not None:
        if not isinstance(mm, dict) or set(mm) - {"image", "video"}:
            raise ValueError("multi_modal_data takes 'image' (a PIL image or a list of them) and 'video' (a video or a "
                             f"list of them), got {mm!r:.80}")
        images = mm.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if mm.get("video") is not None:
            images += [as_video(v) for v in videos_of(mm["video"])]
    return PromptInput(value, images, salt)


def _parts(prompt) -> tuple:
    """(text or token ids, ``Engine.add_request``'s keywords for the rest) of an unwrapped prompt."""
    if not isinstance(prompt, PromptInput):
        return prompt, {}
    return prompt.prompt, {"images": prompt.images, "cache_salt": prompt.cache_salt,
                           "prompt_embeds": prompt.prompt_embeds}


def _cumulative(ids: list, lps: list) -> float:
    """vLLM's cumulative_logprob: the sum of the chosen tokens' logprobs."""
    return float(sum(d[t] for t, d in zip(ids, lps)))


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                  for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (isinstance(content, str) or parts):
            raise ValueError("each message must be a dict with a string 'role' and a 'content' that is a string "
                             "or a list of typed parts ({'type': 'text', 'text': ...}, {'type': 'image_url', ...})")
