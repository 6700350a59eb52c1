"""The default connector: KV blocks move with NIXL (``pip install nixl``; UCX underneath, DRAM
or GPU memory), the transfer library vLLM and SGLang use. The control plane is the producer's
own HTTP server (``server/kv_routes.py``): a consumer claims a lease there (which also hands it
the producer's NIXL agent metadata, once per producer) and then READs the blocks one-sided from
the producer's registered cache tensors into its own registered staging buffer; the READ's
notification tells the producer to release the lease. Every step is bounded by
``kv_transfer_timeout_s``.
"""
from __future__ import annotations

import base64
import itertools
import logging
import math
import threading
import time
import uuid
from typing import Optional

import torch

from .base import CacheLayout, KVConnector, KVLoadError, KVPayload, prompt_digest
from .leases import LeaseTable

log = logging.getLogger("blitzllm.kv_transfer")


def _mem_type(t: torch.Tensor) -> tuple:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


class NixlConnector(KVConnector):
    def __init__(self, config):
        super().__init__(config)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ValueError(f"kv_connector NixlConnector needs the nixl package ({e}): pip install nixl") from None
        self.engine_id = config.engine_id or uuid.uuid4().hex[:16]
        self.agent_name = f"blitz-{self.engine_id}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"]))
        self.leases = LeaseTable(config.kv_lease_s, 2 * config.kv_transfer_timeout_s)
        self._regions: list = []        # per layout entry: [base address, bytes per block, mem type, device]
        self._reg = None
        self._remote: dict[str, str] = {}   # producer engine id -> its NIXL agent name
        self._lock = threading.Lock()       # one pull at a time (the staging buffer)
        self._agent_lock = threading.Lock()  # the agent's calls (a kv_both engine's tick polls it too)
        self._staging: Optional[torch.Tensor] = None
        self._staging_reg = None
        self._ids = itertools.count()
        self.counts = {"kv_pulls_ok": 0, "kv_pulls_failed": 0, "kv_pulled_blocks": 0}

    # ---- worker side ---------------------------------------------------------------
    def register_caches(self, kv_caches: list, block_size: int, tp_size: int = 1) -> None:
        self.layout, self.kv_caches = CacheLayout.of(kv_caches, block_size, tp_size), kv_caches
        tensors = [kv_caches[layer][j] for layer, j, _ in self.layout.entries]
        self._regions = [[t.data_ptr(), t[0].numel() * t.element_size(), *_mem_type(t)] for t in tensors]
        if self.is_producer and tensors:
            self._reg = self.agent.register_memory(tensors)
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def load(self, params: dict, prompt_ids: list) -> Optional[KVPayload]:
        try:
            payload = self._load(params, prompt_ids)
        except KVLoadError as e:
            self.counts["kv_pulls_failed"] += 1
            if self.config.kv_load_failure_policy == "fail":
                raise
            log.warning("KV pull failed, recomputing the prompt: %s", e)
            return None
        if payload is not None:
            self.counts["kv_pulls_ok"] += 1
            self.counts["kv_pulled_blocks"] += payload.tensors[0].shape[0] if payload.tensors else 0
        return payload

    def _load(self, params: dict, prompt_ids: list) -> Optional[KVPayload]:
        import httpx
        n = int(params.get("remote_num_tokens") or 0)
        if n <= 0:
            return None     # nothing was prefilled remotely (a one-token prompt)
        if params.get("prompt_digest") != prompt_digest(prompt_ids):
            raise KVLoadError("the request's prompt is not the one the producer prefilled")
        theirs, ours = int(params.get("tp_size") or 1), self.layout.tp_size
        if theirs != ours and theirs != 1:
            raise KVLoadError(f"the producer has tensor_parallel_size {theirs}, this consumer has {ours}: only a "
                              "producer of size 1 can feed another size")
        timeout = self.config.kv_transfer_timeout_s
        deadline = time.monotonic() + timeout
        engine, lease = str(params["remote_engine_id"]), str(params["remote_request_id"])
        url = f"http://{params['remote_host']}:{int(params['remote_port'])}/kv_transfer/claim"
        with self._lock:
            try:
                r = httpx.post(url, json={"lease": lease, "agent_metadata": engine not in self._remote},
                               timeout=timeout)
            except httpx.HTTPError as e:
                raise KVLoadError(f"the producer at {url} did not answer: {type(e).__name__}: {e}") from None
            if r.status_code != 200:
                raise KVLoadError(f"the producer refused the claim of {lease} ({r.status_code}): {r.text[:200]}")
            d = r.json()
            remote = CacheLayout.from_dict(d["layout"])
            why = self.layout.mismatch(remote)
            if why is not None:
                raise KVLoadError(why)
            if engine not in self._remote:
                with self._agent_lock:
                    self._remote[engine] = self.agent.add_remote_agent(base64.b64decode(d["agent_metadata"]))
            return self._read(engine, lease, d, remote, n, deadline)

    def _read(self, engine: str, lease: str, d: dict, remote: CacheLayout, n: int, deadline: float) -> KVPayload:
        blocks = d["block_ids"][: math.ceil(n / self.layout.block_size)]
        sizes = [r[1] for r in d["regions"]]
        total = len(blocks) * sum(sizes)
        buf = self._staging_for(total)
        mine, theirs, off = [], [], buf.data_ptr()
        for base, nbytes, _, dev in d["regions"]:
            for b in blocks:
                mine.append((off, nbytes, 0))
                theirs.append((base + b * nbytes, nbytes, dev))
                off += nbytes
        mem = d["regions"][0][2] if d["regions"] else "DRAM"
        agent, name, lock = self.agent, self._remote[engine], self._agent_lock
        with lock:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(mine, "DRAM"),
                                           agent.get_xfer_descs(theirs, mem), name, lease.encode())
            state = agent.transfer(handle)
        while state not in ("DONE", "ERR") and time.monotonic() < deadline:
            time.sleep(0.0002)
            with lock:
                state = agent.check_xfer_state(handle)
        with lock:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a transfer still in flight to a dead peer
                pass
        if state != "DONE":
            self._forget(engine)
            raise KVLoadError(f"the KV read of {lease} {'failed' if state == 'ERR' else 'timed out'}")
        data = buf[:total].clone()
        tensors, off = [], 0
        for (_, j, shape), nbytes in zip(remote.entries, sizes):   # (full heads: land() re-slices them)
            part = data[off:off + nbytes * len(blocks)]
            tensors.append(part.view(self.layout.entry_dtype(j)).view(len(blocks), *shape))
            off += nbytes * len(blocks)
        return KVPayload(n, tensors)

    def _forget(self, engine: str) -> None:
        name = self._remote.pop(engine, None)
        if name is not None:
            with self._agent_lock:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            size = max(nbytes, 2 * (self._staging.numel() if self._staging is not None else 0), 1 << 20)
            with self._agent_lock:
                if self._staging_reg is not None:
                    self.agent.deregister_memory(self._staging_reg)
                self._staging = torch.empty(size, dtype=torch.uint8)
                self._staging_reg = self.agent.register_memory(self._staging)
        return self._staging

    # ---- scheduler side ------------------------------------------------------------
    def request_finished(self, req, kv) -> None:
        params, req.kv_transfer_params = req.kv_transfer_params, None
        if not (self.is_producer and isinstance(params, dict) and params.get("do_remote_decode")):
            return
        if req.finish_reason == "abort" or self.layout is None:
            return
        n = len(req.prompt_token_ids) - 1   # the consumer computes the last prompt token itself
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port, "remote_request_id": None,
               "remote_block_ids": [], "remote_num_tokens": 0, "tp_size": self.layout.tp_size,
               "prompt_digest": prompt_digest(req.prompt_token_ids)}
        table = kv.tables.get(req.request_id)
        nb = math.ceil(n / kv.block_size)
        if n >= 1 and table is not None and len(table) >= nb:
            lease = f"{req.request_id}@{self.engine_id}.{next(self._ids)}"
            kv.tables[lease] = kv.tables.pop(req.request_id)   # the blocks outlive the request
            kv.hashes[lease] = kv.hashes.pop(req.request_id, [])
            self.leases.add(lease, table[:nb], n)
            out.update(remote_request_id=lease, remote_block_ids=table[:nb], remote_num_tokens=n)
        req.kv_transfer_params = out

    def tick(self, kv) -> None:
        if not self.is_producer:
            return
        if self._agent_lock.acquire(blocking=False):  # (never wait on a pull: next tick then)
            try:
                notifs = self.agent.get_new_notifs()
            finally:
                self._agent_lock.release()
            for msgs in notifs.values():
                for m in msgs:
                    self.leases.release(m.decode(errors="replace"))
        for lease in self.leases.sweep():
            kv.free_request(lease)

    # ---- control plane (the HTTP thread) -------------------------------------------
    def claim(self, lease_id: str, want_metadata: bool) -> Optional[dict]:
        """What a consumer needs to read a lease's blocks; None when no such lease can be read."""
        lease = self.leases.claim(lease_id) if self.is_producer else None
        if lease is None:
            return None
        out = {"engine_id": self.engine_id, "agent_name": self.agent_name, "block_ids": lease.block_ids,
               "num_tokens": lease.num_tokens, "layout": self.layout.to_dict(), "regions": self._regions}
        if want_metadata:
            out["agent_metadata"] = self._metadata
        return out

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def info(self) -> dict:
        return {"engine_id": self.engine_id, "kv_role": self.config.kv_role, "kv_connector": "NixlConnector",
                "layout": self.layout.to_dict() if self.layout else None, "kv_lease_s": self.config.kv_lease_s,
                "kv_load_failure_policy": self.config.kv_load_failure_policy}

    def stats(self) -> dict:
        return {"kv_leases_held": len(self.leases), "kv_leases_expired": self.leases.expired,
                "kv_leases_completed": self.leases.completed, **self.counts}
