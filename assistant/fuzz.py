"""``python -m assistant.fuzz``: malformed client events against a real Realtime server.

    python -m assistant.fuzz [--events 10000] [--connections 4] [--asr tiny] [--url ws://HOST:PORT/v1/realtime]

Without ``--url`` it starts the assistant's server on 127.0.0.1 (the embedded defaults, ``--asr``
Whisper) and fuzzes that. Over a few connections, in lock-step, it sends ``--events`` malformed
events of every kind a careless or hostile client sends (bad JSON, deep nesting, lone
surrogates, wrong types, unknown events and fields, oversized events and texts, bad base64, audio
of the wrong size, out-of-range values, binary frames, events the session's state refuses) and
checks that each gets an ``error`` event with the expected code. A valid event every few keeps the
run of errors short of ``max_errors``. Then it checks the documented closes: a run of
``max_errors`` invalid events (1008), a flood over the event rate (``rate_limited``, then 1008),
one session more than an address may hold (1013) and a frame over the WebSocket limit (1009).
Last, a clean typed turn and a clean voice turn (a question spoken by the bundled voice) must
still be answered. It prints the counts and exits 1 on any unexpected outcome.
``--url`` targets a running server started with the default limits (or pass the same flags).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from assistant.client_events import MAX_JSON_DEPTH
from assistant.config import ServerConfig

RATE = 24000
UPDATE = json.dumps({"type": "session.update", "session": {}})  # valid; answered by session.updated
QUESTION = "How many days of annual leave do I get per year?"
ANSWER_TIMEOUT_S = 300.0  # a bound on one reply from the server, not a performance target
Case = tuple[str | bytes, frozenset[str]]  # (frame, the error codes it may get)


@dataclass
class FuzzReport:
    sent: int = 0  # malformed events sent
    codes: Counter[str] = field(default_factory=Counter)  # error code -> count
    closes: Counter[str] = field(default_factory=Counter)  # check -> close code seen
    unexpected: list[str] = field(default_factory=list)
    clean_turn: str | None = None  # the last event of the typed turn ("response.done")
    voice_transcript: str | None = None  # what the server heard of the spoken question (None: not tried)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"malformed events sent: {self.sent} in {self.seconds:.1f} s",
                 "error codes: " + ", ".join(f"{c}={n}" for c, n in sorted(self.codes.items())),
                 "closes: " + ", ".join(f"{k}={v}" for k, v in self.closes.items()),
                 f"typed turn after: {self.clean_turn}", f"voice turn after: heard {self.voice_transcript!r}",
                 f"unexpected outcomes: {len(self.unexpected)}", *(f"  {u}" for u in self.unexpected[:20])]  # fmt: skip
        return "\n".join(lines)


# ---- the malformed events ----------------------------------------------------------------------------------
def _event(kind: str, **fields: object) -> str:
    return json.dumps({"type": kind, **fields})


def _item(text: object, role: str = "user", **extra: object) -> dict[str, object]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}], **extra}


def _audio(pcm: bytes) -> str:
    return _event("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())


def _cases(config: ServerConfig) -> list[tuple[float, Callable[[random.Random], Case]]]:
    """(weight, make one case) for every kind of malformed event."""
    def codes(*names: str) -> frozenset[str]:
        return frozenset(names)

    def bad_json(r: random.Random) -> Case:
        valid = _event("conversation.item.create", item=_item("Hello?"))
        frame = r.choice([valid[: r.randrange(1, len(valid) - 1)], "{", "not json", '{"type": }', "", "[1, 2,]",
                          "".join(chr(r.randrange(32, 0x2FFF)) for _ in range(r.randrange(1, 64)))])  # fmt: skip
        return frame, codes("invalid_json", "invalid_event")

    def nesting(r: random.Random) -> Case:
        depth = r.choice([MAX_JSON_DEPTH + 1, r.randrange(MAX_JSON_DEPTH + 1, 2000), 50_000])
        opener, closer = r.choice([("[", "]"), ('{"a":', "}")])
        frame = r.choice([opener * depth, opener * depth + "1" + closer * depth,
                          '{"type": "session.update", "session": ' + "[" * depth + "]" * depth + "}"])  # fmt: skip
        return frame, codes("invalid_json")

    def surrogate(r: random.Random) -> Case:
        lone = r.choice(["\\ud800", "\\udfff", "\\udbff", "x\\ud83d"])
        frame = r.choice([
            '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
            f'"content": [{{"type": "input_text", "text": "hi {lone}"}}]}}}}',
            f'{{"type": "session.update", "session": {{}}, "event_id": "{lone}"}}',
            f'{{"type": "{lone}"}}',
            f'{{"type": "response.create", "response": {{"metadata": {{"{lone}": "v"}}}}}}',
            f'{{"type": "session.update", "session": {{"audio": {{"output": {{"voice": "{lone}"}}}}}}}}',
        ])  # fmt: skip
        return frame, codes("invalid_text")

    def wrong_type(r: random.Random) -> Case:
        return r.choice([
            (json.dumps(r.choice([[1, 2], "a string", None, 42, 1.5, True])), codes("invalid_event")),
            (json.dumps({"type": r.choice([5, None, [], {}, True])}), codes("invalid_event")),
            (_event("input_audio_buffer.append", audio=r.choice([5, None, [], {"a": 1}])), codes("invalid_value")),
            (_event("session.update", session=r.choice(["x", 1, [], None])), codes("invalid_value")),
            (_event("conversation.item.create", item=_item(r.choice([5, None, ["a"]]))), codes("invalid_value")),
            (_event("response.create", response={"max_output_tokens": r.choice(["lots", [], 1.5])}), codes("invalid_value")),
            (_event("response.cancel", response_id=r.choice([1, [], {}])), codes("invalid_value")),
        ])  # fmt: skip

    def unknown(r: random.Random) -> Case:
        name = "".join(r.choice("abcdefghijklmnopqrstuvwxyz._") for _ in range(r.randrange(1, 40)))
        return r.choice([
            (_event(name), codes("unknown_event_type")),
            (_event("x" * 100_000), codes("unknown_event_type")),
            (_event(r.choice(["conversation.item.truncate", "conversation.item.delete", "output_audio_buffer.clear",
                              "conversation.item.retrieve", "transcription_session.update"])), codes("unsupported_event_type")),
            (_event("input_audio_buffer.commit", **{"x_" + name: 1}), codes("unknown_parameter")),
            (_event("session.update", session={"voice_speed": 2}), codes("unknown_parameter")),
            (_event("input_audio_buffer.append"), codes("missing_required_parameter")),
            (_event("conversation.item.create"), codes("missing_required_parameter")),
        ])  # fmt: skip

    def oversized(r: random.Random) -> Case:
        if r.random() < 0.2:
            return _event("input_audio_buffer.append", audio="A" * (config.max_message_bytes + 4)), codes("message_too_large")
        return _event("conversation.item.create", item=_item("a" * (config.max_item_chars + r.randrange(1, 1000)))), codes("item_too_large")

    def bad_audio(r: random.Random) -> Case:
        return r.choice([
            (_event("input_audio_buffer.append", audio=r.choice(["%%%not base64%%%", "AAA", "A", "====", "\u00e9t\u00e9"])),
             codes("invalid_base64")),
            (_audio(r.randbytes(r.randrange(0, 2000) * 2 + 1)), codes("invalid_audio_format")),
            (_audio(b""), codes("invalid_audio_format")),
            (_audio(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(32)), codes("invalid_audio_format")),
        ])  # fmt: skip

    def out_of_range(r: random.Random) -> Case:
        vad = {"type": "server_vad"}
        return r.choice([
            (_event("session.update", session={"audio": {"input": {"turn_detection": {**vad, "threshold": r.choice([5.0, -1, 0.0, 1e30])}}}}), codes("invalid_value")),
            (_event("session.update", session={"audio": {"input": {"turn_detection": {**vad, "silence_duration_ms": r.choice([-1, 0, 10**9])}}}}), codes("invalid_value")),
            (_event("session.update", session={"audio": {"input": {"turn_detection": {**vad, "prefix_padding_ms": 99_999}}}}), codes("invalid_value")),
            (_event("session.update", session={"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}), codes("invalid_value")),
            (_event("session.update", session={"max_output_tokens": r.choice([0, -1, 5000, 10**30])}), codes("invalid_value")),
            (_event("session.update", session={"output_modalities": r.choice([[], ["audio", "text"], ["video"]])}), codes("invalid_value")),
            (_event("response.create", response={"max_output_tokens": r.choice([0, 4097, -5])}), codes("invalid_value")),
            (_event("session.update", session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": r.choice([8000, 16000, 0])}}}}), codes("unsupported_value")),
            (_event("session.update", session={"audio": {"output": {"voice": "alloy"}}}), codes("unsupported_value")),
            (_event("session.update", session={"audio": {"output": {"speed": 2.0}}}), codes("unsupported_value")),
            (_event("session.update", session={"instructions": "Be a pirate."}), codes("unsupported_value")),
            (_event("session.update", session={"audio": {"input": {"transcription": {"language": "xx"}}}}), codes("invalid_value")),
        ])  # fmt: skip

    def binary(r: random.Random) -> Case:
        return r.randbytes(r.randrange(1, 4096)), codes("binary_not_supported")

    def state(r: random.Random) -> Case:
        return r.choice([
            (_event("input_audio_buffer.commit"), codes("input_audio_buffer_commit_empty")),
            (_event("response.cancel"), codes("response_cancel_not_active")),
            (_event("response.create"), codes("no_user_input")),
            (_event("conversation.item.create", item=_item("Hi", role="assistant")), codes("unsupported_value")),
            (_event("conversation.item.create", previous_item_id="item_nope", item=_item("Hi")), codes("invalid_value")),
            (_event("conversation.item.create", item=_item("Hi", role="system")), codes("invalid_value")),
        ])  # fmt: skip

    return [(10, bad_json), (6, nesting), (10, surrogate), (10, wrong_type), (10, unknown), (0.5, oversized),
            (10, bad_audio), (12, out_of_range), (6, binary), (8, state)]  # fmt: skip


# ---- the run -----------------------------------------------------------------------------------------------
async def _receive(ws: ClientConnection) -> dict:
    async with asyncio.timeout(ANSWER_TIMEOUT_S):
        return json.loads(await ws.recv())


async def _open(url: str, attempts: int = 300) -> ClientConnection:
    """A new session; while the server is still releasing this address's last ones, try again."""
    for _ in range(attempts):
        ws = await connect(url, max_size=None, open_timeout=60)
        created = await _receive(ws)
        if created["type"] == "session.created":
            return ws
        await ws.close()
        if created.get("error", {}).get("code") != "client_session_limit_reached":
            break
        await asyncio.sleep(0.1)
    raise RuntimeError(f"no session: {created}")


async def _fuzz_connection(url: str, config: ServerConfig, count: int, rng: random.Random, report: FuzzReport) -> None:
    """``count`` malformed events on one connection, each waited for; a valid one every few."""
    makers = _cases(config)
    weights = [w for w, _ in makers]
    interval = 1.0 / (0.75 * config.max_events_per_s)  # stay under the session's event rate
    ws = await _open(url)
    try:
        for k in range(count):
            if k % max(1, config.max_errors - 1) == 0 and k:
                await ws.send(UPDATE)
                if (reply := await _receive(ws))["type"] != "session.updated":
                    report.unexpected.append(f"valid session.update answered by {reply}")
            start = time.monotonic()
            frame, expected = rng.choices(makers, weights)[0][1](rng)
            await ws.send(frame)
            report.sent += 1
            event = await _receive(ws)
            code = event.get("error", {}).get("code") if event["type"] == "error" else None
            report.codes[code or event["type"]] += 1
            if code not in expected:
                report.unexpected.append(f"{str(frame)[:100]!r} -> {json.dumps(event)[:200]} (expected {sorted(expected)})")
            await asyncio.sleep(max(0.0, start + interval - time.monotonic()))
    except (ConnectionClosed, TimeoutError) as exc:
        report.unexpected.append(f"connection ended during the fuzz: {exc!r}")
    finally:
        await ws.close()


async def _expect_close(ws: ClientConnection, code: int, check: str, report: FuzzReport) -> list[str]:
    """Read until the server closes; record the close code and return the error codes seen."""
    codes = []
    try:
        while True:
            event = await _receive(ws)
            if event["type"] == "error":
                codes.append(event["error"]["code"])
    except ConnectionClosed as exc:
        got = exc.rcvd.code if exc.rcvd is not None else 1006
        report.closes[check] = got
        if got != code:
            report.unexpected.append(f"{check}: closed with {got}, expected {code}")
    except TimeoutError:
        report.unexpected.append(f"{check}: the server never closed the connection")
    return codes


async def _documented_closes(url: str, config: ServerConfig, report: FuzzReport) -> None:
    ws = await _open(url)  # a run of max_errors invalid events: too_many_errors, 1008
    for _ in range(config.max_errors):
        await ws.send("{")
        report.sent += 1
    codes = await _expect_close(ws, 1008, "error_run", report)
    report.codes.update(codes)
    if codes != ["invalid_json"] * config.max_errors + ["too_many_errors"]:
        report.unexpected.append(f"error run: got {Counter(codes)}")

    ws = await _open(url)  # a flood over the event rate: rate_limited, then too_many_errors and 1008
    try:
        for _ in range(int(6 * config.max_events_per_s) + config.max_errors):
            await ws.send(UPDATE)
    except ConnectionClosed:
        pass
    codes = await _expect_close(ws, 1008, "rate_flood", report)
    report.codes.update(codes)
    if codes.count("rate_limited") != config.max_errors or codes[-1:] != ["too_many_errors"]:
        report.unexpected.append(f"rate flood: got {Counter(codes)}")

    held = [await _open(url) for _ in range(config.max_sessions_per_client)]  # one session too many: 1013
    try:
        extra = await connect(url, open_timeout=60)
        codes = await _expect_close(extra, 1013, "sessions_per_client", report)
        report.codes.update(codes)
        if codes != ["client_session_limit_reached"]:
            report.unexpected.append(f"sessions per client: got {codes}")
    finally:
        for ws in held:
            await ws.close()

    ws = await _open(url)  # one frame over the WebSocket limit: 1009
    try:
        await ws.send("A" * (max(16 << 20, 4 * config.max_message_bytes) + (1 << 20)))
    except ConnectionClosed:
        pass
    await _expect_close(ws, 1009, "frame_too_large", report)


async def _clean_turns(url: str, report: FuzzReport, speech: bytes | None) -> None:
    ws = await _open(url)
    try:
        await ws.send(_event("conversation.item.create", item=_item(QUESTION)))
        await ws.send(_event("response.create", response={"output_modalities": ["text"]}))
        while (event := await _receive(ws))["type"] not in ("response.done", "error"):
            pass
        report.clean_turn = event["type"] if event["type"] == "error" else f"response.done ({event['response']['status']})"
        if event["type"] == "error" or event["response"]["status"] == "failed":
            report.unexpected.append(f"typed turn: {json.dumps(event)[:300]}")
        if speech is None:
            return
        step = RATE // 10 * 2  # 100 ms packets, as fast as the server takes them (under its event rate)
        for i in range(0, len(speech), step):
            await ws.send(_audio(speech[i : i + step]))
            await asyncio.sleep(0.02)
        done = False
        while not done:
            event = await _receive(ws)
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                report.voice_transcript = event["transcript"]
            elif event["type"] == "error":
                report.unexpected.append(f"voice turn: {json.dumps(event)[:300]}")
            done = event["type"] in ("response.done", "error")
        if event["type"] == "response.done" and event["response"]["status"] == "failed":
            report.unexpected.append(f"voice turn failed: {json.dumps(event['response'])[:300]}")
        if not report.voice_transcript or "leave" not in report.voice_transcript.lower():
            report.unexpected.append(f"voice turn: heard {report.voice_transcript!r} for {QUESTION!r}")
    except (ConnectionClosed, TimeoutError) as exc:
        report.unexpected.append(f"clean turns: {exc!r}")
    finally:
        await ws.close()


async def fuzz(url: str, config: ServerConfig, events: int = 10_000, connections: int = 4, seed: int = 0,
               speech: bytes | None = None) -> FuzzReport:  # fmt: skip
    """Fuzz the server at ``url`` (whose limits are ``config``'s); ``speech``: PCM16 24 kHz of
    :data:`QUESTION` for the voice turn at the end (None: typed turn only)."""
    report = FuzzReport()
    start = time.monotonic()
    shares = [events // connections + (k < events % connections) for k in range(connections)]
    await asyncio.gather(*(_fuzz_connection(url, config, n, random.Random(seed * 1000 + k), report)
                           for k, n in enumerate(shares)))  # fmt: skip
    await _documented_closes(url, config, report)
    await _clean_turns(url, report, speech)
    report.seconds = time.monotonic() - start
    return report


def spoken_question() -> bytes:
    """:data:`QUESTION` spoken by the bundled voice, with silence after it (PCM16 mono 24 kHz)."""
    import numpy as np

    from speech.audio import resample, to_pcm16
    from speech.config import TTSConfig
    from speech.tts import load_tts

    tts = load_tts(TTSConfig(backend="hibari", seed=0))
    pcm = resample(tts.synthesize(QUESTION).pcm, tts.sample_rate, RATE)
    audio = np.concatenate([np.zeros(RATE // 5, np.float32), pcm, np.zeros(RATE, np.float32)])
    return to_pcm16(audio).astype("<i2").tobytes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m assistant.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's ws://.../v1/realtime (default: start one on 127.0.0.1)")
    p.add_argument("--events", type=int, default=10_000, help="malformed events to send (default 10000)")
    p.add_argument("--connections", type=int, default=4, help="connections they are spread over (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--asr", default="tiny", metavar="base|tiny|DIR", help="the started server's Whisper (default tiny)")
    p.add_argument("--no-voice", dest="voice", action="store_false", help="skip the voice turn at the end")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # the server's errors too
    from assistant.serve_command import load_server, parse_config
    from engine.serving.server import BackgroundServer

    config, _, _ = parse_config(["serve", "--asr", a.asr])
    speech = spoken_question() if a.voice else None
    if a.url:
        report = asyncio.run(fuzz(a.url, config, a.events, a.connections, a.seed, speech))
    else:
        server = load_server(config, warm_up=True)
        try:
            with BackgroundServer(server.app) as http:
                url = http.url.replace("http://", "ws://") + "/v1/realtime"
                print(f"fuzzing {url} ({server.model_name}, defaults, --asr {a.asr})", flush=True)
                report = asyncio.run(fuzz(url, config, a.events, a.connections, a.seed, speech))
        finally:
            server.close()
    print(report.summary(), flush=True)
    return 1 if report.unexpected or report.clean_turn is None else 0


if __name__ == "__main__":
    sys.exit(main())
