"""Online API: the engine loop on its own thread, streams of deltas as async iterators.

The event loop never runs model code: ``generate`` validates and enqueues, the engine thread
steps and hands each delta back to the caller's loop with ``call_soon_threadsafe``. A consumer
that stops iterating (a client that went away) aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore, RequestError
from engine.metrics import EngineStats
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.scheduler import StepBoundPolicy

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


STALL_WARNING_S = 20.0  # a request this long without its first output or any progress is logged (once), with the engine's view of it


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    opened_at: float = 0.0
    delivered: int = 0  # outputs handed to the caller's loop
    warned: bool = False
    computed: int = 0  # the request's prompt tokens computed when the watchdog last looked
    progressed_at: float = 0.0  # when the watchdog last saw that number grow (0: not since it opened)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    extra_keys: tuple
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetCounters:
    done: threading.Event


def _put_all(batch: list[tuple[str, asyncio.Queue, object]]) -> None:
    """On the caller's loop: each output into its stream's queue."""
    for _, queue_, item in batch:
        queue_.put_nowait(item)


class AsyncEngine:
    def __init__(
        self, config: EngineConfig | None = None, *, core: EngineCore | None = None, step_bound: StepBoundPolicy | None = None,
        capture_lock: AbstractContextManager | None = None,
    ) -> None:
        """From a config the engine thread itself loads the model (and waits here until it has,
        re-raising a load error): the thread that runs torch should be the one that loaded it.
        On the CPU, OpenMP thread pools are per calling thread, and a model loaded on one thread
        and stepped on another decoded ~30% slower here (2.6k context, int4: 21 vs 15 tok/s).
        ``step_bound`` goes to the scheduler of the engine built from ``config`` (see
        :func:`~engine.engine_builder.build_engine`); it is called on the engine thread. So is
        ``capture_lock``, held around each CUDA graph capture (see ``build_engine``)."""
        if core is None and config is None:
            raise ValueError("AsyncEngine needs an EngineConfig or an EngineCore")
        if core is not None and (step_bound is not None or capture_lock is not None):
            raise ValueError("step_bound and capture_lock are given when the engine is built; pass a config, not a core")
        self._step_bound, self._capture_lock = step_bound, capture_lock
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._stop = threading.Event()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config if core is None else None,), name="engine-loop", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        self.tokenizer = self.core.tokenizer
        self._stats = self.core.stats()

    @classmethod
    def from_model(cls, model: str, **kwargs: Any) -> "AsyncEngine":
        from engine.llm import make_config

        return cls(make_config(model, **kwargs))

    # ---- public API -------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        extra_keys: tuple = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; raises :class:`RequestError` before scheduling if invalid."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped")
        arrival = time.perf_counter()
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in use")
            self.core.validate_request(ids, params, None)
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), arrival)
            self._streams[rid] = stream
        self._commands.put(_Add(rid, ids, params, priority, extra_keys, arrival))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(rid))
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop ``request_id``; its stream ends with finish_reason 'abort'."""
        self._commands.put(_Abort(request_id))

    def add_finish_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """Call ``listener(output)`` on the engine thread with every request's final output
        (stopped, length or aborted), e.g. to observe its metrics; it must be quick."""
        self._finish_listeners.append(listener)

    def reset_counters(self) -> None:
        """Zero the engine's counters (:meth:`EngineCore.reset_counters`; cached prefixes stay) on the
        engine thread, and wait for it. For a warm-up of the caller's own, once its requests are done."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped")
        done = threading.Event()
        self._commands.put(_ResetCounters(done))
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise EngineDeadError("the engine loop has stopped")

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shut down or crashed)."""
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the last engine step (safe from any thread)."""
        return self._stats

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self, config: EngineConfig | None) -> None:
        if config is not None:
            try:
                self.core = build_engine(config, step_bound=self._step_bound, capture_lock=self._capture_lock)
            except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
                self._load_error = e
        self._loaded.set()
        if self._load_error is not None:
            return
        core = self.core
        watched = time.perf_counter()
        while not self._stop.is_set():
            self._drain(block=not core.has_unfinished_requests())
            if time.perf_counter() - watched > 1.0:
                watched = time.perf_counter()
                self._warn_stalls(core)
            if not core.has_unfinished_requests():
                continue
            try:
                outputs = core.step()
            except Exception as e:  # a bug in a step: fail the requests in flight, keep serving
                log.exception("engine step failed")
                for rid in list(core.requests):
                    core.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                outputs = []
            self._deliver_all([(out.request_id, out) for out in outputs])
            self._stats = core.stats()

    def _warn_stalls(self, core: EngineCore, now: float | None = None) -> list[str]:
        """Log each stream that has waited ``STALL_WARNING_S`` for its first output, with no prompt
        token computed meanwhile, once, with what the engine knows of its request (queue, tokens
        computed, blocks free): a turn a caller gives up on leaves this line in the server's log. A
        long prompt still being prefilled (on a CPU, 2,500 tokens of a 1.5B model take a minute)
        is progress, not a stall. Returns the lines logged."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            for rid, s in self._streams.items():
                req = core.requests.get(rid)
                if req is not None and req.num_computed_tokens != s.computed:
                    s.computed, s.progressed_at = req.num_computed_tokens, now
            stalled = [(rid, s) for rid, s in self._streams.items()
                       if not s.warned and s.delivered == 0 and now - max(s.opened_at, s.progressed_at) > STALL_WARNING_S]  # fmt: skip
            for _, s in stalled:
                s.warned = True
        lines = []
        for rid, stream in stalled:
            req = core.requests.get(rid)
            scheduler = core.scheduler
            if req is None:
                state = "not in the engine (never added, or finished without an output delivered)"
            else:
                where = (f"waiting, {scheduler.waiting.index(req) + 1} of {len(scheduler.waiting)}" if req in scheduler.waiting
                         else f"running, {len(scheduler.running)} running")  # fmt: skip
                state = (f"{req.status.name} ({where}), priority {req.priority}, {req.num_computed_tokens} of "
                         f"{req.num_prompt_tokens} prompt tokens computed ({max(req.num_cached_tokens, 0)} cached), "
                         f"{req.num_output_tokens} generated, {req.num_pending_tokens} pending, "
                         f"scheduled first {'never' if req.metrics.first_scheduled_time is None else 'yes'}")  # fmt: skip
            lines.append(f"request {rid} has had no output for {now - stream.opened_at:.1f} s: {state}; "
                         f"KV blocks free {core.block_manager.num_free_blocks}, steps {core.num_steps}")  # fmt: skip
            log.warning("%s", lines[-1])
        return lines

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None

    def _apply(self, cmd: _Add | _Abort | _ResetCounters) -> None:
        if isinstance(cmd, _ResetCounters):
            self.core.reset_counters()
            self._stats = self.core.stats()
            cmd.done.set()
            return
        if isinstance(cmd, _Add):
            try:
                self.core.add_request(
                    cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id, priority=cmd.priority,
                    extra_keys=cmd.extra_keys, arrival_time=cmd.arrival_time,
                )
            except Exception as e:
                self._deliver(cmd.request_id, e)
            return
        req = self.core.requests.get(cmd.request_id)
        if req is not None and self.core.abort_request(cmd.request_id):
            self._deliver(cmd.request_id, RequestOutput(
                request_id=cmd.request_id, text="", token_ids=[], finished=True, finish_reason="abort",
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
                num_generated_tokens=len(req.output_token_ids), metrics=req.metrics,
            ))
        self._stats = self.core.stats()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their callers: one wake-up per event loop, not one per request
        (64 answers decoding together would otherwise wake the server's loop 64 times a step)."""
        for _, item in items:
            if isinstance(item, RequestOutput) and item.finished:
                for listener in self._finish_listeners:
                    try:
                        listener(item)
                    except Exception:  # an observer's bug must not stop the engine
                        log.exception("finish listener failed")
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue, object]]] = {}
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.delivered += 1
                    by_loop.setdefault(stream.loop, []).append((rid, stream.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                for rid, _, _ in batch:
                    self._commands.put(_Abort(rid))
