"""A voice in a worker process of its own: the same ``TTSBackend``, its Python off the server's GIL.

Synthesis is mostly numpy and ONNX Runtime, but the glue between them (phonemizing, the DSP of
each piece) is Python that holds the GIL the whole server shares, the engine's and Whisper's
threads included. :class:`ProcessVoice` loads the configured backend in a spawned process and
asks it for one piece at a time, so a cancelled reply still stops within the piece being made
(the base class checks between pieces). The worker thread that owns the instance only sends the
text and reads the pieces back.

One text at a time per instance (the TTS worker gives each thread an instance of its own).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection

import numpy as np

from speech.config import ConfigError, TTSConfig
from speech.tts.base import TTSBackend, TTSUnavailable


LOAD_TIMEOUT_S = 300.0  # loading a voice (coqui's model may take minutes on a slow disk)
PIECE_TIMEOUT_S = 60.0  # one piece of audio: a voice this late is taken for hung


def _serve(conn: Connection, config: TTSConfig, load: Callable[[TTSConfig], TTSBackend]) -> None:
    """The worker process: load the voice, then answer start / next / stop until the pipe closes."""
    try:
        backend = load(config)
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it as the same kind
        kind = "unavailable" if isinstance(exc, TTSUnavailable) else "config" if isinstance(exc, ConfigError) else "error"
        conn.send((kind, str(exc) if kind != "error" else f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", (backend.name, backend.sample_rate, backend.device)))
    pieces: Iterator[np.ndarray] | None = None
    while True:
        try:
            op, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "start":
                pieces = backend._synthesize(text)
                reply: object = None
            elif op == "next":
                piece = next(pieces, None) if pieces is not None else None
                reply = None if piece is None else np.asarray(piece, np.float32).reshape(-1).tobytes()
            else:  # stop
                if pieces is not None:
                    pieces.close()
                pieces, reply = None, None
            conn.send(("ok", reply))
        except Exception as exc:  # noqa: BLE001
            pieces = None
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessVoice(TTSBackend):
    """The backend ``config`` names, loaded by ``load`` (a module-level function: it goes to the
    worker process by name) in a worker process; pieces fetched one at a time."""

    def __init__(self, config: TTSConfig, load: Callable[[TTSConfig], TTSBackend]) -> None:
        super().__init__(config)
        self._load = load
        self._start()
        self.restarts = 0  # worker processes started again after one stopped

    def _start(self) -> None:
        """Start the worker process and wait for its voice to load."""
        context = multiprocessing.get_context("spawn")  # the parent may hold CUDA
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, replace(self.config, processes=False), self._load),
                                        name=f"tts-voice-{self.config.backend}", daemon=True)  # fmt: skip
        self._process.start()
        child.close()
        status, reply = self._receive(LOAD_TIMEOUT_S)
        if status != "ready":
            self.close()
            raise {"unavailable": TTSUnavailable, "config": ConfigError}.get(status, RuntimeError)(reply)
        name, self.sample_rate, self.device = reply  # type: ignore[misc]
        self.name = f"{name} (process)"

    def _receive(self, timeout: float = PIECE_TIMEOUT_S) -> tuple[str, object]:
        try:
            if not self._conn.poll(timeout):
                self._process.kill()
                raise RuntimeError(f"the voice process {self._process.name} gave no reply in {timeout:g} s and was stopped")
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the voice process {self._process.name} stopped (exit code {self._process.exitcode})") from exc

    def _call(self, op: str, text: str | None = None) -> object:
        try:
            self._conn.send((op, text))
        except (OSError, BrokenPipeError) as exc:
            raise RuntimeError(f"the voice process {self._process.name} stopped (exit code {self._process.exitcode})") from exc
        status, reply = self._receive()
        if status != "ok":
            raise RuntimeError(f"the voice process {self._process.name} failed: {reply}")
        return reply

    def _synthesize(self, text: str) -> Iterator[np.ndarray]:
        if not self._process.is_alive():  # it stopped (or hung and was stopped) during an earlier text
            self.close()
            self._start()
            self.restarts += 1
        self._call("start", text)
        try:
            while (piece := self._call("next")) is not None:
                yield np.frombuffer(piece, np.float32)  # type: ignore[arg-type]
        finally:
            if self._process.is_alive():
                self._call("stop")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def close(self) -> None:
        """Stop the worker process."""
        self._conn.close()
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)


__all__ = ["ProcessVoice"]
