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

from engine.kernels.triton_utils import use_triton


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


def verify_and_draft(
    history: torch.Tensor, lengths: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, samples: torch.Tensor | None,
    out: torch.Tensor | None, tables: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    seq_lens: torch.Tensor, *, min_n: int, max_n: int, page: int, triton: bool | None = None,
) -> None:
    """A verifying step's end and the next step's start, in place: with ``samples`` ([B, k + 1],
    the step's argmax rows) the accepted count (:func:`accept_greedy`) and the samples to ``out``
    ([B, k + 3]: the samples, the count + 1, the drafts verified) and the kept tokens appended
    (:func:`append_accepted`); then the next drafts (:func:`ngram_drafts`) into ``drafts`` [B, k]
    and ``num_drafts``, and the next step's B * (k + 1) rows (request-major: its last token, then
    its k drafts, padded with its last token) into ``input_ids``, ``positions``, ``slots`` (through
    ``tables``: [B, blocks], ``page`` tokens a block) and ``seq_lens``. On CUDA (``triton`` None)
    one Triton kernel, one program a request: inside a CUDA graph the torch version's ~50 small
    kernels cost ~0.3 ms a step (H100, 2026-12-07)."""
    b, k = drafts.shape
    if triton if triton is not None else use_triton(history):
        import triton as _triton

        from engine.kernels._verify_draft_triton import verify_draft_kernel

        verify = samples is not None
        verify_draft_kernel[(b,)](
            history, lengths, drafts, num_drafts, samples if verify else drafts, out if verify else drafts, tables,
            input_ids, positions, slots, seq_lens, history.shape[1], tables.stride(0),
            K=k, K_PAD=_triton.next_power_of_2(k + 1), MIN_N=min_n, MAX_N=max_n, BLOCK=512, PAGE=page, VERIFY=verify,
        )
        return
    if samples is not None:
        accepted = accept_greedy(drafts, num_drafts, samples)
        out[:, : k + 1] = samples
        out[:, k + 1] = accepted + 1
        out[:, k + 2] = num_drafts
        append_accepted(history, lengths, samples, accepted)
    found, num = ngram_drafts(history, lengths, k, min_n, max_n)
    drafts.copy_(found)
    num_drafts.copy_(num)
    last = lengths - 1
    pos = last[:, None] + torch.arange(k + 1, device=history.device)[None, :]
    input_ids.view(b, k + 1).copy_(torch.cat([history.gather(1, last[:, None]), found], dim=1))
    positions.view(b, k + 1).copy_(pos)
    slots.view(b, k + 1).copy_(tables.gather(1, pos // page).to(torch.int64) * page + pos % page)
    seq_lens.view(b, k + 1).copy_(pos + 1)

