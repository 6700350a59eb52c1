"""AsyncEngine against a scripted fake engine (no model): batching across requests, errors,
aborts, the waiting bound, and surviving an engine failure."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from blitzllm.engine.async_engine import (AsyncEngine, EngineNotReadyError, EngineStepError, QueueFullError)
from blitzllm.engine.engine import StepEvent
from blitzllm.sampling_params import SamplingParams


class FakeEngine:
    """Each step emits one token for every request, up to max_num_seqs of them (the rest wait)."""

    def __init__(self, max_num_seqs: int = 64, step_s: float = 0.002):
        self.requests: dict = {}
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.batch_sizes: list = []
        self.fail_next = False
        self.thread_ids: set = set()
        self.compiled: dict = {}

    def add_request(self, rid, prompt, params):
        if not prompt:
            raise ValueError("the prompt is empty")
        if params.structured_output is not None:
            self.grammar_compiler().compile(params.structured_output)   # (the real engine's matcher)
        self.requests[rid] = {"left": params.max_tokens, "n": params.n, "done": 0}

    def abort_request(self, rid):
        return self.requests.pop(rid, None) is not None

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        batch = list(self.requests.items())[: self.max_num_seqs]
        self.batch_sizes.append(len(batch))
        events = []
        for rid, st in batch:
            st["left"] -= 1
            st["done"] += 1
            fin = "length" if st["left"] == 0 else None
            for i in range(st["n"]):
                events.append(StepEvent(rid, i, [st["done"]], f"t{st['done']} ", None, fin))
            if fin:
                del self.requests[rid]
        return events

    def stats(self):
        running = min(len(self.requests), self.max_num_seqs)
        return {"num_running": running, "num_waiting": len(self.requests) - running, "kv_cache_usage": 0.0}

    def close(self):
        self.closed = True

    def grammar_compiler(self):
        return self

    def compile(self, spec):
        """The grammar cache: a spec compiles once (0.2 s, recording its thread); a regex "(" fails."""
        if spec.get("pattern") == "(":
            raise ValueError("structured_output pattern not supported")
        key = repr(spec)
        if key not in self.compiled:
            time.sleep(0.2)
            self.compiled[key] = threading.get_ident()


def run(coro_fn, engine, **kw):
    async def main():
        ae = AsyncEngine(lambda: engine, **kw)
        ae.start()
        for _ in range(200):
            if ae.ready:
                break
            await asyncio.sleep(0.01)
        try:
            return await coro_fn(ae)
        finally:
            ae.shutdown()
    return asyncio.run(main())


async def until(cond, timeout_s: float = 2.0) -> None:
    """Poll ``cond`` on the event loop until it holds (or the timeout passes)."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)


async def collect(ae, rid, max_tokens=5, n=1):
    stream = await ae.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, n=n))
    out = {}
    async for ev in stream:
        out.setdefault(ev.index, []).append((ev.text, ev.finish_reason))
    return out


def test_requests_are_batched_and_complete():
    eng = FakeEngine()

    async def go(ae):
        return await asyncio.gather(*(collect(ae, f"r{i}", max_tokens=5, n=1 + i % 2) for i in range(16)))

    results = run(go, eng)
    for i, out in enumerate(results):
        assert sorted(out) == list(range(1 + i % 2))
        for seq in out.values():
            assert [t for t, _ in seq] == [f"t{k} " for k in range(1, 6)]
            assert [f for _, f in seq] == [None] * 4 + ["length"]
    assert max(eng.batch_sizes) > 1            # many requests shared steps
    assert len(eng.thread_ids) == 1 and threading.get_ident() not in eng.thread_ids


def test_add_error_is_raised_to_the_caller_and_serving_goes_on():
    async def go(ae):
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("bad", [], SamplingParams(max_tokens=2))
        return await collect(ae, "good", max_tokens=2)

    assert run(go, FakeEngine())[0][-1][1] == "length"


def test_grammars_compile_off_the_engine_thread():
    """A request's grammar compiles in a worker thread before the engine sees it: another
    request's steps go on meanwhile; a spec that cannot compile is the caller's ValueError."""
    eng = FakeEngine(step_s=0.01)

    async def go(ae):
        other = asyncio.create_task(collect(ae, "other", max_tokens=60))
        await until(lambda: len(eng.batch_sizes) > 2)
        steps = len(eng.batch_sizes)
        stream = await ae.add_request("json", [1], SamplingParams(max_tokens=2, structured_output={"type": "regex", "pattern": "[ab]+"}))
        during = len(eng.batch_sizes) - steps
        async for _ in stream:
            pass
        with pytest.raises(ValueError, match="not supported"):
            await ae.add_request("bad", [1], SamplingParams(max_tokens=2, structured_output={"type": "regex", "pattern": "("}))
        await other
        return during

    during = run(go, eng)
    assert during >= 5   # the other request's steps during the 0.2 s compile (0.01 s each)
    (compiled_on,) = eng.compiled.values()
    assert compiled_on not in eng.thread_ids and compiled_on != threading.get_ident()


def test_abort_mid_stream_frees_the_request():
    eng = FakeEngine(step_s=0.01)

    async def go(ae):
        stream = await ae.add_request("long", [1], SamplingParams(max_tokens=10_000))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        ae.abort("long")
        for _ in range(100):
            if not eng.requests:
                break
            await asyncio.sleep(0.01)
        return got

    assert run(go, eng) == 3
    assert eng.requests == {}


def test_a_reused_id_names_a_new_request():
    """An id reused once its request finished or was aborted names a new request: the old
    request's late cleanup (an abort naming its own stream) leaves the new one alone, and the
    events of an aborted request's step still in flight never reach it (the engine knows each
    add by an id of its own). Before, the first made the new request wait forever and the second
    gave it the old request's token."""
    eng = FakeEngine(step_s=0.01)

    async def texts(stream):
        return [ev.text async for ev in stream]

    async def go(ae):
        first = await ae.add_request("x", [1], SamplingParams(max_tokens=2))
        await texts(first)
        second = await ae.add_request("x", [1], SamplingParams(max_tokens=3))
        ae.abort("x", first)   # (the first request's handler cleaning up after it)
        reused_after_finish = await asyncio.wait_for(texts(second), 5)
        third = await ae.add_request("y", [1], SamplingParams(max_tokens=10_000))
        async for _ in third:
            break   # one token, then the client leaves while the next step runs
        ae.abort("y", third)
        fourth = await ae.add_request("y", [1], SamplingParams(max_tokens=2))
        reused_after_abort = await asyncio.wait_for(texts(fourth), 5)
        await until(lambda: not eng.requests)
        return reused_after_finish, reused_after_abort

    after_finish, after_abort = run(go, eng)
    assert after_finish == ["t1 ", "t2 ", "t3 "]
    assert after_abort == ["t1 ", "t2 "]
    assert eng.requests == {}


class FakeProducer(FakeEngine):
    """A prefill producer: a finished request's last event carries a KV lease, which its
    connector records when given back."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.kv, self.released = None, []
        self.connector = self

    is_consumer = False

    def tick(self, kv):
        pass

    def release(self, lease):
        self.released.append(lease)
        return True

    def add_request(self, rid, prompt, params, kv_transfer_params=None):
        super().add_request(rid, prompt, params)

    def step(self):
        events = super().step()
        return [StepEvent(**{**ev.__dict__, "kv_transfer_params": {"remote_request_id": f"lease-{ev.request_id}"}})
                if ev.finish_reason else ev for ev in events]


def test_a_lease_no_client_will_read_is_given_back():
    """A producer's request that finishes in the step during which its client left (aborted
    too late): its lease goes back at once, not after kv_lease_s; a finished request whose answer
    cannot be sent gives its lease back through ``release_lease``; a delivered one keeps it."""
    eng = FakeProducer(step_s=0.05)

    async def go(ae):
        late = await ae.add_request("late", [1], SamplingParams(max_tokens=1))
        ae.abort("late", late)   # (the step that finishes it is running)
        await until(lambda: eng.released)
        kept = await ae.add_request("kept", [1], SamplingParams(max_tokens=1))
        async for _ in kept:
            pass
        released_before = list(eng.released)
        ae.release_lease(kept)
        return released_before, kept.kv_transfer_params

    released_before, params = run(go, eng)
    assert released_before == ["lease-late#0"]
    assert params == {"remote_request_id": "lease-kept#1"} and eng.released == ["lease-late#0", "lease-kept#1"]


def test_waiting_bound_raises_queue_full():
    eng = FakeEngine(max_num_seqs=1, step_s=0.01)

    async def go(ae):
        a = await ae.add_request("a", [1], SamplingParams(max_tokens=10_000))
        b = await ae.add_request("b", [1], SamplingParams(max_tokens=10_000))
        with pytest.raises(QueueFullError):
            await ae.add_request("c", [1], SamplingParams(max_tokens=2))
        ae.abort("a")
        ae.abort("b")
        del a, b
        await asyncio.sleep(0.05)
        return await collect(ae, "d", max_tokens=2)

    assert run(go, eng, max_waiting=1)[0][-1][1] == "length"


def test_engine_failure_fails_in_flight_requests_then_recovers():
    eng = FakeEngine(step_s=0.01)

    async def go(ae):
        stream = await ae.add_request("x", [1], SamplingParams(max_tokens=10_000))
        eng.fail_next = True
        with pytest.raises(EngineStepError):
            async for _ in stream:
                pass
        return await collect(ae, "y", max_tokens=3)

    assert run(go, eng)[0][-1] == ("t3 ", "length")
    assert eng.requests == {}


def test_dead_engine_fails_in_flight_requests_and_stops_serving():
    """A tensor-parallel worker died (TPWorkerError): no step can run again, so the stream
    fails, the engine reports not ready with the reason, the loop ends and closes it."""
    from blitzllm.engine.tp import TPWorkerError
    eng = FakeEngine(step_s=0.01)
    errors = []

    def step():
        raise TPWorkerError("tensor-parallel worker rank 1 (pid 1) died with exit code -9")

    async def go(ae):
        stream = await ae.add_request("x", [1], SamplingParams(max_tokens=10_000))
        eng.step = step
        with pytest.raises(EngineStepError, match="worker rank 1"):
            async for _ in stream:
                pass
        await until(lambda: errors)
        with pytest.raises(EngineNotReadyError, match="worker rank 1"):
            await ae.add_request("y", [1], SamplingParams())
        return ae

    ae = run(go, eng, on_load_error=errors.append)
    assert isinstance(ae.fatal_error, TPWorkerError) and errors == [ae.fatal_error]
    ae._thread.join(5)
    assert getattr(eng, "closed", False)


def test_not_ready_and_load_failure():
    errors = []

    def factory():
        raise ValueError("no such model")

    async def go():
        ae = AsyncEngine(factory, on_load_error=errors.append)
        with pytest.raises(EngineNotReadyError):
            await ae.add_request("a", [1], SamplingParams())
        ae.start()
        await until(lambda: errors)
        with pytest.raises(EngineNotReadyError, match="no such model"):
            await ae.add_request("a", [1], SamplingParams())
        ae.shutdown()

    asyncio.run(go())
    assert [str(e) for e in errors] == ["no such model"]


def test_run_forever_in_a_thread_of_the_callers_choosing_and_shutdown_ends_streams():
    """The server's layout: the engine loop runs where the caller says (the main thread
    there); shutdown() ends in-flight streams with EngineStoppedError."""
    from blitzllm.engine.async_engine import EngineStoppedError
    eng = FakeEngine(step_s=0.01)

    async def go():
        ae = AsyncEngine(lambda: eng)
        ae.bind(asyncio.get_running_loop())
        t = threading.Thread(target=ae.run_forever, daemon=True)
        t.start()
        while not ae.ready:
            await asyncio.sleep(0.01)
        done = await collect(ae, "a", max_tokens=3)
        stream = await ae.add_request("b", [1], SamplingParams(max_tokens=10_000))
        ae.shutdown()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        t.join(5)
        return done, t.is_alive()

    done, alive = asyncio.run(go())
    assert done[0][-1] == ("t3 ", "length") and not alive
