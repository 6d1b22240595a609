"""Speech: audio utilities, VAD endpointing, streaming ASR and TTS, text chunking.

Knows audio, not LLMs: never imports ``engine`` or ``assistant``; models come in its configs.
"""
