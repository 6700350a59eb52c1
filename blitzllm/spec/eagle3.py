"""EAGLE-3 draft head: one decoder layer fed with the token embedding and a projection of the
target's low / middle / high hidden states, its own final norm and the target's frozen lm_head
(a folder of config.json + model.safetensors). Owns the head (plain torch: training and
drafting) and its training-time-test mask; knows nothing about the scheduler.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.rotary import apply_rotary_torch, build_cos_sin_cache
from .base import Proposal, ngram_match
from .hidden import HiddenCapture, HiddenStateProposer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


COPY_MAX_N = 3     # longest suffix n-gram the copy input looks up
COPY_GATE_SCALE = 8.0   # the gate's parameters are this many times smaller than its effect
# (they start at 0; Adam's step then moves the gate by ~lr * 8 per step)


def copy_candidates(tokens: list, max_n: int = COPY_MAX_N) -> tuple:
    """Per position p of ``tokens``: (the token after the most recent earlier occurrence of
    the longest n-gram (n <= max_n) that ends at p, n), or (0, 0) where none occurred."""
    last = [dict() for _ in range(max_n + 1)]
    cand, length = [], []
    for p in range(len(tokens)):
        c = n_found = 0
        for n in range(min(max_n, p + 1), 0, -1):
            q = last[n].get(tuple(tokens[p - n + 1:p + 1]))
            if q is not None:
                c, n_found = tokens[q + 1], n
                break
        cand.append(c)
        length.append(n_found)
        for n in range(1, min(max_n, p + 1) + 1):
            last[n][tuple(tokens[p - n + 1:p + 1])] = p
    return cand, length


def copy_candidate_at(tokens: list, max_n: int = COPY_MAX_N) -> tuple:
    """``copy_candidates`` of the last position alone: prompt lookup's match (a scan back
    from the end; the reference the proposer's ``CopyIndex`` is tested against)."""
    i, n = ngram_match(tokens, 1, max_n)
    return (tokens[i + n], n) if n else (0, 0)


class CopyIndex:
    """``copy_candidate_at`` for a growing token sequence without a scan per call: the last end of
    every n-gram (n <= max_n), extended as the sequence grows and rebuilt when the old one is not
    its prefix. ``candidate(extra)``: the candidate of the last position of tokens + extra."""

    def __init__(self, max_n: int = COPY_MAX_N):
        self.max_n = max_n
        self.tokens: list = []
        self.last = [dict() for _ in range(max_n + 1)]

    def update(self, tokens: list) -> None:
        tokens = list(tokens)
        if tokens[:len(self.tokens)] != self.tokens:
            self.tokens, self.last = [], [dict() for _ in range(self.max_n + 1)]
        for q in range(max(0, len(self.tokens) - 1), len(tokens) - 1):   # ends 0 .. len - 2
            for n in range(1, min(self.max_n, q + 1) + 1):
                self.last[n][tuple(tokens[q - n + 1:q + 1])] = q
        self.tokens = tokens

    def candidate(self, extra: list = ()) -> tuple:
        seq = self.tokens + list(extra)
        p = len(seq) - 1
        first_direct = max(0, len(self.tokens) - 1)   # ends from here to p - 1: not indexed
        for n in range(min(self.max_n, p + 1), 0, -1):
            suffix = seq[p - n + 1:]
            for q in range(p - 1, max(first_direct, n - 1) - 1, -1):
                if seq[q - n + 1:q + 1] == suffix:
                    return seq[q + 1], n
            q = self.last[n].get(tuple(suffix))
            if q is not None:
                return seq[q + 1], n
        return 0, 0


def default_layer_ids(num_layers: int) -> list:
    """Outputs of layers 1, L/2 - 1 and L - 4 (the hidden states entering layers 2, L/2
    and L - 3), clamped for very shallow models."""
    L = num_layers
    return [min(1, L - 1), max(L // 2 - 1, 0), max(L - 4, 0)]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    layer_ids: list = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # RMSNorm (own weights) on each of the three target features before fc: the raw layer
    # outputs differ ~10x in scale between layers and carry massive-activation outliers
    feature_norm: bool = False
    # > 0: the head predicts over this many target tokens only (the buffer d2t maps its
    # indices to target ids; its lm_head rows are the target's rows of those tokens)
    draft_vocab_size: int = 0
    # the copy input (``copy_candidates``): the layer output also gets, per position, the
    # embedding of the token that followed the last earlier occurrence of its longest suffix
    # n-gram (n <= COPY_MAX_N, as prompt lookup finds it), times a learned gate per n
    copy_input: bool = False
    architecture: str = "Eagle3DraftHead"

    @classmethod
    def from_target(cls, cfg, layer_ids: Optional[list] = None, feature_norm: bool = False) -> "Eagle3Config":
        """The draft layer mirrors a target layer's widths (``cfg``: blitzllm ModelConfig)."""
        return cls(feature_norm=feature_norm, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   vocab_size=cfg.vocab_size, target_hidden_size=cfg.hidden_size,
                   layer_ids=list(layer_ids or default_layer_ids(cfg.num_layers)),
                   rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                   max_position_embeddings=cfg.max_position_embeddings)

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H, D = cfg.hidden_size, cfg.head_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)   # the target's, frozen
        if cfg.feature_norm:
            self.feature_norms = nn.ModuleList(nn.RMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps)
                                               for _ in range(3))
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.input_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.post_attention_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)   # the target's (rows), frozen
        if cfg.copy_input:   # gate per n-gram length (row 0: no occurrence, never used)
            self.copy_gate = nn.Parameter(torch.zeros(COPY_MAX_N + 1, H))
        if cfg.draft_vocab_size:
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))
        self.register_buffer("cos_sin", build_cos_sin_cache(D, cfg.max_position_embeddings, cfg.rope_theta),
                             persistent=False)

    # ---- building blocks -------------------------------------------------------------
    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3 * target_hidden] -> the layer's hidden input [T, H]."""
        x = feats.to(self.fc.weight.dtype)
        if self.config.feature_norm:
            x = torch.cat([n(f) for n, f in zip(self.feature_norms, x.chunk(3, -1))], -1)
        return self.fc(x)

    def qkv(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """hidden [T, H] (projected target features or a previous draft step's output),
        tokens [T] (the token following each hidden's position) -> rotated q, k and v."""
        c = self.config
        x = torch.cat([self.input_norm(self.embed_tokens(tokens)), self.hidden_norm(hidden)], -1)
        T = x.shape[0]
        q = apply_rotary_torch(self.q_proj(x).view(T, c.num_heads, c.head_dim), positions, self.cos_sin)
        k = apply_rotary_torch(self.k_proj(x).view(T, c.num_kv_heads, c.head_dim), positions, self.cos_sin)
        return q, k, self.v_proj(x).view(T, c.num_kv_heads, c.head_dim)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """q [Tq, Hq, D], k/v [Tk, Hkv, D], mask [Tq, Tk] (True = visible) -> [Tq, Hq * D]."""
        g = self.config.num_heads // self.config.num_kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask)
        return o.transpose(0, 1).reshape(q.shape[0], -1)

    def copy_vector(self, cand: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """The copy input of positions with copy candidates ``cand`` [T] found by n-grams of
        ``length`` [T] (0: none): gate[n] * embedding(candidate), 0 where length is 0."""
        gate = self.copy_gate[length] * COPY_GATE_SCALE
        return gate * self.embed_tokens(cand) * (length > 0).unsqueeze(-1).to(gate.dtype)

    def finish_layer(self, attn_out: torch.Tensor, residual: torch.Tensor,
                     copy: Optional[torch.Tensor] = None) -> torch.Tensor:
        """o_proj + residual (+ the copy input), then the MLP block; returns the layer output
        (pre final norm)."""
        h = residual + self.o_proj(attn_out)
        if copy is not None:
            h = h + copy
        m = self.post_attention_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (the target's unless reduced: see ``draft_tokens``)."""
        return self.lm_head(self.norm(out)).float()

    def draft_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy drafts as target token ids from ``logits`` [..., draft vocab]."""
        idx = logits.argmax(-1)
        return self.d2t[idx] if self.config.draft_vocab_size else idx

    def reduce_vocab(self, d2t: torch.Tensor) -> None:
        """Predict over the target tokens ``d2t`` only: the lm_head keeps those rows of the target's
        (frozen); the full one stays as ``full_lm_head`` (not saved) for training labels."""
        d2t = torch.as_tensor(d2t, dtype=torch.long).flatten()
        V = self.config.vocab_size
        if d2t.numel() == 0 or d2t.unique().numel() != d2t.numel() or int(d2t.min()) < 0 or int(d2t.max()) >= V:
            raise ValueError(f"draft vocabulary must be distinct target token ids in [0, {V})")
        if self.config.draft_vocab_size:
            raise ValueError("the head's vocabulary is already reduced")
        full = self.lm_head.weight.detach()
        dev = full.device
        self.register_buffer("full_lm_head", full, persistent=False)
        self.lm_head = nn.Linear(full.shape[1], d2t.numel(), bias=False, device=dev, dtype=full.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(full[d2t.to(dev)])
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", d2t.to(dev))
        self.config.draft_vocab_size = int(d2t.numel())

    # ---- training: one sequence, ``steps`` draft steps (training-time test) ------------
    def forward_steps(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int,
                      copy: Optional[tuple] = None) -> list:
        """feats [T, 3Ht]: target features of positions 0..T-1; tokens [T + steps]: ids of positions
        1..T+steps (token t+1+j is step j's input at row t); ``copy``: (candidates, lengths) of the
        same positions, each [T + steps]. Returns per step j the layer output [T, H] (row t predicts
        position t + 2 + j); step j's query at row t sees step-0 keys <= t and steps 1..j at t."""
        T = feats.shape[0]
        pos = torch.arange(T, device=feats.device)
        causal = pos[None, :] <= pos[:, None]
        eye = torch.eye(T, dtype=torch.bool, device=feats.device)
        hidden = self.project(feats)
        ks, vs, out = [], [], []
        for j in range(steps):
            q, k, v = self.qkv(hidden, tokens[j:j + T], pos + j)
            ks.append(k)
            vs.append(v)
            mask = torch.cat([causal] + [eye] * j, 1)
            cv = self.copy_vector(copy[0][j:j + T], copy[1][j:j + T]) if self.config.copy_input else None
            hidden = self.finish_layer(self.attend(q, torch.cat(ks), torch.cat(vs), mask), hidden, cv)
            out.append(hidden)
        return out

    # ---- save / load -----------------------------------------------------------------
    FROZEN = ("embed_tokens.weight", "lm_head.weight")   # the target's: not saved

    def save(self, path: str) -> None:
        """config.json + model.safetensors with the trained weights only: the frozen
        embedding and lm_head are the target's and come from it at load time."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG), "w") as f:
            json.dump(asdict(self.config), f, indent=2)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if k not in self.FROZEN},
                  os.path.join(path, WEIGHTS))

    @classmethod
    def load(cls, path: str, device="cpu", dtype=torch.float32, target=None, target_cfg=None) -> "Eagle3Head":
        """``target`` (a blitzllm causal LM) and ``target_cfg`` supply the frozen embedding
        and lm_head when the folder does not hold them, and are checked against the head."""
        from safetensors.torch import load_file
        cfg_path, w_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
        if not (os.path.isfile(cfg_path) and os.path.isfile(w_path)):
            raise ValueError(f"speculative_config.model {path!r} is not an EAGLE-3 head folder "
                             f"({CONFIG} + {WEIGHTS}, as written by `blitz train-draft`)")
        with open(cfg_path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or raw.get("architecture") != "Eagle3DraftHead":
            raise ValueError(f"speculative_config.model {path!r} is not an EAGLE-3 head folder (its "
                             f"{CONFIG} is not an Eagle3DraftHead's, as written by `blitz train-draft`)")
        cfg = Eagle3Config.from_dict(raw)
        if target_cfg is not None:
            if (cfg.vocab_size, cfg.target_hidden_size) != (target_cfg.vocab_size, target_cfg.hidden_size):
                raise ValueError(f"EAGLE-3 head {path!r} was trained for vocab {cfg.vocab_size} / hidden "
                                 f"{cfg.target_hidden_size}; the target has {target_cfg.vocab_size} / "
                                 f"{target_cfg.hidden_size}")
            if max(cfg.layer_ids) >= target_cfg.num_layers:
                raise ValueError(f"EAGLE-3 head {path!r} reads target layers {cfg.layer_ids}; the target has "
                                 f"{target_cfg.num_layers} layers")
        state = load_file(w_path)
        if any(k not in state for k in cls.FROZEN):
            if target is None:
                raise ValueError(f"EAGLE-3 head {path!r} shares the target's embedding and lm_head: "
                                 "load it with its target")
            embed, lm_head = _target_embed_lm_head(target, target_cfg)
            state.setdefault("embed_tokens.weight", embed.detach().float().cpu())
            lm_head = lm_head.detach().float().cpu()
            if cfg.draft_vocab_size:   # the target's rows of the draft tokens
                if "d2t" not in state or state["d2t"].numel() != cfg.draft_vocab_size:
                    raise ValueError(f"EAGLE-3 head {path!r}: draft_vocab_size {cfg.draft_vocab_size} "
                                     "without a matching d2t map in its weights")
                lm_head = lm_head[state["d2t"].long()]
            state.setdefault("lm_head.weight", lm_head)
        head = cls(cfg)
        head.load_state_dict(state)
        return head.to(device, dtype).eval()

    @classmethod
    def from_target(cls, model, cfg, layer_ids: Optional[list] = None, feature_norm: bool = False,
                    init_layer: bool = False, intermediate_size: int = 0, copy_input: bool = False) -> "Eagle3Head":
        """A fresh head for ``model`` (a blitzllm causal LM): embedding and lm_head copied (frozen),
        final norm the target's (trained), fc the identity on the high layer's features; the layer
        small, or (``init_layer``) the target's last one. ``intermediate_size`` > 0: MLP width."""
        hc = Eagle3Config.from_target(cfg, layer_ids, feature_norm)
        hc.copy_input = copy_input
        if intermediate_size:
            if init_layer and intermediate_size != cfg.intermediate_size:
                raise ValueError(f"--init-layer copies the target's MLP ({cfg.intermediate_size} wide): "
                                 f"--draft-intermediate {intermediate_size} does not fit it")
            hc.intermediate_size = intermediate_size
        head = cls(hc)
        H = cfg.hidden_size
        embed, lm_head = _target_embed_lm_head(model, cfg)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embed.float())
            head.lm_head.weight.copy_(lm_head.float())
            head.norm.weight.copy_(model.model.norm.weight.float())
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, 2 * H:] += torch.eye(H)
            if init_layer:
                _copy_target_layer(head, model.model.layers[-1])
            else:
                head.o_proj.weight.mul_(0.1)
                head.down_proj.weight.mul_(0.1)
        return head


def _dense(linear, in_features: int) -> torch.Tensor:
    """[out, in] float weight of a target linear layer, whatever its storage (packed int4
    included): the layer applied to the identity."""
    w = getattr(linear, "weight", None)
    dt = w.dtype if w is not None and w.is_floating_point() else torch.float32
    dev = next(iter(list(linear.parameters()) + list(linear.buffers()))).device
    out = linear(torch.eye(in_features, device=dev, dtype=dt))
    if getattr(linear, "bias", None) is not None:
        out = out - linear.bias
    return out.t().float().cpu()


def _copy_target_layer(head: "Eagle3Head", layer) -> None:
    c, H = head.config, head.config.hidden_size
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _dense(attn.qkv_proj, H)
    for proj, w in ((head.q_proj, qkv[:nq]), (head.k_proj, qkv[nq:nq + nkv]), (head.v_proj, qkv[nq + nkv:])):
        proj.weight[:, :H] *= 0.1
        proj.weight[:, H:] = w
    head.o_proj.weight.copy_(_dense(attn.o_proj, nq))
    gu = _dense(mlp.gate_up_proj, H)
    head.gate_proj.weight.copy_(gu[:c.intermediate_size])
    head.up_proj.weight.copy_(gu[c.intermediate_size:])
    head.down_proj.weight.copy_(_dense(mlp.down_proj, c.intermediate_size))
    head.hidden_norm.weight.copy_(layer.input_layernorm.weight.float())
    head.post_attention_norm.weight.copy_(layer.post_attention_layernorm.weight.float())


def _target_embed_lm_head(model, cfg) -> tuple:
    """The target's input embedding and lm_head weights ([V, H] each). A quantized lm_head
    (weight_dtype='int4') has no float weight: a tied one is the embedding."""
    embed = model.model.embed_tokens.weight
    lm = getattr(model.lm_head, "weight", None)
    if lm is None:
        if cfg is None or not cfg.tie_word_embeddings:
            raise ValueError("EAGLE-3 needs the target's lm_head weights; this target's are quantized")
        lm = embed
    return embed, lm


class Eagle3Proposer(HiddenStateProposer):
    """Drafts k tokens per request greedily (point drafts) with an EAGLE-3 head; ``cache`` holds per
    request the head's step-0 K/V of the verified positions (tokens, k / v [c, Hkv, D])."""

    def __init__(self, head: Eagle3Head, runner, kv):
        super().__init__(HiddenCapture(runner.model, head.config.layer_ids), runner, kv)
        self.head = head

    def _copy(self, index: Optional[CopyIndex], drafts: list, dev) -> Optional[torch.Tensor]:
        """The copy input of the last position of the request's tokens + ``drafts`` (heads
        with the copy input; ``index`` holds the request's tokens)."""
        if index is None:
            return None
        c, n = index.candidate(drafts)
        return self.head.copy_vector(torch.tensor([c], device=dev), torch.tensor([n], device=dev))

    @torch.inference_mode()
    def propose(self, reqs, limits):
        self._ingest()
        head, dev = self.head, self.head.fc.weight.device
        drafts = []
        for r, lim in zip(reqs, limits):
            rid, all_ids = r.request_id, r.all_token_ids
            n = len(all_ids) - 1          # features needed for positions 0..n-1
            feats = self.features(rid, all_ids) if lim > 0 else None
            if feats is None:
                drafts.append([])
                continue
            feats = feats.to(dev)
            m = self.reusable(rid, all_ids, n)
            _, k0, v0 = self.cache.get(rid, ([], None, None))
            # step-0 entries of positions m..n-1 (position t: features t, token t + 1)
            pos = torch.arange(m, n, device=dev)
            tok = torch.tensor(all_ids[m + 1:n + 1], device=dev)
            hidden = head.project(feats[m:n])
            q, k, v = head.qkv(hidden, tok, pos)
            k0 = k if m == 0 else torch.cat([k0[:m], k])
            v0 = v if m == 0 else torch.cat([v0[:m], v])
            self.cache[rid] = (list(all_ids[1:n + 1]), k0, v0)
            # step 0: the last position's query over all step-0 entries
            index = None
            if head.config.copy_input:
                index = self.copy_index.setdefault(rid, CopyIndex())
                index.update(all_ids)
            out = head.finish_layer(head.attend(q[-1:], k0, v0, None), hidden[-1:], self._copy(index, [], dev))
            d = [int(head.draft_tokens(head.logits(out)))]
            ks, vs = [k0], [v0]
            for j in range(1, lim):
                qj, kj, vj = head.qkv(out, torch.tensor(d[-1:], device=dev),
                                      torch.tensor([n - 1 + j], device=dev))
                ks.append(kj)
                vs.append(vj)
                out = head.finish_layer(head.attend(qj, torch.cat(ks), torch.cat(vs), None), out,
                                        self._copy(index, d, dev))
                d.append(int(head.draft_tokens(head.logits(out))))
            drafts.append(d)
        return Proposal(drafts)
