"""MTP speculative decoding (``{"method": "mtp"}``): DeepSeek-V3's ``MTPLayer`` run k times per
step on the target's final-normed hidden state and the newest token, over its own per-request
latents; greedy point drafts. Knows nothing about the scheduler (docs/speculative.md).
"""
from __future__ import annotations

import torch

from .hidden import HiddenCapture, HiddenStateProposer


class MTPDraft:
    """One MTP module of a DeepSeek-V3 model as a step-by-step draft."""

    def __init__(self, model, index: int = 0):
        mtp = getattr(model, "mtp", None)
        if mtp is None or len(mtp.layers) <= index:
            raise ValueError("speculative_config method 'mtp' needs a model with MTP layers (DeepSeek-V3 with "
                             "num_nextn_predict_layers > 0 and their weights in the checkpoint)")
        self.layer = mtp.layers[index]
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
        return self._proposal(drafts)
