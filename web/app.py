"""The page: talk or type to the handbook, see where the time went and what the server does.

:class:`WebApp` builds the Gradio Blocks and serves every browser tab as a client of the
assistant: each tab opens its own Realtime session (:class:`~web.client.RealtimeClient`) over the
assistant's WebSocket API, so voice and text go through exactly the protocol other clients use.

- Talk: the microphone streams to the session (resampled to the session rate); the server's VAD
  ends the turn, or, in push-to-talk mode, releasing the mic does. Partial transcripts show live;
  each spoken answer streams into an autoplaying player as it arrives. Speaking over an answer
  stops it (server-side barge-in), so does the Stop button. A recording can be uploaded instead.
- Type: questions typed in the box are answered in text, streamed, with the handbook section the
  answer is attributed to. Voice and typed turns are one conversation.
- See: each finished turn's stage timings as a waterfall and a table; the server panel
  (:mod:`web.stats`) refreshes every two seconds.
- Documents (:mod:`web.documents`) and per-tab settings (speech language, answer voice or text,
  turn-taking, VAD hangover) with the server's defaults shown.

Who may do what: when the server has an API key, the page (and its Gradio API) asks for it at a
login form (any user name, the key as password). Pointing the assistant at another folder and
adding documents are operator actions: the page offers them (and the Gradio API has them) only
when the server was started with ``allow_document_changes`` (``--allow-document-changes``).

One long-running update loop per tab (:meth:`WebApp.follow`) pushes the session's changes to the
page; a new spoken answer starts a player stream of its own (:meth:`WebApp.speak`).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from assistant.docs import DocumentError
from assistant.image_reading import ImageError
from assistant.server import AssistantServer
from web import waterfall
from web.audio import NotAudioError, StreamResampler, read_audio_file, to_mono_float, to_pcm16_bytes, wav_bytes
from web.client import RealtimeClient, SessionError
from web.documents import DOCUMENT_SUFFIXES, DocumentLibrary
from web.picture import picture_url
from web.stats import ServerSnapshot

HANDS_FREE = "Hands-free (the assistant hears when you stop)"
PUSH_TO_TALK = "Push to talk (stop recording to ask)"
LANGUAGES = ("auto", "en", "zh")
REPLY_VOICE, REPLY_TEXT = "voice", "text"
MIC_EVERY_S = 0.2  # how often the browser sends microphone audio
PLAYER_PIECE_S = 0.2  # the least answer audio handed to the player at once (the last piece may be shorter)
UPDATE_EVERY_S = 0.15  # the update loop coalesces changes for this long (token deltas come faster)
UPLOAD_PACE = 4.0  # an uploaded recording is sent this many times faster than real time
RELEASE_GRACE_S = 0.3  # push-to-talk: let the last microphone chunk arrive before ending the turn
STATS_EVERY_S = 2.0
STOP_PLAYER_JS = "() => { document.querySelectorAll('#speaker audio').forEach((a) => a.pause()); return []; }"
CSS = """
#live { min-height: 4.5em; }
#turns table { font-size: 0.85em; }
"""


@dataclass
class Page:
    """One browser tab: its Realtime session and what the tab has been shown."""

    client: RealtimeClient
    resampler: StreamResampler | None = None
    settings_sent: tuple[str, str, str, int] | None = None  # what apply_settings sent last
    timelines_shown: int = 0
    reply_shown: str | None = None
    reply_cut: str | None = None  # a spoken answer interrupted while playing, once its player was cleared
    stats_before: ServerSnapshot | None = None


class WebApp:
    """The Gradio page of one assistant server; ``blocks()`` builds it, mount it on ``server.app``."""

    def __init__(self, server: AssistantServer, realtime_url: str, documents: DocumentLibrary,
                 allow_document_changes: bool = False) -> None:  # fmt: skip
        self.server = server
        self.realtime_url = realtime_url
        self.documents = documents
        self.allow_document_changes = allow_document_changes
        self.pages: dict[str, Page] = {}

    # ---- layout ----------------------------------------------------------------------------------
    def blocks(self) -> gr.Blocks:
        voice = self.server.config.voice
        with gr.Blocks(title="Handbook assistant", analytics_enabled=False) as page:
            gr.Markdown("# Handbook assistant\nAsk about the company handbook by voice or by text. "
                        "Answers come from the documents listed below; each names the section it is based on.")  # fmt: skip
            reply = gr.State(None)
            with gr.Row(equal_height=False):
                with gr.Column(scale=3):
                    chat = gr.Chatbot(label="Conversation", height=420, elem_id="chat", buttons=["copy"],
                                      feedback_options=None, placeholder="Speak or type a question.")  # fmt: skip
                    with gr.Row():
                        question = gr.Textbox(placeholder="Type a question, e.g. How do I apply for annual leave?",
                                              show_label=False, scale=5, elem_id="question", submit_btn=False)  # fmt: skip
                        ask = gr.Button("Ask", variant="primary", scale=1, elem_id="ask")
                        stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
                    picture = gr.Image(sources=["upload", "clipboard", "webcam"], type="filepath", height=180,
                                       label="Ask about a picture: upload, paste or take a photo (a receipt, a form, "
                                             "a screenshot), then type the question", elem_id="picture")  # fmt: skip
                with gr.Column(scale=2):
                    live = gr.Markdown("Connecting to the assistant...", elem_id="live")
                    mic = gr.Audio(sources=["microphone"], streaming=True, type="numpy", label="Microphone", elem_id="mic")
                    speaker = gr.Audio(streaming=True, autoplay=True, interactive=False, label="Answer audio", elem_id="speaker")
                    recording = gr.File(label="Or ask with a recording (WAV, MP3, OGG, ...)", elem_id="recording", height=100)
            with gr.Row(equal_height=False):
                with gr.Column(scale=3):
                    gr.Markdown("### Where the time went")
                    summary = gr.Markdown("Stage timings of each turn appear here.", elem_id="summary")
                    plot = gr.Plot(label="Latency waterfall of the last turn", format="png", elem_id="waterfall")
                with gr.Column(scale=2):
                    gr.Markdown("### Server")
                    stats = gr.Markdown(elem_id="stats")
            turns = gr.Markdown(elem_id="turns")
            with gr.Tab("Documents", elem_id="documents-tab"):
                docs = gr.Markdown(elem_id="documents")
                with gr.Row():
                    if self.allow_document_changes:
                        folder = gr.Textbox(label="Answer from this folder", placeholder="/path/to/documents", scale=4)
                        use_folder = gr.Button("Use folder", scale=1)
                    reload = gr.Button("Reload", scale=1, elem_id="reload")
                if self.allow_document_changes:
                    upload = gr.File(label=f"Add a document ({', '.join(DOCUMENT_SUFFIXES)})", file_types=list(DOCUMENT_SUFFIXES),
                                     elem_id="upload", height=100)  # fmt: skip
                else:
                    gr.Markdown("Changing the folder or adding documents is off (the server's --allow-document-changes turns it on).")
                docs_status = gr.Markdown(elem_id="documents-status")
            with gr.Tab("Settings", elem_id="settings-tab"):
                with gr.Row():
                    mode = gr.Radio([HANDS_FREE, PUSH_TO_TALK], value=HANDS_FREE, label="Turn-taking")
                    language = gr.Dropdown(list(dict.fromkeys([*LANGUAGES, voice.asr_language])), value=voice.asr_language,
                                           label="Speech language")  # fmt: skip
                    reply_as = gr.Radio([REPLY_VOICE, REPLY_TEXT], value=REPLY_VOICE, label="Answer spoken questions with")
                    hangover = gr.Slider(100, 3000, value=voice.hangover_ms, step=50, label="VAD hangover (ms of silence that ends a turn)")
                voice_name = gr.Textbox(label="Voice (set when the server starts)", interactive=False)
                in_effect = gr.Markdown(elem_id="in-effect")
                gr.Markdown(f"Defaults: speech language **{voice.asr_language}**, **hands-free**, hangover **{voice.hangover_ms} ms**, "
                            f"answers **spoken** by the **{voice.tts_backend}** voice. Typed questions are always answered in text.")  # fmt: skip
            timer = gr.Timer(STATS_EVERY_S)

            hidden: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}
            view = [live, chat, summary, plot, turns, reply, in_effect, speaker]
            page.load(self.open, None, [voice_name, docs, stats], **hidden).then(self.follow, None, view, **hidden)
            page.unload(self.close)
            mic.stream(self.hear, [mic], None, stream_every=MIC_EVERY_S, **hidden)
            mic.start_recording(self.start_talking, None, None, **hidden)
            mic.stop_recording(self.stop_talking, None, None, **hidden)
            reply.change(self.speak, [reply], [speaker], trigger_mode="always_last", **hidden)
            for event in (question.submit, ask.click):
                event(self.ask, [question, picture], [question, picture], **hidden)
            stop.click(self.stop, None, None, js=STOP_PLAYER_JS, **hidden)
            recording.upload(self.ask_recording, [recording], [recording], **hidden)
            settings = [mode, language, reply_as, hangover]
            for event in (mode.input, language.input, reply_as.input, hangover.release):
                event(self.apply_settings, settings, None, **hidden)
            timer.tick(self.stats, None, [stats], **hidden)
            documents = {"concurrency_limit": 1, "concurrency_id": "documents", "show_progress": "minimal"}
            reload.click(self.reload, None, [docs, docs_status], api_name="reload", **documents)
            if self.allow_document_changes:
                use_folder.click(self.use_folder, [folder], [docs, docs_status], api_name="use_folder", **documents)
                upload.upload(self.add_document, [upload], [docs, docs_status, upload], api_name="add_document", **documents)
        return page

    def mount(self, path: str = "/") -> None:
        """Serve the page on the assistant's own app (beside ``/v1``, ``/health``, ``/metrics``),
        behind a login asking for the server's API key when it has one."""
        key = self.server.config.api_key
        auth = None if key is None else (lambda _user, password: hmac.compare_digest(password.encode(), key.encode()))
        gr.mount_gradio_app(self.server.app, self.blocks().queue(default_concurrency_limit=None), path=path,
                            css=CSS, ssr_mode=False, footer_links=[], auth=auth,
                            auth_message="Sign in with any user name and the server's API key as password.")  # fmt: skip

    # ---- a tab opens and closes ------------------------------------------------------------------
    async def open(self, request: gr.Request) -> tuple[str, str, str]:
        """Open the tab's Realtime session; the voice, the documents and the server panel."""
        try:
            client = await RealtimeClient.open(self.realtime_url, self.server.config.api_key)
        except SessionError as exc:
            gr.Warning(str(exc), duration=None)
            return "", self.documents.markdown(), ServerSnapshot.take(self.server).markdown()
        self.pages[request.session_hash] = Page(client)
        voice = client.session["audio"]["output"]["voice"]
        return f"{voice} ({self.server.config.voice.tts_backend})", self.documents.markdown(), self.stats(request)

    async def close(self, request: gr.Request) -> None:
        page = self.pages.pop(request.session_hash, None)
        if page is not None:
            await page.client.close()

    # ---- the update loop -------------------------------------------------------------------------
    async def follow(self, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """Push the tab's session to the page as it changes, until the session ends."""
        page = self.pages.get(request.session_hash)
        if page is None:
            yield ("**Not connected to the assistant.** Reload the page to try again.", *[gr.skip()] * 7)
            return
        client = page.client
        version = -1
        while not client.closed:
            version = await client.wait(version, timeout=30.0)
            for message in client.take_errors():
                gr.Warning(message)
            yield self._view(page)
            await asyncio.sleep(UPDATE_EVERY_S)
        gr.Warning(f"The session with the assistant ended ({client.closed_reason}). Reload the page to start a new one.", duration=None)
        yield self._view(page)

    def _view(self, page: Page) -> tuple[Any, ...]:
        """(live line, chat, summary, plot, turns table, newest spoken reply, settings in effect, player)."""
        client = page.client
        timed = [(n, t.timeline) for n, t in enumerate(client.turns, 1) if t.timeline is not None]
        if len(timed) != page.timelines_shown and timed:
            page.timelines_shown = len(timed)
            last = timed[-1][1]
            charts: tuple[Any, ...] = (waterfall.summary(last), waterfall.figure(last), waterfall.table(timed))
        else:
            charts = (gr.skip(),) * 3
        newest = client.audio_replies[-1] if client.audio_replies else None
        cut = newest is not None and newest in client.audio and client.audio[newest].cut
        reply: Any = gr.skip()
        player: Any = gr.skip()
        if newest != page.reply_shown and not cut:  # a new spoken answer: start its player stream
            page.reply_shown = reply = newest
        elif cut and newest == page.reply_shown and newest != page.reply_cut:
            page.reply_cut, player = newest, None  # interrupted while playing: drop what the player still holds
        return (self._live(page), self._chat(page), *charts, reply, self._in_effect(client), player)

    def _live(self, page: Page) -> str:
        client = page.client
        if client.closed:
            return f"**Disconnected:** {client.closed_reason}"
        activity = client.activity
        if activity == "hearing":
            line = "**Hearing you...**"
        elif activity == "thinking":
            line = "**Thinking...**"
        elif activity == "answering":
            line = "**Answering...** (speak or press Stop to interrupt)"
        elif not client.hands_free:
            line = "Push to talk: press **Record**, ask, then **Stop**."
        else:
            line = "Press **Record** and ask a question, or type one."
        spoken = [t for t in client.turns if t.spoken and t.question]
        if spoken:
            line += f"\n\nYou said: *{spoken[-1].question}{'' if spoken[-1].heard else ' ...'}*"
        return line

    def _chat(self, page: Page) -> list[dict[str, Any]]:
        messages = []
        for turn in page.client.turns:
            if turn.picture:
                messages.append({"role": "user", "content": {"path": turn.picture}})
            if turn.question:
                said = turn.question + ("" if turn.heard else " ...")
                messages.append({"role": "user", "content": f"{said} *(spoken)*" if turn.spoken else said})
            if turn.response_id is None:
                continue
            text = turn.answer or ("..." if turn.status is None else "")
            if turn.status is None:
                text += " ▌"
            elif turn.status == "cancelled":
                text += " *(interrupted)*"
            elif turn.status == "failed":
                text += f" *(failed: {turn.detail})*"
            elif turn.answer and turn.citation:
                text += f"\n\n*Source: {turn.citation}*"
            messages.append({"role": "assistant", "content": text})
        return messages

    def _in_effect(self, client: RealtimeClient) -> str:
        audio = client.session["audio"]
        detection = audio["input"]["turn_detection"]
        turn_taking = f"hands-free, hangover {detection['silence_duration_ms']} ms" if detection else "push to talk"
        modality = " and ".join(client.session["output_modalities"])
        return (f"In effect for this tab: speech language **{audio['input']['transcription']['language']}** · {turn_taking} · "
                f"spoken questions answered in **{modality}**")  # fmt: skip

    # ---- talk ------------------------------------------------------------------------------------
    async def hear(self, chunk: tuple[int, Any] | None, request: gr.Request) -> None:
        """One microphone chunk from the browser: resample and send it."""
        page = self.pages.get(request.session_hash)
        if page is None or chunk is None or page.client.closed:  # a closed session is shown once, by follow()
            return
        rate, samples = chunk
        if page.resampler is None or page.resampler.src_rate != rate:
            page.resampler = StreamResampler(rate, page.client.input_rate)
        await self._send_audio(page, to_pcm16_bytes(page.resampler.process(to_mono_float(samples))))

    async def start_talking(self, request: gr.Request) -> None:
        """Recording starts: a fresh resampler; in push-to-talk mode, pressing stops an answer."""
        page = self.pages.get(request.session_hash)
        if page is None:
            return
        page.resampler = None
        if not page.client.hands_free:
            await self._guard(page.client.interrupt())

    async def stop_talking(self, request: gr.Request) -> None:
        """Recording stops: in push-to-talk mode, the question is over; ask for the answer."""
        page = self.pages.get(request.session_hash)
        if page is None or page.client.hands_free:
            return
        await asyncio.sleep(RELEASE_GRACE_S)
        if await self._guard(page.client.finish_turn()) is False:
            gr.Warning("No question was heard. Press Record, speak, then Stop.")

    async def speak(self, response_id: str | None, request: gr.Request) -> AsyncIterator[bytes]:
        """Stream one spoken answer into the player as it arrives (ends early on a barge-in)."""
        page = self.pages.get(request.session_hash)
        if page is None or response_id is None:
            return
        rate = page.client.output_rate
        async for pcm in page.client.answer_audio(response_id, round(PLAYER_PIECE_S * rate)):
            yield wav_bytes(pcm, rate)

    async def ask_recording(self, path: str | None, request: gr.Request) -> None:
        """Ask with an uploaded recording: it is sent like microphone audio, faster than real time.
        The file box is cleared (the output is None) either way."""
        page = self.pages.get(request.session_hash)
        if page is None or path is None:
            return
        rate = page.client.input_rate
        try:
            pcm = await asyncio.to_thread(read_audio_file, Path(path), rate)
        except NotAudioError as exc:
            gr.Warning(f"{exc}. Upload a recording of a question (WAV, MP3, OGG, ...).")
            return
        step = rate // 10 * 2  # 100 ms of PCM16
        for start in range(0, len(pcm), step):
            await self._send_audio(page, pcm[start : start + step])
            await asyncio.sleep(0.1 / UPLOAD_PACE)
        if not page.client.hands_free:
            if await self._guard(page.client.finish_turn()) is False:
                gr.Warning("No question was heard in the recording.")
        else:  # silence after it, so the server's VAD ends the turn
            detection = page.client.session["audio"]["input"]["turn_detection"]
            await self._send_audio(page, bytes(2 * rate * (detection["silence_duration_ms"] + 300) // 1000))

    async def _send_audio(self, page: Page, pcm16: bytes) -> None:
        await self._guard(page.client.append_audio(pcm16))

    @staticmethod
    async def _guard(request: Any) -> Any:
        """Await a request to the session; a session that has ended becomes a warning, not a crash."""
        try:
            return await request
        except SessionError as exc:
            gr.Warning(str(exc))
            return None

    # ---- type ------------------------------------------------------------------------------------
    async def ask(self, text: str | None, picture: str | None, request: gr.Request) -> tuple[str, str | None]:
        """A typed question, about the picture if there is one: answered in text, streamed into the
        conversation (the picture is cleared once sent; a picture the server would refuse stays, with why)."""
        page = self.pages.get(request.session_hash)
        text = (text or "").strip()
        if not text and not picture:
            gr.Warning("Type a question first.")
            return "", None
        if page is None:
            gr.Warning("Not connected to the assistant. Reload the page.")
            return text, picture
        url = None
        if picture:
            try:
                url = await asyncio.to_thread(picture_url, picture)
            except ImageError as exc:
                gr.Warning(f"That picture cannot be used: {exc}")
                return text, None
        await self._guard(page.client.ask(text, url, picture))
        return "", None

    async def stop(self, request: gr.Request) -> None:
        page = self.pages.get(request.session_hash)
        if page is not None:
            await self._guard(page.client.interrupt())

    # ---- settings --------------------------------------------------------------------------------
    async def apply_settings(self, mode: str, language: str, reply_as: str, hangover: float, request: gr.Request) -> None:
        """Send the tab's settings to its session; the server refuses what it cannot do (a warning)."""
        page = self.pages.get(request.session_hash)
        settings = (mode, language, reply_as, int(hangover))
        if page is None or settings == page.settings_sent:  # an update restarts listening: only send changes
            return
        page.settings_sent = settings
        detection = None if mode == PUSH_TO_TALK else {"type": "server_vad", "silence_duration_ms": int(hangover)}
        await self._guard(page.client.update({
            "output_modalities": [REPLY_TEXT if reply_as == REPLY_TEXT else "audio"],
            "audio": {"input": {"transcription": {"language": language}, "turn_detection": detection}},
        }))  # fmt: skip

    # ---- server panel ----------------------------------------------------------------------------
    def stats(self, request: gr.Request) -> str:
        snapshot = ServerSnapshot.take(self.server)
        page = self.pages.get(request.session_hash)
        before = page.stats_before if page is not None else None
        if page is not None:
            page.stats_before = snapshot
        return snapshot.markdown(before)

    # ---- documents -------------------------------------------------------------------------------
    async def reload(self) -> tuple[str, str]:
        return await self._documents(self.documents.reload)

    async def use_folder(self, folder: str | None) -> tuple[str, str]:
        if not (folder or "").strip():
            gr.Warning("Type the path of a documents folder first.")
            return self.documents.markdown(), ""
        return await self._documents(self.documents.use_folder, Path(folder.strip()))

    async def add_document(self, path: str | None) -> tuple[str, str, None]:
        if path is None:
            return self.documents.markdown(), "", None
        return (*await self._documents(self.documents.add_file, Path(path), Path(path).name), None)

    async def _documents(self, change: Any, *args: Any) -> tuple[str, str]:
        """Run a documents change off the event loop; its outcome as a message."""
        try:
            message = await asyncio.to_thread(change, *args)
        except DocumentError as exc:
            message = f"**Not changed:** {exc}. The assistant still answers from the documents listed above."
            gr.Warning(str(exc))
        else:
            gr.Info(message)
        return self.documents.markdown(), message
