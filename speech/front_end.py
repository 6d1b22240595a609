"""The hearing front end of one audio stream: resampling to 16 kHz and voice activity detection.

Every 40 ms packet of every caller goes through it: a resampler call, webrtcvad on each 10 ms
frame, Silero, a dozen small numpy operations. Each is cheap, but it is Python that holds the GIL
the whole server shares. On the H200 with 32 callers the front ends held the GIL 67 % of the
time it was held at all (py-spy ``--gil``), and the engine's and Whisper's threads, which
release the GIL for every CUDA call, waited behind them: a 100-token prefill took 134-585 ms.

So the front end has two homes behind one interface (:class:`FrontEnd`):

- :class:`LocalFrontEnd`: in the caller's process (the default on a CPU-only machine, and in tests);
- :class:`FrontEndPool`: ``processes`` worker processes, each serving the front ends of the
  sessions assigned to it round-robin (its own Silero per stream: a process is single-threaded,
  so there is nothing to batch with). The server's process only checks the packet, sends it and
  reads back the 16 kHz samples and the VAD events: one pipe round trip, the GIL released while
  it waits.

Both give the same samples and events for the same audio (tests/speech/test_front_end.py).
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

import numpy as np

from speech.audio import Resampler, check_rate, to_float32
from speech.config import VADConfig
from speech.messages import SpeechEnded
from speech.vad import SharedScorer, VADEvent, VoiceActivityDetector

REPLY_TIMEOUT_S = 10.0  # a worker process this late with a reply is taken for hung: stopped, restarted on the next open


class FrontEndError(RuntimeError):
    """The front end's worker process stopped (or failed): the stream cannot be heard any more."""


class FrontEnd(Protocol):
    """One stream's resampler and VAD (see the module docstring)."""

    silence_s: float  # how long the utterance in progress has been silent (0 when none is)

    def hear(self, audio: bytes | np.ndarray) -> tuple[np.ndarray, list[VADEvent]]:
        """The next packet at the stream's rate -> its 16 kHz samples and the VAD events they complete.
        Raises ``AudioFormatError`` (and changes nothing) for audio that is not mono PCM16 or floats."""
        ...

    def commit(self) -> SpeechEnded | None:
        """End the utterance in progress now (the client said so); None if there is none."""
        ...

    def end_turn(self) -> SpeechEnded | None:
        """End the utterance in progress as the hangover would; None if there is none."""
        ...

    def close(self) -> None: ...


class LocalFrontEnd:
    """The front end in this process."""

    def __init__(self, input_rate: int, vad: VADConfig, scorer: SharedScorer | None = None) -> None:
        self._resampler = Resampler(check_rate(input_rate), vad.sample_rate)
        self._vad = VoiceActivityDetector(vad, scorer)

    @property
    def silence_s(self) -> float:
        return self._vad.silence_s

    def hear(self, audio: bytes | np.ndarray) -> tuple[np.ndarray, list[VADEvent]]:
        samples = self._resampler.process(to_float32(audio))
        return samples, (self._vad.process(samples) if len(samples) else [])

    def commit(self) -> SpeechEnded | None:
        return self._vad.commit()

    def end_turn(self) -> SpeechEnded | None:
        return self._vad.end_turn()

    def close(self) -> None:
        self._vad.close()


# ---- the worker processes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Request:
    op: str  # "open", "hear", "commit", "end_turn", "close"
    stream: int
    payload: object = None  # open: (input_rate, VADConfig); hear: float32 samples' bytes


def _serve(conn: Connection) -> None:
    """A worker process: answer requests until the pipe closes. A failure answers that request
    with the exception (the stream's state is then unknown: the caller closes it)."""
    streams: dict[int, LocalFrontEnd] = {}
    while True:
        try:
            request: _Request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if request.op == "open":
                rate, config = request.payload  # type: ignore[misc]
                streams[request.stream] = LocalFrontEnd(rate, config)
                reply: object = None
            elif request.op == "close":
                front = streams.pop(request.stream, None)
                if front is not None:
                    front.close()
                reply = None
            else:
                front = streams[request.stream]
                if request.op == "hear":
                    samples, events = front.hear(np.frombuffer(request.payload, np.float32))  # type: ignore[arg-type]
                    reply = (samples.astype(np.float32, copy=False).tobytes(), events, front.silence_s)
                elif request.op == "commit":
                    reply = (front.commit(), front.silence_s)
                else:
                    reply = (front.end_turn(), front.silence_s)
            conn.send(("ok", reply))
        except Exception as exc:  # noqa: BLE001 - handed back to the caller, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    """One worker process and its pipe; one request at a time (the lock spans the round trip)."""

    def __init__(self, context: multiprocessing.context.BaseContext, index: int) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name=f"speech-front-end-{index}", daemon=True)
        self.process.start()
        child.close()
        self.lock = threading.Lock()

    def call(self, request: _Request, timeout: float = REPLY_TIMEOUT_S) -> object:
        with self.lock:
            try:
                self.conn.send(request)
                if not self.conn.poll(timeout):
                    self.process.kill()  # hung: its streams fail now, and the pool restarts it on the next open
                    raise FrontEndError(f"the speech front-end process {self.process.name} gave no reply in {timeout:g} s "
                                        "and was stopped")  # fmt: skip
                status, reply = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as exc:
                raise FrontEndError(f"the speech front-end process {self.process.name} stopped "
                                    f"(exit code {self.process.exitcode}): {type(exc).__name__}") from exc  # fmt: skip
        if status == "error":
            raise FrontEndError(f"the speech front-end process {self.process.name} failed: {reply}")
        return reply

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        self.conn.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


class RemoteFrontEnd:
    """A stream's front end in one of the pool's worker processes."""

    def __init__(self, worker: _Worker, stream: int, input_rate: int, vad: VADConfig) -> None:
        self._worker, self._stream = worker, stream
        self.silence_s = 0.0
        worker.call(_Request("open", stream, (check_rate(input_rate), vad)))
        self._closed = False

    def hear(self, audio: bytes | np.ndarray) -> tuple[np.ndarray, list[VADEvent]]:
        floats = to_float32(audio)  # checked here: bad audio changes nothing
        samples, events, self.silence_s = self._worker.call(_Request("hear", self._stream, floats.tobytes()))  # type: ignore[misc]
        return np.frombuffer(samples, np.float32), events

    def commit(self) -> SpeechEnded | None:
        event, self.silence_s = self._worker.call(_Request("commit", self._stream))  # type: ignore[misc]
        return event

    def end_turn(self) -> SpeechEnded | None:
        event, self.silence_s = self._worker.call(_Request("end_turn", self._stream))  # type: ignore[misc]
        return event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._worker.call(_Request("close", self._stream))
        except FrontEndError:
            pass  # the process is gone: so is the stream


class FrontEndPool:
    """``processes`` worker processes (spawned: the parent may hold CUDA) serving streams' front
    ends, assigned round-robin. A worker process found dead when a stream is opened is replaced;
    its old streams fail with :class:`FrontEndError` and their sessions open new ones."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"a front-end pool needs at least 1 process, got {processes}")
        self._context = multiprocessing.get_context("spawn")
        self._workers = [_Worker(self._context, i) for i in range(processes)]
        self._streams = itertools.count()
        self._lock = threading.Lock()

    def open(self, input_rate: int, vad: VADConfig) -> RemoteFrontEnd:
        """A new stream's front end, in the next worker process (restarted first if it died)."""
        with self._lock:
            stream = next(self._streams)
            index = stream % len(self._workers)
            if not self._workers[index].alive:
                self._workers[index].stop()
                self._workers[index] = _Worker(self._context, index)
            worker = self._workers[index]
        return RemoteFrontEnd(worker, stream, input_rate, vad)

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [w.process for w in self._workers]

    def close(self) -> None:
        """Stop the worker processes (their streams end)."""
        for worker in self._workers:
            worker.stop()


__all__ = ["FrontEnd", "FrontEndError", "FrontEndPool", "LocalFrontEnd", "RemoteFrontEnd"]
