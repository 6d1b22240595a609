"""One Silero VAD model shared by every caller of a process: all pending windows in one ONNX call.

A server runs each caller's front end on a thread of one process. Scored one session per caller,
Silero costs one ONNX Runtime call per caller per packet, and the Python around each call holds
the GIL that all callers share. :class:`SileroScorer` instead collects the windows that the
callers' streams (:class:`SileroStream`, one per caller, each with its own LSTM state, context and
leftover samples) submit from their own threads and scores them in one call; every caller blocks
until its probabilities are back, so ``process`` stays synchronous and returns what a stream of
its own would.

The model is faster-whisper's Silero v6 export, whose input rows are one stream's consecutive
windows (the LSTM runs over the rows as time, batch 1). :func:`batched_silero_model` rewrites it
so that the rows are any callers' windows: the encoder scores each row as before, a ``Gather``
lays the rows out as ``[time, stream]`` (input ``steps``), and the LSTM runs every stream over its
own windows (input ``lengths``, ONNX's ``sequence_lens``), so a stream with two pending windows
chains its state through both in the same call.

Batching: the first stream to submit while no call runs leads: it waits at most ``wait_ms`` for
the other open streams (not at all when it is the only one, or when all have submitted), then
runs the call for everything queued; windows that arrive during a call are the next call's, led
by one of their callers. An exception in the call is raised in every caller of that batch.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speech.config import ConfigError
from speech.vad import SileroVAD, silero_model_path


def batched_silero_model(model_path: Path | None = None) -> bytes:
    """faster-whisper's Silero v6 ONNX model rewritten to score many streams in one call.

    Inputs: ``input`` [rows, 576], ``h``/``c`` [1, streams, 128], ``steps`` [time, streams] (int64:
    the row of each stream's t-th window; any row where the stream has no t-th window) and
    ``lengths`` [streams] (int32: each stream's windows). Output ``speech_probs`` is
    [streams * time], stream-major (entries past a stream's length are meaningless), and
    ``hn``/``cn`` each stream's state after its last window.
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(silero_model_path(model_path)))
    graph = model.graph
    lstm = next(node for node in graph.node if node.op_type == "LSTM")
    index, to_lstm = next((i, n) for i, n in enumerate(graph.node) if n.output[0] == lstm.input[0])
    if to_lstm.op_type != "Transpose" or list(to_lstm.attribute[0].ints) != [0, 2, 1]:
        raise ValueError(f"{model_path}: not the Silero v6 graph this rewrite knows (encoder -> Transpose -> LSTM)")
    # The encoder's output is [rows, 128, 1]; the LSTM takes [time, streams, 128].
    graph.initializer.append(helper.make_tensor("batch_axis_2", TensorProto.INT64, [1], [2]))
    del graph.node[index]
    graph.node.insert(index, helper.make_node("Squeeze", [to_lstm.input[0], "batch_axis_2"], ["batch_rows"]))
    graph.node.insert(index + 1, helper.make_node("Gather", ["batch_rows", "steps"], [to_lstm.output[0]], axis=0))
    lstm.input[4] = "lengths"
    graph.input.append(helper.make_tensor_value_info("steps", TensorProto.INT64, ["time", "streams"]))
    graph.input.append(helper.make_tensor_value_info("lengths", TensorProto.INT32, ["streams"]))
    for value in [*graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.name in ("h", "c", "hn", "cn"):
            dims[1].dim_param = "streams"
        elif value.name == "input":
            dims[0].dim_param = "rows"
    del graph.value_info[:]  # shapes inferred for batch 1
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


@dataclass(frozen=True)
class ScorerStats:
    """What a scorer has done, for tests and benchmarks."""

    calls: int  # ONNX Runtime calls
    windows: int  # windows scored
    largest_batch: int  # most streams in one call


class _Request:
    """One stream's windows waiting to be scored, and their result once scored."""

    __slots__ = ("rows", "h", "c", "ready", "lead", "probs", "error")

    def __init__(self, rows: np.ndarray, h: np.ndarray, c: np.ndarray) -> None:
        self.rows, self.h, self.c = rows, h, c
        self.ready = threading.Lock()  # held until scored, failed or handed the lead (a cheap one-shot event)
        self.ready.acquire()
        self.lead = False
        self.probs: np.ndarray | None = None
        self.error: BaseException | None = None


class SileroScorer:
    """Silero's ONNX model in one session, scoring the windows of every open stream together.

    ``wait_ms``: how long a call may wait for the other open streams' windows (0: run at once).
    Thread-safe: streams submit from any threads, one call runs at a time.
    """

    def __init__(self, model_path: Path | None = None, wait_ms: float = 1.0) -> None:
        import onnxruntime

        if wait_ms < 0:
            raise ConfigError(f"SileroScorer wait_ms={wait_ms}: must be >= 0")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            batched_silero_model(model_path), options, providers=["CPUExecutionProvider"]
        )
        self._wait_s = wait_ms / 1000
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # the leader waits here for more windows
        self._queue: list[_Request] = []
        self._running = False  # a leader is collecting or running a call
        self._open = 0
        self._calls = self._windows = self._largest = 0

    def stream(self) -> SileroStream:
        """A new caller's stream (close it when the caller leaves)."""
        return SileroStream(self)

    @property
    def stats(self) -> ScorerStats:
        with self._lock:
            return ScorerStats(self._calls, self._windows, self._largest)

    def _join(self) -> None:
        with self._lock:
            self._open += 1

    def _leave(self) -> None:
        with self._lock:
            self._open -= 1
            self._arrived.notify()  # a leader waiting for this stream need not

    def _score(self, rows: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One stream's rows scored from state (h, c): (probabilities, h, c) after them."""
        request = _Request(rows, h, c)
        with self._lock:
            self._queue.append(request)
            if self._running:
                self._arrived.notify()
            else:
                self._running = request.lead = True
        if not request.lead:
            request.ready.acquire()
        if request.lead and request.probs is None and request.error is None:
            self._lead()
        if request.error is not None:
            raise request.error
        assert request.probs is not None
        return request.probs, request.h, request.c

    def _lead(self) -> None:
        """Collect the queued windows (waiting at most ``wait_ms`` for the open streams), run the
        call, hand the lead to a caller that queued meanwhile, and wake this batch's callers."""
        with self._lock:
            deadline = time.monotonic() + self._wait_s
            while len(self._queue) < self._open and (left := deadline - time.monotonic()) > 0:
                self._arrived.wait(left)
            batch, self._queue = self._queue, []
        lengths = [len(request.rows) for request in batch]
        try:
            self._run(batch, lengths)
        except Exception as exc:  # every caller of the batch raises it
            for request in batch:
                request.error = exc
        finally:
            for request in batch:
                if request.probs is None and request.error is None:
                    request.error = RuntimeError("the batched Silero call was interrupted")
            with self._lock:
                self._calls += 1
                self._windows += sum(lengths)
                self._largest = max(self._largest, len(batch))
                successor = self._queue[0] if self._queue else None
                self._running = successor is not None
                if successor is not None:
                    successor.lead = True
            if successor is not None:
                successor.ready.release()
            for request in batch:  # each held: from creation, or again by its caller's acquire
                request.ready.release()

    def _run(self, batch: list[_Request], lengths: list[int]) -> None:
        if len(batch) == 1:  # the inputs as they are: no copies
            [request] = batch
            rows, h, c = request.rows, request.h, request.c
        else:
            rows = np.concatenate([request.rows for request in batch])
            h = np.concatenate([request.h for request in batch], axis=1)
            c = np.concatenate([request.c for request in batch], axis=1)
        if max(lengths) == 1:  # one window each, the usual case: row i is stream i's
            steps = np.arange(len(batch), dtype=np.int64).reshape(1, -1)
        else:  # stream i's t-th window (its last one past its length)
            n = np.array(lengths)
            steps = (np.cumsum(n) - n + np.minimum(np.arange(n.max())[:, None], n - 1)).astype(np.int64)
        probs, h, c = self._session.run(
            None, {"input": rows, "h": h, "c": c, "steps": steps, "lengths": np.array(lengths, np.int32)}
        )
        probs = np.asarray(probs, np.float32).reshape(len(batch), -1)
        for i, (request, length) in enumerate(zip(batch, lengths)):
            request.h, request.c = h[:, i : i + 1], c[:, i : i + 1]
            request.probs = probs[i, :length]


class SileroStream(SileroVAD):
    """One caller's Silero over a shared :class:`SileroScorer`: a :class:`~speech.vad.SileroVAD`'s
    state and probabilities, its windows scored in the scorer's shared calls (no session of its own)."""

    def __init__(self, scorer: SileroScorer) -> None:  # no super().__init__: it would load a session
        scorer._join()
        self._scorer = scorer
        self._leave = weakref.finalize(self, scorer._leave)  # runs once: at close() or when dropped
        self.reset()

    def close(self) -> None:
        """Leave the scorer's open streams: no call waits for this one any more (it can still be
        fed, e.g. by a caller winding down, and is then scored without being waited for)."""
        self._leave()

    def _score(self, rows: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._scorer._score(rows, h, c)


__all__ = ["ScorerStats", "SileroScorer", "SileroStream", "batched_silero_model"]
