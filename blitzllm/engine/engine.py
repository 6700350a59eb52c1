"""The engine: owns requests, runs scheduler -> model runner -> sampler each ``step()``, and
turns sampled tokens into per-request events (new tokens, text deltas, finish reasons).

Synchronous and single-threaded; ``async_engine.py`` wraps it for the server.
"""
from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..config import ModelConfig, SchedulerConfig
from ..distributed.parallel_state import SINGLE
from ..layers.sampler import SamplingRow
from ..loader.quantized import check_quantization
from ..loader.source import resolve_model
from ..loader.tokenizer import load_tokenizer, set_chat_template
from ..pooling_params import PoolingParams
from ..envs import Knobs
from ..runner.build import build_runner
from ..sampling_params import SamplingParams, sample_seed
from ..spec.config import parse_speculative_config
from .args import (EngineArgs, check_engine_args, check_tp_size, engine_cache_config, engine_state_layout,
                   lora_config, plan_kv_blocks, resolve_device, resolve_dtype, resolve_weight_dtype, sampling_defaults,
                   speculation_runner_kwargs)
from .detokenizer import IncrementalDetokenizer
from .images import ImageIntake, check_images, release_images, step_images
from .intake import check_priority, check_request
from .kv_cache import KVCacheManager
from .pooling import Pooling, absorb, pool_spans, vector
from .prompt_embeds import embeds_prompt
from .request import Request, Status, score_prompt
from .scheduler import Scheduler
from .state_cache import HybridKVCacheManager
from .warmup import warm_up



@dataclass
class StepEvent:
    """What one step did for one completion of a request."""
    request_id: str
    index: int
    new_token_ids: list
    text: str
    logprobs: Optional[list]
    finish_reason: Optional[str] = None
    stop_reason: object = None
    prompt_logprobs: Optional[list] = None  # on the first event of a request that asked for them
    prompt_ranks: Optional[list] = None     # with them: per prompt token its rank (None for the first)
    kv_transfer_params: Optional[dict] = None  # a producer's finished request: where its KV waits
    num_cached_tokens: Optional[int] = None    # on the last event: the prompt tokens the prefix cache served
    embedding: Optional[list] = None           # a pooling request's one event: its vector (classify: probs)


class Engine:
    """``tensor_parallel_size`` > 1: this process is rank 0 and drives the other ranks through
    ``self.tp`` (``engine/tp.py``; ``close()`` stops them). Under torchrun, an Engine made on a
    rank > 0 serves rank 0 as a worker, then exits the process (SystemExit)."""

    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self.args = args
        self.tp = None
        check_engine_args(args)
        tp_size = check_tp_size(args.tensor_parallel_size)
        self.device = resolve_device(args.device)
        spec_cfg = parse_speculative_config(args.speculative_config)
        if spec_cfg is not None and spec_cfg.method in ("eagle3", "mtp") and tp_size > 1:
            # their hooks and draft layers run on rank 0's part of the model alone
            raise ValueError(f"speculative_config method {spec_cfg.method!r} runs with tensor_parallel_size 1 only")
        src = resolve_model(args.model, args.load_format, args.hf_overrides)
        check_quantization(src.hf_config, args.quantization)
        self.sampling_defaults = sampling_defaults(args, src.generation_config)
        self.model_config = cfg = ModelConfig.from_hf(src.hf_config, args.num_layers)
        folder = src.path if src.path is not None and src.path.is_dir() else None
        self.pooling = Pooling(args.pooler_config, folder, src.hf_config, cfg.num_labels, cfg.architecture)
        self.dtype = resolve_dtype(args.dtype, self.device, src.torch_dtype)
        self.weight_dtype = resolve_weight_dtype(args.weight_dtype, self.device, self.dtype)
        from ..kv_transfer import build_connector   # P/D disaggregation (docs/disaggregation.md)
        self.connector = build_connector(args.kv_transfer_config, tp_size, bool(cfg.state_layers))
        if tp_size > 1:
            self._join_tp_world(cfg, tp_size)
        try:
            self._setup(src, cfg, spec_cfg)
        except BaseException:
            self.close()
            raise
        self.load_time_s = time.perf_counter() - t0

    def _join_tp_world(self, cfg: ModelConfig, tp_size: int) -> None:
        from .tp import TPDriver, check_shardable
        from ..distributed.parallel_state import rank_device, torchrun_env
        env = torchrun_env()
        if env is not None and env.rank > 0:  # torchrun made this process a worker rank
            from .tp import run_worker
            run_worker(self.args, env)
            raise SystemExit(0)
        check_shardable(cfg, tp_size)
        self.device = rank_device(self.device, env.local_rank if env is not None else 0)
        self.tp = TPDriver.launch(self.args, tp_size, self.device)

    def _setup(self, src, cfg: ModelConfig, spec_cfg) -> None:
        args, tp = self.args, self.tp
        self.tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else src.tokenizer_loader()
        if args.chat_template is not None:
            set_chat_template(self.tokenizer, args.chat_template)
        group = tp.group if tp is not None else SINGLE
        self.knobs = Knobs.from_env()
        self.runner = build_runner(src, cfg, device=self.device, dtype=self.dtype, weight_dtype=self.weight_dtype,
                                   seed=args.seed, tp=group, knobs=self.knobs, plan_cache=self._plan_cache,
                                   dummy_mtp=spec_cfg is not None and spec_cfg.method == "mtp",
                                   max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
                                   lora=lora_config(args), **speculation_runner_kwargs(args))
        self.lora = self.runner.lora   # with enable_lora: the adapters' slot pool (blitzllm/lora)
        folder = src.path if src.path is not None and src.path.is_dir() else None
        # a vision tower's inputs: images and videos (engine/images.py)
        self.image_intake = ImageIntake.of(self.runner.model, folder, src.hf_config, args, self.tokenizer)
        if self.lora is not None:
            self.scheduler.max_loras = args.max_loras
        if self.connector is not None:
            self.connector.register_caches(self.runner.kv_caches, args.block_size, group.world_size)
            self.connector.broadcast = tp.send if tp is not None else None   # (KV heads for the other ranks)
            self.scheduler.remote_tokens = self.connector.remote_tokens
        if tp is not None:
            self.runner.driver = tp
            tp.workers_waiting = True
        self.scheduler.lookahead = self.runner.graphs is not None and tp is None
        self.spec = None
        if spec_cfg is not None:
            from ..spec.decoder import SpecDecoder
            from ..spec.proposers import build_proposer
            proposer = build_proposer(spec_cfg, target_cfg=cfg, device=self.device, dtype=self.dtype,
                                      num_blocks=self.cache_config.num_blocks, block_size=args.block_size,
                                      max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                                      seed=args.seed, attention_backend=args.attention_backend,
                                      runner=self.runner, kv=self.kv, new_kv=KVCacheManager, knobs=self.knobs)
            self.spec = SpecDecoder(spec_cfg, proposer, self.kv, self.sched_config.max_num_batched_tokens)
        self.requests: dict[str, list[Request]] = {}   # parent id -> its n sequences
        self.grammars, self._grammar_lock = None, threading.Lock()  # (see grammar_compiler)
        self._arrival = itertools.count()
        self._rng = random.Random(args.seed)
        self.eos_token_ids = self._eos_ids()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0}
        self.warmup_s = warm_up(self) if args.warmup and self.device.type == "cuda" else 0.0

    def _plan_cache(self) -> tuple:
        """The KV cache, scheduler and context length, once the weights are on the device:
        (CacheConfig, max_model_len) for ``build_runner``."""
        args, tp, cfg = self.args, self.tp, self.model_config
        num_blocks = plan_kv_blocks(args, cfg, self.dtype, self.device, 1 if tp is None else tp.group.world_size)
        if tp is not None:
            num_blocks = tp.agree_min(num_blocks)
            tp.workers_waiting = True  # for the runner message (or a stop)
        capacity = num_blocks * args.block_size
        max_len = args.max_model_len
        if max_len is not None and (not isinstance(max_len, int) or max_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_len!r}")
        if max_len is not None and max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be <= {cfg.max_position_embeddings} "
                             f"(the model's max_position_embeddings), got {max_len}")
        if max_len is not None and max_len > capacity:
            raise ValueError(f"max_model_len {max_len} exceeds the KV cache capacity of {capacity} tokens "
                             f"({num_blocks} blocks of {args.block_size}); raise kv_cache_blocks")
        self.max_model_len = max_len or min(cfg.max_position_embeddings, capacity)
        budget = args.max_num_batched_tokens
        if budget is None:
            budget = max(2048 if self.device.type == "cpu" else 8192, args.max_num_seqs)
        self.sched_config = SchedulerConfig(args.max_num_seqs, budget, self.max_model_len, args.scheduling_policy)
        self.cache_config = engine_cache_config(args, cfg, num_blocks)
        layout = engine_state_layout(args, cfg)  # hybrid models: their recurrent-state rows
        if layout is None:
            self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        else:
            self.kv = HybridKVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, layout)
        self.scheduler = Scheduler(self.sched_config, self.kv)
        if tp is not None:
            tp.send(("runner", self.max_model_len))
            tp.workers_waiting = False
        return self.cache_config, self.max_model_len

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do
        with one rank). Idempotent; the engine cannot step afterwards."""
        if self.tp is not None:
            self.tp.shutdown()
        if getattr(self, "connector", None) is not None:
            self.connector.close()

    # ---- setup -------------------------------------------------------------------
    def _eos_ids(self) -> tuple:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.insert(0, tok_eos)
        return tuple(i for i in ids if i is not None)

    # ---- requests ----------------------------------------------------------------
    def tokenize(self, prompt: Union[str, list]) -> list:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy-weight preset): pass prompts as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt must be a string or a list of token ids")

    def add_request(self, request_id: str, prompt: Union[str, list], params: Union[SamplingParams, PoolingParams],
                    kv_transfer_params: Optional[dict] = None, kv_payload=None, priority: int = 0,
                    lora_request=None, images=None, cache_salt: Optional[str] = None, prompt_embeds=None) -> None:
        """``params``: a SamplingParams, or a PoolingParams for an embedding (engine/pooling.py).
        ``kv_transfer_params`` / ``kv_payload``: disaggregation (``async_engine.py`` pulls the payload).
        ``priority``: under the priority scheduling policy, lower is served first (vLLM's).
        ``lora_request``: a ``LoRARequest`` (enable_lora), its adapter read and checked here.
        ``images``: PIL images (or ``ImageInput``s), one per placeholder run in the prompt (engine/images.py).
        ``cache_salt``: vLLM's, a non-empty string; the prefix cache shares KV only between requests
        of the same salt (tenants who cannot probe each other's prompts by timing). ``prompt_embeds``:
        a [P, hidden] tensor in place of the prompt (None), with ``enable_prompt_embeds``."""
        check_priority(priority, self.sched_config.policy)
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.40}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        embedded = None if prompt_embeds is None else embeds_prompt(
            prompt, prompt_embeds, params, enabled=self.args.enable_prompt_embeds, dtype=self.dtype,
            hidden_size=self.model_config.hidden_size, max_model_len=self.max_model_len, images=images,
            kv_transfer_params=kv_transfer_params)
        if images:
            check_images(self.image_intake, self.model_config.architecture, params, kv_transfer_params)
        if isinstance(params, PoolingParams):   # an embedding: one prefill-only sequence
            if lora_request is not None:
                raise ValueError("embeddings run on the base model: lora_request does not go with PoolingParams")
            req = self.pooling.request(f"{request_id}#0", self.tokenize(prompt), params, arrival=next(self._arrival),
                                       vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len)
            req.priority, req.cache_salt = priority, cache_salt
            self.requests[request_id] = [req]
            self.scheduler.add(req)
            self.counters["prompt_tokens"] += len(req.prompt_token_ids)
            return
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams or a PoolingParams")
        if self.model_config.is_classifier:
            raise ValueError(self.pooling.refusal("generate"))
        if lora_request is not None and self.lora is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        adapter = self.lora.resolve(lora_request) if lora_request is not None else None
        if images:   # (a text prompt's videos are written into the text before it is tokenized)
            images = self.image_intake.inputs(images)
            text = self.image_intake.expand_text(prompt, images) if isinstance(prompt, str) else prompt
            ids, prompt_images = self.image_intake.attach(self.tokenize(text), images, params)
        else:
            ids, prompt_images = embedded or (self.tokenize(prompt), None)
            if self.image_intake is not None and embedded is None:
                self.image_intake.check_text(ids)
        ids, params, bad_words = check_request(
            ids, params, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            max_tokens_cap=self.sampling_defaults.get("max_tokens"), tokenizer=self.tokenizer,
            max_logprobs=self.args.max_logprobs)
        if self.connector is None:
            kv_transfer_params = kv_payload = None
        elif kv_transfer_params and kv_transfer_params.get("do_remote_decode") and params.n != 1:
            raise ValueError("n must be 1 with kv_transfer_params do_remote_decode")
        seqs = []
        for i in range(params.n):
            if params.seed is not None:
                seed = sample_seed(params.seed, i)
            else:
                seed = self._rng.getrandbits(63)
            req = Request(request_id=f"{request_id}#{i}", prompt_token_ids=list(ids), params=params,
                          seed=seed, arrival=next(self._arrival), priority=priority, eos_token_ids=self.eos_token_ids,
                          max_total_tokens=self.max_model_len,
                          prompt=prompt if isinstance(prompt, str) else None, bad_words=bad_words)
            if params.structured_output is not None:
                req.matcher = self.grammar_compiler().matcher(params.structured_output)
            req.kv_transfer_params, req.kv_payload, req.lora = kv_transfer_params, kv_payload, adapter
            req.images, req.cache_salt = prompt_images, cache_salt
            if params.prompt_logprobs is not None and i == 0:
                req.prompt_logprobs, req.prompt_ranks = [], []
            if self.tokenizer is not None:
                req.detok = IncrementalDetokenizer(
                    self.tokenizer, ids if embedded is None else [], skip_special_tokens=params.skip_special_tokens,
                    stop=list(params.stop), include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens)
            seqs.append(req)
        self.requests[request_id] = seqs
        for r in seqs:
            self.scheduler.add(r)
        self.counters["prompt_tokens"] += len(ids)

    def grammar_compiler(self):
        """The structured outputs' compiler, made on first use (from any thread: the async front
        compiles a request's grammar in a worker thread before the engine sees the request, so a
        slow compile does not stall the steps of the others)."""
        with self._grammar_lock:
            if self.grammars is None:
                from ..structured import GrammarCompiler
                self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self.grammars

    def abort_request(self, request_id: str) -> bool:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for r in seqs:
            if not r.finished:
                self.scheduler.remove(r)
                if self.spec is not None:
                    self.spec.finish(r.request_id)
                r.status, r.finish_reason = Status.FINISHED, "abort"
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (after new weights, or between benchmark runs), as vLLM's:
        only while no request holds a block; returns whether it was done."""
        if self.kv.num_free_blocks != self.kv.num_blocks or self.states_held():
            return False
        self.kv.reset_prefix_cache()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ----------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        if self.connector is not None:
            self.connector.land(seqs, self.kv)  # KV pulled for requests admitted now
        if self.lora is not None:
            self.lora.prepare_step([s.req.lora for s in seqs])
        pooling = any(s.req.pooler is not None for s in seqs)
        # (a step with pooling rows drafts nothing: its forward is the eager one, which hands back hidden rows)
        drafts = self.spec.propose(seqs) if self.spec is not None and not pooling else None
        if drafts is not None:
            return self._spec_step(seqs, drafts)
        sample_idx = [i for i, s in enumerate(seqs) if s.samples and s.req.pooler is None]
        sampling = [seqs[i] for i in sample_idx]
        rows = [self._row(s.req) for s in sampling]
        batch = [(s.req.token_slice(s.start, s.end), s.start, s.end) for s in seqs]
        tables = [self.kv.block_table(s.req.request_id) for s in seqs]
        if pooling or any(s.req.prompt_logprobs_from is not None for s in seqs):
            logits = self._score(seqs, batch, tables, {i: 1 for i in sample_idx}, self._plan_states(seqs))
            result = self.runner.sample(logits, rows)
        else:
            result = self.runner.execute(batch, tables, sample_idx, rows, self._plan_states(seqs), step_images(seqs))
        self.scheduler.step_done(seqs)
        release_images(seqs)
        tops = result.top or [None] * len(sampling)
        events = [self._append_token(s.req, tok, lp, top)
                  for s, tok, lp, top in zip(sampling, result.token_ids, result.logprobs, tops)]
        return events + [self._pooled(s.req) for s in seqs if s.req.pooler is not None and s.samples]

    def _spec_step(self, seqs, drafts) -> list[StepEvent]:
        """A step where some decodes carry drafts: the target scores every draft position
        plus the bonus one in one (eager) forward; each request emits its accepted drafts
        and one more token, cut at the first stop; KV of rejected drafts is rolled back."""
        sample_idx = [i for i, s in enumerate(seqs) if s.samples]
        batch = [(s.req.token_slice(s.start, s.end) + d, s.start, s.end + len(d)) for s, d in zip(seqs, drafts)]
        tables = [self.kv.block_table(s.req.request_id) for s in seqs]
        logits = self._score(seqs, batch, tables, {i: len(drafts[i]) + 1 for i in sample_idx},
                             self._plan_states(seqs, drafts))
        rows = [self._row(seqs[i].req) for i in sample_idx]
        self.spec.select_probs(sample_idx)
        verified = self.spec.verify(self.runner.sampler, logits, rows, [drafts[i] for i in sample_idx],
                                    self.model_config.vocab_size, self.device)
        self.scheduler.step_done([s for s, d in zip(seqs, drafts) if not d])
        release_images(seqs)
        events = []
        for i, v in zip(sample_idx, verified):
            s = seqs[i]
            evs = []
            for j, tok in enumerate(v.tokens):
                top = v.top[j] if v.top is not None else None
                evs.append(self._append_token(s.req, tok, v.logprobs[j], top))
                if s.req.finished:
                    break
            if drafts[i] and not s.req.finished:
                self.spec.rollback(s.req, s.end, v.num_accepted)
            ev = evs[0]
            for e in evs[1:]:
                ev.new_token_ids += e.new_token_ids
                ev.text += e.text
                if ev.logprobs is not None:
                    ev.logprobs += e.logprobs
                ev.finish_reason, ev.stop_reason = e.finish_reason, e.stop_reason
            events.append(ev)
        return events

    # ---- prompt logprobs: the prefill's logits of every prompt position ------------------
    def _score(self, seqs, batch, tables, sample_counts: dict, states) -> Optional[torch.Tensor]:
        """``runner.score`` of each sampling row's last ``sample_counts[i]`` positions, stacked in
        row order; a prompt-logprobs request's chunk also has its prompt positions scored (in the
        same forward), turned into its prompt logprobs here and left out of what is returned."""
        want = {}  # batch row -> prompt positions [lo, hi) to score this step
        for i, s in enumerate(seqs):
            first = s.req.prompt_logprobs_from
            if first is not None:
                lo, hi = max(s.start, first), min(s.end, len(s.req.prompt_token_ids) - 1)
                if lo < hi:
                    want[i] = (lo, hi)
        idx = sorted(set(sample_counts) | set(want))
        counts = [max(sample_counts.get(i, 0), batch[i][2] - want[i][0] if i in want else 0) for i in idx]
        spans = pool_spans(seqs) or None
        logits = self.runner.score(batch, tables, idx, counts, states, spans, step_images(seqs))
        if spans is not None:
            logits, sums = logits
            absorb(seqs, spans, sums)
        if not want:
            return logits
        keep, off = [], 0
        for i, c in zip(idx, counts):
            if i in want:
                lo, hi = want[i]
                score_prompt(seqs[i].req, logits[off:off + hi - lo], lo)
            keep.extend(range(off + c - sample_counts.get(i, 0), off + c))
            off += c
        return logits[keep] if keep else None

    def _plan_states(self, seqs, drafts=None):
        """A hybrid model's state rows for the step (engine/state_cache.py); None for others."""
        return self.kv.plan_states(seqs, drafts) if isinstance(self.kv, HybridKVCacheManager) else None

    def states_held(self) -> bool:
        return isinstance(self.kv, HybridKVCacheManager) and len(self.kv.free_slots) != self.kv.layout.slots

    @staticmethod
    def _row(req: Request) -> SamplingRow:
        return SamplingRow(params=req.params, seed=req.seed, prompt_ids=req.known_prompt_ids or [],
                           output_ids=req.output_token_ids,
                           eos_token_id=req.eos_token_ids[0] if req.eos_token_ids else None, matcher=req.matcher,
                           bad_words=req.bad_words)

    def _append_token(self, req: Request, tok: int, lp: float, top) -> StepEvent:
        p = req.params
        rid, index = req.request_id.rsplit("#", 1)
        plp = None if req.output_token_ids or req.prompt_logprobs is None else [None] + req.prompt_logprobs
        ranks = None if plp is None else [None] + req.prompt_ranks
        if p.max_tokens == 0:  # scoring only: the prefill is done, nothing is generated
            self._finish(req, "length", None)
            return StepEvent(rid, int(index), [], "", [] if p.logprobs is not None else None, "length",
                             prompt_logprobs=plp, prompt_ranks=ranks)
        req.output_token_ids.append(tok)
        if req.matcher is not None:
            req.matcher.accept_token(tok)
        self.counters["generation_tokens"] += 1
        lps = None
        if p.logprobs is not None:
            d = {tok: lp}
            for tid, tlp in (top or [])[: p.logprobs]:
                d.setdefault(tid, tlp)
            lps = [d]
            req.output_logprobs.append(d)
        n_out = len(req.output_token_ids)
        reason, stop_reason = None, None
        text = ""
        can_stop = n_out >= max(1, p.min_tokens)
        if can_stop and not p.ignore_eos and tok in req.eos_token_ids:
            reason = "stop"
        elif can_stop and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif req.matcher is not None and req.matcher.is_terminated():
            reason = "stop"   # the grammar took its stop token: no token may follow (ignore_eos, min_tokens)
        # a stop token's own text is part of the output only with include_stop_str_in_output (vLLM's
        # rule for EOS and stop_token_ids); stop strings cut the text
        if req.detok is not None and (reason is None or p.include_stop_str_in_output):
            text = req.detok.add([tok])
            if reason is None and req.detok.stopped:
                reason, stop_reason = "stop", req.detok.stop_reason
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                               or req.num_tokens >= req.max_total_tokens):
            reason = "length"
        if reason is not None:
            if req.detok is not None and not req.detok.stopped:
                text += req.detok.finish()
            self._finish(req, reason, stop_reason)
        done = reason is not None
        return StepEvent(rid, int(index), [tok], text, lps, reason, stop_reason, prompt_logprobs=plp,
                         prompt_ranks=ranks, kv_transfer_params=req.kv_transfer_params if done else None,
                         num_cached_tokens=min(req.num_cached_tokens, len(req.prompt_token_ids)) if done else None)

    def _pooled(self, req: Request) -> StepEvent:
        """A pooling request whose prompt is computed: its vector, and it is done."""
        emb = vector(req, self.runner.classify)
        self._finish(req, "stop", None)
        return StepEvent(req.request_id.rsplit("#", 1)[0], 0, [], "", None, "stop", embedding=emb,
                         num_cached_tokens=min(req.num_cached_tokens, len(req.prompt_token_ids)))

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        if self.connector is not None:
            self.connector.request_finished(req, self.kv)   # a producer's blocks stay, under a lease
        self.scheduler.remove(req)
        if self.spec is not None:
            self.spec.finish(req.request_id)
        parent = req.request_id.rsplit("#", 1)[0]
        seqs = self.requests.get(parent)
        if seqs is not None and all(r.finished for r in seqs):
            del self.requests[parent]
            self.counters["finished_requests"] += 1

    # ---- introspection -----------------------------------------------------------
    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_hit_tokens": self.kv.hit_tokens,
            "prefix_cache_queried_tokens": self.kv.queried_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # (labels of the server's blitz_cache_config_info, as vLLM's cache_config_info)
            "cache_config": {"block_size": self.cache_config.block_size, "cache_dtype": self.args.kv_cache_dtype,
                             "num_gpu_blocks": self.kv.num_blocks,
                             "enable_prefix_caching": self.cache_config.enable_prefix_caching},
            **self.counters,
            **(self.kv.state_stats() if isinstance(self.kv, HybridKVCacheManager) else {}),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.connector.stats() if self.connector is not None else {}),
            **(self.lora.stats() if self.lora is not None else {}),
        }
