"""The TTS worker pool: several hibari instances synthesize side by side, first pieces still first."""

from __future__ import annotations

import threading
import time

import pytest

from speech.cancel import CancelToken
from speech.config import ConfigError, TTSConfig, default_tts_workers
from speech.tts.worker import TTSJob, TTSWorker

LONG = " ".join(f"This is sentence number {i} of a long answer about annual leave." for i in range(6))


class Arrivals:
    """(reply, worker thread, perf_counter) of every chunk the real backend delivered; ``done`` per reply."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, str, float]] = []
        self.done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def job(self, name: str, text: str, first: bool) -> TTSJob:
        self.done[name] = threading.Event()

        def deliver(item: object) -> None:
            if isinstance(item, tuple):
                with self._lock:
                    self.chunks.append((name, threading.current_thread().name, item[1]))
            else:
                self.done[name].set()

        return TTSJob(text, CancelToken(), first, deliver)

    def span(self, name: str) -> tuple[float, float]:
        times = [t for n, _, t in self.chunks if n == name]
        return min(times), max(times)

    def threads(self, name: str) -> set[str]:
        return {thread for n, thread, _ in self.chunks if n == name}


@pytest.fixture(scope="module")
def pool():
    worker = TTSWorker.from_config(TTSConfig(backend="hibari", seed=0, workers=2))
    yield worker
    worker.close()


def test_two_workers_synthesize_two_replies_at_once(pool) -> None:
    assert len(pool.backends) == 2 and pool.backends[0] is not pool.backends[1]
    # the warm-up loaded each instance's out-of-vocabulary net (hibari's), not the first answer with an unknown word
    assert all(backend._tts.g2p._oov is not None for backend in pool.backends)
    seen = Arrivals()
    pool.submit(seen.job("a", LONG, False))
    pool.submit(seen.job("b", LONG, False))
    assert seen.done["a"].wait(120) and seen.done["b"].wait(120)
    (a_start, a_end), (b_start, b_end) = seen.span("a"), seen.span("b")
    # both in flight at once: each reply's audio started before the other's ended, on its own thread
    assert a_start < b_end and b_start < a_end
    assert len(seen.threads("a")) == len(seen.threads("b")) == 1 and seen.threads("a") != seen.threads("b")


def test_a_first_piece_goes_before_queued_later_pieces_on_any_free_worker(pool) -> None:
    seen = Arrivals()
    for name in ("busy-1", "busy-2"):  # both workers busy with long later pieces
        pool.submit(seen.job(name, LONG, False))
    while len({n for n, _, _ in seen.chunks}) < 2:  # until each has started
        time.sleep(0.005)
    pool.submit(seen.job("queued-later", "Later pieces wait for first ones.", False))
    pool.submit(seen.job("first", "A first piece goes ahead.", True))
    for event in seen.done.values():
        assert event.wait(120)
    assert seen.span("first")[0] < seen.span("queued-later")[0]


def test_voices_in_worker_processes_serve_and_close_joins_every_thread_and_process() -> None:
    """Two voice instances in processes of their own (as a GPU server runs them): a reply comes
    through; close joins the worker threads and stops the processes."""
    worker = TTSWorker.from_config(TTSConfig(backend="hibari", seed=0, workers=2, processes=True))
    threads = [t for t in threading.enumerate() if t.name.startswith("tts-worker-")]
    assert len(threads) >= 2 and all(b.name == "hibari (process)" for b in worker.backends)
    seen = Arrivals()
    worker.submit(seen.job("a", LONG, True))
    assert seen.done["a"].wait(120) and len(seen.chunks) >= 3
    worker.close()
    assert not any(t.is_alive() for t in worker._threads)
    assert not any(b._process.is_alive() for b in worker.backends)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(TTSJob("Too late.", CancelToken(), True, lambda item: None))


def test_workers_default_and_checks() -> None:
    assert 1 <= default_tts_workers() <= 8 and TTSConfig().workers == default_tts_workers()
    assert TTSConfig(backend="coqui").workers == 1 and TTSConfig(backend="coqui", workers=2).workers == 2
    with pytest.raises(ConfigError, match="workers=0"):
        TTSConfig(workers=0)
    with pytest.raises(ConfigError, match="each of several workers runs on one thread"):
        TTSConfig(workers=2, threads=2)


def test_pool_timing_program_reports_first_audio_and_throughput(tmp_path, capsys) -> None:
    from speech.tts.bench import main

    rows = main(["--workers", "2", "--answers", "2", "--json", str(tmp_path / "tts.json")])
    assert [(r["workers"], r["first_max_chars"], r["answers"]) for r in rows] == [(2, 48, 2), (2, 160, 2)]  # the baseline too
    assert 0 < rows[0]["first_audio_ms"]["p50"] <= rows[0]["first_audio_ms"]["p99"] and rows[0]["audio_s_per_s"] > 0
    assert "first audio p50/p95/p99 ms" in capsys.readouterr().out and (tmp_path / "tts.json").is_file()
