"""n-gram drafts and greedy verification on the device: a verifying step whose next step needs
nothing from the host.

A verifying step that the host must read back before it can launch the next one leaves the GPU
idle while the host learns how many drafts were accepted, appends them, looks up the next drafts
and launches (0.28 ms a verifying step, 0.17 ms of it host work, on an H100 with the 1.5B at
batch 1: docs/performance.md). These functions do that work on the device with fixed-shape
tensor operations, so that they can run inside a CUDA graph right after the step's argmax, and
the next step can be launched before the host reads anything:

- :func:`accept_greedy`: how many drafts each request's samples confirm (temperature 0: a draft
  stands while it equals the argmax at its position, as :func:`engine.speculative.accepted_tokens`).
- :func:`append_accepted`: the accepted drafts and the token after them onto each request's token
  history on the device.
- :func:`ngram_drafts`: the next drafts, by the rule of :class:`engine.speculative.NgramIndex`
  (the most recent earlier occurrence of the longest n-gram, ``min_n`` <= n <= ``max_n``, that
  ends the request's tokens), over the request's own history only.

Each request has a row of ``history`` ([B, L] token ids) and its length in ``lengths`` ([B]).
"""

from __future__ import annotations

import torch


def ngram_drafts(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` drafts per request: the tokens that followed the most recent earlier occurrence
    of the longest n-gram (``min_n`` <= n <= ``max_n``) ending its ``lengths[b]`` tokens of
    ``history[b]``. Returns (drafts [B, k] of history's dtype, num_drafts [B] int64); a request
    without a match has 0 drafts (its row of drafts is then its last token, never read as a draft).

    An occurrence ending at ``e`` (its continuation ``history[e]``, ``1 <= e < lengths``) matches
    m(e) tokens: the leading run of ``history[e-1-o] == history[lengths-1-o]``, o = 0, 1, ...
    (at most ``max_n``, never past the history's start). The best occurrence has the largest
    m(e) >= ``min_n``, then the largest e. Its drafts are ``history[e : e+k]``, cut at the
    request's length (only known tokens are proposed)."""
    b, width = history.shape
    device = history.device
    ends = torch.arange(width, device=device)  # e: where an occurrence's continuation starts
    back = torch.arange(max_n, device=device)  # o: tokens back from an occurrence's end
    last = lengths - 1
    suffix = history.gather(1, (last[:, None] - back[None, :]).clamp(min=0))  # [B, max_n]: the tokens to match, last first
    window = ends[:, None] - 1 - back[None, :]  # [L, max_n]: the occurrence's tokens, last first
    tokens = history[:, window.clamp(min=0)]  # [B, L, max_n]
    equal = (tokens == suffix[:, None, :]) & (window >= 0)[None]
    matched = torch.cumprod(equal.to(torch.int32), dim=2).sum(dim=2)  # m(e) [B, L]
    usable = (matched >= min_n) & (ends[None, :] <= last[:, None])
    score = torch.where(usable, matched * (width + 1) + ends[None, :], -1)  # longest first, then latest
    best, end = score.max(dim=1)
    found = best >= 0
    num_drafts = torch.where(found, torch.clamp(lengths - end, max=k), 0)
    at = (end[:, None] + torch.arange(k, device=device)[None, :]).clamp(max=width - 1)
    drafts = torch.where(torch.arange(k, device=device)[None, :] < num_drafts[:, None], history.gather(1, at),
                         history.gather(1, last[:, None].clamp(min=0)))
    return drafts, num_drafts


def accept_greedy(drafts: torch.Tensor, num_drafts: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request ([B] int64): ``samples`` [B, k + 1] are the argmax after the
    last known token and after each draft; draft i stands while every draft before it stood and
    it equals ``samples[:, i]``, among the request's first ``num_drafts`` drafts."""
    k = drafts.shape[1]
    confirmed = (samples[:, :k] == drafts) & (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None])
    return torch.cumprod(confirmed.to(torch.int64), dim=1).sum(dim=1)


def append_accepted(history: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor, accepted: torch.Tensor) -> None:
    """Append each request's ``accepted[b] + 1`` first samples (its accepted drafts and the token
    after them) to its history, in place. All ``k + 1`` samples are written; those past the new
    length are not the request's and are overwritten by later appends (a lookup never reads past
    a request's length). The caller keeps every length + k + 1 within the history's width."""
    at = lengths[:, None] + torch.arange(samples.shape[1], device=samples.device)[None, :]
    history.scatter_(1, at.clamp(max=history.shape[1] - 1), samples.to(history.dtype))
    lengths += accepted + 1
