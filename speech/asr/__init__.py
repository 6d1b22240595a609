"""Streaming speech recognition shared by many sessions, one module per part.

- ``backend``: ``ASRBackend``, a recognizer over whole 16 kHz clips (``FasterWhisperBackend`` now;
  a torch Whisper for GPU co-scheduling can sit behind the same interface later), and ``ASRError``.
- ``worker``: ``ASRWorker``, one thread that owns the one loaded model and serves every session
  from a bounded queue. Finals go before partials and are never dropped; a session's queued
  partial is replaced by its newer one or removed when its final is queued; a partial that finds
  the queue full is dropped. ``stats`` counts all of it.
- ``stable_prefix``: ``StablePrefix``, the local agreement that keeps partials stable.
- ``session``: ``ASRSession``, one user's stream. VAD endpointing; while the user speaks, the
  growing utterance is re-decoded every ``partial_interval_s`` and only the stable prefix is
  emitted (a word is stable once two decodes in a row agree on it; it is then forced as the
  decoder prefix of every later decode, so each partial is a prefix of the later ones and of the
  final). No partials are decoded while the speaker pauses, so the worker is free when the final
  comes. ``AsyncASRSession`` is the same for asyncio code (``async for event in session``,
  ``await session.final()``).
"""
