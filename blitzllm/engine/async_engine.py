"""An asyncio front for the synchronous ``Engine``: the engine loads and steps in a thread of its
own (``start()``'s, or the caller's in ``run_forever()``); adds and aborts go through a
thread-safe queue drained between steps, and each step's events reach per-request async
streams in one ``call_soon_threadsafe``. Knows nothing about HTTP.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Optional, Union

from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .intake import truncated
from .prompt_embeds import make_prompt_embeds

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("blitzllm.engine")


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load)."""


class QueueFullError(RuntimeError):
    """The waiting queue is over its bound; try again later."""


class DuplicateRequestError(ValueError):
    """A request with this id is still in flight."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request (an internal error, not the client's)."""


class EngineStoppedError(EngineStepError):
    """The engine stopped (server shutdown) before this request finished."""


class RequestStream:
    """The events of one request (all n completions), in order. Iterate with ``async for``;
    iteration ends once every completion has finished."""

    def __init__(self, request_id: str, n: int, arrival: float, engine_id: Optional[str] = None):
        self.request_id = request_id
        self.engine_id = engine_id or request_id   # the id the engine knows it by (unique per add)
        self.kv_transfer_params: Optional[dict] = None   # a producer's finished request: its KV lease
        self.n = n
        self.arrival = arrival
        self.first_token_time: Optional[float] = None
        self.finished = False
        self._last_token_time = [None] * n
        self._remaining = n
        self._queue: asyncio.Queue = asyncio.Queue()

    async def __aiter__(self):
        done = 0
        while done < self.n:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                done += 1
            yield item


class AsyncEngine:
    """``factory`` builds the Engine in the engine thread. ``observer`` (optional) gets
    ``first_token(s)``, ``inter_token(s)`` and ``finished(e2e_s, reason)`` on the event loop
    thread. ``on_load_error``: the engine cannot serve (failed to load, or ``fatal_error``: a
    tensor-parallel worker is gone); in-flight requests then fail and the loop ends."""

    def __init__(self, factory: Callable[[], "Engine"], max_waiting: int = 1024, observer=None,
                 on_load_error: Optional[Callable[[BaseException], None]] = None):
        self._factory = factory
        self.max_waiting = max_waiting
        self.observer = observer
        self._on_load_error = on_load_error
        self.engine: Optional["Engine"] = None
        self.ready = False
        self.load_error: Optional[BaseException] = None
        self.fatal_error: Optional[BaseException] = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        # touched on the event loop thread only: the streams in flight by the caller's id, and by
        # the engine's, which adds a counter so that a finished or aborted request's late events
        # and aborts never reach a later request that reuses the caller's id
        self._streams: dict[str, RequestStream] = {}
        self._by_engine_id: dict[str, RequestStream] = {}
        self._adds = itertools.count()
        self._pending_adds = 0
        self._stats: Optional[dict] = None
        self._stop = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._bound = threading.Event()

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Run the engine in a background thread (call from the event loop)."""
        self.bind(asyncio.get_running_loop())
        self._thread = threading.Thread(target=self.run_forever, name="blitz-engine", daemon=True)
        self._thread.start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Name the event loop that receives the streams (for ``run_forever`` elsewhere)."""
        self._loop = loop
        self._bound.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine loop (any thread); joins the background thread of ``start()``."""
        self._stop = True
        self._cmds.put(("wake",))
        self._bound.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        loop = self._loop
        if loop is not None and not loop.is_closed():  # end in-flight streams now
            try:
                loop.call_soon_threadsafe(self._fail_all, EngineStoppedError("the server is shutting down"))
            except RuntimeError:
                pass  # the loop closed meanwhile

    # ---- requests (event loop thread) ----------------------------------------------
    def stats(self) -> Optional[dict]:
        """The engine's counters as of the end of its last step (None while loading)."""
        return self._stats

    async def add_request(self, request_id: str, prompt, params: Union[SamplingParams, PoolingParams],
                          kv_transfer_params: Optional[dict] = None, priority: int = 0,
                          lora_request=None, images=None, cache_salt: Optional[str] = None,
                          prompt_embeds=None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises
        ValueError (the engine's user-facing message), EngineNotReadyError or QueueFullError.
        ``kv_transfer_params`` (disaggregation, docs/disaggregation.md): a producer's answer on a
        consumer, whose KV is pulled here before the engine sees the request (KVLoadError when
        the pull fails under policy 'fail'); ``{"do_remote_decode": true}`` on a producer. ``priority``,
        ``lora_request``, ``images``, ``cache_salt``, ``prompt_embeds``: as ``Engine.add_request``'s
        (the priority scheduling policy, a LoRA adapter, PIL images: made into the model's inputs
        here, off the engine thread; the prefix cache's salt; embeddings in place of ``prompt``)."""
        self._check_ready()
        waiting = (self._stats or {}).get("num_waiting", 0) + self._pending_adds
        if waiting >= self.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (bound {self.max_waiting}); retry later")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        pooling = isinstance(params, PoolingParams)   # (an embedding: one sequence, no grammar)
        stream = RequestStream(request_id, 1 if pooling else params.n, time.monotonic(),
                               f"{request_id}#{next(self._adds)}")
        self._streams[request_id] = self._by_engine_id[stream.engine_id] = stream
        fut = self._loop.create_future()
        self._pending_adds += 1
        try:
            if prompt_embeds is not None and kv_transfer_params:
                raise ValueError("prompt_embeds are not disaggregated (kv_transfer_params)")
            extras = await self._kv_extras(prompt, params, kv_transfer_params)   # (Engine.add_request's keywords)
            if priority:
                extras["priority"] = priority
            if lora_request is not None:
                extras["lora_request"] = lora_request
            if cache_salt is not None:
                extras["cache_salt"] = cache_salt
            if prompt_embeds is not None:   # (cast, checked and hashed here, off the engine thread)
                eng = self.engine
                extras["prompt_embeds"] = await asyncio.to_thread(
                    make_prompt_embeds, prompt_embeds, params, hidden_size=eng.model_config.hidden_size,
                    dtype=eng.dtype, max_model_len=eng.max_model_len)
            if images:
                intake = self.engine.image_intake
                extras["images"] = images if intake is None else await asyncio.to_thread(
                    lambda: [intake.media(im) for im in images])
            if not pooling and params.structured_output is not None:   # compiled here, off the engine thread
                await asyncio.to_thread(lambda: self.engine.grammar_compiler().compile(params.structured_output))
            self._cmds.put(("add", stream.engine_id, prompt, params, fut, extras))
            await fut
        except BaseException:  # rejected, or the caller went away before the engine saw it
            self.abort(request_id, stream)
            raise
        finally:
            self._pending_adds -= 1
        return stream

    async def reset_prefix_cache(self) -> bool:
        """``Engine.reset_prefix_cache`` on the engine thread, between steps."""
        self._check_ready()
        fut = self._loop.create_future()
        self._cmds.put(("reset_prefix_cache", fut))
        return await fut

    def _check_ready(self) -> None:
        if not self.ready:
            raise EngineNotReadyError(str(self.load_error) if self.load_error else "the model is still loading")

    async def _kv_extras(self, prompt, params: SamplingParams, kv_transfer_params: Optional[dict]) -> dict:
        """The engine's keyword arguments for a request's KV transfer: its params, and on a
        consumer the KV pulled from the producer (in a worker thread, bounded by its timeout)."""
        conn = getattr(self.engine, "connector", None)
        if not kv_transfer_params or conn is None:
            return {}
        out = {"kv_transfer_params": kv_transfer_params}
        if conn.is_consumer and kv_transfer_params.get("do_remote_prefill"):
            ids = prompt if isinstance(prompt, list) else self.engine.tokenize(prompt)
            ids = truncated(ids, params.truncate_prompt_tokens, self.engine.max_model_len)  # (as the producer's)
            out["kv_payload"] = await asyncio.to_thread(conn.load, kv_transfer_params, ids)
        return out

    def abort(self, request_id: str, stream: Optional[RequestStream] = None) -> None:
        """Stop a request and free its KV blocks (no-op once it finished). ``stream``: only while
        ``request_id`` still names that stream (once it finished, the id may name a new request)."""
        current = self._streams.get(request_id)
        if current is None or (stream is not None and current is not stream):
            return
        self._forget(current)
        if not current.finished:
            self._cmds.put(("abort", current.engine_id))

    def release_lease(self, stream: RequestStream) -> None:
        """Give back the KV lease of a producer's finished request whose answer will not reach
        its client (it left as the request finished), so the blocks need not wait for kv_lease_s."""
        self._release(stream.kv_transfer_params)

    def _release(self, params: Optional[dict]) -> None:
        conn = getattr(self.engine, "connector", None)
        lease = (params or {}).get("remote_request_id")
        if conn is not None and lease:
            conn.release(lease)   # (thread-safe: the engine thread frees the blocks at its next tick)

    def _forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        self._by_engine_id.pop(stream.engine_id, None)

    # ---- delivery (event loop thread, scheduled by the engine thread) --------------
    def _deliver(self, events: list, t: float) -> None:
        obs = self.observer
        for ev in events:
            s = self._by_engine_id.get(ev.request_id)
            if s is None:  # aborted while this step ran, which finished it: no one takes its lease
                self._release(ev.kv_transfer_params)
                continue
            if ev.kv_transfer_params is not None:
                s.kv_transfer_params = ev.kv_transfer_params
            last = s._last_token_time[ev.index]
            if obs is not None and ev.embedding is None:   # (an embedding has no tokens to time)
                if s.first_token_time is None:
                    obs.first_token(t - s.arrival)
                elif last is not None:
                    obs.inter_token(t - last)
            if s.first_token_time is None:
                s.first_token_time = t
            s._last_token_time[ev.index] = t
            s._queue.put_nowait(ev)
            if ev.finish_reason is not None:
                s._remaining -= 1
                if s._remaining == 0:
                    s.finished = True
                    self._forget(s)
                    if obs is not None:
                        obs.finished(t - s.arrival, ev.finish_reason)
                    log.debug("request %s finished (%s) after %.3fs", s.request_id, ev.finish_reason,
                              t - s.arrival)

    def _resolve(self, results: list) -> None:
        for fut, exc, value in results:
            if fut.done():
                continue
            if exc is None:
                fut.set_result(value)
            else:
                fut.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for s in list(self._streams.values()):
            s._queue.put_nowait(exc)
            s.finished = True
            self._forget(s)

    def _loaded(self, error: Optional[BaseException]) -> None:
        """The engine can serve (``error`` None), or it cannot: it failed to load or died."""
        self.ready = error is None
        if error is not None:
            self.load_error = error
            if self._on_load_error is not None:
                self._on_load_error(error)

    # ---- the engine thread ---------------------------------------------------------
    def run_forever(self) -> None:
        """Load the engine, then step it until ``shutdown()``, in the calling thread. Waits for
        ``bind()`` first; returns early if loading fails (``load_error`` says why)."""
        self._bound.wait()
        if self._stop:
            return
        try:
            self.engine = self._factory()
            self._stats = self.engine.stats()
        except Exception as e:  # reported to the server, which exits with the message
            if not isinstance(e, ValueError):
                log.error("model load failed:\n%s", traceback.format_exc())
            self._loop.call_soon_threadsafe(self._loaded, e)
            return
        self._loop.call_soon_threadsafe(self._loaded, None)
        try:
            self._step_loop(self.engine)
        finally:
            self.engine.close()

    def _step_loop(self, eng: "Engine") -> None:
        from .tp import TPWorkerError
        while not self._stop:
            self._drain(block=not eng.has_unfinished())
            if self._stop:
                break
            if eng.has_unfinished():
                try:
                    events = eng.step()
                except TPWorkerError as e:  # the engine cannot run another step: stop serving
                    log.error("engine failed: %s", e)
                    self.fatal_error = e
                    self._loop.call_soon_threadsafe(self._fail_all, EngineStepError(f"the engine failed: {e}"))
                    self._loop.call_soon_threadsafe(self._loaded, e)
                    return
                except Exception as e:  # an engine bug: fail what is in flight, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    for rid in list(eng.requests):
                        eng.abort_request(rid)
                    err = EngineStepError(f"internal engine error: {type(e).__name__}: {e}")
                    self._loop.call_soon_threadsafe(self._fail_all, err)
                    events = []
                if events:
                    self._loop.call_soon_threadsafe(self._deliver, events, time.monotonic())
            if getattr(eng, "connector", None) is not None:
                eng.connector.tick(eng.kv)   # free the blocks of released and expired KV leases
            self._stats = eng.stats()

    def _drain(self, block: bool) -> None:
        cmds = []
        try:
            cmds.append(self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait())
            while True:
                cmds.append(self._cmds.get_nowait())
        except queue.Empty:
            pass
        if not cmds:
            return
        eng = self.engine
        results = []
        for cmd in cmds:
            if cmd[0] == "add":
                _, rid, prompt, params, fut, extras = cmd
                try:
                    eng.add_request(rid, prompt, params, **extras)
                    results.append((fut, None, None))
                except Exception as e:  # ValueError: the client's fault; others: ours
                    if not isinstance(e, ValueError):
                        log.error("add_request failed:\n%s", traceback.format_exc())
                        e = EngineStepError(f"internal engine error: {type(e).__name__}: {e}")
                    results.append((fut, e, None))
            elif cmd[0] == "abort":
                eng.abort_request(cmd[1])
            elif cmd[0] == "reset_prefix_cache":
                results.append((cmd[1], None, eng.reset_prefix_cache()))
        self._stats = eng.stats()   # before resolving, so a new waiter is counted by the bound
        if results:
            self._loop.call_soon_threadsafe(self._resolve, results)
