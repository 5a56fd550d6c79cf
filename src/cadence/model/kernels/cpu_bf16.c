/* cadence's own CPU kernels for bfloat16 models on AVX512-BF16 machines (see model/cpu_kernels.py):
 *   cadence_pack, cadence_linear, cadence_linear_f32      y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 *                                                         float32 sums, on a packed bfloat16 weight
 *   cadence_pack_q4_1, cadence_linear_q4_1                the same on GGUF Q4_1 blocks
 *   cadence_pack_q4_1_i8, cadence_pack_q4_0_i8, cadence_linear_q4_1_i8, cadence_pack_q8_0_i8,
 *   cadence_linear_q8_0_i8, cadence_linear_q8_0_i8_f32    GGUF Q4_1 / Q4_0 / Q8_0 blocks against
 *                                                         int8 activations (AVX512-VNNI)
 *   cadence_linear_q4_1_i8x2, cadence_linear_q8_0_i8x2, cadence_linear_q8_0_i8x2_f32
 *                                                         the same, activations in two int8 terms
 *   cadence_add_rms_norm  residual += delta; out = rms_norm(residual) * w, in one pass
 *   cadence_silu_mul      SwiGLU's silu(gate) * up from the fused gate-up output
 *   cadence_rope          rotary embedding of q and k, in place
 *   cadence_decode_attention, cadence_prefill_attention   attention over the paged KV cache
 *   cadence_decode_attention_kv8, cadence_prefill_attention_kv8   the same over an 8-bit KV cache
 *   cadence_quantize_kv8  K/V rows into the 8-bit cache's layout (int8 values and a float32 scale)
 *   cadence_decode_layers every decoder layer of an all-decode step in one call
 *   cadence_sample        one token per row: temperature, top-k, top-p, min-p, inverse CDF
 * Each works row by row with a fixed summation order, so a row's result never depends on the
 * other rows of the batch, and attention computes a query the same way in a decode step as in a
 * prefill chunk: a token's hidden state is the same bits however it was batched, chunked, cached
 * or recomputed. Rounding follows the reference (Hugging Face's Llama in bfloat16):
 * a value is rounded to bfloat16 wherever the reference stores a bfloat16 tensor.
 *
 * Linear layers. Why a kernel of our own: a
 * decode step is a GEMV over the whole model, bound by memory; oneDNN's bfloat16 GEMV streams the
 * weights at about half the machine's read bandwidth. This kernel streams each weight byte once
 * per call, whatever M, from a layout made for that.
 *
 * Packed weight layout, made once at load by cadence_pack: [N/64][K/2][64][2] bfloat16. For one
 * block of 64 output columns and one pair of k, the 64 x 2 weights are 256 contiguous bytes, four
 * zmm registers; `vdpbf16ps` multiplies each register by a broadcast pair x[m, k:k+2] and adds both
 * products into 16 float32 lanes, one lane per output column. No horizontal sums.
 *
 * Batch invariance: y[m, n] is summed over k pairs in increasing order into its own lane, whatever
 * M is and whichever tile the row lands in, so a request's output does not depend on what else is
 * in the batch (bit for bit).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 64 /* output columns per block: four zmm of 16 float32 */
#define MT 6  /* rows per register tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 zmm */

/* W [N, K] row-major bfloat16 -> packed [ceil(N/64)][K/2][64][2], zero-padded past N. K even. */
void cadence_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    int64_t blocks = (n + NB - 1) / NB, kp = k / 2;
    memset(packed, 0, (size_t)(blocks * NB * k) * sizeof(uint16_t));
    for (int64_t c = 0; c < n; c++) {
        uint16_t *dst = packed + (c / NB) * kp * NB * 2 + (c % NB) * 2;
        const uint16_t *src = w + c * k;
        for (int64_t p = 0; p < kp; p++) {
            dst[p * NB * 2] = src[2 * p];
            dst[p * NB * 2 + 1] = src[2 * p + 1];
        }
    }
}

/* ---- bfloat16 helpers -------------------------------------------------------------------- */

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

static inline __m512 load_bf16(const uint16_t *p, __mmask16 mask) {
    __m256i v = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

/* v rounded to the nearest bfloat16 (ties to even), kept in float32 lanes. */
static inline __m512 round_bf16(__m512 v) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Store a tile's sums (+ bias) for rows 0..mt of vectors v0..v0+nv (16 columns each, from col0):
 * bfloat16 into y, or float32 into yf when given. Every linear kernel ends its tile here. */
static inline __attribute__((always_inline)) void store_tile(__m512 acc[MT][4], const float *bias, uint16_t *y,
                                                             float *yf, int64_t n, int64_t col0, int mt, int nv,
                                                             int v0) {
    for (int j = 0; j < nv; j++) {
        int64_t c = col0 + 16 * (v0 + j);
        if (c >= n) break;
        __mmask16 mask = tail_mask(n - c);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
        for (int m = 0; m < mt; m++) {
            __m512 sum = _mm512_add_ps(acc[m][j], bv);
            if (yf)
                _mm512_mask_storeu_ps(yf + m * n + c, mask, sum);
            else
                store_bf16(y + m * n + c, sum, mask);
        }
    }
}

/* One tile: rows m0..m0+mt of x against one block of 64 columns; into y (bfloat16) or, when yf is
 * given, into yf (float32, the sums unrounded). */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t k, const uint16_t *wb, const float *bias, uint16_t *y, float *yf, int64_t n,
    int64_t col0, int64_t mt) {
    __m512 acc[MT][4];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    const int64_t kp = k / 2;
    for (int64_t p = 0; p < kp; p++) {
        const __m512bh *wp = (const __m512bh *)(wb + p * NB * 2);
        __m512bh w0 = wp[0], w1 = wp[1], w2 = wp[2], w3 = wp[3];
        for (int m = 0; m < mt; m++) {
            int32_t pair;
            memcpy(&pair, x + m * k + 2 * p, sizeof pair);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xb, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xb, w1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xb, w2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xb, w3);
        }
    }
    store_tile(acc, bias, y, yf, n, col0, (int)mt, 4, 0);
}

static void block(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wb, const float *bias,
                  uint16_t *y, float *yf, int64_t n, int64_t col0) {
    int64_t m0 = 0;
#define AT(r) x + (r) * k, k, wb, bias, y ? y + (r) * n : NULL, yf ? yf + (r) * n : NULL, n, col0
    for (; m0 + MT <= m; m0 += MT) tile(AT(m0), MT);
    switch (m - m0) { /* constant tile heights, so each tile's loops unroll into registers */
        case 5: tile(AT(m0), 5); break;
        case 4: tile(AT(m0), 4); break;
        case 3: tile(AT(m0), 3); break;
        case 2: tile(AT(m0), 2); break;
        case 1: tile(AT(m0), 1); break;
        default: break;
    }
#undef AT
}

/* x [M, K] bfloat16 contiguous, packed from cadence_pack, bias float32 [N] or NULL, y [M, N].
 * Blocks are handed out guided (large contiguous runs first, then smaller ones), not statically:
 * when the HTTP thread or a client takes one core for a moment, the other thread takes over the
 * rest of the blocks instead of waiting at the barrier (served single stream: 45-50 -> 56-58 tok/s). */
static void linear_into(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, float *yf,
                        int64_t m, int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++)
        block(x, m, k, packed + b * k * NB, bias, y, yf, n, b * NB);
}

void cadence_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y,
                    int64_t m, int64_t n, int64_t k, int threads) {
    linear_into(x, packed, bias, y, NULL, m, n, k, threads);
}

/* As cadence_linear, the output float32 and unrounded: for the logits, where bfloat16's 8 bits
 * (steps of 0.125 at a logit of 25) would decide near-ties and coarsen sampling. */
void cadence_linear_f32(const uint16_t *x, const uint16_t *packed, const float *bias, float *y,
                        int64_t m, int64_t n, int64_t k, int threads) {
    linear_into(x, packed, bias, NULL, y, m, n, k, threads);
}

/* ---- Q4_1 weights, read as four-bit values ------------------------------------------------
 *
 * GGUF's Q4_1 stores 32 weights of a row in 20 bytes: a float16 scale d, a float16 minimum m and
 * 32 four-bit values q (the low nibbles of 16 bytes, then the high ones); w = d * q + m. A decode
 * step streams every weight once, so reading 0.625 bytes a weight (the nibbles and the float16
 * scales) instead of bfloat16's 2 cuts the memory traffic of a small batch by 3.2x.
 *
 * The arithmetic is the checkpoint's own, per block of 32 k: with s = sum over the block of x,
 *   y = sum over blocks of  d * (sum of x * (128 + q)) + (m - 128 d) * s
 * which is sum of x * (d q + m) with the exact float32 weights (bfloat16 would round them). 128 + q
 * is a bfloat16 whose bits are 0x4300 | q: a nibble becomes a weight with one OR, where converting
 * it to float, scaling and rounding to bfloat16 took ten instructions for 16 weights and made the
 * kernel slower than streaming bfloat16. The products x * (128 + q) are exact in float32 and `vdpbf16ps`
 * sums them; the large offset costs about five bits of the float32 block sums, far below the
 * bfloat16 output's rounding.
 *
 * Batch invariance: a row's blocks are summed in increasing k, pairs in order, whatever M and
 * whichever tile shape the row lands in (small batches use 3-row tiles over all 64 columns, large
 * ones 6-row tiles over 32 columns: the same operations per row and column).
 *
 * Packed layout, made once at load by cadence_pack_q4_1: [N/64][K/32] blocks of Q4_BYTES:
 *   16 pairs of k x 64 bytes of nibbles, then the 64 columns' float16 d and float16 m, as GGUF
 *   has them, in the order the kernel reads them: strictly forward, which the hardware prefetcher
 *   follows (scales first, read after the nibbles, halved the streaming rate).
 *   Byte t of half h (bytes 32h + t) of a pair holds, low nibble: column 32h + t/2, high nibble:
 *   column 32h + 16 + t/2, each at k = 2p + t%2: 32 bytes widened to 16-bit lanes give, masked
 *   or shifted, the weight pairs of 16 columns in the order `vdpbf16ps` reads them. */
#define QK 32
#define Q4_RAW_BYTES 20 /* one GGUF Q4_1 block: float16 d, float16 m, 16 bytes of nibbles */
#define Q4_BYTES (QK / 2 * NB + NB * 2 * 2)

static inline int q4_value(const uint8_t *row, int64_t kk) { /* raw GGUF row, element kk */
    const uint8_t *blk = row + (kk / QK) * Q4_RAW_BYTES;
    int i = (int)(kk % QK);
    return i < 16 ? (blk[4 + i] & 0x0F) : (blk[4 + i - 16] >> 4);
}

/* raw [N][K/32][20 bytes] -> packed (above); columns past N get zeros. */
void cadence_pack_q4_1(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k) {
    int64_t blocks = (n + NB - 1) / NB, kb = k / QK, row_bytes = kb * Q4_RAW_BYTES;
    memset(packed, 0, (size_t)(blocks * kb * Q4_BYTES));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < kb; j++) {
            uint8_t *dst = packed + (b * kb + j) * Q4_BYTES;
            uint8_t *d = dst + QK / 2 * NB, *mn = d + 2 * NB;
            for (int c = 0; c < NB && b * NB + c < n; c++) {
                const uint8_t *blk = raw + (b * NB + c) * row_bytes + j * Q4_RAW_BYTES;
                memcpy(d + 2 * c, blk, 2);
                memcpy(mn + 2 * c, blk + 2, 2);
            }
            uint8_t *qs = dst;
            for (int p = 0; p < QK / 2; p++)
                for (int t = 0; t < 64; t++) {
                    int64_t lo_c = b * NB + 32 * (t / 32) + (t % 32) / 2, hi_c = lo_c + 16;
                    int64_t kk = j * QK + 2 * p + t % 2;
                    int lo = lo_c < n ? q4_value(raw + lo_c * row_bytes, kk) : 0;
                    int hi = hi_c < n ? q4_value(raw + hi_c * row_bytes, kk) : 0;
                    qs[p * NB + t] = (uint8_t)(lo | (hi << 4));
                }
        }
}

/* Rows m0.. of x (mt of them) against nv of the block's four 16-column vectors, from vector v0. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint16_t *x, int64_t k, const float *xs, const uint8_t *qb, const float *bias, uint16_t *y,
    int64_t n, int64_t col0, int mt, int nv, int v0) {
    __m512 acc[6][4], part[6][4];
    const __m512i low4 = _mm512_set1_epi16(0x0F), base = _mm512_set1_epi16(0x4300); /* bf16(128) */
    const int64_t kb = k / QK;
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *qs = qb + b * Q4_BYTES;
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < nv; j++) part[m][j] = _mm512_setzero_ps();
        for (int p = 0; p < QK / 2; p++) {
            __m512bh w[4];
            for (int h = 0; 2 * h < nv; h++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + p * NB + 16 * (v0 + 2 * h))));
                w[2 * h] = (__m512bh)_mm512_ternarylogic_epi32(raw, low4, base, 0xEA); /* (raw & 15) | base */
                w[2 * h + 1] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 4), base);
            }
            for (int m = 0; m < mt; m++) {
                int32_t pair;
                memcpy(&pair, x + m * k + b * QK + 2 * p, sizeof pair);
                __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < nv; j++) part[m][j] = _mm512_dpbf16_ps(part[m][j], xb, w[j]);
            }
        }
        const uint16_t *d = (const uint16_t *)(qs + QK / 2 * NB), *mn = d + NB;
        for (int j = 0; j < nv; j++) {
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * (v0 + j))));
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * (v0 + j))));
            mv = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), dv, mv); /* m - 128 d, exactly one rounding */
            for (int m = 0; m < mt; m++) {
                acc[m][j] = _mm512_fmadd_ps(dv, part[m][j], acc[m][j]);
                acc[m][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[m * kb + b]), acc[m][j]);
            }
        }
    }
    store_tile(acc, bias, y, NULL, n, col0, mt, nv, v0);
}

/* Below this many rows a tile covers all 64 columns (the nibbles are widened once per 3 rows); from
 * it on, 6-row tiles over 32 columns (12 accumulators of partial sums + 12 of totals fit the 32
 * registers, and a weight register serves 6 rows). */
#define Q4_WIDE_ROWS 12

static void q4_block(const uint16_t *x, int64_t m, int64_t k, const float *xs, const uint8_t *qb,
                     const float *bias, uint16_t *y, int64_t n, int64_t col0) {
    int64_t kb = k / QK, m0 = 0;
#define Q4_AT(r) x + (r) * k, k, xs + (r) * kb, qb, bias, y + (r) * n, n, col0
    if (m >= Q4_WIDE_ROWS)
        for (; m0 + 6 <= m; m0 += 6) {
            q4_tile(Q4_AT(m0), 6, 2, 0);
            q4_tile(Q4_AT(m0), 6, 2, 2);
        }
    for (; m0 + 3 <= m; m0 += 3) q4_tile(Q4_AT(m0), 3, 4, 0);
    if (m - m0 == 2) q4_tile(Q4_AT(m0), 2, 4, 0);
    if (m - m0 == 1) q4_tile(Q4_AT(m0), 1, 4, 0);
#undef Q4_AT
}

/* xs [M, K/32]: each row's sum over each block of 32 k, in a fixed order (a batch-invariant s). */
static void block_sums(const uint16_t *x, int64_t m, int64_t k, float *xs) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k / QK; b++) {
            const uint16_t *p = x + r * k + b * QK;
            xs[r * (k / QK) + b] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(p, 0xFFFF), load_bf16(p + 16, 0xFFFF)));
        }
}

/* As cadence_linear, on cadence_pack_q4_1's layout (K a multiple of 32). Returns 0, or -1 when
 * the block sums' buffer cannot be allocated. */
int cadence_linear_q4_1(const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                        int64_t m, int64_t n, int64_t k, int threads) {
    int64_t blocks = (n + NB - 1) / NB, kb = k / QK;
    float *xs = malloc((size_t)(m * kb) * sizeof(float));
    if (!xs) return -1;
    block_sums(x, m, k, xs);
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) q4_block(x, m, k, xs, packed + b * kb * Q4_BYTES, bias, y, n, b * NB);
    free(xs);
    return 0;
}

/* ---- quantized weights against int8 activations (AVX512-VNNI) ------------------------------
 *
 * The integer path for GGUF Q4_1, Q4_0 and Q8_0 layers, as llama.cpp computes them: each row of x is
 * quantized per block of 32 k to int8 (scale sx = max|x| / 127, q = round(x * 127 / max|x|), ties to
 * even), and a block's products with the weights' stored integers are summed exactly in int32 by
 * `vpdpbusd` (64 unsigned x signed byte products an instruction, twice `vdpbf16ps`'s 32). Per block
 * and output column, in float32, blocks in increasing k:
 *   Q4_1 (w = d q4 + m):  y += (d sx) * sum(q4 qx) + m * (sx sum(qx))
 *   Q4_0 (w = d (q4 - 8)): the same, with m = -8 d (packed into the Q4_1 layout)
 *   Q8_0 (w = d q8):      y += (d sx) * sum(q8 qx), with q8 stored as q8 + 128 (vpdpbusd's unsigned
 *                         operand) and the sum started at -128 sum(qx), so the int32 sum is exact
 * The _i8x2 kernels quantize x finer, to Q = 128 qx + qr (15 bits; i8_rows), and sum both terms.
 * A row's result depends on its own values only (its quantization is its own, the integer sums are
 * exact, the float sums go in a fixed order, and every tile shape does the same operations per row
 * and column), so the batch invariance of the other kernels holds here too.
 *
 * Packed layouts, per 64 columns and block of 32 k; then the 64 columns' float16 d (and, for Q4_1,
 * float16 m) as GGUF has them:
 *   Q4_1 and Q4_0 (cadence_pack_q4_1_i8, cadence_pack_q4_0_i8, Q4_BYTES): for each 16-column
 *     vector, four 64-byte rows h: byte 4c + i of row h holds column c's q at k = 4h + i (low
 *     nibble) and k = 16 + 4h + i (high nibble): a row masked or shifted is the operand `vpdpbusd`
 *     multiplies by 4 broadcast int8 x.
 *   Q8_0 (cadence_pack_q8_0_i8, Q8_BYTES): for each 16-column vector, eight 64-byte rows g: byte
 *     4c + i holds column c's q + 128 at k = 4g + i. */
#define Q8_RAW_BYTES 34 /* one GGUF Q8_0 block: float16 d, 32 int8 q */
#define Q4_0_RAW_BYTES 18 /* one GGUF Q4_0 block: float16 d, 16 bytes of nibbles */
#define Q8_BYTES (QK * NB + NB * 2)
#define I8_TARGET __attribute__((target("avx512vnni")))

/* raw Q4_1 [N][K/32][20 bytes: d, m, 16 bytes of nibbles] or, with q4_0, Q4_0 [N][K/32][18 bytes: d,
 * nibbles; w = d (q - 8), stored as m = -8 d, exact in float16] -> the Q4_1 layout above. A raw
 * byte t holds the block's q at k = t (low nibble) and k = 16 + t (high): the layout's byte itself. */
static void pack_q4_i8(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k, int q4_0) {
    const int64_t blocks = (n + NB - 1) / NB, kb = k / QK, raw_bytes = q4_0 ? Q4_0_RAW_BYTES : Q4_RAW_BYTES;
    memset(packed, 0, (size_t)(blocks * kb * Q4_BYTES));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < kb; j++) {
            uint8_t *dst = packed + (b * kb + j) * Q4_BYTES;
            uint8_t *d = dst + QK / 2 * NB, *mn = d + 2 * NB;
            for (int c = 0; c < NB && b * NB + c < n; c++) {
                const uint8_t *blk = raw + ((b * NB + c) * kb + j) * raw_bytes, *qs = blk + raw_bytes - 16;
                memcpy(d + 2 * c, blk, 2);
                if (q4_0) {
                    uint16_t h;
                    memcpy(&h, blk, 2);
                    const __m512 d32 = _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
                    const __m256i m16 = _mm512_cvtps_ph(_mm512_mul_ps(d32, _mm512_set1_ps(-8.0f)), _MM_FROUND_TO_NEAREST_INT);
                    h = (uint16_t)_mm256_extract_epi16(m16, 0);
                    memcpy(mn + 2 * c, &h, 2);
                } else {
                    memcpy(mn + 2 * c, blk + 2, 2);
                }
                const int v = c / 16, cc = c % 16;
                for (int h = 0; h < 4; h++)
                    for (int i = 0; i < 4; i++) dst[v * 256 + h * 64 + cc * 4 + i] = qs[4 * h + i];
            }
        }
}

void cadence_pack_q4_1_i8(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k) {
    pack_q4_i8(raw, packed, n, k, 0);
}

void cadence_pack_q4_0_i8(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k) {
    pack_q4_i8(raw, packed, n, k, 1);
}

/* raw [N][K/32][34 bytes] -> the Q8_0 layout above; columns past N get zeros (d = 0). */
void cadence_pack_q8_0_i8(const uint8_t *raw, uint8_t *packed, int64_t n, int64_t k) {
    int64_t blocks = (n + NB - 1) / NB, kb = k / QK, row_bytes = kb * Q8_RAW_BYTES;
    memset(packed, 0, (size_t)(blocks * kb * Q8_BYTES));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < kb; j++) {
            uint8_t *dst = packed + (b * kb + j) * Q8_BYTES, *d = dst + QK * NB;
            for (int c = 0; c < NB && b * NB + c < n; c++) {
                const uint8_t *blk = raw + (b * NB + c) * row_bytes + j * Q8_RAW_BYTES;
                memcpy(d + 2 * c, blk, 2);
                const int v = c / 16, cc = c % 16;
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) dst[v * 512 + g * 64 + cc * 4 + i] = (uint8_t)(blk[2 + 4 * g + i] ^ 0x80);
            }
        }
}

/* A batch's activations quantized per row and block of 32: qx [M, K] int8, and per [M, K/32]
 * block its scale sx, the sum of its qx (sq) and sx * sq (ss). One allocation (`mem`).
 * In two terms (qr not NULL): each value is an integer Q = 128 qx + qr, |Q| <= 127 * 128, qx in
 * [-127, 127] and qr in [-64, 63], scale sx = max|x| / (127 * 128); sq is the sum of Q. The kernels
 * sum both int8 terms against the weights and add them as 128 s(qx) + s(qr), exactly: a 15-bit
 * quantization at twice the integer products. */
typedef struct {
    int8_t *qx, *qr;
    float *sx, *ss;
    int32_t *sq;
    void *mem;
} i8_rows;

#define I8X2_MAX (127.0f * 128.0f)

/* Block i of the rows in two terms (above): Q rounded to nearest even, split as qx = (Q + 64) >> 7. */
static void quantize_block_i8x2(const __m512 a, const __m512 c, float amax, int8_t *qx, int8_t *qr,
                                float *sx, int32_t *sq) {
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? I8X2_MAX / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
    const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, _mm512_set1_epi32(64)), 7);
    const __m512i hc = _mm512_srai_epi32(_mm512_add_epi32(qc, _mm512_set1_epi32(64)), 7);
    _mm_storeu_si128((__m128i *)qx, _mm512_cvtsepi32_epi8(ha));
    _mm_storeu_si128((__m128i *)(qx + 16), _mm512_cvtsepi32_epi8(hc));
    _mm_storeu_si128((__m128i *)qr, _mm512_cvtsepi32_epi8(_mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 7))));
    _mm_storeu_si128((__m128i *)(qr + 16), _mm512_cvtsepi32_epi8(_mm512_sub_epi32(qc, _mm512_slli_epi32(hc, 7))));
    *sx = amax / I8X2_MAX;
    *sq = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
}

static int quantize_rows_i8(const uint16_t *x, int64_t m, int64_t k, int two, i8_rows *r) {
    const int64_t kb = k / QK;
    r->mem = malloc((size_t)(m * k) * (two ? 2 : 1) + 3 * (size_t)(m * kb) * 4);
    if (!r->mem) return -1;
    r->qx = r->mem; /* m * k is a multiple of 32: the arrays after it are aligned */
    r->qr = two ? r->qx + m * k : NULL;
    r->sx = (float *)(r->qx + m * k * (two ? 2 : 1));
    r->ss = r->sx + m * kb;
    r->sq = (int32_t *)(r->ss + m * kb);
    for (int64_t i = 0; i < m * kb; i++) {
        const uint16_t *p = x + i * QK; /* row i / kb, block i % kb: rows are contiguous */
        const __m512 a = load_bf16(p, 0xFFFF), c = load_bf16(p + 16, 0xFFFF);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        if (two) {
            quantize_block_i8x2(a, c, amax, r->qx + i * QK, r->qr + i * QK, r->sx + i, r->sq + i);
            r->ss[i] = r->sx[i] * (float)r->sq[i];
            continue;
        }
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)); /* round to nearest even */
        const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, inv));
        _mm_storeu_si128((__m128i *)(r->qx + i * QK), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(r->qx + i * QK + 16), _mm512_cvtsepi32_epi8(qc));
        r->sx[i] = amax / 127.0f;
        r->sq[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
        r->ss[i] = r->sx[i] * (float)r->sq[i];
    }
    return 0;
}

/* The integer sums of one block of 32 k: s[m][j] += sum over k of w[j] * qx[m] for rows 0..mt and
 * vectors 0..nv, w[j * 8 + g] the weights of vector j at k = 4g..4g+3. Rows and vectors go in the
 * inner loops so that the mt x nv sums are independent chains (one `vpdpbusd` chain of 8 would wait
 * on its latency). Integer sums are exact: their order does not change a bit. */
static inline __attribute__((always_inline)) I8_TARGET void i8_sums(
    __m512i s[6][4], const __m512i *w, const int8_t *qx, int64_t k, int mt, int nv) {
    for (int g = 0; g < 8; g++)
        for (int m = 0; m < mt; m++) {
            int32_t four;
            memcpy(&four, qx + m * k + 4 * g, 4);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < nv; j++) s[m][j] = _mm512_dpbusd_epi32(s[m][j], w[j * 8 + g], xb);
        }
}

/* Two terms: s = 128 s + sum of w qr, the int32 sum of w Q (|128 s| < 2^27: no overflow). */
static inline __attribute__((always_inline)) I8_TARGET void i8_second_term(
    __m512i s[6][4], const __m512i *w, const int8_t *qr, int64_t k, int mt, int nv) {
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nv; j++) s[m][j] = _mm512_slli_epi32(s[m][j], 7);
    i8_sums(s, w, qr, k, mt, nv);
}

/* Q4_1: rows m0.. of qx (mt of them) against nv of the block's four 16-column vectors, from v0.
 * A block's nibbles are widened once into `w` (on the stack, in L1) and read by every row. */
static inline __attribute__((always_inline)) I8_TARGET void q4_i8_tile(
    const int8_t *qx, const int8_t *qr, int64_t k, const float *sx, const float *ss, const uint8_t *qb, const float *bias,
    uint16_t *y, float *yf, int64_t n, int64_t col0, int mt, int nv, int v0) {
    __m512 acc[6][4];
    __m512i s[6][4], w[32];
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int64_t kb = k / QK;
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = qb + b * Q4_BYTES;
        const uint16_t *d = (const uint16_t *)(blk + QK / 2 * NB), *mn = d + NB;
        for (int j = 0; j < nv; j++)
            for (int h = 0; h < 4; h++) {
                const __m512i raw = _mm512_loadu_si512(blk + (v0 + j) * 256 + 64 * h);
                w[j * 8 + h] = _mm512_and_si512(raw, low4);
                w[j * 8 + h + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < nv; j++) s[m][j] = _mm512_setzero_si512();
        i8_sums(s, w, qx + b * QK, k, mt, nv);
        if (qr) i8_second_term(s, w, qr + b * QK, k, mt, nv);
        for (int j = 0; j < nv; j++) {
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * (v0 + j))));
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * (v0 + j))));
            for (int m = 0; m < mt; m++) {
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[m * kb + b]));
                acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][j]), scale, acc[m][j]);
                acc[m][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ss[m * kb + b]), acc[m][j]);
            }
        }
    }
    store_tile(acc, bias, y, yf, n, col0, mt, nv, v0);
}

/* Q8_0: as q4_i8_tile, on the Q8_0 layout (the weights read as stored). */
static inline __attribute__((always_inline)) I8_TARGET void q8_i8_tile(
    const int8_t *qx, const int8_t *qr, int64_t k, const float *sx, const int32_t *sq, const uint8_t *qb, const float *bias,
    uint16_t *y, float *yf, int64_t n, int64_t col0, int mt, int nv, int v0) {
    __m512 acc[6][4];
    __m512i s[6][4];
    const int64_t kb = k / QK;
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = qb + b * Q8_BYTES;
        const uint16_t *d = (const uint16_t *)(blk + QK * NB);
        for (int m = 0; m < mt; m++) /* the sums start at -128 sum(qx): undoes the weights' + 128 */
            for (int j = 0; j < nv; j++) s[m][j] = _mm512_set1_epi32(qr ? 0 : -128 * sq[m * kb + b]);
        i8_sums(s, (const __m512i *)(blk + v0 * 512), qx + b * QK, k, mt, nv);
        if (qr) {
            i8_second_term(s, (const __m512i *)(blk + v0 * 512), qr + b * QK, k, mt, nv);
            for (int m = 0; m < mt; m++) /* in two terms sq is the sum of Q = 128 qx + qr */
                for (int j = 0; j < nv; j++) s[m][j] = _mm512_sub_epi32(s[m][j], _mm512_set1_epi32(128 * sq[m * kb + b]));
        }
        for (int j = 0; j < nv; j++) {
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * (v0 + j))));
            for (int m = 0; m < mt; m++) {
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[m * kb + b]));
                acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][j]), scale, acc[m][j]);
            }
        }
    }
    store_tile(acc, bias, y, yf, n, col0, mt, nv, v0);
}

/* Q4_1, rows m0 .. m0+mt of k-block b against the four 16-column vectors of a 64-column block, its
 * nibbles already widened into `w`; the float sums in acc[m0 ..] (in L1 from one k-block to the
 * next). The same operations per row and column as q4_i8_tile, in the same order: the same bits. */
static inline __attribute__((always_inline)) I8_TARGET void q4_i8_rows(
    const i8_rows *r, int64_t k, int64_t b, const __m512i *w, const uint8_t *blk, __m512 (*acc)[4], int64_t m0,
    int mt) {
    const int64_t kb = k / QK;
    const uint16_t *d = (const uint16_t *)(blk + QK / 2 * NB), *mn = d + NB;
    __m512i s[6][4]; /* i8_sums' shape; rows 0 .. mt used */
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) s[m][j] = _mm512_setzero_si512();
    i8_sums(s, w, r->qx + m0 * k + b * QK, k, mt, 4);
    if (r->qr) i8_second_term(s, w, r->qr + m0 * k + b * QK, k, mt, 4);
    for (int j = 0; j < 4; j++) {
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + 16 * j)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * j)));
        for (int m = 0; m < mt; m++) {
            const int64_t i = (m0 + m) * kb + b;
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(r->sx[i]));
            const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][j]), scale, acc[m0 + m][j]);
            acc[m0 + m][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(r->ss[i]), a);
        }
    }
}

/* Q4_1 at 4 to Q4_WIDE_ROWS - 1 rows: one block of 64 columns, k-block by k-block for all rows at
 * once, so that its nibbles are widened once for the batch (3-row tiles over the whole of k widened
 * them once a tile: three times at 8 rows), then 3-row tiles over the 64 columns. Q8_0 has nothing
 * to widen and keeps its tiles (the float sums' trips through L1 would only cost there). */
static I8_TARGET void q4_i8_block_few(const i8_rows *r, int64_t m, int64_t k, const uint8_t *qb, const float *bias,
                                      uint16_t *y, float *yf, int64_t n, int64_t col0) {
    const int64_t kb = k / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[Q4_WIDE_ROWS][4];
    __m512i w[32];
    for (int64_t i = 0; i < m; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        const uint8_t *blk = qb + b * Q4_BYTES;
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 4; h++) {
                const __m512i raw = _mm512_loadu_si512(blk + j * 256 + 64 * h);
                w[j * 8 + h] = _mm512_and_si512(raw, low4);
                w[j * 8 + h + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
        int64_t m0 = 0;
        for (; m0 + 3 <= m; m0 += 3) q4_i8_rows(r, k, b, w, blk, acc, m0, 3);
        if (m - m0 == 2) q4_i8_rows(r, k, b, w, blk, acc, m0, 2);
        if (m - m0 == 1) q4_i8_rows(r, k, b, w, blk, acc, m0, 1);
    }
    for (int64_t m0 = 0; m0 < m; m0 += MT) {
        const int mt = m - m0 < MT ? (int)(m - m0) : MT;
        store_tile(acc + m0, bias, y ? y + m0 * n : NULL, yf ? yf + m0 * n : NULL, n, col0, mt, 4, 0);
    }
}

/* One block of 64 columns for every row: Q4_1 at 4 to Q4_WIDE_ROWS - 1 rows in q4_i8_block_few;
 * else 3-row tiles over 64 columns for small batches, 6-row tiles over 32 columns from
 * Q4_WIDE_ROWS rows on. */
static I8_TARGET void i8_block(int q8, const i8_rows *r, int64_t m, int64_t k, const uint8_t *qb,
                               const float *bias, uint16_t *y, float *yf, int64_t n, int64_t col0) {
    if (!q8 && m > 3 && m < Q4_WIDE_ROWS) { /* up to 3 rows are one tile: widened once already */
        q4_i8_block_few(r, m, k, qb, bias, y, yf, n, col0);
        return;
    }
    int64_t kb = k / QK, m0 = 0;
#define I8_AT(row) r->qx + (row) * k, r->qr ? r->qr + (row) * k : NULL, k, r->sx + (row) * kb
#define I8_OUT(row) qb, bias, y ? y + (row) * n : NULL, yf ? yf + (row) * n : NULL, n, col0
#define I8_TILE(row, mt, nv, v0)                                                                   \
    do {                                                                                             \
        if (q8)                                                                                      \
            q8_i8_tile(I8_AT(row), r->sq + (row) * kb, I8_OUT(row), mt, nv, v0);                     \
        else                                                                                         \
            q4_i8_tile(I8_AT(row), r->ss + (row) * kb, I8_OUT(row), mt, nv, v0);                     \
    } while (0)
    if (m >= Q4_WIDE_ROWS)
        for (; m0 + 6 <= m; m0 += 6) {
            I8_TILE(m0, 6, 2, 0);
            I8_TILE(m0, 6, 2, 2);
        }
    for (; m0 + 3 <= m; m0 += 3) I8_TILE(m0, 3, 4, 0);
    if (m - m0 == 2) I8_TILE(m0, 2, 4, 0);
    if (m - m0 == 1) I8_TILE(m0, 1, 4, 0);
#undef I8_TILE
#undef I8_OUT
#undef I8_AT
}

static int linear_i8(int q8, int two, const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                     float *yf, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + NB - 1) / NB, block_bytes = (k / QK) * (q8 ? Q8_BYTES : Q4_BYTES);
    i8_rows r;
    if (quantize_rows_i8(x, m, k, two, &r)) return -1;
#pragma omp parallel for schedule(guided) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) i8_block(q8, &r, m, k, packed + b * block_bytes, bias, y, yf, n, b * NB);
    free(r.mem);
    return 0;
}

/* As cadence_linear_q4_1, on cadence_pack_q4_1_i8's layout, with int8 activations (above). The
 * Q8_0 ones on cadence_pack_q8_0_i8's, into bfloat16 or (_f32) float32. K a multiple of 32; the
 * CPU must have AVX512-VNNI (model/cpu_kernels.py checks). Return 0, or -1 when the quantized
 * activations' buffer cannot be allocated. */
int cadence_linear_q4_1_i8(const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                           int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(0, 0, x, packed, bias, y, NULL, m, n, k, threads);
}

int cadence_linear_q8_0_i8(const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                           int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(1, 0, x, packed, bias, y, NULL, m, n, k, threads);
}

int cadence_linear_q8_0_i8_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y,
                               int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(1, 0, x, packed, bias, NULL, y, m, n, k, threads);
}

/* The same three with the activations in two int8 terms (i8_rows): same layouts. */
int cadence_linear_q4_1_i8x2(const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                             int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(0, 1, x, packed, bias, y, NULL, m, n, k, threads);
}

int cadence_linear_q8_0_i8x2(const uint16_t *x, const uint8_t *packed, const float *bias, uint16_t *y,
                             int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(1, 1, x, packed, bias, y, NULL, m, n, k, threads);
}

int cadence_linear_q8_0_i8x2_f32(const uint16_t *x, const uint8_t *packed, const float *bias, float *y,
                                 int64_t m, int64_t n, int64_t k, int threads) {
    return linear_i8(1, 1, x, packed, bias, NULL, y, m, n, k, threads);
}

/* ---- elementwise kernels ------------------------------------------------------------------- */

/* exp(x) to within a few float32 ulps: x = n ln2 + r, |r| <= ln2/2, Taylor to r^7, times 2^n. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2, split in two */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Rows are independent; small batches stay on the calling thread (a fork-join costs more). */
#define PARALLEL_ROWS 32

/* residual [M, E] += delta [M, E] (skipped when delta is NULL), rounded to bfloat16 as torch's add;
 * out [M, E] = bf16(bf16(residual / rms(residual)) * w), as Hugging Face's LlamaRMSNorm. */
void cadence_add_rms_norm(uint16_t *residual, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                          int64_t m, int64_t e, float eps, int threads) {
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; r++) {
        uint16_t *x = residual + r * e;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t c = 0; c < e; c += 16) {
            __mmask16 mask = tail_mask(e - c);
            __m512 v = load_bf16(x + c, mask);
            if (delta) {
                v = round_bf16(_mm512_add_ps(v, load_bf16(delta + r * e + c, mask)));
                store_bf16(x + c, v, mask);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)e + eps));
        for (int64_t c = 0; c < e; c += 16) {
            __mmask16 mask = tail_mask(e - c);
            __m512 t = round_bf16(_mm512_mul_ps(load_bf16(x + c, mask), inv));
            store_bf16(out + r * e + c, _mm512_mul_ps(t, load_bf16(w + c, mask)), mask);
        }
    }
}

/* gate_up [M, 2F] (gate then up) -> out [M, F] = bf16(bf16(silu(gate)) * up), as torch's
 * F.silu(gate) * up in bfloat16. */
void cadence_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t m, int64_t f, int threads) {
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *g = gate_up + r * 2 * f, *u = g + f;
        for (int64_t c = 0; c < f; c += 16) {
            __mmask16 mask = tail_mask(f - c);
            __m512 x = load_bf16(g + c, mask);
            __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            __m512 s = round_bf16(_mm512_div_ps(x, den));
            store_bf16(out + r * f + c, _mm512_mul_ps(s, load_bf16(u + c, mask)), mask);
        }
    }
}

/* Rotate heads [0, rot_heads) of qkv [T, heads, D] in place, pairs (i, i + D/2), with the float32
 * tables cos [P, D] and signed sin [P, D] (-sin on the first half, +sin on the second) at each
 * token's position: x1' = x1 cos + x2 (-sin), x2' = x2 cos + x1 sin, one rounding to bfloat16. */
void cadence_rope(uint16_t *qkv, const int64_t *pos, const float *cos, const float *sin, int64_t t,
                  int64_t heads, int64_t rot_heads, int64_t d, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int64_t i = 0; i < t; i++) {
        const float *co = cos + pos[i] * d, *si = sin + pos[i] * d;
        for (int64_t h = 0; h < rot_heads; h++) {
            uint16_t *x = qkv + (i * heads + h) * d;
            for (int64_t c = 0; c < half; c += 16) {
                __mmask16 mask = tail_mask(half - c);
                __m512 x1 = load_bf16(x + c, mask), x2 = load_bf16(x + half + c, mask);
                __m512 c1 = _mm512_maskz_loadu_ps(mask, co + c), c2 = _mm512_maskz_loadu_ps(mask, co + half + c);
                __m512 s1 = _mm512_maskz_loadu_ps(mask, si + c), s2 = _mm512_maskz_loadu_ps(mask, si + half + c);
                store_bf16(x + c, _mm512_fmadd_ps(x2, s1, _mm512_mul_ps(x1, c1)), mask);
                store_bf16(x + half + c, _mm512_fmadd_ps(x1, s2, _mm512_mul_ps(x2, c2)), mask);
            }
        }
    }
}

/* ---- attention over the paged cache: one arithmetic for prefill and decode ---------------------
 *
 * A query vector's result is computed by the same operations in the same order whether its token
 * is a decode row, a row of a prefill chunk (however the prompt was chunked), or a recomputed row
 * after preemption: both kernels below run `attend_tile`, and nothing in it depends on the other
 * queries of the tile. Keys go in chunks of 16 from position 0 (`KC`); for each chunk:
 *   scores   lane t = sum over pairs p of head dims, in increasing p, by vdpbf16ps, times scale;
 *            keys past the query are -inf;
 *   softmax  a running maximum m; when it moves, corr = exp(m_old - m_new) rescales the sums;
 *            the denominator stays 16 lanes wide until the end (lane t: keys t, t+16, ...);
 *   P x V    acc = acc * corr + keys of even t (one chain) + keys of odd t (another), in t order;
 * and the result is acc / (the lanes of the denominator summed by a fixed tree), rounded once to
 * bfloat16. A tile whose last query sees further than this one only adds exact zeros to its sums.
 * So decode rows, prefill chunks, recomputes and prefix-cache hits all give the same bits. */

#define MAX_GROUP 8 /* query heads per KV head */
#define MAX_DIM 256 /* head_dim, a multiple of 32 */
#define KC 16       /* keys per chunk: one float32 lane each */
#define PQ 8        /* query tokens per prefill task: PQ x G query vectors share each loaded chunk */

/* 16 rows of 16 dwords, transposed in registers: r[i] becomes column i (the standard unpack,
 * unpack, shuffle, shuffle sequence). */
static inline void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* One KV head's keys t0 .. t0+kn-1 of a context: K as pairs of head dims [D/2][KC] (dword t of row
 * p = key t's dims 2p, 2p+1: the layout vdpbf16ps scores KC keys from), V widened to float32 [KC][D]
 * (rows past kn unset: never read). Where the chunk's keys are one run of slots (a block size that
 * is a multiple of 16), K is loaded whole and transposed in registers, else gathered key by key;
 * lanes past kn hold other keys of the block, or key t0: their scores are masked. */
static inline void load_chunk(const uint16_t *k_head, const uint16_t *v_head, const int64_t *table, int64_t t0,
                              int64_t kn, int64_t bs, int64_t d, __m512i *kt, float (*vf)[MAX_DIM]) {
    int64_t rows[KC];
    if (bs % KC == 0) {
        const int64_t base = (table[t0 / bs] * bs + t0 % bs) * d; /* t0 is a multiple of KC */
        for (int64_t t = 0; t < KC; t++) rows[t] = base + t * d;
        for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
            __m512i r[16];
            for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_si512(k_head + rows[t] + 2 * p0);
            transpose16(r);
            for (int i = 0; i < 16; i++) kt[p0 + i] = r[i];
        }
    } else {
        for (int64_t t = 0; t < KC; t++) {
            const int64_t pos = t0 + (t < kn ? t : 0);
            rows[t] = (table[pos / bs] * bs + pos % bs) * d;
        }
        /* 64-bit indices (in dwords): a cache of any size */
        const __m512i lo = _mm512_srli_epi64(_mm512_loadu_si512(rows), 1),
                      hi = _mm512_srli_epi64(_mm512_loadu_si512(rows + 8), 1);
        for (int64_t p = 0; p < d / 2; p++) {
            const void *base = k_head + 2 * p;
            kt[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_i64gather_epi32(lo, base, 4)),
                                       _mm512_i64gather_epi32(hi, base, 4), 1);
        }
    }
    for (int64_t t = 0; t < kn; t++)
        for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(vf[t] + c, load_bf16(v_head + rows[t] + c, 0xFFFF));
}

/* ---- the 8-bit KV cache ---------------------------------------------------------------------
 *
 * A slot of one KV head holds D int8 values and their float32 scale (D + 4 bytes): one token's K
 * (or V) of that head, quantised alone, so a token's stored bits depend on nothing but its own K/V
 * and exactness carries over. x = q * scale, with scale = max|x| / 127 and q = x / scale rounded to
 * the nearest integer, ties to even (model/attention.py's `quantize_kv` computes the same bits). */
#define KV8_SCALE_BYTES 4

static void quantize_row_kv8(const uint16_t *x, int64_t d, int8_t *row) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load_bf16(x + c, 0xFFFF)));
    const float scale = _mm512_reduce_max_ps(mx) / 127.0f;
    for (int64_t c = 0; c < d; c += 16) {
        __m512 v = _mm512_setzero_ps();
        if (scale > 0.0f)
            v = _mm512_roundscale_ps(_mm512_div_ps(load_bf16(x + c, 0xFFFF), _mm512_set1_ps(scale)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(row + c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    memcpy(row + d, &scale, KV8_SCALE_BYTES);
}

/* rows [n] of d bfloat16 (row i at x + i * x_stride) -> the 8-bit slots out + slot[i] * (d + 4). */
void cadence_quantize_kv8(const uint16_t *x, int64_t x_stride, int64_t n, int64_t d, const int64_t *slot,
                          int8_t *out) {
    for (int64_t i = 0; i < n; i++) quantize_row_kv8(x + i * x_stride, d, out + slot[i] * (d + KV8_SCALE_BYTES));
}

/* As load_chunk, from the 8-bit cache: K's int8 values become bfloat16 (exactly: integers of at
 * most 8 bits) in the pair layout, with each key's scale in ks[t] (scores are scaled per key after
 * the dot products); V is dequantised to float32. Lanes past kn hold zeros. */
static inline void load_chunk_kv8(const int8_t *k_head, const int8_t *v_head, const int64_t *table, int64_t t0,
                                  int64_t kn, int64_t bs, int64_t d, __m512i *kt, float (*vf)[MAX_DIM], float *ks) {
    const int64_t rb = d + KV8_SCALE_BYTES;
    uint16_t kb[KC][MAX_DIM];
    for (int64_t t = 0; t < KC; t++) {
        if (t >= kn) {
            memset(kb[t], 0, (size_t)d * 2);
            ks[t] = 0.0f;
            continue;
        }
        const int64_t pos = t0 + t, row = (table[pos / bs] * bs + pos % bs) * rb;
        const int8_t *kr = k_head + row, *vr = v_head + row;
        for (int64_t c = 0; c < d; c += 32) {
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(kr + c))));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(kr + c + 16))));
            _mm512_storeu_si512(kb[t] + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        float vs;
        memcpy(&ks[t], kr + d, KV8_SCALE_BYTES);
        memcpy(&vs, vr + d, KV8_SCALE_BYTES);
        for (int64_t c = 0; c < d; c += 16)
            _mm512_storeu_ps(vf[t] + c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(vr + c)))), _mm512_set1_ps(vs)));
    }
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
        __m512i r[16];
        for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_si512(kb[t] + 2 * p0);
        transpose16(r);
        for (int i = 0; i < 16; i++) kt[p0 + i] = r[i];
    }
}

/* Scores of the chunk's KC keys for nv query vectors qv[]: up to four vdpbf16ps chains at a time
 * (independent chains hide the instruction's latency; each vector's chain is the same alone). */
static inline void score_chunk(const uint16_t *const *qv, int64_t nv, const __m512i *kt, int64_t d,
                               float (*sc)[KC]) {
    for (int64_t v0 = 0; v0 < nv; v0 += 4) {
        const int64_t u_n = nv - v0 < 4 ? nv - v0 : 4;
        const uint16_t *q0 = qv[v0], *q1 = qv[v0 + (u_n > 1)], *q2 = qv[v0 + 2 * (u_n > 2)],
                       *q3 = qv[v0 + 3 * (u_n > 3)];
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t p = 0; p < d / 2; p++) {
            const __m512bh kp = (__m512bh)kt[p];
            int32_t a0, a1, a2, a3;
            memcpy(&a0, q0 + 2 * p, 4);
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32(a0), kp);
            if (u_n > 1) {
                memcpy(&a1, q1 + 2 * p, 4);
                s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32(a1), kp);
            }
            if (u_n > 2) {
                memcpy(&a2, q2 + 2 * p, 4);
                s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32(a2), kp);
            }
            if (u_n > 3) {
                memcpy(&a3, q3 + 2 * p, 4);
                s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32(a3), kp);
            }
        }
        _mm512_storeu_ps(sc[v0], s0);
        if (u_n > 1) _mm512_storeu_ps(sc[v0 + 1], s1);
        if (u_n > 2) _mm512_storeu_ps(sc[v0 + 2], s2);
        if (u_n > 3) _mm512_storeu_ps(sc[v0 + 3], s3);
    }
}

/* One query vector's online-softmax step over a chunk: `visible` of its kn keys (the rest masked). */
static inline void attend_chunk(float *acc, float *m, __m512 *lv, const float *sc, int64_t visible, int64_t kn,
                                const float (*vf)[MAX_DIM], int64_t d, float scale) {
    const __mmask16 mask = tail_mask(visible < kn ? visible : kn);
    const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask,
                                         _mm512_mul_ps(_mm512_loadu_ps(sc), _mm512_set1_ps(scale)));
    const float new_m = fmaxf(*m, _mm512_reduce_max_ps(sv));
    /* once the maximum has settled (most chunks of a long context) the sums need no rescaling:
     * skip the scalar exp (exp(0) is exactly 1, so this changes no bit) */
    const float corr = new_m == *m ? 1.0f : expf(*m - new_m);
    const __m512 pv = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(new_m))));
    *lv = _mm512_fmadd_ps(*lv, _mm512_set1_ps(corr), pv);
    *m = new_m;
    float pw[KC];
    _mm512_storeu_ps(pw, pv);
    for (int64_t c = 0; c < d; c += 16) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), _mm512_set1_ps(corr));
        __m512 b = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 1 < kn; t += 2) {
            a = _mm512_fmadd_ps(_mm512_set1_ps(pw[t]), _mm512_loadu_ps(vf[t] + c), a);
            b = _mm512_fmadd_ps(_mm512_set1_ps(pw[t + 1]), _mm512_loadu_ps(vf[t + 1] + c), b);
        }
        if (t < kn) a = _mm512_fmadd_ps(_mm512_set1_ps(pw[t]), _mm512_loadu_ps(vf[t] + c), a);
        _mm512_storeu_ps(acc + c, _mm512_add_ps(a, b));
    }
}

/* Query tokens first .. first+qn-1 (positions start+first ..) of one request, the G query heads of
 * KV head j each, causally over the context in the paged cache through `table`.
 * q, out: the request's rows (row i at q + i * q_row_stride, out + i * heads * d).
 * kv8 is a compile-time constant at every use: attend_tile_bf16 and attend_tile_kv8 below are its two
 * instantiations, so the bfloat16 cache's chunk loop carries no test of it and no 8-bit code. */
static inline __attribute__((always_inline)) void attend_tile(
    const uint16_t *q, int64_t q_row_stride, const void *cache, const int64_t *table, int64_t start, int64_t first,
    int64_t qn, int64_t j, uint16_t *out, int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t num_blocks,
    float scale, const int kv8) {
    const int64_t g_n = heads / kvh, nv = qn * g_n, keys = start + first + qn; /* the last query sees `keys` */
    const int64_t slot_bytes = kv8 ? d + KV8_SCALE_BYTES : 2 * d;
    const char *k_head = (const char *)cache + j * num_blocks * bs * slot_bytes,
               *v_head = k_head + kvh * num_blocks * bs * slot_bytes;
    float acc[PQ * MAX_GROUP][MAX_DIM], m[PQ * MAX_GROUP], sc[PQ * MAX_GROUP][KC], vf[KC][MAX_DIM], ks[KC];
    __m512 lv[PQ * MAX_GROUP];
    __m512i kt[MAX_DIM / 2];
    const uint16_t *qv[PQ * MAX_GROUP];
    for (int64_t v = 0; v < nv; v++) {
        qv[v] = q + (first + v / g_n) * q_row_stride + (j * g_n + v % g_n) * d;
        m[v] = -INFINITY;
        lv[v] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c++) acc[v][c] = 0.0f;
    }
    for (int64_t t0 = 0; t0 < keys; t0 += KC) {
        const int64_t kn = keys - t0 < KC ? keys - t0 : KC;
        if (kv8)
            load_chunk_kv8((const int8_t *)k_head, (const int8_t *)v_head, table, t0, kn, bs, d, kt, vf, ks);
        else
            load_chunk((const uint16_t *)k_head, (const uint16_t *)v_head, table, t0, kn, bs, d, kt, vf);
        score_chunk(qv, nv, kt, d, sc);
        if (kv8) /* each key's dot product times its scale */
            for (int64_t v = 0; v < nv; v++) _mm512_storeu_ps(sc[v], _mm512_mul_ps(_mm512_loadu_ps(sc[v]), _mm512_loadu_ps(ks)));
        for (int64_t v = 0; v < nv; v++) {
            const int64_t qpos = start + first + v / g_n;
            if (t0 > qpos) continue; /* this chunk is entirely in the query's future */
            attend_chunk(acc[v], &m[v], &lv[v], sc[v], qpos - t0 + 1, kn, (const float (*)[MAX_DIM])vf, d, scale);
        }
    }
    for (int64_t v = 0; v < nv; v++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lv[v]));
        uint16_t *o = out + (first + v / g_n) * heads * d + (j * g_n + v % g_n) * d;
        for (int64_t c = 0; c < d; c += 16) store_bf16(o + c, _mm512_mul_ps(_mm512_loadu_ps(acc[v] + c), inv), 0xFFFF);
    }
}

#define ATTEND_TILE_ARGS                                                                                  \
    const uint16_t *q, int64_t q_row_stride, const void *cache, const int64_t *table, int64_t start, int64_t first, \
        int64_t qn, int64_t j, uint16_t *out, int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t num_blocks, \
        float scale
/* Out of line: one copy of each, shared by the decode and prefill kernels. */
static __attribute__((noinline)) void attend_tile_bf16(ATTEND_TILE_ARGS) {
    attend_tile(q, q_row_stride, cache, table, start, first, qn, j, out, heads, kvh, d, bs, num_blocks, scale, 0);
}

static __attribute__((noinline)) void attend_tile_kv8(ATTEND_TILE_ARGS) {
    attend_tile(q, q_row_stride, cache, table, start, first, qn, j, out, heads, kvh, d, bs, num_blocks, scale, 1);
}
#undef ATTEND_TILE_ARGS

/* One query token per request, attending to its whole context where it lies in the paged cache:
 * each (row, KV head) is `attend_tile` of one query token at position lens[r] - 1.
 *
 * q: row r's head h at q + r * q_row_stride + h * d (a view into the fused qkv output).
 * cache: one layer, [2, kvh, num_blocks, bs, d] contiguous (K then V). tables: [rows, table_width]
 * block ids; lens: [rows] context length including this step's token (already written).
 * out: [rows, heads, d]. */
void cadence_decode_attention(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                              const int64_t *tables, int64_t table_width, const int64_t *lens,
                              uint16_t *out, int64_t rows, int64_t heads, int64_t kvh, int64_t d,
                              int64_t bs, int64_t num_blocks, float scale, int64_t total_len, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (total_len * kvh >= 2048)
    for (int64_t task = 0; task < rows * kvh; task++) {
        const int64_t r = task / kvh, j = task % kvh;
        attend_tile_bf16(q + r * q_row_stride, q_row_stride, cache, tables + r * table_width, lens[r] - 1, 0, 1, j,
                         out + r * heads * d, heads, kvh, d, bs, num_blocks, scale);
    }
}

/* As cadence_decode_attention, over the 8-bit cache: [2, kvh, num_blocks, bs, d + 4] bytes. */
void cadence_decode_attention_kv8(const uint16_t *q, int64_t q_row_stride, const int8_t *cache,
                                  const int64_t *tables, int64_t table_width, const int64_t *lens,
                                  uint16_t *out, int64_t rows, int64_t heads, int64_t kvh, int64_t d,
                                  int64_t bs, int64_t num_blocks, float scale, int64_t total_len, int threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (total_len * kvh >= 2048)
    for (int64_t task = 0; task < rows * kvh; task++) {
        const int64_t r = task / kvh, j = task % kvh;
        attend_tile_kv8(q + r * q_row_stride, q_row_stride, cache, tables + r * table_width, lens[r] - 1, 0, 1, j,
                        out + r * heads * d, heads, kvh, d, bs, num_blocks, scale);
    }
}

/* A chunk of n query tokens of one request at positions start .. start+n-1, attending causally
 * to keys 0 .. start+i (query i) read in place from the paged cache (this chunk's K/V already
 * written). Same layouts as cadence_decode_attention, with one block table `table`. Tasks are
 * (KV head, tile of PQ query tokens): the tile's PQ x G query vectors share each loaded chunk. */
void cadence_prefill_attention(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                               const int64_t *table, int64_t start, int64_t n, uint16_t *out,
                               int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t num_blocks,
                               float scale, int threads) {
    const int64_t tiles = (n + PQ - 1) / PQ;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < kvh * tiles; task++) {
        const int64_t j = task % kvh, first = (task / kvh) * PQ, qn = n - first < PQ ? n - first : PQ;
        attend_tile_bf16(q, q_row_stride, cache, table, start, first, qn, j, out, heads, kvh, d, bs, num_blocks, scale);
    }
}

/* As cadence_prefill_attention, over the 8-bit cache (cadence_decode_attention_kv8's layout). */
void cadence_prefill_attention_kv8(const uint16_t *q, int64_t q_row_stride, const int8_t *cache,
                                   const int64_t *table, int64_t start, int64_t n, uint16_t *out,
                                   int64_t heads, int64_t kvh, int64_t d, int64_t bs, int64_t num_blocks,
                                   float scale, int threads) {
    const int64_t tiles = (n + PQ - 1) / PQ;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < kvh * tiles; task++) {
        const int64_t j = task % kvh, first = (task / kvh) * PQ, qn = n - first < PQ ? n - first : PQ;
        attend_tile_kv8(q, q_row_stride, cache, table, start, first, qn, j, out, heads, kvh, d, bs, num_blocks, scale);
    }
}

/* ---- a whole decode step's decoder layers in one call -------------------------------------- */

/* Linear layer weights of one layer, by kind: 0 = cadence_pack's bfloat16 layout, 1 = Q4_1, and with
 * int8 activations 2 = Q4_1 (cadence_pack_q4_1_i8), 3 = Q8_0 (cadence_pack_q8_0_i8), and in two int8
 * terms 4 = Q4_1, 5 = Q8_0 (the _i8x2 kernels, on the same layouts). Once per matrix of a layer:
 * inlined, a few compares before the kernel's call. */
static inline __attribute__((always_inline)) int linear_any(int64_t kind, const uint16_t *x, const void *packed,
                                                            const float *bias, uint16_t *y, int64_t m, int64_t n,
                                                            int64_t k, int threads) {
    if (kind == 1) return cadence_linear_q4_1(x, (const uint8_t *)packed, bias, y, m, n, k, threads);
    if (kind == 2) return cadence_linear_q4_1_i8(x, (const uint8_t *)packed, bias, y, m, n, k, threads);
    if (kind == 3) return cadence_linear_q8_0_i8(x, (const uint8_t *)packed, bias, y, m, n, k, threads);
    if (kind == 4) return cadence_linear_q4_1_i8x2(x, (const uint8_t *)packed, bias, y, m, n, k, threads);
    if (kind == 5) return cadence_linear_q8_0_i8x2(x, (const uint8_t *)packed, bias, y, m, n, k, threads);
    cadence_linear(x, (const uint16_t *)packed, bias, y, m, n, k, threads);
    return 0;
}

/* K then V of each KV head of rows 0..t of qkv into each row's slot of one layer's cache (planes of
 * `plane` bytes, one per KV head and K/V): bfloat16 as they are, or with kv8 (a constant at each
 * use, so each copy of the loop has one kind of store) quantised into the 8-bit slots. */
static inline __attribute__((always_inline)) void store_kv_rows(const uint16_t *qkv, int64_t width, int64_t heads,
                                                                int64_t kvh, int64_t d, const int64_t *slots,
                                                                int64_t t, char *layer_cache, int64_t plane,
                                                                const int kv8) {
    const int64_t slot_bytes = kv8 ? d + KV8_SCALE_BYTES : 2 * d;
    for (int64_t r = 0; r < t; r++)
        for (int64_t s = 0; s < 2 * kvh; s++) {
            const uint16_t *src = qkv + r * width + (heads + s) * d;
            char *dst = layer_cache + s * plane + slots[r] * slot_bytes;
            if (kv8)
                quantize_row_kv8(src, d, (int8_t *)dst);
            else
                memcpy(dst, src, (size_t)d * 2);
        }
}

/* Where one layer's tensors are: addresses in `w` [layers][DL_FIELDS], kinds [layers][4]. */
enum { DL_INPUT_NORM, DL_POST_NORM, DL_QKV, DL_QKV_BIAS, DL_O, DL_GATE_UP, DL_DOWN, DL_FIELDS };

/* Every decoder layer of a step whose rows are all single-token decodes, as model/llama.py runs
 * them (input norm, qkv, RoPE, K/V into the paged cache, decode attention, o, residual + post norm,
 * gate-up, SwiGLU, down, residual + next layer's input norm) through the same kernels in the same
 * order: the result is bit-identical to that path. What it saves is the ~270 Python calls a step
 * and their temporary tensors (~10 us each: a third of a one-stream step).
 *
 * x [T, E] is the embedded input, updated in place as the residual stream; on return `delta` holds
 * the last layer's MLP output, which the caller adds (as the Python path does). h, qkv, attn, gu and
 * act are scratch of [T, E], [T, (H + 2 KVH) D], [T, H D], [T, 2F], [T, F]. cache: all layers,
 * [layers][2][KVH][num_blocks * bs][D] bfloat16, or with kv8 (last, so that callers and libraries
 * from before it still agree) the 8-bit cache's D + 4 bytes a slot;
 * slots, pos: each row's cache slot and position; tables, lens, total_len: as
 * cadence_decode_attention. Returns 0, or -1 when a kernel ran out of memory. */
int cadence_decode_layers(uint16_t *x, uint16_t *h, uint16_t *qkv, uint16_t *attn, uint16_t *gu, uint16_t *act,
                          uint16_t *delta, const int64_t *w, const int64_t *kinds, void *cache,
                          const int64_t *slots, const int64_t *pos, const float *cos, const float *sin,
                          const int64_t *tables, int64_t table_width, const int64_t *lens, int64_t total_len,
                          int64_t t, int64_t layers, int64_t e, int64_t heads, int64_t kvh, int64_t d,
                          int64_t f, int64_t bs, int64_t num_blocks, float eps, float scale, int threads,
                          int64_t kv8) {
    const int64_t width = (heads + 2 * kvh) * d, slot_bytes = kv8 ? d + KV8_SCALE_BYTES : 2 * d;
    const int64_t plane = num_blocks * bs * slot_bytes, layer_bytes = 2 * kvh * plane; /* plane: one KV head's */
#define PTR(i, field) ((void *)(intptr_t)w[(i) * DL_FIELDS + (field)])
    cadence_add_rms_norm(x, NULL, PTR(0, DL_INPUT_NORM), h, t, e, eps, threads);
    for (int64_t i = 0; i < layers; i++) {
        const int64_t *kind = kinds + 4 * i;
        char *layer_cache = (char *)cache + i * layer_bytes;
        if (linear_any(kind[0], h, PTR(i, DL_QKV), PTR(i, DL_QKV_BIAS), qkv, t, width, e, threads)) return -1;
        cadence_rope(qkv, pos, cos, sin, t, heads + 2 * kvh, heads + kvh, d, threads);
        if (kv8) {
            store_kv_rows(qkv, width, heads, kvh, d, slots, t, layer_cache, plane, 1);
            cadence_decode_attention_kv8(qkv, width, (const int8_t *)layer_cache, tables, table_width, lens, attn, t,
                                         heads, kvh, d, bs, num_blocks, scale, total_len, threads);
        } else {
            store_kv_rows(qkv, width, heads, kvh, d, slots, t, layer_cache, plane, 0);
            cadence_decode_attention(qkv, width, (const uint16_t *)layer_cache, tables, table_width, lens, attn, t,
                                     heads, kvh, d, bs, num_blocks, scale, total_len, threads);
        }
        if (linear_any(kind[1], attn, PTR(i, DL_O), NULL, delta, t, e, heads * d, threads)) return -1;
        cadence_add_rms_norm(x, delta, PTR(i, DL_POST_NORM), h, t, e, eps, threads);
        if (linear_any(kind[2], h, PTR(i, DL_GATE_UP), NULL, gu, t, 2 * f, e, threads)) return -1;
        cadence_silu_mul(gu, act, t, f, threads);
        if (linear_any(kind[3], act, PTR(i, DL_DOWN), NULL, delta, t, e, f, threads)) return -1;
        if (i + 1 < layers) cadence_add_rms_norm(x, delta, PTR(i + 1, DL_INPUT_NORM), h, t, e, eps, threads);
    }
#undef PTR
    return 0;
}

/* ---- sampling ------------------------------------------------------------------------------ */

/* exp((x - m) * inv_t) for 16 logits, 0 where that is below -87 (a filtered -inf logit, or a token
 * some 1e-38 times less likely than the top one: exp512 would clamp it to a small nonzero). */
static inline __m512 sample_weights(__m512 x, __m512 m, __m512 inv_t, __mmask16 tail) {
    __m512 y = _mm512_mul_ps(_mm512_sub_ps(x, m), inv_t);
    __mmask16 live = _mm512_mask_cmp_ps_mask(tail, y, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, exp512(y));
}

/* ---- top-k, top-p and min-p ----------------------------------------------------------------
 *
 * A filtered row keeps the tokens of a prefix of its weights sorted in decreasing order (ties by
 * increasing token id): the first top_k; of those, each whose predecessors' weight is below top_p
 * times their normaliser (the whole row's total, or the top_k's when top_k is set, as vLLM
 * renormalises after top-k); and of those, each whose weight is at least min_p times the top one's
 * (the top weight is 1). The prefix is found without sorting the vocabulary: the tokens of weight
 * at least tau (first 2^-12: within 8.3 nats of the top at the row's temperature) are gathered
 * (one comparison per 16 tokens, then the lanes it sets) and only they are sorted; if the cut is not among them, tau drops by 2^-8
 * and they are gathered again, down to every token of nonzero weight. The kept set is then
 * "weight > wc, or weight == wc and id <= ic" for the last kept token (wc, ic); the rest are
 * zeroed in the weights buffer and the draw inverts the CDF of what is left, in token order, as
 * the unfiltered path does. */

typedef struct {
    float w;
    int32_t id;
} cand_t;

static int cand_order(const void *a, const void *b) { /* weight descending, then id ascending */
    const cand_t *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Tokens of weight >= tau (> 0 when tau is 0) into c (room for vocab), in id order; their count. */
static int64_t gather(const float *w, int64_t vocab, float tau, cand_t *c) {
    const __m512 t = _mm512_set1_ps(tau);
    int64_t n = 0;
    float wf[16];
    for (int64_t i = 0; i < vocab; i += 16) {
        __m512 v = _mm512_loadu_ps(w + i); /* the buffer is padded with zeros to 16 */
        __mmask16 keep = tau > 0.0f ? _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ) : _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);
        if (!keep) continue;
        _mm512_storeu_ps(wf, v);
        for (unsigned bits = keep; bits; bits &= bits - 1) {
            int lane = __builtin_ctz(bits);
            c[n].w = wf[lane];
            c[n].id = (int32_t)(i + lane);
            n++;
        }
    }
    return n;
}

/* (wc, ic) of the last token kept by top_k / top_p (0 / 1 when unset) over weights w whose
 * total is `total`; c: scratch for vocab candidates. Keeps everything (wc = 0, ic = vocab) when
 * neither is set. */
static void top_cut(const float *w, int64_t vocab, float total, int64_t top_k, float top_p, cand_t *c,
                    float *wc, int64_t *ic) {
    const int use_k = top_k > 0 && top_k < vocab, use_p = top_p < 1.0f;
    *wc = 0.0f;
    *ic = vocab;
    if (!use_k && !use_p) return;
    for (float tau = 0x1p-12f;; tau = tau > 0x1p-60f ? tau * 0x1p-8f : 0.0f) {
        int64_t n = gather(w, vocab, tau, c);
        if (use_k && n < top_k && tau > 0.0f) continue; /* the top_k-th token lies below tau */
        qsort(c, (size_t)n, sizeof *c, cand_order);
        int64_t keep = use_k && top_k < n ? top_k : n;
        if (keep == 0) return; /* no token of nonzero weight: nothing to cut */
        if (use_p) {
            float norm = total;
            if (use_k) {
                norm = 0.0f;
                for (int64_t j = 0; j < keep; j++) norm += c[j].w;
            }
            const float limit = top_p * norm;
            float before = 0.0f;
            int64_t j = 0;
            while (j < keep && before < limit) before += c[j++].w;
            /* The cut is found when the kept tokens reach the limit, or when top_k's were all
             * gathered (the nucleus is inside them); else it lies below tau. */
            if (before < limit && !use_k && tau > 0.0f) continue;
            keep = j > 0 ? j : 1;
        }
        *wc = c[keep - 1].w;
        *ic = c[keep - 1].id;
        return;
    }
}

/* 16 weights of a row from token i on: read from `w` when the caller computed them (zero-padded to
 * 16), else exp((x - m) * inv_t) from the logits x. */
static inline __attribute__((always_inline)) __m512 row_weights(const float *x, const float *w, int64_t vocab,
                                                                __m512 m, __m512 inv_t, int64_t i) {
    if (w) return _mm512_loadu_ps(w + i);
    const __mmask16 tail = tail_mask(vocab - i);
    return sample_weights(_mm512_maskz_loadu_ps(tail, x + i), m, inv_t, tail);
}

/* One draw by inverting a row's CDF at u: the first token whose running sum of weights exceeds u
 * times their total, as a cumulative sum and a search would, 16 tokens at a time. The total is the
 * sum of the 16-token chunk sums in order, and the search walks the same chunk sums, so it always
 * ends inside the vocabulary; a zero weight never exceeds the sum before it, so a filtered token
 * is never drawn. Weights as `row_weights` gives them (constant `w` and x: the two callers each
 * get their own copy, computing the weights in place or reading them). */
static inline __attribute__((always_inline)) int64_t invert_cdf(const float *x, const float *w, int64_t vocab,
                                                                __m512 m, __m512 inv_t, float u) {
    float total = 0.0f;
    for (int64_t i = 0; i < vocab; i += 16) total += _mm512_reduce_add_ps(row_weights(x, w, vocab, m, inv_t, i));
    const float target = u * total;
    float below = 0.0f;
    int64_t last_live = -1; /* the last token of nonzero weight seen so far */
    for (int64_t i = 0; i < vocab; i += 16) {
        __m512 v = row_weights(x, w, vocab, m, inv_t, i);
        __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
        if (live) last_live = i + 31 - __builtin_clz((unsigned)live);
        float chunk = _mm512_reduce_add_ps(v);
        if (below + chunk <= target) {
            below += chunk;
            continue;
        }
        float wf[16], run = below;
        _mm512_storeu_ps(wf, v);
        for (int k = 0; k < 16 && i + k < vocab; k++) {
            run += wf[k];
            if (wf[k] > 0.0f && run > target) return i + k;
        }
        return last_live; /* the lanes summed one by one fell short of the chunk's tree sum */
    }
    return last_live < 0 ? 0 : last_live; /* target at the total (u rounds to 1): the last live token */
}

/* A filtered row (top_k > 0, top_p < 1 or min_p > 0): weights into a buffer, the cut, then the
 * draw over the kept weights. Returns -1 when its buffers cannot be allocated. */
static int64_t sample_filtered(const float *x, int64_t vocab, float m, float inv_temp, float u, int64_t top_k,
                               float top_p, float min_p) {
    const int64_t padded = (vocab + 15) / 16 * 16;
    float *w = malloc((size_t)padded * sizeof(float));
    cand_t *c = malloc((size_t)padded * sizeof(cand_t));
    if (!w || !c) {
        free(w);
        free(c);
        return -1;
    }
    const __m512 mv = _mm512_set1_ps(m), it = _mm512_set1_ps(inv_temp);
    float total = 0.0f;
    for (int64_t i = 0; i < vocab; i += 16) {
        __mmask16 tail = tail_mask(vocab - i);
        __m512 v = sample_weights(_mm512_maskz_loadu_ps(tail, x + i), mv, it, tail);
        _mm512_storeu_ps(w + i, v); /* zeros past the vocabulary */
        total += _mm512_reduce_add_ps(v);
    }
    float wc;
    int64_t ic;
    top_cut(w, vocab, total, top_k, top_p, c, &wc, &ic);
    if (min_p > wc) { /* min_p keeps fewer: every token of weight >= min_p (the top one's is 1) */
        wc = min_p;
        ic = vocab;
    }
    const __m512 wcv = _mm512_set1_ps(wc);
    for (int64_t i = 0; i < padded; i += 16) {
        __m512 v = _mm512_loadu_ps(w + i);
        __mmask16 ids = ic >= i + 15 ? (__mmask16)0xFFFF : ic < i ? (__mmask16)0 : tail_mask(ic - i + 1);
        __mmask16 keep = _mm512_cmp_ps_mask(v, wcv, _CMP_GT_OQ) | (_mm512_cmp_ps_mask(v, wcv, _CMP_EQ_OQ) & ids);
        _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(keep, v));
    }
    int64_t pick = invert_cdf(NULL, w, vocab, _mm512_setzero_ps(), _mm512_setzero_ps(), u);
    free(w);
    free(c);
    return pick;
}

/* One token per row of logits [rows, vocab] float32, drawn from softmax(logits / temps[r]) by
 * inverting its CDF at u[r] in [0, 1) (`invert_cdf`): one pass for the maximum, two over the weights.
 * top_k (int64, 0 = off), top_p (1 = off) and min_p (0 = off) are per-row arrays, each NULL when
 * no row sets it; a row with any of them set is filtered first (above). Returns 0, or -1 when a
 * filtered row's buffers could not be allocated. */
int cadence_sample(const float *logits, int64_t rows, int64_t vocab, const float *temps, const float *u,
                   const int64_t *top_k, const float *top_p, const float *min_p, int64_t *out, int threads) {
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < vocab; i += 16) {
            __mmask16 tail = tail_mask(vocab - i);
            mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, x + i));
        }
        const int64_t tk = top_k ? top_k[r] : 0;
        const float tp = top_p ? top_p[r] : 1.0f, mp = min_p ? min_p[r] : 0.0f;
        if ((tk > 0 && tk < vocab) || tp < 1.0f || mp > 0.0f) {
            int64_t pick = sample_filtered(x, vocab, _mm512_reduce_max_ps(mv), 1.0f / temps[r], u[r], tk, tp, mp);
            failed |= pick < 0;
            out[r] = pick < 0 ? 0 : pick;
            continue;
        }
        out[r] = invert_cdf(x, NULL, vocab, _mm512_set1_ps(_mm512_reduce_max_ps(mv)), _mm512_set1_ps(1.0f / temps[r]),
                            u[r]);
    }
    return failed ? -1 : 0;
}
