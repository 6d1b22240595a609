"""Attention over the paged KV cache: metadata shared by all backends, and backend selection."""

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.selection import select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
