"""Streaming speech recognition shared by many sessions, one module per part.

- ``backend``: ``ASRBackend``, a recognizer over whole 16 kHz clips (``FasterWhisperBackend`` on
  the CPU) and ``ASRError``; ``factory``: ``load_backend``, which picks one by device.
- ``torch_backend``: ``TorchWhisperBackend``, Whisper in PyTorch over the same CTranslate2 weights,
  many clips per batch (the GPU backend), built from ``ct2_weights`` (the model.bin reader),
  ``log_mel`` (features as faster-whisper computes them), ``whisper_model`` (encoder, decoder step
  on a static KV cache, the turbo shape with random weights) and ``greedy_decode`` (the batched
  greedy loop, its step captured in CUDA graphs per batch-size bucket).
- ``worker``: ``ASRWorker``, one thread that owns the one loaded model and serves every session
  from a bounded queue (a batching backend gets up to ``max_batch`` jobs a turn). Finals go
  before partials and are never dropped; a session's queued
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
