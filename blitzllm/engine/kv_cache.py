"""Paged KV cache bookkeeping: a pool of ref-counted blocks, per-request block tables, and
prefix caching by chained hashes of full blocks. Knows nothing about tensors or devices.

A free block keeps its hash (and stays findable) until it is handed out again; the free
queue is LRU so recently freed prefixes survive longest. A request's ``root`` (its LoRA
adapter's key) is the parent of its first block's hash: KV computed under one adapter (or the
base model) is never found by a request under another.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


def block_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class Block:
    __slots__ = ("id", "ref", "hash")

    def __init__(self, bid: int):
        self.id, self.ref, self.hash = bid, 0, None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # hash -> block id
        self.tables: dict[str, list[int]] = {}    # request id -> block ids
        self.hashes: dict[str, list[int]] = {}    # request id -> hashes of its full blocks
        self.hit_tokens = 0
        self.queried_tokens = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def block_table(self, rid: str) -> list[int]:
        return self.tables.get(rid, [])

    def blocks_needed(self, rid: str, num_tokens: int) -> int:
        have = len(self.tables.get(rid, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    # ---- allocation ----------------------------------------------------------------
    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None:
            if self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash = None
        blk.ref = 1
        return blk

    def match_prefix(self, rid: str, tokens: Sequence[int], root=None) -> int:
        """Attach cached full blocks of ``tokens`` to a new request; returns tokens covered.
        At most len(tokens) - 1 tokens match, so the last token is always computed."""
        assert rid not in self.tables
        table: list[int] = []
        hashes: list[int] = []
        if self.enable_prefix_caching:
            bs = self.block_size
            parent = root
            for i in range((len(tokens) - 1) // bs):
                h = block_hash(parent, tokens[i * bs:(i + 1) * bs])
                bid = self.cached.get(h)
                if bid is None:
                    break
                blk = self.blocks[bid]
                if blk.ref == 0:
                    del self.free[bid]
                blk.ref += 1
                table.append(bid)
                hashes.append(h)
                parent = h
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(table) * bs
        self.tables[rid] = table
        self.hashes[rid] = hashes
        return len(table) * self.block_size

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens``; False (and no change) if short."""
        need = self.blocks_needed(rid, num_tokens)
        if need > len(self.free):
            return False
        table = self.tables.setdefault(rid, [])
        self.hashes.setdefault(rid, [])
        for _ in range(need):
            table.append(self._take_free().id)
        return True

    def commit(self, rid: str, tokens: Sequence[int], num_computed: int, root=None) -> None:
        """Register the hashes of blocks that became full now that ``num_computed`` tokens
        of ``tokens`` have their KV written."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[rid], self.hashes[rid]
        bs = self.block_size
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            blk = self.blocks[table[i]]
            if blk.hash is None:
                blk.hash = h
                self.cached.setdefault(h, blk.id)
            parent = h

    def trim(self, rid: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks that ``num_tokens`` tokens fill (the
        roll-back of rejected speculative tokens); freed tail blocks go back to the pool
        and hashes of blocks past the kept tokens are forgotten."""
        table = self.tables.get(rid)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        hashes = self.hashes.get(rid)
        if hashes is not None:
            del hashes[num_tokens // self.block_size:]

    def free_request(self, rid: str) -> None:
        table = self.tables.pop(rid, None)
        self.hashes.pop(rid, None)
        # tail blocks first, so they are evicted before the shared prefix
        for bid in reversed(table or ()):
            self._release(bid)

    def _release(self, bid: int) -> None:
        """Drop one reference to block ``bid``; it joins the free queue (its hash kept) at none."""
        blk = self.blocks[bid]
        blk.ref -= 1
        assert blk.ref >= 0
        if blk.ref == 0:
            self.free[bid] = None

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            if blk.ref == 0:
                blk.hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref > 0}
