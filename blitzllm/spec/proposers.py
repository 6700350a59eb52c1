"""Draft proposers for the ``Proposer`` interface of ``base.py``: prompt lookup (n-gram) and a
draft model with its own runner and paged KV cache. Knows nothing about verification.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch

from ..config import CacheConfig, ModelConfig
from ..layers.sampler import SamplingMetadata, SamplingRow, exponential_noise
from .base import Proposal, Proposer, common_prefix
from .config import SpeculativeConfig

assert array("I").itemsize == 4, "TokenBytes packs token ids as 4-byte words"


class TokenBytes:
    """A request's token ids as 4-byte words, extended as it grows, so prompt lookup's match is a
    C substring search (``bytes.rfind``), cheap enough for every running request at large batch."""

    def __init__(self):
        self.buf = bytearray()
        self.n = 0

    def update(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        total = len(prompt) + len(output)
        if total < self.n:  # not the sequence indexed so far: start over
            self.buf, self.n = bytearray(), 0
        p = len(prompt)
        new = (list(prompt[self.n:]) + list(output)) if self.n < p else output[self.n - p:]
        self.buf += array("I", new).tobytes()
        self.n = total

    def match(self, n_min: int, n_max: int) -> tuple:
        """``ngram_match`` of the indexed tokens: (start, n) or (-1, 0)."""
        L, buf = self.n, self.buf
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = bytes(buf[4 * (L - n):])
            end = 4 * (L - 1)  # an earlier occurrence starts at <= L - n - 1: it lies within buf[:end]
            pos = buf.rfind(suffix, 0, end)
            while pos > 0 and pos % 4:  # a match straddling token boundaries: look further back
                pos = buf.rfind(suffix, 0, pos + len(suffix) - 1)
            if pos >= 0:
                return pos // 4, n
        return -1, 0

    def tokens(self, start: int, stop: int) -> list:
        return array("I", bytes(self.buf[4 * start:4 * min(stop, self.n)])).tolist()


class NgramProposer(Proposer):
    """Prompt lookup (``ngram_lookup``) over a per-request ``TokenBytes``."""

    def __init__(self, spec: SpeculativeConfig):
        self.spec = spec
        self.index: dict[str, TokenBytes] = {}

    def finish(self, rid: str) -> None:
        self.index.pop(rid, None)

    def propose(self, reqs, limits) -> Proposal:
        s, drafts = self.spec, []
        for r, lim in zip(reqs, limits):
            idx = self.index.get(r.request_id)
            if idx is None:
                idx = self.index[r.request_id] = TokenBytes()
            idx.update(r.prompt_token_ids, r.output_token_ids)
            i, n = idx.match(s.prompt_lookup_min, s.prompt_lookup_max) if lim > 0 else (-1, 0)
            drafts.append(idx.tokens(i + n, i + n + lim) if n else [])
        return Proposal(drafts)


_DRAFT_SALT = 0x5DEECE66D  # the draft's noise must be independent of the target's draws


class DraftModelProposer(Proposer):
    """A smaller model with the target's vocabulary, its own ModelRunner and paged KV pool (no
    prefix caching), drafting greedily after catching its cache up with each request."""

    def __init__(self, spec: SpeculativeConfig, target_cfg: ModelConfig, device, dtype, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_model_len: int, seed: int,
                 attention_backend: str = "auto", new_kv=None, knobs=None):
        """``new_kv(num_blocks, block_size, enable_prefix_caching)``: a KV cache manager of the
        engine's kind (engine/kv_cache.py's ``KVCacheManager``) for the draft's own pool;
        ``knobs``: the engine's kernel knobs."""
        from ..loader.source import resolve_model
        from ..runner.build import build_runner
        self.spec = spec
        src = resolve_model(spec.model, "auto")
        cfg = ModelConfig.from_hf(src.hf_config, None)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config.model has vocab_size {cfg.vocab_size}, the target has "
                             f"{target_cfg.vocab_size}; the draft must share the target's tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model supports {cfg.max_position_embeddings} positions, "
                             f"fewer than max_model_len={max_model_len}")
        self.cfg = cfg
        self.kv = new_kv(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = build_runner(src, cfg, device=device, dtype=dtype, seed=seed, knobs=knobs,
                                   plan_cache=lambda: (CacheConfig(block_size, num_blocks, False), max_model_len),
                                   max_num_seqs=max_num_seqs, enforce_eager=True, attention_backend=attention_backend)
        self.tokens: dict[str, list] = {}   # request id -> tokens whose KV the draft cache holds

    def finish(self, rid: str) -> None:
        self.kv.free_request(rid)
        self.tokens.pop(rid, None)

    def stats(self) -> dict:
        return {"spec_draft_kv_blocks_total": self.kv.num_blocks,
                "spec_draft_kv_blocks_free": self.kv.num_free_blocks}

    @torch.inference_mode()
    def _draw(self, reqs, drafts, batch, tables) -> tuple:
        """One draft forward; each request's next draft token under its own sampling
        settings (history: its output + drafts so far). Greedy requests take the argmax
        (q = None); random ones sample q with noise salted apart from the target's draws
        and return q, the processed distribution the rejection sampler needs."""
        logits = self.runner.score(batch, tables, list(range(len(batch))), [1] * len(batch))
        rows = [SamplingRow(params=r.params, seed=(r.seed ^ _DRAFT_SALT) & (2**63 - 1), prompt_ids=r.known_prompt_ids or [],
                            output_ids=list(r.output_token_ids) + d,
                            eos_token_id=r.eos_token_ids[0] if r.eos_token_ids else None, bad_words=r.bad_words)
                for r, d in zip(reqs, drafts)]
        md = SamplingMetadata.build(rows, self.cfg.vocab_size, self.runner.device)
        x = self.runner.sampler.processed_logits(logits, md)
        if md.all_greedy:
            return x.argmax(dim=-1).tolist(), [None] * len(rows)
        q = x.softmax(dim=-1)
        noise = exponential_noise(md.seeds, md.steps, x.shape[-1])
        tokens = torch.where(md.temperature == 0, x.argmax(dim=-1), (q / noise).argmax(dim=-1)).tolist()
        return tokens, [None if r.params.temperature == 0 else q[j] for j, r in enumerate(rows)]

    def propose(self, reqs, limits) -> Proposal:
        drafts = [[] for _ in reqs]
        probs = [[] for _ in reqs]
        active = []   # (index, request id, tokens, limit, tokens the draft cache keeps)
        for i, (r, lim) in enumerate(zip(reqs, limits)):
            if lim <= 0:
                continue
            rid, toks = r.request_id, r.all_token_ids
            n = len(toks)
            keep = min(common_prefix(self.tokens.get(rid, ()), toks), n - 1)
            if rid in self.kv.tables:
                self.kv.trim(rid, keep)
            else:
                self.kv.tables[rid], self.kv.hashes[rid] = [], []
                keep = 0
            self.tokens[rid] = toks[:keep]
            # the cache will hold every known token plus all drafts but the last
            if not self.kv.allocate(rid, n + lim - 1):
                # make room: drop the state of requests not drafting now (preempted or
                # waiting ones), then retry once
                busy = {q.request_id for q in reqs}
                for other in [o for o in self.tokens if o not in busy]:
                    self.finish(other)
                if not self.kv.allocate(rid, n + lim - 1):
                    self.finish(rid)   # still no room: draft nothing for it this step
                    continue
            active.append((i, rid, toks, lim, keep))
        if not active:
            return Proposal(drafts)
        for step in range(max(a[3] for a in active)):
            live = [a for a in active if a[3] > step]
            if step == 0:   # catch up (one chunk per request) and draft the first token
                batch = [(toks[keep:], keep, len(toks)) for _, _, toks, _, keep in live]
            else:   # one token per still-drafting request
                batch = [([drafts[i][-1]], len(toks) + step - 1, len(toks) + step) for i, _, toks, _, _ in live]
            tables = [self.kv.block_table(rid) for _, rid, _, _, _ in live]
            toks_out, qs = self._draw([reqs[a[0]] for a in live], [list(drafts[a[0]]) for a in live], batch, tables)
            for (i, rid, toks, _, _), t, q in zip(live, toks_out, qs):
                self.tokens[rid] = list(toks) + drafts[i]
                drafts[i].append(t)
                probs[i].append(q)
        # blocks reserved beyond what the cache now holds go back to the pool
        for i, rid, _, _, _ in active:
            self.kv.trim(rid, len(self.tokens[rid]))
        stacked = [torch.stack(p) if p and p[0] is not None else None for p in probs]
        return Proposal(drafts, stacked if any(p is not None for p in stacked) else None)


def build_proposer(spec: SpeculativeConfig, runner=None, kv=None, **target) -> Proposer:
    """``runner`` / ``kv``: the target's ModelRunner and KV manager (EAGLE-3 and MTP read
    the target's hidden states from the runner's forwards)."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft_model":
        return DraftModelProposer(spec, **target)
    if spec.method == "eagle3":
        from .eagle3 import Eagle3Head, Eagle3Proposer
        head = Eagle3Head.load(spec.model, target["device"], target=runner.model,
                               target_cfg=target["target_cfg"])
        return Eagle3Proposer(head, runner, kv)
    if spec.method == "mtp":
        from .mtp import make_mtp_proposer
        return make_mtp_proposer(runner.model, runner, kv)
    raise ValueError(f"speculative_config.method {spec.method!r} is not available")
