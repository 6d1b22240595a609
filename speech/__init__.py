"""Speech: audio utilities, VAD endpointing, streaming ASR, streaming TTS, text chunking. Knows audio, not LLMs."""
