"""Triton kernel: a verifying step's acceptance, append, next n-gram drafts and next inputs, in
one launch per step (engine/device_ngram.py ``verify_and_draft``)."""

import triton
import triton.language as tl


@triton.jit
def verify_draft_kernel(
    HISTORY, LENGTHS, DRAFTS, NUM_DRAFTS, SAMPLES, OUT, TABLES, INPUT_IDS, POSITIONS, SLOTS, SEQ_LENS,
    width, stride_table,
    K: tl.constexpr, K_PAD: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
    PAGE: tl.constexpr, VERIFY: tl.constexpr,
):
    """Program b (one request). With VERIFY: the drafts its samples confirm, the samples, that
    count + 1 and the drafts verified to OUT, the samples appended at its length (the length moves past the kept
    ones). Then, always: the longest most recent n-gram match of its history's end (a scan of
    its history BLOCK positions at a time, MAX_N compares each), the next drafts, and the next
    step's K + 1 rows: input tokens (its last token, then the drafts), positions, cache slots
    (through its block table, PAGE tokens a block) and context lengths."""
    b = tl.program_id(0).to(tl.int64)
    hist = HISTORY + b * width
    length = tl.load(LENGTHS + b)
    j = tl.arange(0, K_PAD)
    if VERIFY:
        drafts = tl.load(DRAFTS + b * K + j, mask=j < K, other=-1)
        num = tl.load(NUM_DRAFTS + b)
        samples = tl.load(SAMPLES + b * (K + 1) + j, mask=j <= K, other=-2)
        confirmed = (samples == drafts) & (j < num)
        accepted = tl.min(tl.where(confirmed, K, j), 0)  # the first draft not confirmed
        tl.store(OUT + b * (K + 3) + j, samples, mask=j <= K)
        tl.store(OUT + b * (K + 3) + K + 1, accepted + 1)
        tl.store(OUT + b * (K + 3) + K + 2, num)
        tl.store(hist + tl.minimum(length + j, width - 1), samples, mask=j <= K)
        length = length + accepted + 1
        tl.store(LENGTHS + b, length)
        tl.debug_barrier()  # the appended tokens are read below, by other threads of the program
    last = length - 1
    best = tl.full((), -1, tl.int64)
    for start in range(0, length, BLOCK):
        e = start + tl.arange(0, BLOCK).to(tl.int64)  # an occurrence's end: its continuation starts at e
        run = (e >= 1) & (e <= last)
        matched = tl.zeros((BLOCK,), tl.int64)
        for o in tl.static_range(MAX_N):
            want = tl.load(hist + last - o, mask=last - o >= 0, other=-3)
            got = tl.load(hist + e - 1 - o, mask=run & (e - 1 - o >= 0), other=-4)
            run = run & (got == want)
            matched += run.to(tl.int64)
        score = tl.where(matched >= MIN_N, matched * (width + 1) + e, -1)  # longest first, then latest
        best = tl.maximum(best, tl.max(score, 0))
    end = best % (width + 1)
    num_next = tl.where(best >= 0, tl.minimum(length - end, K), 0)
    last_token = tl.load(hist + last)
    drafts_next = tl.load(hist + end + j, mask=j < num_next, other=0)
    drafts_next = tl.where(j < num_next, drafts_next, last_token)
    tl.store(DRAFTS + b * K + j, drafts_next, mask=j < K)
    tl.store(NUM_DRAFTS + b, num_next)
    row = b * (K + 1) + j
    token = tl.load(hist + end + j - 1, mask=(j >= 1) & (j - 1 < num_next), other=0)
    token = tl.where((j >= 1) & (j - 1 < num_next), token, last_token)
    pos = last + j
    block = tl.load(TABLES + b * stride_table + pos // PAGE, mask=j <= K, other=0).to(tl.int64)
    tl.store(INPUT_IDS + row, token, mask=j <= K)
    tl.store(POSITIONS + row, pos, mask=j <= K)
    tl.store(SLOTS + row, block * PAGE + pos % PAGE, mask=j <= K)
    tl.store(SEQ_LENS + row, (pos + 1).to(tl.int32), mask=j <= K)
