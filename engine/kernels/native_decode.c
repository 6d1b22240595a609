/* One decode step (any batch size) of a Llama or Qwen2 model on the CPU, weights in 4/8-bit GGUF blocks.

   Why native: at batch 1 the 135M model's step is ~120 matrix-vector products plus ~800 small
   tensor ops; eager PyTorch pays microseconds of dispatch for each, more than the arithmetic.
   Here the whole step is one call: embedding, 30 layers (RMSNorm, q|k|v, RoPE, paged KV write,
   attention over the block table, o, gate|up, SiLU-mul, down), final norm and the LM head.
   Qwen2 adds q|k|v biases; its K-quant files arrive repacked as Q4_1/Q8_0 (engine/gguf_blocks.py),
   so a fused output (q|k|v, gate|up) may be row blocks of both formats.

   Numerics follow llama.cpp's CPU path: activations are quantized per block of 32 to int8 with
   one float scale (Q8), and each weight block is multiplied as integers, 32 products in one
   VNNI instruction (dpbusd: unsigned x signed bytes), then scaled:
       Q4_1 block  w = d*q + m   (q 0..15):   sum w*x ~= d*dx*sum(q*xq) + m*dx*sum(xq)
       Q8_0 block  w = d*q       (q signed):  sum w*x ~= d*dx*sum(q*xq)
   Residual stream, norms, RoPE and attention are float32; the KV cache is bf16, shared with the
   PyTorch path (layout [layers, 2, blocks, page, kv_heads, head_dim]).

   Built at run time by engine/native_decode.py with the machine's C compiler (-O3 -march=native
   -fopenmp). Without AVX2 a portable scalar path computes the same integer sums. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <omp.h>

#define QK 32 /* weights per quantization block */

enum { Q4_1 = 0, Q8_0 = 1 };

typedef struct { /* one weight matrix [n, k] in blocks of 32 along k */
    const uint8_t *qs; /* Q4_1: [n, k/32, 16] nibbles (low: weights 0..15, high: 16..31); Q8_0: [n, k] int8 */
    const float *d;    /* [n, k/32] scale */
    const float *m;    /* [n, k/32] Q4_1 minimum; NULL for Q8_0 */
    int32_t type, n, k;
} matrix_t;

#define MAX_PARTS 3

typedef struct { /* one output's rows as consecutive row blocks (q|k|v, gate|up), each in its own format */
    matrix_t part[MAX_PARTS];
    int32_t parts;
} fused_t;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    fused_t qkv;                         /* q|k|v rows */
    const float *qkv_bias;               /* [q + 2 kv] or NULL */
    fused_t o, gate_up, down;            /* gate|up rows */
} layer_t;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, layers, vocab, page, rope_len;
    float eps;
    const uint16_t *embed;  /* [vocab, hidden] bf16 */
    const float *cos_sin;   /* [rope_len, head_dim]: cos in the first half, sin in the second */
    const float *final_norm;
    fused_t head;           /* [vocab, hidden] */
    const layer_t *layer;   /* [layers] */
} model_t;

#define TILE 8 /* tokens whose activations one unpacked weight block is dotted with (one float lane each) */

typedef struct { /* activations of B rows quantized per block of 32 */
    int8_t *q;   /* [B, k] */
    float *d;    /* [B, k/32] */
    float *s;    /* [B, k/32]: d * sum(q) of the block */
    float *dt;   /* [k/32, bp]: d transposed, so a tile's scales of one block are one vector; zero past B */
    float *st;   /* [k/32, bp]: s likewise */
    int k, bp;   /* bp: B rounded up to a multiple of TILE */
} qact_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* Block b of activation row r (k wide) from its 32 values xb; a->k is left to the caller. */
static void quantize_block(const float *xb, int k, int r, int b, qact_t *a) {
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int8_t *qb = a->q + (size_t)r * k + b * QK;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        int v = (int)nearbyintf(xb[j] * inv);
        qb[j] = (int8_t)v;
        sum += v;
    }
    a->d[r * (k / QK) + b] = d;
    a->s[r * (k / QK) + b] = d * (float)sum;
    a->dt[(size_t)b * a->bp + r] = d;
    a->st[(size_t)b * a->bp + r] = d * (float)sum;
}

static void quantize_rows(const float *x, int rows, int k, qact_t *a) {
    a->k = k;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < k / QK; b++) quantize_block(x + (size_t)r * k + b * QK, k, r, b, a);
}

#ifdef __AVX2__
/* 8 int32 partial sums of 32 products u8 x s8. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef __AVX2__
/* One weight row . one quantized activation row, two blocks per iteration (two independent
   accumulator chains hide the FMA latency). */
static inline float dot_q4_1(const uint8_t *qs, const float *d, const float *m, const int8_t *xq, const float *xd,
                             const float *xs, int nb) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float mt = 0.f;
    int blk = 0;
    for (; blk + 1 < nb; blk += 2) {
        __m128i r0 = _mm_loadu_si128((const __m128i *)(qs + blk * 16)), r1 = _mm_loadu_si128((const __m128i *)(qs + blk * 16 + 16));
        __m256i w0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r0, 4), mask), _mm_and_si128(r0, mask));
        __m256i w1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r1, 4), mask), _mm_and_si128(r1, mask));
        __m256i p0 = dot_u8s8(w0, _mm256_loadu_si256((const __m256i *)(xq + blk * QK)));
        __m256i p1 = dot_u8s8(w1, _mm256_loadu_si256((const __m256i *)(xq + blk * QK + QK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[blk] * xd[blk]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d[blk + 1] * xd[blk + 1]), acc1);
        mt += m[blk] * xs[blk] + m[blk + 1] * xs[blk + 1];
    }
    for (; blk < nb; blk++) {
        __m128i r0 = _mm_loadu_si128((const __m128i *)(qs + blk * 16));
        __m256i w0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r0, 4), mask), _mm_and_si128(r0, mask));
        __m256i p0 = dot_u8s8(w0, _mm256_loadu_si256((const __m256i *)(xq + blk * QK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[blk] * xd[blk]), acc0);
        mt += m[blk] * xs[blk];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + mt;
}

static inline float dot_q8_0(const int8_t *qs, const float *d, const int8_t *xq, const float *xd, int nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int blk = 0;
    for (; blk + 1 < nb; blk += 2) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(qs + blk * QK)), w1 = _mm256_loadu_si256((const __m256i *)(qs + blk * QK + QK));
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + blk * QK)), x1 = _mm256_loadu_si256((const __m256i *)(xq + blk * QK + QK));
        /* |w| as unsigned times x carrying w's sign */
        __m256i p0 = dot_u8s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
        __m256i p1 = dot_u8s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[blk] * xd[blk]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d[blk + 1] * xd[blk + 1]), acc1);
    }
    for (; blk < nb; blk++) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(qs + blk * QK)), x0 = _mm256_loadu_si256((const __m256i *)(xq + blk * QK));
        __m256i p0 = dot_u8s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[blk] * xd[blk]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}
#else
static float dot_q4_1(const uint8_t *qs, const float *d, const float *m, const int8_t *xq, const float *xd,
                      const float *xs, int nb) {
    float acc = 0.f;
    for (int blk = 0; blk < nb; blk++) {
        const uint8_t *q = qs + blk * 16;
        const int8_t *x = xq + blk * QK;
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += (q[j] & 0x0f) * x[j] + (q[j] >> 4) * x[j + 16];
        acc += (float)sum * d[blk] * xd[blk] + m[blk] * xs[blk];
    }
    return acc;
}

static float dot_q8_0(const int8_t *qs, const float *d, const int8_t *xq, const float *xd, int nb) {
    float acc = 0.f;
    for (int blk = 0; blk < nb; blk++) {
        int sum = 0;
        for (int j = 0; j < QK; j++) sum += qs[blk * QK + j] * xq[blk * QK + j];
        acc += (float)sum * d[blk] * xd[blk];
    }
    return acc;
}
#endif

#ifdef __AVX2__
/* One weight row . the activations of NT <= TILE tokens t0.. (y[t * ldy] for token t0 + t). Each
   block is loaded and unpacked once and dotted with every token of the tile while in registers;
   per token that leaves one integer dot, one conversion and one FMA (lanes stay apart until the
   end). The block scales d*dx of the tile's tokens are one vector multiply (dx transposed), and
   Q4_1's m*sum(xq) terms one FMA per block for the whole tile. Each token's sums run in the
   same order whatever the tile holds, so a row's result does not depend on the batch. NT is a
   constant in every caller (TILE_CASES), so the token loops unroll into registers. */
static inline __attribute__((always_inline)) void tile_q4_1(const uint8_t *qs, const float *d, const float *m, const qact_t *a,
                                                            int t0, const int NT, int nb, float *y, size_t ldy) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    const int8_t *xq = a->q + (size_t)t0 * a->k;
    __m256 acc[TILE], mt = _mm256_setzero_ps();
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; blk++) {
        const __m128i r = _mm_loadu_si128((const __m128i *)(qs + blk * 16));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(r, 4), mask), _mm_and_si128(r, mask));
        float sc[TILE];
        _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(d[blk]), _mm256_loadu_ps(a->dt + (size_t)blk * a->bp + t0)));
        mt = _mm256_fmadd_ps(_mm256_set1_ps(m[blk]), _mm256_loadu_ps(a->st + (size_t)blk * a->bp + t0), mt);
        for (int t = 0; t < NT; t++) {
            const __m256i p = dot_u8s8(w, _mm256_loadu_si256((const __m256i *)(xq + (size_t)t * a->k + blk * QK)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc[t]), acc[t]);
        }
    }
    float mts[TILE];
    _mm256_storeu_ps(mts, mt);
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]) + mts[t];
}

static inline __attribute__((always_inline)) void tile_q8_0(const int8_t *qs, const float *d, const qact_t *a, int t0,
                                                            const int NT, int nb, float *y, size_t ldy) {
    const int8_t *xq = a->q + (size_t)t0 * a->k;
    __m256 acc[TILE];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; blk++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + blk * QK)), wabs = _mm256_sign_epi8(w, w);
        float sc[TILE];
        _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(d[blk]), _mm256_loadu_ps(a->dt + (size_t)blk * a->bp + t0)));
        for (int t = 0; t < NT; t++) { /* |w| as unsigned times x carrying w's sign */
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (size_t)t * a->k + blk * QK));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(x, w))), _mm256_set1_ps(sc[t]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum(acc[t]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) \
    && !defined(NATIVE_TILE_256)
/* The same tile with 512-bit registers: one register holds two blocks (lanes 0-7 the first, 8-15
   the second), so a token's integer dot, conversion and FMA cover two blocks, and four Q4_1 blocks
   (64 bytes of nibbles) unpack with one load, one shift, two ANDs and two lane permutes. A
   token's blocks always pair the same way (quads, then a pair, then a single block whose upper
   lanes are zero), so its sums keep one order whatever the tile holds; Q4_1's m*sum(xq) terms are
   one dot product of the row's m with the token's s, 16 blocks a register. Compiled out with
   -DNATIVE_TILE_256 (the 256-bit tile: a benchmark's baseline, and the sums the AVX2 build repeats). */
#define WIDE_TILE 1

static inline float hsum512(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* The scales d[blk+j] * dx of blocks blk..blk+3 for the tile's tokens, as two registers per token
   (blocks blk, blk+1 and blk+2, blk+3; 8 lanes a block). One token reads its dx consecutively
   from a->d; a tile reads the transposed a->dt and picks each token's lanes with a permute. */
static inline __attribute__((always_inline)) void quad_scales(const float *d, const qact_t *a, int blk, int t0, const int NT,
                                                              __m512 *s01, __m512 *s23) {
    const __m512i lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    if (NT == 1) {
        const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(d + blk), _mm_loadu_ps(a->d + (size_t)t0 * (a->k / QK) + blk)));
        s01[0] = _mm512_permutexvar_ps(lo, s);
        s23[0] = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(2)), s);
        return;
    }
    __m256 sj[4];
    for (int j = 0; j < 4; j++) sj[j] = _mm256_mul_ps(_mm256_set1_ps(d[blk + j]), _mm256_loadu_ps(a->dt + (size_t)(blk + j) * a->bp + t0));
    const __m512 p01 = _mm512_insertf32x8(_mm512_castps256_ps512(sj[0]), sj[1], 1);
    const __m512 p23 = _mm512_insertf32x8(_mm512_castps256_ps512(sj[2]), sj[3], 1);
    const __m512i pick = _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int t = 0; t < NT; t++) {
        const __m512i idx = _mm512_add_epi32(pick, _mm512_set1_epi32(t));
        s01[t] = _mm512_permutexvar_ps(idx, p01);
        s23[t] = _mm512_permutexvar_ps(idx, p23);
    }
}

/* The scales of 1 or 2 blocks at blk for token t0 + t (upper lanes zero for a single block). */
static inline __m512 tail_scale(const float *d, const qact_t *a, int blk, int t0, int t, int n) {
    const __m512 s0 = _mm512_set1_ps(d[blk] * a->dt[(size_t)blk * a->bp + t0 + t]);
    return n == 2 ? _mm512_mask_mov_ps(s0, 0xff00, _mm512_set1_ps(d[blk + 1] * a->dt[(size_t)(blk + 1) * a->bp + t0 + t]))
                  : _mm512_maskz_mov_ps(0x00ff, s0);
}

/* Q4_1 nibbles of 4 blocks (64 bytes: low nibbles weights 0-15, high 16-31 of each) as two
   registers of two blocks each, weights in the activations' order. */
static inline void unpack_q4_quad(const uint8_t *qs, __m512i *w01, __m512i *w23) {
    const __m512i r = _mm512_loadu_si512(qs), mask = _mm512_set1_epi8(0x0f);
    const __m512i lo = _mm512_and_si512(r, mask), hi = _mm512_and_si512(_mm512_srli_epi16(r, 4), mask);
    /* 64-bit lanes: lo = [l0 l0 l1 l1 l2 l2 l3 l3], hi likewise; block j = l_j then h_j */
    *w01 = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
    *w23 = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
}

/* 1 or 2 Q4_1 blocks: a single block leaves the upper lanes zero. */
static inline __m512i unpack_q4_blocks(const uint8_t *qs, int n) {
    const __m256i r = n == 2 ? _mm256_loadu_si256((const __m256i *)qs)
                             : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)qs)), mask = _mm256_set1_epi8(0x0f);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(r, mask)),
                                         _mm256_and_si256(_mm256_srli_epi16(r, 4), mask), 1);
    const __m512i w = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)); /* [lo0 hi0 lo1 hi1] */
    return n == 2 ? w : _mm512_maskz_mov_epi64(0x0f, w);
}

/* A token's activations of 1 or 2 blocks (a single block: upper half zero, nothing read past it). */
static inline __m512i load_x(const int8_t *x, int n) {
    return n == 2 ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi8(0xffffffffull, x);
}

/* m . s over nb blocks, 16 a register (the Q4_1 minimum terms of one token). */
static inline float min_terms(const float *m, const float *s, int nb) {
    __m512 acc = _mm512_setzero_ps();
    int blk = 0;
    for (; blk + 16 <= nb; blk += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(m + blk), _mm512_loadu_ps(s + blk), acc);
    if (blk < nb) {
        const __mmask16 k = (__mmask16)((1u << (nb - blk)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + blk), _mm512_maskz_loadu_ps(k, s + blk), acc);
    }
    return hsum512(acc);
}

/* Software prefetch inside the row loop, in step with it: the weight stream PREFETCH_BLOCKS
   blocks ahead of block blk (past a row's end: the next rows, as laid out), one quad's bytes
   each quad, and every 16 blocks the line of scales (and Q4_1 minima) as far ahead. Row by row
   (prefetch_row_ahead) a long row of down (8960 wide) asked for its 105 lines at once, more than
   a core has fill buffers for: 28 layers of down at batch 1 on the 2-core Xeon (2026-12-03)
   read 18.1-19.8 GB/s that way (Q4_1), 23.2-23.9 this way; Q8_0 16.4-19.4 against 17.7-20.1;
   gate|up and down together 18.7-21.1 against 22.7-23.5
   (docs/results/2026-12-03-cpu-native-prefetch-in-loop-matvec-bw.txt). */
#define PREFETCH_BLOCKS 128

static inline __attribute__((always_inline)) void prefetch_quad_ahead(const uint8_t *qs, int block_bytes, const float *d,
                                                                      const float *m, int blk) {
    const uint8_t *q = qs + (size_t)(blk + PREFETCH_BLOCKS) * block_bytes;
    for (int i = 0; i < 4 * block_bytes; i += 64) __builtin_prefetch(q + i, 0, 3);
    if (blk % 16 == 0) {
        __builtin_prefetch(d + blk + PREFETCH_BLOCKS, 0, 3);
        if (m) __builtin_prefetch(m + blk + PREFETCH_BLOCKS, 0, 3);
    }
}

static inline __m512 pair_fma(__m512i w, __m512i x, __m512 scale, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)), scale, acc);
}

/* Each token keeps two accumulators (blocks 0-1 and 2-3 of every quad; the tail's blocks go to
   the first), two independent FMA chains even for one token, summed at the end. */
static inline __attribute__((always_inline)) void wide_q4_1(const uint8_t *qs, const float *d, const float *m, const qact_t *a,
                                                            int t0, const int NT, int nb, float *y, size_t ldy) {
    const int8_t *xq = a->q + (size_t)t0 * a->k;
    __m512 acc0[TILE], acc1[TILE], s01[TILE], s23[TILE];
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    int blk = 0;
    for (; blk + 4 <= nb; blk += 4) {
        prefetch_quad_ahead(qs, 16, d, m, blk);
        __m512i w01, w23;
        unpack_q4_quad(qs + blk * 16, &w01, &w23);
        quad_scales(d, a, blk, t0, NT, s01, s23);
        for (int t = 0; t < NT; t++) {
            const int8_t *x = xq + (size_t)t * a->k + blk * QK;
            acc0[t] = pair_fma(w01, _mm512_loadu_si512(x), s01[t], acc0[t]);
            acc1[t] = pair_fma(w23, _mm512_loadu_si512(x + 2 * QK), s23[t], acc1[t]);
        }
    }
    for (int n; blk < nb; blk += n) {
        n = nb - blk >= 2 ? 2 : 1;
        const __m512i w = unpack_q4_blocks(qs + blk * 16, n);
        for (int t = 0; t < NT; t++) acc0[t] = pair_fma(w, load_x(xq + (size_t)t * a->k + blk * QK, n), tail_scale(d, a, blk, t0, t, n), acc0[t]);
    }
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum512(_mm512_add_ps(acc0[t], acc1[t])) + min_terms(m, a->s + (size_t)(t0 + t) * nb, nb);
}

/* |w| as unsigned times x carrying w's sign (AVX-512 has no byte sign instruction: a masked negate). */
static inline __m512i signed_x(__m512i x, __mmask64 neg) { return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x); }

static inline __attribute__((always_inline)) void wide_q8_0(const int8_t *qs, const float *d, const qact_t *a, int t0,
                                                            const int NT, int nb, float *y, size_t ldy) {
    const int8_t *xq = a->q + (size_t)t0 * a->k;
    __m512 acc0[TILE], acc1[TILE], s01[TILE], s23[TILE];
    for (int t = 0; t < NT; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    int blk = 0;
    for (; blk + 4 <= nb; blk += 4) {
        prefetch_quad_ahead((const uint8_t *)qs, QK, d, NULL, blk);
        const __m512i w01 = _mm512_loadu_si512(qs + blk * QK), w23 = _mm512_loadu_si512(qs + blk * QK + 2 * QK);
        const __m512i a01 = _mm512_abs_epi8(w01), a23 = _mm512_abs_epi8(w23);
        const __mmask64 n01 = _mm512_movepi8_mask(w01), n23 = _mm512_movepi8_mask(w23);
        quad_scales(d, a, blk, t0, NT, s01, s23);
        for (int t = 0; t < NT; t++) {
            const int8_t *x = xq + (size_t)t * a->k + blk * QK;
            acc0[t] = pair_fma(a01, signed_x(_mm512_loadu_si512(x), n01), s01[t], acc0[t]);
            acc1[t] = pair_fma(a23, signed_x(_mm512_loadu_si512(x + 2 * QK), n23), s23[t], acc1[t]);
        }
    }
    for (int n; blk < nb; blk += n) {
        n = nb - blk >= 2 ? 2 : 1;
        const __m512i w = load_x(qs + blk * QK, n), wabs = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        for (int t = 0; t < NT; t++)
            acc0[t] = pair_fma(wabs, signed_x(load_x(xq + (size_t)t * a->k + blk * QK, n), neg), tail_scale(d, a, blk, t0, t, n), acc0[t]);
    }
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum512(_mm512_add_ps(acc0[t], acc1[t]));
}
#endif

#define TILE_CASES(call) \
    switch (nt) {        \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; default: call(8); break; \
    }

/* Row ``r`` of W . the tile of nt tokens from t0. */
static void dot_tile(const matrix_t *w, int r, const qact_t *a, int t0, int nt, float *y, size_t ldy) {
    const int nb = w->k / QK;
    const size_t o = (size_t)r * nb;
#ifdef WIDE_TILE
#define Q4(n) wide_q4_1(w->qs + o * 16, w->d + o, w->m + o, a, t0, n, nb, y, ldy)
#define Q8(n) wide_q8_0((const int8_t *)w->qs + o * QK, w->d + o, a, t0, n, nb, y, ldy)
#else
#define Q4(n) tile_q4_1(w->qs + o * 16, w->d + o, w->m + o, a, t0, n, nb, y, ldy)
#define Q8(n) tile_q8_0((const int8_t *)w->qs + o * QK, w->d + o, a, t0, n, nb, y, ldy)
#endif
    if (w->type == Q4_1) {
        TILE_CASES(Q4)
    } else {
        TILE_CASES(Q8)
    }
#undef Q4
#undef Q8
}
#else
static void dot_tile(const matrix_t *w, int r, const qact_t *a, int t0, int nt, float *y, size_t ldy) {
    const int nb = w->k / QK;
    const size_t o = (size_t)r * nb;
    for (int t = 0; t < nt; t++) {
        const size_t b = (size_t)t0 + t;
        y[t * ldy] = w->type == Q4_1 ? dot_q4_1(w->qs + o * 16, w->d + o, w->m + o, a->q + b * w->k, a->d + b * nb, a->s + b * nb, nb)
                                     : dot_q8_0((const int8_t *)w->qs + o * QK, w->d + o, a->q + b * w->k, a->d + b * nb, nb);
    }
}
#endif

/* Software prefetch of the weights PREFETCH_AHEAD bytes ahead of the row being multiplied (the
   scales as far ahead in their own streams). The hardware prefetcher alone left a core short of
   memory: on the 2-core Xeon (AMX) of 2026-12-03, 28 layers' gate_up and down at batch 1 read
   10.0 GB/s on one thread and 19-20 GB/s on two, where a plain read loop reads 13.8 and 26.7;
   with this, 12.7-13.3 and 23.6-25.3 (1 KiB ahead: 23.6-24.3; 4 KiB: 23.1; whole rows 2 ahead: 23.3-23.9;
   engine/bench/experiments/native_matvec_bw.c). The engine's batch-1 decode of Qwen2.5-1.5B went
   from 0.67-0.71 of its bandwidth ceiling to 0.78-0.83 (docs/results/2026-12-03-cpu-native-prefetch-ab.txt).
   The wide tile has since moved its prefetch into its loop (prefetch_quad_ahead); this one serves
   the other tiles (the 256-bit tile on the same machine, one pair of runs: 13.8 -> 18.3 GB/s).
   Both helpers are always inlined: gcc 12 at -O2 takes a function whose only effect is a prefetch
   for one without effects and drops its calls. */
#define PREFETCH_AHEAD 2048

static inline __attribute__((always_inline)) void prefetch_span(const void *base, size_t from, size_t to, size_t end) {
    for (size_t i = from; i < to && i < end; i += 64) __builtin_prefetch((const char *)base + i, 0, 3);
}

static inline __attribute__((always_inline)) void prefetch_row_ahead(const matrix_t *w, int r) {
    const size_t nb = w->k / QK, qrow = nb * (w->type == Q4_1 ? 16 : QK), srow = nb * sizeof(float);
    const size_t ahead = PREFETCH_AHEAD * srow / qrow;
    prefetch_span(w->qs, r * qrow + PREFETCH_AHEAD, (r + 1) * qrow + PREFETCH_AHEAD, w->n * qrow);
    prefetch_span(w->d, r * srow + ahead, (r + 1) * srow + ahead, w->n * srow);
    if (w->m) prefetch_span(w->m, r * srow + ahead, (r + 1) * srow + ahead, w->n * srow);
}

/* y[b * ldy + row] = W[row, :] . x[b, :] for rows [r0, r1). A row's blocks (<= 1 KiB) stay in L1
   while the B activation rows pass over them, so each weight byte comes from memory once.
   ``tiled``: the tokens in tiles of TILE that share each unpacked block (dot_tile); otherwise
   one dot product per (row, token): the earlier kernel, kept as the benchmarks' baseline. */
static void matvec_rows(const matrix_t *w, const qact_t *a, int B, float *y, int ldy, int r0, int r1, int tiled) {
    const int nb = w->k / QK;
    for (int r = r0; r < r1; r++) {
#ifndef WIDE_TILE /* the wide tile prefetches inside its loop (prefetch_quad_ahead) */
        prefetch_row_ahead(w, r);
#endif
        if (tiled) {
            for (int t0 = 0; t0 < B; t0 += TILE)
                dot_tile(w, r, a, t0, B - t0 < TILE ? B - t0 : TILE, y + (size_t)t0 * ldy + r, (size_t)ldy);
            continue;
        }
        const size_t o = (size_t)r * nb;
        for (int b = 0; b < B; b++) {
            const int8_t *xq = a->q + (size_t)b * w->k;
            const float *xd = a->d + (size_t)b * nb;
            y[(size_t)b * ldy + r] = w->type == Q4_1 ? dot_q4_1(w->qs + o * 16, w->d + o, w->m + o, xq, xd, a->s + (size_t)b * nb, nb)
                                                      : dot_q8_0((const int8_t *)w->qs + o * QK, w->d + o, xq, xd, nb);
        }
    }
}

static inline int chunks_of(const matrix_t *w) { return (w->n + 15) / 16; }

/* y [B, total rows] = the fused rows . x. Rows of all parts split evenly over the team, in chunks
   of 16 (within one part) so threads do not share cache lines of y. */
static void matvec(const fused_t *w, const qact_t *a, int B, float *y, int tiled) {
    int n = 0, chunks = 0;
    for (int p = 0; p < w->parts; p++) {
        n += w->part[p].n;
        chunks += chunks_of(&w->part[p]);
    }
#pragma omp for schedule(static)
    for (int c = 0; c < chunks; c++) {
        int p = 0, local = c, row0 = 0;
        while (local >= chunks_of(&w->part[p])) {
            local -= chunks_of(&w->part[p]);
            row0 += w->part[p].n;
            p++;
        }
        const matrix_t *m = &w->part[p];
        const int r1 = (local + 1) * 16 < m->n ? (local + 1) * 16 : m->n;
        matvec_rows(m, a, B, y + row0, n, local * 16, r1, tiled);
    }
}

static void rms_norm(const float *x, const float *w, float *out, int n, float eps) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* HF "rotate_half" RoPE of one head in place. */
static void rope(float *x, const float *cs, int hd) {
    const int half = hd / 2;
    for (int j = 0; j < half; j++) {
        float c = cs[j], s = cs[half + j], x1 = x[j], x2 = x[j + half];
        x[j] = x1 * c - x2 * s;
        x[j + half] = x2 * c + x1 * s;
    }
}

#ifdef __AVX2__
static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* Attention is split like flash-decoding: a task is one request over a chunk of ATTN_CHUNK
   context tokens, and a work item one KV head of it with its GQA group of query heads, so each
   token's K and V slice of that head is read from memory once and converted once per group; the
   chunks' partial results are merged by their log-sum-exp. At a 2.6k-token context the chunks
   keep both cores busy; below ATTN_CHUNK tokens (a short decode) the KV heads do: with all heads
   in one item, one thread attended alone while the other waited. Qwen2.5-1.5B at 152 tokens on
   the 2-core Xeon (2026-12-03): attention and the merge 1.7-1.8 ms of a 60 ms step, 1.0-1.2 ms
   split by KV head (docs/results/2026-12-03-cpu-native-shared-attention-silu-profile.txt).
   Per head the sums are unchanged. */
#define ATTN_CHUNK 256
#define MAX_HEADS 64

typedef struct { /* a chunk's result for one query head: max score, sum of exp (output kept apart) */
    float max, sum;
} partial_t;

/* scores[g, i] = q_g . k_t * scale for the chunk's tokens t = t0 + i, each query head g of one
   KV head's group; k_cache points at that KV head's slice of slot 0 (slots slot_stride apart). */
static void chunk_scores(const float *q, const uint16_t *k_cache, size_t slot_stride, const int64_t *table, int t0, int t1,
                         int page, int hd, int group, float scale, float *scores) {
    for (int t = t0, blk = t0 / page, off = t0 % page; t < t1; t++, off = off + 1 == page ? 0 : off + 1, blk += off == 0) {
        const uint16_t *k = k_cache + ((size_t)table[blk] * page + off) * slot_stride;
        float *sg = scores + (t - t0);
#ifdef __AVX2__
        if (hd % 8 == 0) {
            __m256 acc[8];
            for (int g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
            for (int j = 0; j < hd; j += 8) {
                const __m256 kv = load_bf16x8(k + j);
                for (int g = 0; g < group; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + j), kv, acc[g]);
            }
            for (int g = 0; g < group; g++) sg[g * ATTN_CHUNK] = hsum(acc[g]) * scale;
            continue;
        }
#endif
        for (int g = 0; g < group; g++) {
            float dot = 0.f;
            for (int j = 0; j < hd; j++) dot += q[g * hd + j] * bf16_to_f32(k[j]);
            sg[g * ATTN_CHUNK] = dot * scale;
        }
    }
}

/* out[g, :] = sum_t p[g, t] v_t (unnormalised), each query head g of one KV head's group
   (v_cache: that KV head's slice of slot 0). With AVX2 an 8-wide column slice of every head of
   the group stays in registers over a run of VALUE_RUN tokens (their V rows in L1), instead of a
   load and store of the output per token; each output still adds its tokens in order, so the
   sums are the same. */
#define VALUE_RUN 64
static void chunk_values(const float *p, const uint16_t *v_cache, size_t slot_stride, const int64_t *table, int t0, int t1,
                         int page, int hd, int group, float *out) {
    for (int i = 0; i < group * hd; i++) out[i] = 0.f;
#ifdef __AVX2__
    if (hd % 8 == 0) {
        const uint16_t *rows[VALUE_RUN];
        for (int r0 = t0; r0 < t1; r0 += VALUE_RUN) {
            const int n = t1 - r0 < VALUE_RUN ? t1 - r0 : VALUE_RUN;
            for (int i = 0; i < n; i++) {
                const int t = r0 + i;
                rows[i] = v_cache + ((size_t)table[t / page] * page + t % page) * slot_stride;
            }
            const float *pg = p + (r0 - t0);
            for (int g0 = 0; g0 < group; g0 += 8) /* at most 8 heads' accumulators at a time */
                for (int j = 0; j < hd; j += 8) {
                    const int gs = group - g0 < 8 ? group - g0 : 8;
                    __m256 acc[8];
                    for (int g = 0; g < gs; g++) acc[g] = _mm256_loadu_ps(out + (g0 + g) * hd + j);
                    for (int i = 0; i < n; i++) {
                        const __m256 vv = load_bf16x8(rows[i] + j);
                        for (int g = 0; g < gs; g++) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(pg[(g0 + g) * ATTN_CHUNK + i]), vv, acc[g]);
                    }
                    for (int g = 0; g < gs; g++) _mm256_storeu_ps(out + (g0 + g) * hd + j, acc[g]);
                }
        }
        return;
    }
#endif
    for (int t = t0, blk = t0 / page, off = t0 % page; t < t1; t++, off = off + 1 == page ? 0 : off + 1, blk += off == 0) {
        const uint16_t *v = v_cache + ((size_t)table[blk] * page + off) * slot_stride;
        for (int g = 0; g < group; g++)
            for (int j = 0; j < hd; j++) out[g * hd + j] += p[g * ATTN_CHUNK + (t - t0)] * bf16_to_f32(v[j]);
    }
}

#ifdef __AVX2__
/* e^x for x <= 0 (scores minus their max), 8 at a time: 2^n * p(r) with x = n ln2 + r,
   |r| <= ln2/2, p of degree 6 (relative error ~2e-7, like expf); below -87 it is 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts: exact first product */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)));
}
#endif

/* s[i] = e^(s[i] - shift) in place; returns their sum. */
static float exp_shifted(float *s, int n, float shift) {
    float total = 0.f;
    int i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum(acc);
#endif
    for (; i < n; i++) total += s[i] = expf(s[i] - shift);
    return total;
}

/* One work item: the query heads q [group, hd] of one KV head (k_cache, v_cache: its slice of
   slot 0) over context tokens [t0, t1). */
static void attend_chunk(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, size_t slot_stride,
                         const int64_t *table, int t0, int t1, int page, int hd, int group, float scale, partial_t *part,
                         float *out) {
    float scores[MAX_HEADS * ATTN_CHUNK];
    chunk_scores(q, k_cache, slot_stride, table, t0, t1, page, hd, group, scale, scores);
    for (int h = 0; h < group; h++) {
        float *sh = scores + (size_t)h * ATTN_CHUNK, mx = -INFINITY;
        for (int i = 0; i < t1 - t0; i++) mx = fmaxf(mx, sh[i]);
        part[h] = (partial_t){mx, exp_shifted(sh, t1 - t0, mx)};
    }
    chunk_values(scores, v_cache, slot_stride, table, t0, t1, page, hd, group, out);
}

/* Attention work: rows [b0, b1) of one request (a prefill chunk's tokens share its block table)
   over context chunk ``chunk`` and KV head ``kvh``, one row after another, so the chunk's K/V (<= 2 * ATTN_CHUNK rows)
   comes from memory once for up to ATTN_ROWS rows and from L2 for the rest; each row's own
   sums are unchanged. Rows of different requests are items of their own. */
#define ATTN_ROWS 16
typedef struct {
    int b0, b1, chunk, kvh;
} attn_work_t;

static size_t max_k(const model_t *m) { return (size_t)(m->inter > m->hidden ? m->inter : m->hidden); }

/* One decode step for B >= 1 requests. tokens/positions [B]; block_tables [B, table_width] int64;
   kv: the whole bf16 cache [layers, 2, blocks, page, kv_heads, head_dim] with ``blocks`` blocks;
   logits [n_out, vocab] float32 (out) of rows out_rows [n_out] (NULL: every row, n_out = B; a
   prefill chunk needs its last row's only, or none, and the head is a sixth of a small model's work). ``tiled`` 0 runs the matrices one row per token and attention
   one row per item (the earlier kernel, the benchmarks' baseline). Returns 0, or a negative code for inputs it cannot run. */
int decode_step(const model_t *m, int B, const int64_t *tokens, const int64_t *positions, const int64_t *block_tables,
                int table_width, uint16_t *kv, int64_t blocks, const int64_t *out_rows, int n_out, float *logits, int threads,
                int tiled) {
    if (B < 1 || m->heads > MAX_HEADS || n_out < 0 || (!out_rows && n_out != B)) return -1;
    for (int i = 0; out_rows && i < n_out; i++)
        if (out_rows[i] < 0 || out_rows[i] >= B) return -2;
    for (int b = 0; b < B; b++) { /* bad ids would read or write outside the tables and the cache */
        if (positions[b] < 0 || positions[b] >= m->rope_len || tokens[b] < 0 || tokens[b] >= m->vocab) return -2;
        if (positions[b] / m->page >= table_width) return -2;
        for (int i = 0; i <= positions[b] / m->page; i++)
            if (block_tables[b * table_width + i] < 0 || block_tables[b * table_width + i] >= blocks) return -2;
    }
    const int H = m->hidden, hd = m->head_dim, nh = m->heads, nkv = m->kv_heads;
    const int qsz = nh * hd, kvsz = nkv * hd, qkv_n = qsz + 2 * kvsz, I = m->inter, group = nh / nkv;
    const size_t layer_elems = (size_t)2 * blocks * m->page * kvsz;
    const size_t K = max_k(m);

    int *task_start = malloc(sizeof(int) * (B + 1)); /* first attention task of each request, then the total */
    if (!task_start) return -3;
    float *resid = malloc(sizeof(float) * B * H), *x = malloc(sizeof(float) * B * K);
    float *qkv = malloc(sizeof(float) * B * qkv_n), *attn = malloc(sizeof(float) * B * qsz);
    float *gu = malloc(sizeof(float) * B * 2 * I), *out = malloc(sizeof(float) * B * H);
    /* attention tasks: (request, chunk of ATTN_CHUNK context tokens) */
    task_start[0] = 0;
    for (int b = 0; b < B; b++) task_start[b + 1] = task_start[b] + (int)((positions[b] + ATTN_CHUNK) / ATTN_CHUNK);
    const int tasks = task_start[B];
    attn_work_t *work = malloc(sizeof(attn_work_t) * (size_t)tasks * nkv); /* at most one item per task and KV head */
    int works = 0;
    for (int b0 = 0, b1; work && b0 < B; b0 = b1) {
        int chunks = task_start[b0 + 1] - task_start[b0];
        for (b1 = b0 + 1; tiled && b1 < B && b1 - b0 < ATTN_ROWS &&
                          !memcmp(block_tables + (size_t)b1 * table_width, block_tables + (size_t)b0 * table_width, sizeof(int64_t) * table_width);
             b1++)
            if (task_start[b1 + 1] - task_start[b1] > chunks) chunks = task_start[b1 + 1] - task_start[b1];
        for (int c = 0; c < chunks; c++)
            for (int kvh = 0; kvh < nkv; kvh++) work[works++] = (attn_work_t){b0, b1, c, kvh};
    }
    partial_t *parts = malloc(sizeof(partial_t) * (size_t)tasks * nh);
    float *part_out = malloc(sizeof(float) * (size_t)tasks * qsz);
    const int bp = (B + TILE - 1) / TILE * TILE;
    qact_t act = {malloc(B * K), malloc(sizeof(float) * B * K / QK), malloc(sizeof(float) * B * K / QK),
                  calloc((size_t)bp * K / QK, sizeof(float)), calloc((size_t)bp * K / QK, sizeof(float)), 0, bp};
    if (!resid || !x || !qkv || !attn || !gu || !out || !work || !parts || !part_out || !act.q || !act.d || !act.s || !act.dt || !act.st) {
        free(resid); free(x); free(qkv); free(attn); free(gu); free(out); free(work); free(parts); free(part_out);
        free(act.q); free(act.d); free(act.s); free(act.dt); free(act.st); free(task_start);
        return -3;
    }
    for (int b = 0; b < B; b++)
        for (int i = 0; i < H; i++) resid[b * H + i] = bf16_to_f32(m->embed[(size_t)tokens[b] * H + i]);

#pragma omp parallel num_threads(threads)
    {
        for (int l = 0; l < m->layers; l++) {
            const layer_t *L = &m->layer[l];
            uint16_t *kc = kv + l * layer_elems, *vc = kc + layer_elems / 2;
#pragma omp single
            {
                for (int b = 0; b < B; b++) rms_norm(resid + b * H, L->input_norm, x + b * H, H, m->eps);
                quantize_rows(x, B, H, &act);
            }
            matvec(&L->qkv, &act, B, qkv, tiled); /* implicit barrier */
#pragma omp single
            for (int b = 0; b < B; b++) { /* biases, RoPE on q and k, then K/V into the request's slot */
                float *row = qkv + (size_t)b * qkv_n;
                if (L->qkv_bias)
                    for (int i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
                const float *cs = m->cos_sin + (size_t)positions[b] * hd;
                for (int h = 0; h < nh + nkv; h++) rope(row + h * hd, cs, hd);
                const int64_t pos = positions[b];
                const size_t slot = (size_t)block_tables[b * table_width + pos / m->page] * m->page + pos % m->page;
                for (int i = 0; i < kvsz; i++) {
                    kc[slot * kvsz + i] = f32_to_bf16(row[qsz + i]);
                    vc[slot * kvsz + i] = f32_to_bf16(row[qsz + kvsz + i]);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int w = 0; w < works; w++)
                for (int b = work[w].b0; b < work[w].b1; b++) {
                    const int task = task_start[b] + work[w].chunk, t0 = work[w].chunk * ATTN_CHUNK, len = (int)positions[b] + 1;
                    const int h0 = work[w].kvh * group; /* the KV head's first query head */
                    if (task >= task_start[b + 1]) continue; /* an earlier row of the request: fewer chunks */
                    attend_chunk(qkv + (size_t)b * qkv_n + (size_t)h0 * hd, kc + (size_t)work[w].kvh * hd, vc + (size_t)work[w].kvh * hd,
                                 kvsz, block_tables + b * table_width, t0, t0 + ATTN_CHUNK < len ? t0 + ATTN_CHUNK : len, m->page, hd,
                                 group, 1.f / sqrtf((float)hd), parts + (size_t)task * nh + h0, part_out + (size_t)task * qsz + (size_t)h0 * hd);
                }
#pragma omp for schedule(static)
            for (int bh = 0; bh < B * nh; bh++) { /* merge each head's chunks by their log-sum-exp */
                const int b = bh / nh, h = bh % nh;
                float mx = -INFINITY, total = 0.f, *o = attn + (size_t)b * qsz + (size_t)h * hd;
                for (int c = task_start[b]; c < task_start[b + 1]; c++) mx = fmaxf(mx, parts[(size_t)c * nh + h].max);
                for (int j = 0; j < hd; j++) o[j] = 0.f;
                for (int c = task_start[b]; c < task_start[b + 1]; c++) {
                    const float w = expf(parts[(size_t)c * nh + h].max - mx), *po = part_out + (size_t)c * qsz + (size_t)h * hd;
                    total += w * parts[(size_t)c * nh + h].sum;
                    for (int j = 0; j < hd; j++) o[j] += w * po[j];
                }
                for (int j = 0; j < hd; j++) o[j] /= total;
            }
#pragma omp single
            quantize_rows(attn, B, qsz, &act);
            matvec(&L->o, &act, B, out, tiled);
#pragma omp single
            {
                for (int i = 0; i < B * H; i++) resid[i] += out[i];
                for (int b = 0; b < B; b++) rms_norm(resid + b * H, L->post_norm, x + b * H, H, m->eps);
                quantize_rows(x, B, H, &act);
            }
            matvec(&L->gate_up, &act, B, gu, tiled);
            /* SiLU-mul and quantization block by block, shared by the team: on one thread they took
               1.1 ms of a 60 ms step (Qwen2.5-1.5B, 2-core Xeon, 2026-12-03), shared 0.7 ms
               (docs/results/2026-12-03-cpu-native-shared-attention-silu-profile.txt). */
#pragma omp for schedule(static)
            for (int rb = 0; rb < B * (I / QK); rb++) {
                const int b = rb / (I / QK), blk = rb % (I / QK);
                const float *g = gu + (size_t)b * 2 * I + blk * QK, *u = g + I;
                float *xb = x + (size_t)b * I + blk * QK;
                for (int j = 0; j < QK; j++) xb[j] = g[j] / (1.f + expf(-g[j])) * u[j];
                quantize_block(xb, I, b, blk, &act);
                if (rb == 0) act.k = I; /* read by the down matvec only, after this loop's barrier */
            }
            matvec(&L->down, &act, B, out, tiled);
#pragma omp single
            for (int i = 0; i < B * H; i++) resid[i] += out[i];
        }
#pragma omp single
        if (n_out > 0) {
            for (int i = 0; i < n_out; i++) rms_norm(resid + (out_rows ? out_rows[i] : i) * H, m->final_norm, x + i * H, H, m->eps);
            quantize_rows(x, n_out, H, &act);
        }
        if (n_out > 0) matvec(&m->head, &act, n_out, logits, tiled);
    }
    free(resid); free(x); free(qkv); free(attn); free(gu); free(out); free(work); free(parts); free(part_out);
    free(act.q); free(act.d); free(act.s); free(act.dt); free(act.st); free(task_start);
    return 0;
}

/* Which integer dot product this build uses: 3 AVX-512 VNNI (two blocks a register), 2 VNNI, 1 AVX2,
   0 scalar (for logs and tests). */
int simd_level(void) {
#if defined(WIDE_TILE)
    return 3;
#elif defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
