"""MTP speculative decoding (``{"method": "mtp"}``): the model's multi-token-prediction layer run k
times per step on the target's final-normed hidden state and the newest token, then on its own
output and draft; greedy point drafts. DeepSeek-V3's ``MTPLayer`` over its own dense per-request
latents (``MTPProposer``); Qwen3-Next / Qwen3.5's over paged K/V in the target's blocks
(``PagedMTPProposer``). Knows nothing about the scheduler (docs/speculative.md).
"""
from __future__ import annotations

import torch

from .base import Proposal
from .hidden import HiddenCapture, HiddenStateProposer


class MTPDraft:
    """The first MTP module of a DeepSeek-V3 model as a step-by-step draft."""

    def __init__(self, model):
        mtp = getattr(model, "mtp", None)
        if mtp is None or not mtp.layers:
            raise ValueError("speculative_config method 'mtp' needs a model with MTP layers (DeepSeek-V3 with "
                             "num_nextn_predict_layers > 0 and their weights in the checkpoint)")
        self.layer = mtp.layers[0]
        self.embed = model.model.embed_tokens

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the target's, or the previous step's output) and the tokens that
        follow each position [T] -> the layer input [T, H]."""
        L = self.layer
        e = L.enorm(self.embed(tokens))
        return L.eh_proj(torch.cat([e, L.hnorm(hidden.to(e.dtype))], -1))

    def entries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple:
        """(q [T, heads, N + P], latent entries [T, R + P]) of layer inputs x at ``positions``."""
        return self.layer.self_attn.draft_entries(positions, self.layer.input_layernorm(x))

    def finish(self, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, H] for inputs x [T, H] whose queries q attend to the
        entries kv of positions 0..len(kv)-1."""
        L, attn = self.layer, self.layer.self_attn
        o = attn.draft_attend(q, kv, qpos)
        h = x + attn.o_proj(o.reshape(o.shape[0], -1))
        return h + L.mlp(L.post_attention_layernorm(h))

    def draft(self, out: torch.Tensor) -> int:
        head = self.layer.shared_head
        return int(head.head(head.norm(out)).float().argmax(-1))


class MTPProposer(HiddenStateProposer):
    """Per request ``cache``: (tokens used, latent entries [c, R + P]) of the module at the
    positions whose target hidden states it has seen; each call extends them with the new
    positions, then drafts k tokens greedily."""

    def __init__(self, model, runner, kv):
        self.draft = MTPDraft(model)
        super().__init__(HiddenCapture(model, [], final_features=True), runner, kv)

    @torch.inference_mode()
    def propose(self, reqs, limits):
        self._ingest()
        D = self.draft
        dev = D.embed.weight.device
        drafts = []
        for r, lim in zip(reqs, limits):
            rid, all_ids = r.request_id, r.all_token_ids
            n = len(all_ids) - 1          # hidden states needed for positions 0..n-1
            hidden = self.features(rid, all_ids) if lim > 0 else None
            if hidden is None:
                drafts.append([])
                continue
            m = self.reusable(rid, all_ids, n)
            # entries of positions m..n-1 (position t: the target's h_t, token t + 1)
            pos = torch.arange(m, n, device=dev)
            x = D.inputs(hidden[m:n].to(dev), torch.tensor(all_ids[m + 1:n + 1], device=dev))
            q, kv = D.entries(x, pos)
            kv = kv if m == 0 else torch.cat([self.cache[rid][1][:m], kv])
            self.cache[rid] = (list(all_ids[1:n + 1]), kv)
            # step 0: the last position's query; steps 1..: the module's own output and draft
            out = D.finish(x[-1:], q[-1:], kv, pos[-1:])
            d = [D.draft(out)]
            for j in range(1, lim):
                pj = torch.tensor([n - 1 + j], device=dev)
                xj = D.inputs(out, torch.tensor(d[-1:], device=dev))
                qj, ej = D.entries(xj, pj)
                kv = torch.cat([kv, ej])
                out = D.finish(xj, qj, kv, pj)
                d.append(D.draft(out))
            drafts.append(d)
        return Proposal(drafts)


class PagedMTPProposer(HiddenStateProposer):
    """MTP of the hybrid models (Qwen3-Next, Qwen3.5; ``models/qwen3_next_mtp.py``): the layer's
    K/V in a paged cache tensor of its own (cache index num_layers) indexed by the target's block
    tables, so the target's blocks hold the draft's pages too: admission and preemption hand them
    out and take them back with the target's (the KV budget counts the extra layer,
    ``engine/args.py``), and the proposer reserves the blocks its later draft steps write ahead of
    the verify step (which needs them anyway). Per request ``cache``: (tokens used,) of the
    positions whose entries the pages hold; a request's blocks freed (finish, abort, preemption)
    forget them. ``pages``: the full blocks whose every entry was written, by the chained hash of
    the tokens they were written for, so a request that starts with cached blocks (a prefix-cache
    hit, a recompute) takes the entries of those that still hold them and needs the target's
    hidden states only past them. Each call writes the entries of the new positions and drafts
    from the last one, batched over the requests, then runs the further steps on its own output
    and draft."""

    def __init__(self, model, runner, kv):
        if not hasattr(model, "check_mtp"):
            raise ValueError("speculative_config method 'mtp' needs a model with MTP layers")
        model.check_mtp()
        self.model, self.mtp = model, model.mtp
        k, v = runner.kv_caches[runner.cfg.kv_layers[0]]
        # (every draft step runs MTP layer 0, as vLLM does past the checkpoint's MTP layers)
        self.kv_caches = list(runner.kv_caches) + [(torch.zeros_like(k), torch.zeros_like(v))]
        super().__init__(HiddenCapture(model, [], final_features=True), runner, kv)
        self.pages: dict = {}   # block id -> the hash of the tokens its entries were written for
        free = kv.free_request

        def freeing(rid):
            self.cache.pop(rid, None)   # (its pages go back: the entries are gone)
            free(rid)
        kv.free_request = freeing

    @torch.inference_mode()
    def propose(self, reqs, limits):
        from ..kernels._common import reference_ops
        self._ingest()
        with reference_ops(self.runner.knobs.reference):
            return Proposal(self._draft(reqs, limits))

    def _draft(self, reqs, limits) -> list:
        drafts = [[] for _ in reqs]
        live, seqs, tables, hidden = [], [], [], []
        for i, (r, lim) in enumerate(zip(reqs, limits)):
            rid, ids = r.request_id, r.all_token_ids
            n = len(ids) - 1          # entries of positions 0..n-1 (the target's hidden states there)
            m = min(self.reusable(rid, ids, n) if rid in self.cache else self._in_pages(rid), n - 1)
            h = self.features(rid, ids, m) if lim > 0 else None
            if h is None:
                continue
            lim = min(lim, self._reserve(rid, n + lim - 1) - n + 1)   # step j writes position n - 1 + j
            if lim <= 0:
                continue
            self.cache[rid] = (list(ids[1:n + 1]),)
            self._mark(rid, m, n, n + lim - 1)
            live.append((i, n, lim))
            seqs.append((list(ids[m + 1:n + 1]), m, n))   # position t: h_t and token t + 1
            tables.append(self.kv.block_table(rid))
            hidden.append(h)
        out = None
        for j in range(max((lim for _, _, lim in live), default=0)):
            if j:  # the live requests' next step: their own output and draft at the next position
                keep = [a for a, (_, _, lim) in enumerate(live) if lim > j]
                hidden = [out[a:a + 1] for a in keep]
                live, tables = [live[a] for a in keep], [tables[a] for a in keep]
                seqs = [([drafts[i][-1]], n - 1 + j, n + j) for i, n, _ in live]
            out = self._step(seqs, tables, hidden)
            for (i, _, _), t in zip(live, self.model.compute_logits(out).argmax(-1).tolist()):
                drafts[i].append(t)
        return drafts

    def _step(self, seqs, tables, hidden) -> torch.Tensor:
        """One batched MTP forward (its pages written) -> the output of each sequence's last position."""
        from ..layers.attention import ForwardContext, forward_context
        runner = self.runner
        ids, pos, md, qsl = type(runner).prepare(runner, seqs, tables)   # (not the recording wrapper)
        x = self.mtp.inputs(self.model.model.embed_tokens(ids), torch.cat(hidden).to(ids.device))
        with forward_context(ForwardContext(md, self.kv_caches, runner.backend)):
            out = self.mtp(pos, x)
        return out.index_select(0, torch.tensor(qsl[1:], device=out.device) - 1)

    def _append(self, rid, start, toks, feats) -> None:
        have = self.toks.get(rid, [])
        if start > len(have):  # a prefix-cache hit skipped these positions: their entries may be in the pages
            gap = start - len(have)
            old, pad = self.feats.get(rid), feats.new_zeros(gap, feats.shape[1])
            self.toks[rid] = have + [None] * gap
            self.feats[rid] = pad if old is None else torch.cat([old[:len(have)], pad])
        super()._append(rid, start, toks, feats)

    def _in_pages(self, rid: str) -> int:
        """Leading positions of the request whose entries its blocks hold (written for the same tokens)."""
        table, hashes = self.kv.block_table(rid), self.kv.hashes.get(rid, [])
        b = 0
        while b < len(hashes) and self.pages.get(table[b]) == hashes[b]:
            b += 1
        return b * self.kv.block_size

    def _mark(self, rid: str, m: int, n: int, end: int) -> None:
        """This call writes the entries of positions m..end-1 (those from n on by draft steps): the
        request's full blocks of positions < n then hold all theirs; the blocks past them do not."""
        table, hashes, bs = self.kv.block_table(rid), self.kv.hashes.get(rid, []), self.kv.block_size
        for b in range(m // bs, -(-end // bs)):
            if b < min(n // bs, len(hashes)):
                self.pages[table[b]] = hashes[b]
            else:
                self.pages.pop(table[b], None)

    def _reserve(self, rid: str, num_tokens: int) -> int:
        """Blocks for ``num_tokens`` tokens of the request where the pool has them; the tokens its
        blocks hold now."""
        if self.kv.allocate(rid, num_tokens):
            return num_tokens
        return len(self.kv.block_table(rid)) * self.kv.block_size


def make_mtp_proposer(model, runner, kv):
    """The MTP proposer of the model: paged for the hybrid models, DeepSeek's otherwise."""
    if hasattr(model, "state_layers"):
        return PagedMTPProposer(model, runner, kv)
    return MTPProposer(model, runner, kv)
