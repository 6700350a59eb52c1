"""Batch -> tensors -> logits -> sampled tokens.

Owns the model weights, the KV cache tensors and the attention backend. Turns the
scheduler's list of (request, token range) into flat input ids, positions and attention
metadata, runs the model inside a forward context and samples on the device. Knows nothing
about stop conditions or text.

Tensor parallel: every rank has a runner over its shard of the model and of the KV cache.
Rank 0's runner has a ``driver`` (``engine/tp.py``) and broadcasts each
forward's host inputs before running it; the other ranks' runners get them in
``engine/tp.py`` and run the same forward, so the collectives inside meet.
Sampling happens on rank 0 only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import CacheConfig, ModelConfig
from ..distributed.parallel_state import SINGLE, TPGroup
from ..envs import Knobs
from ..kernels._common import reference_ops
from ..kernels.attention.kv_store import kv_cache_dtype
from ..layers.attention import AttentionMetadata, ForwardContext, forward_context, select_backend
from ..layers.sampler import Sampler, SamplingMetadata, SamplingRow
from ..layers.state import StatePlan, state_context
from .state_pool import StatePool


@dataclass
class ImageStep:
    """A step's image inputs as rank 0 makes them (``ModelRunner.image_step``) and every
    tensor-parallel rank reads: each token's rotary position (index + delta past a prompt's
    images); where chunks hold image tokens, their [3, T] M-RoPE positions; and the embedding
    rows of the images or of prompts given as embeddings (``vals``) with the step's token index
    of each (``rows``)."""
    positions: list
    pos3: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    vals: Optional[torch.Tensor] = None

    def to_host(self) -> "ImageStep":
        """For the broadcast to the other ranks (the embeddings pickled from host memory)."""
        return ImageStep(self.positions, self.pos3, self.rows, None if self.vals is None else self.vals.cpu())


@dataclass
class StepResult:
    token_ids: list           # one per sampled sequence
    logprobs: list            # chosen-token logprob per sampled sequence
    top: Optional[list]       # per sampled sequence: list of (id, logprob), or None


def allocate_kv_caches(cfg: ModelConfig, cache: CacheConfig, dtype, device, tp_size: int = 1) -> list:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, heads, dim]; MLA models
    get (latent_cache, None) with one head of kv_lora_rank + qk_rope_head_dim values, or with a
    sparse-attention indexer (latent_cache, indexer_key_cache [num_blocks, block_size, 1,
    index_head_dim]). With ``tp_size`` ranks, a rank's share of the KV heads. Layers without a
    KV cache (a hybrid model's state layers) get tensors of no blocks. K/V and latents are of
    ``cache.kv_cache_dtype`` (fp8: float8 e4m3), an indexer's keys of the model's ``dtype``."""
    n, heads, dim = cfg.kv_cache_entry_for(tp_size)
    kv_layers = set(cfg.kv_layers)
    kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, dtype)
    out = []
    for i in range(cfg.num_layers):
        shape = (cache.num_blocks if i in kv_layers else 0, cache.block_size, heads, dim)
        k = torch.zeros(shape, dtype=kv_dtype, device=device)
        if n == 2:
            second = torch.zeros(shape, dtype=kv_dtype, device=device)
        else:
            second = torch.zeros(shape[:3] + (cfg.index_head_dim,), dtype=dtype, device=device) \
                if cfg.index_head_dim else None
        out.append((k, second))
    return out


def _kernel_mode(method):
    """Run a ModelRunner entry point with every op on its torch reference when the engine's
    knob asks (``knobs.reference``; ``kernels/_common.reference_ops``)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with reference_ops(self.knobs.reference):
            return method(self, *args, **kwargs)
    return run


class ModelRunner:
    def __init__(self, model, cfg: ModelConfig, cache: CacheConfig, device, dtype,
                 max_num_seqs: int = 256, max_model_len: int = 4096, enforce_eager: bool = False,
                 attention_backend: str = "auto", tp: TPGroup = SINGLE, max_decode_rows: int = 0,
                 knobs: Optional[Knobs] = None, lora=None):
        """``max_decode_rows``: decode graphs are captured for up to max(max_num_seqs, this)
        rows (speculative verify steps run as one decode row per scored position). ``knobs``:
        the engine's kernel knobs (``knobs.reference``: every op on its torch reference, no
        graphs, the torch attention backend). ``lora``: the LoRA manager (``blitzllm/lora``) of a
        model whose linears it wrapped: every step runs eagerly (graphs and the fused CPU decode
        would bypass the wrapped modules)."""
        self.knobs = knobs = Knobs() if knobs is None else knobs
        if knobs.reference:
            enforce_eager, attention_backend = True, "torch"
        self.lora = lora
        self.model = model
        self.cfg = cfg
        self.cache_cfg = cache
        self.device = device
        self.dtype = dtype
        self.backend = select_backend(device, attention_backend)
        if max_decode_rows and hasattr(self.backend, "fused_decode"):
            self.backend.fused_decode = False   # verify rows of one sequence read each other's k/v
        self.sampler = Sampler(greedy_kernel=knobs.greedy_kernel)
        self.kv_caches = allocate_kv_caches(cfg, cache, dtype, device, tp.world_size)
        # under tensor parallelism the token embeddings are partial sums (each rank its vocabulary
        # rows, the first norm all-reduces them): given rows (images, prompt embeddings) are rank 0's
        self.given_rows_here = tp.rank == 0
        # hybrid models: the recurrent states of their GDN layers (runner/state_pool.py)
        self.states = (StatePool(model, cache.num_state_rows, dtype, device, cache.num_state_spare)
                       if cache.num_state_rows else None)
        self.driver = None  # rank 0 of several: sends each forward's inputs to the other ranks
        self.graphs = None
        self._ahead = None  # (key, SamplerOutput, state rows it wrote) of a launched look-ahead decode step
        if device.type == "cuda" and not enforce_eager and self.backend.name == "triton":
            from .cuda_graphs import DecodeGraphs
            width = -(-max_model_len // cache.block_size)
            self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, device,
                                       max(max_num_seqs, max_decode_rows), width, self.states, lora)
            self.graphs.capture()
        self.cpu_decode = None  # CPU pure-decode steps in few ops, compiled or not (runner/cpu_graph.py)
        if device.type == "cpu" and not knobs.reference and lora is None:
            from .cpu_graph import maybe_cpu_decode
            self.cpu_decode = maybe_cpu_decode(model, self.kv_caches, self.backend, cache.block_size, tp.world_size,
                                               self.states, enforce_eager)

    def _to_dev(self, data, dtype):
        return torch.tensor(data, dtype=dtype, device="cpu").to(self.device, non_blocking=True)

    def prepare(self, seqs, block_tables, positions: Optional[list] = None):
        """seqs: list of (token_ids, start, end); block_tables: list of block id lists;
        ``positions``: each token's rotary position where they are not its index (a step with
        images: ``ImageStep.positions``)."""
        bs = self.cache_cfg.block_size
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for (toks, start, end), table in zip(seqs, block_tables):
            ids.extend(toks)
            if positions is None:
                pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + end - start)
            lens.append(end)
        width = max(len(t) for t in block_tables)
        bt = [t + [0] * (width - len(t)) for t in block_tables]
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        md = AttentionMetadata(
            slot_mapping=self._to_dev(slots, torch.int64),
            query_start_loc=self._to_dev(qsl, torch.int32),
            seq_lens=self._to_dev(lens, torch.int32),
            block_tables=self._to_dev(bt, torch.int32),
            max_q_len=max(q_lens), max_seq_len=max(lens),
            q_lens_host=q_lens, seq_lens_host=lens)
        pos = pos if positions is None else positions
        return self._to_dev(ids, torch.int64), self._to_dev(pos, torch.int64), md, qsl

    def _decode_inputs(self, seqs, block_tables, ahead: int = 0, images: Optional[list] = None):
        """Host lists for a pure-decode step, ``ahead`` positions past the given one (rotary
        positions past a prompt's images shifted by its ``delta``); None if a row's block table
        does not reach that far."""
        bs = self.cache_cfg.block_size
        pos, slots, lens = [], [], []
        for j, ((_, start, end), table) in enumerate(zip(seqs, block_tables)):
            p = start + ahead
            if p // bs >= len(table):
                return None
            im = images[j] if images is not None else None
            pos.append(p if im is None else im.positions_1d(p, p + 1)[0])
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(end + ahead)
        return pos, slots, lens

    def launch_decode_graph(self, ids, pos, slots, lens, block_tables, states: Optional[StatePlan] = None,
                            ahead_rows: Optional[list] = None, lora_counts: Optional[list] = None):
        """ids: host list or a device tensor (the previous step's sampled tokens). ``states``:
        a hybrid model's state plan (copies before and after the graph, its rows). A look-ahead
        step gives ``ahead_rows``: the spare rows it writes the states into, none of the plan's
        copies made. ``lora_counts``: the rows of each sequence when not one each (LoRA slots)."""
        lora = self.lora.row_slots(lora_counts) if self.lora is not None else None
        if self.states is None:
            return self.graphs.run(ids, pos, slots, lens, block_tables, lora_slots=lora)
        rows = self.states.rows_of(states.slots)
        if ahead_rows is not None:
            return self.graphs.run(ids, pos, slots, lens, block_tables, rows, ahead_rows, lora_slots=lora)
        self.states.copy(states.restores)
        self.states.zero([row for row, p in zip(states.slots, pos) if p == 0])
        logits = self.graphs.run(ids, pos, slots, lens, block_tables, rows, lora_slots=lora)
        self.states.finish(states)
        return logits

    def _broadcast(self, kind: str, *args) -> None:
        """Send a step's inputs to the other ranks (``engine/tp.py``'s ``_serve`` runs them),
        with the LoRA slots' part of the step when there are adapters."""
        self.driver.send((kind, self.lora.step_message() if self.lora is not None else None, *args))

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[2] is not None:
            self.states.drop(ahead[2])

    def _decode_step(self, seqs, block_tables, rows, states: Optional[StatePlan] = None, images=None):
        """Pure decode through the CUDA graphs, one step pipelined: right after sampling
        step N, step N+1 is launched on the sampled tokens (still on the device), so the
        host's bookkeeping overlaps the GPU. The look-ahead is used only if the next call
        asks for exactly that step; otherwise it is dropped (its KV writes are rewritten; a
        hybrid model's states it wrote into spare rows, see state_pool.py). Tensor parallel:
        no look-ahead (the other ranks need the tokens on their host)."""
        cur = self._decode_inputs(seqs, block_tables, images=images)
        if self.driver is not None:
            ids = [t[0] for t, _, _ in seqs]
            with self.driver.step():
                self._broadcast("graph", ids, *cur, block_tables, states)
                logits = self.launch_decode_graph(ids, *cur, block_tables, states)
            return _to_host_async(self.sampler(logits, SamplingMetadata.build(rows, self.cfg.vocab_size, self.device)))
        slots = tuple(states.slots) if states is not None else None
        if self.lora is not None:   # (the rows' adapter slots are inputs of the step too)
            slots = (slots, tuple(self.lora.step_slots))
        key = (tuple(cur[0]), tuple(cur[1]), tuple((r.seed, len(r.output_ids), id(r.params)) for r in rows), slots)
        ahead = self._ahead
        # (a restore into a sequence of the batch would change the state the look-ahead read)
        if ahead is not None and ahead[0] == key and not (states and set(slots) & {d for _, d in states.restores}):
            self._ahead = None
            out = ahead[1]
            if states is not None:
                self.states.take(states.slots, ahead[2])
                self.states.copy(states.restores)
                self.states.finish(states)
        else:
            self._drop_ahead()
            logits = self.launch_decode_graph([t[0] for t, _, _ in seqs], *cur, block_tables, states)
            out = self.sampler(logits, SamplingMetadata.build(rows, self.cfg.vocab_size, self.device))
        host = _to_host_async(out)
        nxt = self._decode_inputs(seqs, block_tables, ahead=1, images=images)
        go = nxt is not None and not any(r.params.needs_previous_token for r in rows)
        spare = self.states.ahead_rows(len(seqs)) if go and self.states is not None else None
        if go and (self.states is None or spare is not None):
            logits = self.launch_decode_graph(out.token_ids, *nxt, block_tables, states, ahead_rows=spare)
            nout = self.sampler(logits, SamplingMetadata.build(rows, self.cfg.vocab_size, self.device, extra_steps=1))
            nkey = (tuple(nxt[0]), tuple(nxt[1]), tuple((r.seed, len(r.output_ids) + 1, id(r.params)) for r in rows),
                    slots)
            self._ahead = (nkey, nout, spare)
        return host

    @torch.inference_mode()
    @_kernel_mode
    def execute(self, seqs, block_tables, sample_idx: list[int], rows: list[SamplingRow],
                states: Optional[StatePlan] = None, images: Optional[list] = None) -> StepResult:
        """Run one step. ``sample_idx`` lists the batch rows that sample a token; ``states``: a
        hybrid model's state plan for the step (engine/state_cache.py); ``images``: per row its
        prompt's images (engine/images.py) or None."""
        decode = all(e - s == 1 for _, s, e in seqs) and not _has_image_tokens(seqs, images)
        if decode and self.graphs is not None and len(sample_idx) == len(seqs) and self.graphs.can_run(len(seqs)):
            return _host_result(self._decode_step(seqs, block_tables, rows, states, images))
        # (the CPU decode path skips the modules: not while hooks read them, as a hidden-state
        # capture's for EAGLE-3, MTP or draft training)
        body = getattr(self.model, "model", self.model)
        if (self.cpu_decode is not None and self.driver is None and len(sample_idx) == len(seqs)
                and decode and not body._forward_hooks and not body._forward_pre_hooks):
            self._drop_ahead()
            cur = self._decode_inputs(seqs, block_tables, images=images)
            return self.sample(self.cpu_decode.run([t[0] for t, _, _ in seqs], *cur, block_tables), rows)
        return self.sample(self.score(seqs, block_tables, sample_idx, [1] * len(sample_idx), states, images=images),
                           rows)

    @torch.inference_mode()
    @_kernel_mode
    def sample(self, logits: Optional[torch.Tensor], rows: list[SamplingRow]) -> StepResult:
        """The sampler on the sampling rows' logits (one row each), its output on the host."""
        if not rows:
            return StepResult([], [], None)
        smd = SamplingMetadata.build(rows, self.cfg.vocab_size, self.device)
        return _host_result(_to_host_async(self.sampler(logits, smd)))

    @torch.inference_mode()
    @_kernel_mode
    def score(self, seqs, block_tables, sample_idx: list[int], counts: list[int],
              states: Optional[StatePlan] = None, spans: Optional[list] = None, images: Optional[list] = None):
        """Eager forward that returns the logits of the last ``counts[j]`` positions of
        batch row ``sample_idx[j]`` (a speculative verify step: each drafting row scores
        its k drafts plus the bonus position), stacked in row order: [sum(counts), V];
        None when no row asks for logits. With ``spans`` (pooling, engine/pooling.py):
        (those logits, ``forward``'s sums of final hidden rows)."""
        self._drop_ahead()
        # (state layers run a sequence's rows in order: its verify rows cannot be decode rows;
        # the decode graphs hand back logits only, so a pooling step never takes them)
        if (spans is None and self.graphs is not None and self.states is None and len(sample_idx) == len(seqs)
                and all(c == e - s for c, (_, s, e) in zip(counts, seqs)) and self.graphs.can_run(sum(counts))
                and not _has_image_tokens(seqs, images)):
            return self._score_as_decode_rows(seqs, block_tables, images)
        mm = self.image_step(seqs, images)
        if self.driver is None:
            return self.forward(seqs, block_tables, sample_idx, counts, states, spans, mm)
        with self.driver.step():
            # (the other ranks need no spans: rank 0's final hidden rows are whole, the norm all-reduced them)
            self._broadcast("forward", seqs, block_tables, sample_idx, counts, states, None, mm and mm.to_host())
            return self.forward(seqs, block_tables, sample_idx, counts, states, spans, mm)

    def forward(self, seqs, block_tables, sample_idx: list[int], counts: list[int],
                states: Optional[StatePlan] = None, spans: Optional[list] = None, mm: Optional[ImageStep] = None):
        """``score`` without the broadcast (what every tensor-parallel rank runs). ``spans``:
        (batch row, first, end) offsets within the row's chunk; then returns (logits, the
        float32 sum of each span's final hidden rows, [len(spans), hidden]). ``mm``: the step's
        image inputs (``image_step``)."""
        input_ids, positions, md, qsl = self.prepare(seqs, block_tables, mm.positions if mm is not None else None)
        rope_rows = embeds = None
        if mm is not None and mm.rows is not None:   # chunks with image tokens or prompt embeddings
            embeds = self.model.model.embed_tokens(input_ids)   # (every rank: a collective under TP)
            embeds[mm.rows.to(self.device)] = mm.vals.to(self.device, embeds.dtype) if self.given_rows_here else 0
            if mm.pos3 is not None:   # image tokens: M-RoPE rows
                rope_rows = self.model.mrope_rows(mm.pos3.to(self.device))
                positions = torch.arange(len(input_ids), device=self.device)
        smd = None
        if self.states is not None:
            smd = self.states.begin(states, seqs, qsl, md.query_start_loc, md.is_pure_decode)
        lora = self.lora.mapping(qsl) if self.lora is not None else None
        ctx = ForwardContext(md, self.kv_caches, self.backend, lora=lora, rope_rows=rope_rows)
        with forward_context(ctx), state_context(smd):
            hidden = (self.model(input_ids, positions) if embeds is None
                      else self.model(input_ids, positions, inputs_embeds=embeds))
        if smd is not None:
            self.states.finish(states)
        logits = None
        if sample_idx:
            idx = [p for i, c in zip(sample_idx, counts) for p in range(qsl[i + 1] - c, qsl[i + 1])]
            logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(idx, device=self.device)))
        if spans is None:
            return logits
        return logits, torch.stack([hidden[qsl[i] + a:qsl[i] + b].float().sum(0) for i, a, b in spans])

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's head on pooled final hidden rows [N, hidden] -> logits [N, labels]
        (rank 0 alone under tensor parallelism: the head is whole on every rank)."""
        return self.model.classify(pooled)

    def image_step(self, seqs, images: Optional[list]) -> Optional[ImageStep]:
        """The step's ``ImageStep`` (None when no sequence has images): rank 0 makes it, running
        the vision tower where a chunk first reaches an image (the embeddings stay on the prompt's
        PromptImages until the prefill is past it)."""
        if images is None or all(im is None for im in images):
            return None
        pos = []
        for (_, start, end), im in zip(seqs, images):
            rope = im.positions_1d(start, end) if im is not None else None
            pos.extend(range(start, end) if rope is None else rope)
        if not _has_image_tokens(seqs, images):
            return ImageStep(pos)
        # (M-RoPE rows only where a chunk holds image tokens; prompt embeddings take text positions)
        mrope = any(im is not None and im.mrope and im.images_in(s, e) for im, (_, s, e) in zip(images, seqs))
        pos3, rows, vals, t0 = [], [], [], 0
        for (_, start, end), im in zip(seqs, images):
            pos3.append(torch.arange(start, end).expand(3, -1) if im is None else im.positions_3d(start, end))
            for k in im.images_in(start, end) if im is not None else ():
                o, n = im.span(k)
                lo, hi = max(start, o), min(end, o + n)
                rows.append(torch.arange(lo, hi) - start + t0)
                vals.append(im.embeddings(k, self.model)[lo - o:hi - o])
            t0 += end - start
        return ImageStep(pos, torch.cat(pos3, 1) if mrope else None, torch.cat(rows), torch.cat(vals))

    def _score_as_decode_rows(self, seqs, block_tables, images=None) -> torch.Tensor:
        """A verify step where every position is scored: each position becomes a decode row
        of its own (its sequence's block table, context up to and including itself), so the
        step replays a decode CUDA graph. Every row's K/V is written before any attention
        of the layer reads the cache, so a row sees the drafts before it, as causal
        attention over the chunk would. Returns the logits in token order."""
        bs = self.cache_cfg.block_size
        ids, pos, slots, lens, tables = [], [], [], [], []
        for i, ((toks, start, end), table) in enumerate(zip(seqs, block_tables)):
            im = images[i] if images is not None else None
            rope = range(start, end) if im is None else im.positions_1d(start, end)
            for j, p in enumerate(range(start, end)):
                ids.append(toks[j])
                pos.append(rope[j])
                slots.append(table[p // bs] * bs + p % bs)
                lens.append(p + 1)
                tables.append(table)
        counts = [end - start for _, start, end in seqs]
        if self.driver is None:
            return self.launch_decode_graph(ids, pos, slots, lens, tables, lora_counts=counts)
        with self.driver.step():
            self._broadcast("graph", ids, pos, slots, lens, tables, None, None, counts)
            return self.launch_decode_graph(ids, pos, slots, lens, tables, lora_counts=counts)


def _has_image_tokens(seqs, images: Optional[list]) -> bool:
    """Whether a chunk of the step holds image tokens (needs M-RoPE rows and the images' embeddings)."""
    return images is not None and any(im is not None and im.images_in(s, e) for im, (_, s, e) in zip(images, seqs))


def _to_host_async(out):
    """Start copying a SamplerOutput to the host; returns (tensors, event) without waiting."""
    tensors = [out.token_ids, out.logprobs]
    if out.top_ids is not None:
        tensors += [out.top_ids, out.top_logprobs]
    if tensors[0].device.type != "cuda":
        return tensors, None
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    ev = torch.cuda.Event()
    ev.record()
    return host, ev


def _host_result(pending) -> StepResult:
    tensors, ev = pending
    if ev is not None:
        ev.synchronize()
    tokens, lps = tensors[0].tolist(), tensors[1].tolist()
    top = None
    if len(tensors) > 2:
        top = [list(zip(a, b)) for a, b in zip(tensors[2].tolist(), tensors[3].tolist())]
    return StepResult(tokens, lps, top)
