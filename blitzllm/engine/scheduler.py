"""Continuous batching: each step, catch every request's computed tokens up to its known
tokens within a token budget. Running decodes go first, then running prefills (chunked),
then waiting requests in arrival order. When blocks run out, the newest running request is
preempted (recompute: its blocks are freed, it goes back to the front of the queue).

With the ``priority`` policy (vLLM's: lower value first, ties by arrival) every "arrival order"
above reads (priority, arrival): the queue, the order running requests take the budget, and
the victim (the lowest priority, newest). A waiting request that does not fit also preempts
running requests of a lower priority than its own, so urgent work does not wait for long
generations to end.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Optional

from ..config import SchedulerConfig
from .kv_cache import KVCacheManager
from .request import Request, Status


# a prefill chunk that scores its prompt (prompt logprobs) has logits for every position:
# [chunk, vocab], so its chunks are bounded
PROMPT_LOGPROBS_CHUNK = 512


def _chunk_cap(req: Request) -> int:
    return PROMPT_LOGPROBS_CHUNK if req.prompt_logprobs_from is not None else 1 << 62


@dataclass
class ScheduledSeq:
    req: Request
    start: int        # first token index computed this step
    num_tokens: int   # tokens computed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token: a token is sampled."""
        return self.end == self.req.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager):
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.lookahead = False  # set by the engine when its runner pipelines decode steps
        self.remote_tokens = None  # a KV connector's: req -> prompt tokens whose KV came with it
        self.max_loras = 0  # with enable_lora: distinct adapters the running requests may use (0: no limit)

    @staticmethod
    def _key(req: Request) -> tuple:
        return req.priority, req.arrival

    def add(self, req: Request) -> None:
        # (a preempted request keeps its place: under fcfs, before every request that came later)
        bisect.insort(self.waiting, req, key=self._key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free_request(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.add(req)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.cfg.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # decodes (one new token) before chunked prefills, each group in queue order
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, *self._key(r)))
        scheduled = set()
        for req in order:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted as a victim below
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, _chunk_cap(req))
            # decodes reserve the next token's slot too when blocks are plentiful: the
            # runner may compute one step ahead (its pipelined decode)
            if (n == 1 and self.lookahead and self.kv.num_free_blocks > self.cfg.max_num_seqs
                    and req.num_computed_tokens + 2 <= self.cfg.max_model_len):
                self.kv.allocate(req.request_id, req.num_computed_tokens + 2)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = max((r for r in self.running if r.request_id not in scheduled), key=self._key)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.append(ScheduledSeq(req, req.num_computed_tokens, n))
                scheduled.add(req.request_id)
                budget -= n
        # newly admitted requests, in queue order
        skipped = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.lora is not None and self.max_loras and not self._lora_fits(req):
                # its adapter waits for a slot (running requests hold them all); those behind may run
                skipped.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.cfg.max_num_seqs:
                freed = self._make_room(req, out)
                if freed is None:
                    break
                budget += freed
                continue
            if req.request_id not in self.kv.tables:
                # (prompt logprobs and pooling need positions the cache would skip)
                req.num_computed_tokens = self.kv.match_prefix(req.request_id, req.cacheable_tokens, req.cache_root)
                req.num_cached_tokens = max(req.num_cached_tokens, req.num_computed_tokens)
                if self.remote_tokens is not None:  # (landed by the engine before the forward)
                    req.num_computed_tokens = max(req.num_computed_tokens, self.remote_tokens(req))
            n = min(req.num_tokens - req.num_computed_tokens, budget, _chunk_cap(req))
            fits = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            while not fits and (freed := self._make_room(req, out)) is not None:
                budget += freed
                fits = self.kv.allocate(req.request_id, req.num_computed_tokens + n)
            if not fits:
                if not self.running and not out:
                    # nothing else holds blocks: it can never fit
                    raise RuntimeError("KV cache too small for a single request")
                self.kv.free_request(req.request_id)  # release prefix hits while it waits
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
        for req in skipped:
            self.add(req)
        return out

    def _lora_fits(self, req: Request) -> bool:
        """Whether ``req``'s adapter is one the running requests use, or a slot is left for it."""
        active = {r.lora.key for r in self.running if r.lora is not None}
        return req.lora.key in active or len(active) < self.max_loras

    def _make_room(self, req: Request, out: list) -> Optional[int]:
        """Under the priority policy, preempt the lowest-priority running request if its priority
        is below ``req``'s (a larger value); returns the token budget its part of this step gave
        back (it leaves ``out``), or None when there is no such request."""
        victim = max(self.running, key=self._key, default=None)
        if self.cfg.policy != "priority" or victim is None or victim.priority <= req.priority:
            return None
        freed = 0
        for i, s in enumerate(out):
            if s.req is victim:
                freed = s.num_tokens
                del out[i]
                break
        self._preempt(victim)
        return freed

    def step_done(self, seqs: list[ScheduledSeq]) -> None:
        """Record that the scheduled tokens now have their KV written."""
        bs = self.kv.block_size
        for s in seqs:
            s.req.num_computed_tokens = s.end
            if s.end // bs > len(self.kv.hashes.get(s.req.request_id, ())):
                self.kv.commit(s.req.request_id, s.req.hash_tokens, s.end, s.req.cache_root)
