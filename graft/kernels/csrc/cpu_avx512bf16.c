/* Causal prefill attention on a CPU in bf16 with AVX-512 BF16 dot products: a flash-attention
 * loop (online softmax, no score matrix in memory) over one sequence's queries and keys.
 *
 * Layouts: q [lq, H, 64] and k, v [lk, n_kv, 64], bf16, each with its own token and head strides
 * in elements (the last dimension contiguous), so the views the model hands over need no copy;
 * out [lq, H, 64] contiguous. Query i sits at position lk - lq + i and sees keys 0..lk - lq + i
 * (the causal mask aligned bottom-right, as a chunk of a longer prompt sees the chunks before
 * it). Query head qh reads KV head qh / (H / n_kv), as in graft.engine.attention.
 *
 * The arithmetic is what a bf16 flash attention does: scores are exact float32 sums of bf16
 * products (vdpbf16ps), softmax in float32, the weights rounded to bf16 for the product with the
 * values, accumulated in float32, one rounding to bf16 at the end.
 *
 * First the keys and values of each KV head are packed, 64 keys to a block, into the pair-
 * interleaved order vdpbf16ps reads (keys: for each pair of dimensions, 64 keys; values: for
 * each pair of keys, 64 dimensions), zero beyond lk. Then one work item is 16 query positions of
 * one KV head's group of query heads, four rows at a time, so each block of keys and values is
 * loaded once for four rows. Items run on the OpenMP threads of the process (torch's runtime
 * and thread count), the longest (last) positions first.
 *
 * Returns 0; -1 for shapes it does not take (head size other than 64, lk < lq, H not a multiple
 * of n_kv); -2 when memory ran out.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define D 64          /* head size */
#define KB 64         /* keys per packed block */
#define PAIRS (D / 2) /* dimension pairs per key, and key pairs per block */
#define ROWS 4        /* query rows computed together */
#define TILE 16       /* query positions per work item */
#define CUTOFF (-69.f)

/* e^x for x <= 0, 16 lanes: x = n ln2 + r, Cephes' degree-5 polynomial for e^r, 2^n by scalef;
 * below CUTOFF (and -inf, a masked score) exactly 0, which keeps subnormals out of the sums. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(CUTOFF));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    y = _mm512_scalef_ps(y, n);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(CUTOFF), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(keep, y);
}

static inline __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

static inline __m512 round16(__m512 x) {  /* x rounded to bf16 and back, as a bf16 tensor holds it */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

static inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Keys of one KV head, block b: kp[b][pair][key][2]; values: vp[b][key pair][dim][2]. */
static void pack(const uint16_t *k, int64_t k_tok, const uint16_t *v, int64_t v_tok, int lk, int b,
                 uint16_t *restrict kp, uint16_t *restrict vp) {
    for (int j = 0; j < KB; j++) {
        const int key = b * KB + j;
        const uint16_t *kr = k + (int64_t)key * k_tok, *vr = v + (int64_t)key * v_tok;
        for (int p = 0; p < PAIRS; p++) {
            kp[(p * KB + j) * 2] = key < lk ? kr[2 * p] : 0;
            kp[(p * KB + j) * 2 + 1] = key < lk ? kr[2 * p + 1] : 0;
        }
        for (int d = 0; d < D; d++) vp[((j / 2) * D + d) * 2 + (j & 1)] = key < lk ? vr[d] : 0;
    }
}

/* Rows r of one query head at positions pos[r] (keys 0..limit[r]); writes out rows at out_row[r]. */
static void attend_rows(const uint32_t qpair[ROWS][PAIRS], const int limit[ROWS], const uint16_t *kp,
                        const uint16_t *vp, float scale, uint16_t *out_row[ROWS]) {
    __m512 acc[ROWS][D / 16], lsum[ROWS];
    float m[ROWS];
    int max_limit = limit[0];
    for (int r = 0; r < ROWS; r++) {
        for (int e = 0; e < D / 16; e++) acc[r][e] = _mm512_setzero_ps();
        lsum[r] = _mm512_setzero_ps();
        m[r] = -INFINITY;
        if (limit[r] > max_limit) max_limit = limit[r];
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int blocks = max_limit / KB + 1;
    for (int b = 0; b < blocks; b++) {
        const uint16_t *kb = kp + (int64_t)b * KB * D, *vb = vp + (int64_t)b * KB * D;
        __m512 s[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; p++) {
            const __m512i k0 = _mm512_load_si512(kb + (p * KB + 0) * 2), k1 = _mm512_load_si512(kb + (p * KB + 16) * 2),
                          k2 = _mm512_load_si512(kb + (p * KB + 32) * 2), k3 = _mm512_load_si512(kb + (p * KB + 48) * 2);
            for (int r = 0; r < ROWS; r++) {
                const __m512i qb = _mm512_set1_epi32((int)qpair[r][p]);
                s[r][0] = dot(s[r][0], qb, k0);
                s[r][1] = dot(s[r][1], qb, k1);
                s[r][2] = dot(s[r][2], qb, k2);
                s[r][3] = dot(s[r][3], qb, k3);
            }
        }
        uint32_t weights[ROWS][KB / 2];
        for (int r = 0; r < ROWS; r++) {
            __m512 bmax = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                s[r][c] = _mm512_mul_ps(s[r][c], vscale);
                if (b * KB + KB - 1 > limit[r]) {  /* keys past this row's position are masked */
                    const __m512i key = _mm512_add_epi32(iota, _mm512_set1_epi32(b * KB + 16 * c));
                    const __mmask16 late = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(limit[r]));
                    s[r][c] = _mm512_mask_mov_ps(s[r][c], late, _mm512_set1_ps(-INFINITY));
                }
                bmax = _mm512_max_ps(bmax, s[r][c]);
            }
            const float block_max = _mm512_reduce_max_ps(bmax);
            const float m_new = block_max > m[r] ? block_max : m[r];
            /* a row sees key 0 in block 0, so m_new is finite from the first block on */
            const float alpha = m[r] == -INFINITY ? 0.f : expf(m[r] - m_new);
            m[r] = m_new;
            const __m512 vm = _mm512_set1_ps(m_new), valpha = _mm512_set1_ps(alpha);
            __m512 p[4];
            for (int c = 0; c < 4; c++) p[c] = exp_nonpositive(_mm512_sub_ps(s[r][c], vm));
            lsum[r] = _mm512_fmadd_ps(lsum[r], valpha,
                                      _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
            for (int e = 0; e < D / 16; e++) acc[r][e] = _mm512_mul_ps(acc[r][e], valpha);
            /* weights as bf16, keys in order: 32-bit lane t holds keys 2t and 2t + 1 */
            _mm512_storeu_si512(weights[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
            _mm512_storeu_si512(weights[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
        }
        for (int t = 0; t < KB / 2; t++) {
            const __m512i v0 = _mm512_load_si512(vb + (t * D + 0) * 2), v1 = _mm512_load_si512(vb + (t * D + 16) * 2),
                          v2 = _mm512_load_si512(vb + (t * D + 32) * 2), v3 = _mm512_load_si512(vb + (t * D + 48) * 2);
            for (int r = 0; r < ROWS; r++) {
                const __m512i wb = _mm512_set1_epi32((int)weights[r][t]);
                acc[r][0] = dot(acc[r][0], wb, v0);
                acc[r][1] = dot(acc[r][1], wb, v1);
                acc[r][2] = dot(acc[r][2], wb, v2);
                acc[r][3] = dot(acc[r][3], wb, v3);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        if (!out_row[r]) continue;
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum[r]));
        for (int e = 0; e < D / 16; e++)
            _mm256_storeu_si256((__m256i *)(out_row[r] + 16 * e),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][e], inv)));
    }
}

int graft_prefill_bf16(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k, int64_t k_tok,
                       int64_t k_head, const uint16_t *v, int64_t v_tok, int64_t v_head, uint16_t *out, int lq,
                       int lk, int H, int n_kv, int d, float scale) {
    if (d != D || lq < 1 || lk < lq || n_kv < 1 || H % n_kv) return -1;
    const int group = H / n_kv, blocks = (lk + KB - 1) / KB, tiles = (lq + TILE - 1) / TILE;
    const int64_t per_block = (int64_t)KB * D;  /* bf16 elements of one packed block */
    uint16_t *kp = aligned_alloc(64, (size_t)n_kv * blocks * per_block * 2);
    uint16_t *vp = aligned_alloc(64, (size_t)n_kv * blocks * per_block * 2);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -2;
    }
    const int offset = lk - lq;
#pragma omp parallel
    {
#pragma omp for schedule(static) collapse(2)
        for (int h = 0; h < n_kv; h++)
            for (int b = 0; b < blocks; b++)
                pack(k + h * k_head, k_tok, v + h * v_head, v_tok, lk, b,
                     kp + ((int64_t)h * blocks + b) * per_block, vp + ((int64_t)h * blocks + b) * per_block);
        /* item i: KV head i % n_kv, tile tiles - 1 - i / n_kv (the longest rows first) */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n_kv * tiles; item++) {
            const int h = item % n_kv, tile = tiles - 1 - item / n_kv;
            const uint16_t *kh = kp + (int64_t)h * blocks * per_block, *vh = vp + (int64_t)h * blocks * per_block;
            for (int g = 0; g < group; g++) {
                const int qh = h * group + g;
                for (int i0 = tile * TILE; i0 < tile * TILE + TILE && i0 < lq; i0 += ROWS) {
                    uint32_t qpair[ROWS][PAIRS];
                    int limit[ROWS];
                    uint16_t *rows[ROWS];
                    for (int r = 0; r < ROWS; r++) {
                        const int i = i0 + r < lq ? i0 + r : lq - 1;  /* past the end: a repeat, not stored */
                        memcpy(qpair[r], q + i * q_tok + qh * q_head, D * sizeof(uint16_t));
                        limit[r] = offset + i;
                        rows[r] = i0 + r < lq ? out + ((int64_t)i * H + qh) * D : NULL;
                    }
                    attend_rows((const uint32_t(*)[PAIRS])qpair, limit, kh, vh, scale, rows);
                }
            }
        }
    }
    free(kp);
    free(vp);
    return 0;
}

/* ---- paged decode ----
 *
 * One query token per sequence over its cached tokens, read in place from the paged cache, as
 * csrc/paged_decode_cpu.c does, for bf16 and a head size of 64. Layouts as there: q and out
 * [B, H, 64]; k_cache, v_cache [num_blocks, block_size, n_kv, 64]; block_tables [B, max_blocks]
 * int32; context_lens [B] int32. One work item is one sequence, all its heads (or, with fewer
 * sequences than twice the threads, one KV head of one sequence with its group of query heads).
 * Scores: each key row is two vectors of 32 bf16, multiplied into a query head by
 * vdpbf16ps (exact bf16 products, float32 sums); sixteen keys' partial sums are then folded into
 * one vector of sixteen scores by a tree of lane permutes, instead of a horizontal sum per key.
 * Softmax in float32, normalised before the values are weighted; the values are widened to
 * float32 and weighted in float32, so the only roundings are the float32 sums' and the one to
 * bf16 at the end.
 *
 * Returns 0; -1 when a block table names a block outside the cache, a length is out of range or
 * the head size is not 64 (nothing is read out of bounds); -2 when memory ran out. */

#define GROUP_MAX 16

/* a + b over lanes paired by `lo` and `hi` (permutes of the 32 lanes of a then b) */
static inline __m512 fold(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

/* v[0..15], each a vector whose lanes sum to one score: lane i of the result is the sum of v[i]. */
static inline __m512 sum16(__m512 v[16]) {
    const __m512i lo8 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i hi8 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i lo4 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i hi4 = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i lo2 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i hi2 = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
    const __m512i lo1 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i hi1 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    /* after each level, vector j holds 2^level scores, each spread over 16 / 2^level lanes */
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = fold(v[2 * j], v[2 * j + 1], lo8, hi8);
    for (int j = 0; j < 4; j++) b[j] = fold(a[2 * j], a[2 * j + 1], lo4, hi4);
    for (int j = 0; j < 2; j++) c[j] = fold(b[2 * j], b[2 * j + 1], lo2, hi2);
    return fold(c[0], c[1], lo1, hi1);
}

/* How far ahead the decode kernel asks for the keys and values it will read. A sequence's tokens
 * lie in 64-token blocks scattered over the cache, which the hardware prefetchers do not follow
 * from one block to the next; each load of a token's head is paired with a prefetch of the same
 * head 32 tokens on, so the requests spread over the computation instead of coming in bursts
 * that fill the core's miss buffers (a burst of a whole tile's lines at once ran clearly slower). */
#define PREFETCH_AHEAD 32  /* tokens */

static inline void prefetch_line(const void *p) {
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));   /* GCC 12 drops the builtin here */
}

/* Row pointers of the sixteen tokens from t0 (NULL past n): where a tile reads, or will read. */
static inline void tile_rows(const uint16_t *cache, const int32_t *table, int t0, int n, int block_size,
                             int64_t row, const uint16_t *out[16]) {
    for (int t = 0; t < 16; t++)
        out[t] = t0 + t < n ? cache + ((int64_t)table[(t0 + t) / block_size] * block_size + (t0 + t) % block_size) * row : NULL;
}

/* Query heads of KV heads h0..h1 - 1 of one sequence. The keys and values are read in tiles of
 * sixteen tokens, all the item's KV heads of a token together, so each cached row is read whole
 * and once: reading one head's 128 bytes out of each token's row, as one item per KV head did,
 * ran at a third of the memory's speed once the cache no longer fit the last-level cache.
 * `scores` holds (h1 - h0) * g * padded floats, `acc` (h1 - h0) * g * D. */
static int decode_item(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                       uint16_t *out, int n, int h0, int h1, int g, int n_kv, int block_size, int64_t num_blocks,
                       float scale, float *restrict scores, float *restrict acc) {
    const int64_t row = (int64_t)n_kv * D;  /* elements from one cached token to the next */
    for (int t = 0; t < n; t += block_size)
        if (table[t / block_size] < 0 || table[t / block_size] >= num_blocks) return -1;
    const int padded = (n + 15) & ~15, heads = (h1 - h0) * g;
    const uint16_t *rows[16];
    for (int t0 = 0; t0 < padded; t0 += 16) {
        for (int t = 0; t < 16; t++) {
            const int tok = t0 + t < n ? t0 + t : n - 1;  /* past the end: a repeat, masked below */
            rows[t] = k_cache + ((int64_t)table[tok / block_size] * block_size + tok % block_size) * row;
        }
        const uint16_t *ahead[16];
        tile_rows(k_cache, table, t0 + PREFETCH_AHEAD, n, block_size, row, ahead);
        for (int h = h0; h < h1; h++)
            for (int j = 0; j < g; j++) {
                const uint16_t *qh = q + (h * g + j) * D;
                const __m512i q0 = _mm512_loadu_si512(qh), q1 = _mm512_loadu_si512(qh + 32);
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    const uint16_t *kr = rows[t] + h * D;
                    if (j == 0 && ahead[t]) {   /* the same head's lines of a token further on */
                        prefetch_line(ahead[t] + h * D);
                        prefetch_line(ahead[t] + h * D + 32);
                    }
                    part[t] = dot(dot(_mm512_setzero_ps(), q0, _mm512_loadu_si512(kr)), q1, _mm512_loadu_si512(kr + 32));
                }
                _mm512_storeu_ps(scores + (int64_t)((h - h0) * g + j) * padded + t0,
                                 _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
            }
    }
    for (int i = 0; i < heads; i++) {
        float *restrict s = scores + (int64_t)i * padded;
        for (int t = n; t < padded; t++) s[t] = -INFINITY;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < padded; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 total = _mm512_setzero_ps();
        for (int t = 0; t < padded; t += 16) {
            const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
            _mm512_storeu_ps(s + t, p);
            total = _mm512_add_ps(total, p);
        }
        /* the weights carry the normalisation, so the sums below need no division */
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
        for (int t = 0; t < padded; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    }
    memset(acc, 0, sizeof(float) * heads * D);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int tn = n - t0 < 16 ? n - t0 : 16;
        tile_rows(v_cache, table, t0, n, block_size, row, rows);  /* the tn rows below n */
        const uint16_t *ahead[16];
        tile_rows(v_cache, table, t0 + PREFETCH_AHEAD, n, block_size, row, ahead);
        for (int h = h0; h < h1; h++) {
            __m512 a[GROUP_MAX][4];
            float *ah = acc + (int64_t)(h - h0) * g * D;
            for (int j = 0; j < g; j++)
                for (int e = 0; e < 4; e++) a[j][e] = _mm512_loadu_ps(ah + j * D + 16 * e);
            for (int t = 0; t < tn; t++) {
                const uint16_t *vr = rows[t] + h * D;
                if (ahead[t]) {
                    prefetch_line(ahead[t] + h * D);
                    prefetch_line(ahead[t] + h * D + 32);
                }
                __m512 vf[4];
                for (int e = 0; e < 4; e++) vf[e] = load16(vr + 16 * e);
                for (int j = 0; j < g; j++) {
                    const __m512 p = _mm512_set1_ps(scores[(int64_t)((h - h0) * g + j) * padded + t0 + t]);
                    for (int e = 0; e < 4; e++) a[j][e] = _mm512_fmadd_ps(p, vf[e], a[j][e]);
                }
            }
            for (int j = 0; j < g; j++)
                for (int e = 0; e < 4; e++) _mm512_storeu_ps(ah + j * D + 16 * e, a[j][e]);
        }
    }
    for (int i = 0; i < heads; i++)
        for (int e = 0; e < 4; e++)
            store16(out + (h0 * g + i) * D + 16 * e, _mm512_loadu_ps(acc + (int64_t)i * D + 16 * e));
    return 0;
}

int graft_paged_decode_bf16_avx512(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, const int32_t *context_lens, uint16_t *out, int B,
                                   int H, int n_kv, int d, int block_size, int max_blocks, int64_t num_blocks,
                                   float scale) {
    if (d != D || n_kv < 1 || H % n_kv || H / n_kv > GROUP_MAX) return -1;
    const int g = H / n_kv;
    for (int b = 0; b < B; b++)
        if (context_lens[b] < 1 || context_lens[b] > max_blocks * block_size) return -1;
    /* a sequence per item, its rows read whole; with too few sequences to keep every thread busy,
     * a KV head per item */
    const int split = B < 2 * omp_get_max_threads() ? n_kv : 1, per = n_kv / split;
    int status = 0;
#pragma omp parallel
    {
        float *scratch = NULL;
        int64_t room = 0;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < B * split; item++) {
            const int b = item / split, h0 = item % split * per, n = context_lens[b];
            const int64_t need = (int64_t)per * g * (((n + 15) & ~15) + D);
            if (room < need) {
                free(scratch);
                room = need;
                scratch = malloc(sizeof(float) * room);
            }
            const int rc = scratch ? decode_item(q + (int64_t)b * H * D, k_cache, v_cache,
                                                 block_tables + (int64_t)b * max_blocks, out + (int64_t)b * H * D,
                                                 n, h0, h0 + per, g, n_kv, block_size, num_blocks, scale,
                                                 scratch + (int64_t)per * g * D, scratch)
                                   : -2;
            if (!scratch) room = 0;
            if (rc) {
#pragma omp atomic write
                status = rc;
            }
        }
        free(scratch);
    }
    return status;
}

/* ---- the layer around attention: RMSNorm with the residual add, RoPE, SiLU-and-mul, and the
 * linear layers of a decode step ----
 *
 * Each replaces several torch operators of every layer of every step with one call, and rounds
 * where torch's bf16 operators round, so its results are torch's within a bf16 rounding (the
 * sums' order and the exponential's last bits differ). Tensors are bf16 unless said otherwise,
 * rows carry their own stride in elements, the last dimension is contiguous. Each returns 0, or -1
 * for shapes it does not take (nothing is read or written then). Rows are split over the OpenMP
 * threads when there are enough of them to pay for waking the threads. */

#define PARALLEL_ELEMENTS 65536

/* RMSNorm over rows of `dim` (a multiple of 16): out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w),
 * statistics in float32. With `delta`, first res = bf16(res + delta) in place and x = res (the
 * residual stream's add fused into the norm that follows it); without, x = res, left as it is. */
int graft_rms_norm_bf16(const uint16_t *delta, int64_t delta_stride, uint16_t *res, int64_t res_stride,
                        const uint16_t *w, uint16_t *out, int64_t out_stride, int rows, int dim, float eps) {
    if (dim <= 0 || dim % 16 || rows < 0) return -1;
#pragma omp parallel for schedule(static) if ((int64_t)rows * dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        uint16_t *x = res + (int64_t)r * res_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
            __m512 v = load16(x + i);
            if (delta) {
                v = round16(_mm512_add_ps(v, load16(delta + (int64_t)r * delta_stride + i)));
                store16(x + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 scale = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
        uint16_t *y = out + (int64_t)r * out_stride;
        for (int i = 0; i < dim; i += 16)
            store16(y + i, _mm512_mul_ps(round16(_mm512_mul_ps(load16(x + i), scale)), load16(w + i)));
    }
    return 0;
}

/* Half-rotation RoPE for the queries and keys of `rows` tokens: q [rows, hq, d] (row stride
 * q_stride) into q_out [rows, hq, d] contiguous, and k [rows, hk, d] (row stride k_stride) in
 * place. cos and sin are float32 [max_position, d] tables (row stride table_stride); token t sits
 * at position pos[t], which must be below max_position. For i < d/2:
 * out[i] = x[i] cos[i] - x[i + d/2] sin[i], out[i + d/2] = x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2],
 * in float32, rounded once. d is a multiple of 32. */
static inline void rope_head(const uint16_t *x, uint16_t *y, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i += 16) {
        const __m512 a = load16(x + i), b = load16(x + half + i);
        const __m512 ya = _mm512_fmsub_ps(a, _mm512_loadu_ps(c + i), _mm512_mul_ps(b, _mm512_loadu_ps(s + i)));
        const __m512 yb = _mm512_fmadd_ps(b, _mm512_loadu_ps(c + half + i), _mm512_mul_ps(a, _mm512_loadu_ps(s + half + i)));
        store16(y + i, ya);
        store16(y + half + i, yb);
    }
}

int graft_rope_bf16(const uint16_t *q, int64_t q_stride, uint16_t *q_out, uint16_t *k, int64_t k_stride,
                    const int64_t *pos, const float *cos, const float *sin, int64_t table_stride,
                    int64_t max_position, int rows, int hq, int hk, int d) {
    if (d <= 0 || d % 32 || rows < 0 || hq < 0 || hk < 0) return -1;
    for (int t = 0; t < rows; t++)
        if (pos[t] < 0 || pos[t] >= max_position) return -1;
    const int half = d / 2;
#pragma omp parallel for schedule(static) if ((int64_t)rows * (hq + hk) * d >= PARALLEL_ELEMENTS)
    for (int t = 0; t < rows; t++) {
        const float *c = cos + pos[t] * table_stride, *s = sin + pos[t] * table_stride;
        for (int h = 0; h < hq; h++)
            rope_head(q + t * q_stride + h * d, q_out + ((int64_t)t * hq + h) * d, c, s, half);
        for (int h = 0; h < hk; h++)
            rope_head(k + t * k_stride + h * d, k + t * k_stride + h * d, c, s, half);
    }
    return 0;
}

/* SwiGLU's middle: gu [rows, 2 * inter] holds gate then up; out [rows, inter] contiguous,
 * out = bf16(bf16(silu(gate)) * up), silu in float32. inter is a multiple of 16. */
int graft_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int rows, int inter) {
    if (inter <= 0 || inter % 16 || rows < 0) return -1;
#pragma omp parallel for schedule(static) if ((int64_t)rows * inter >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gu + (int64_t)r * gu_stride, *u = g + inter;
        uint16_t *y = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i += 16) {
            const __m512 x = load16(g + i);
            /* sigmoid from e^-|x|, which never overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below */
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
            const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(_mm512_set1_ps(1.f), neg, e), den);
            store16(y + i, _mm512_mul_ps(round16(_mm512_mul_ps(x, sig)), load16(u + i)));
        }
    }
    return 0;
}

/* y [m, n] contiguous = x [m, k] (row stride x_stride) times w [n, k] contiguous, transposed: a
 * linear layer for the few rows of a decode step, where a general matmul cannot keep the weights
 * streaming (torch's bf16 matmul reads them at 11-17 GB/s at 16 rows here, `graft bench kernels`). Each thread takes
 * its share of eight-row slabs of w; a slab is read from memory once, for the first two rows of
 * x, and from the first-level cache for the others. Two rows of x against eight of w make sixteen
 * float32 accumulators of vdpbf16ps, which `sum16` folds into one vector of sixteen outputs.
 * k is a multiple of 32, n of 8. */
int graft_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *y, int m, int n, int k) {
    if (m < 0 || n <= 0 || n % 8 || k <= 0 || k % 32) return -1;
    const int slabs = n / 8, pairs = (m + 1) / 2;
#pragma omp parallel for schedule(static) if (slabs >= 16)
    for (int sl = 0; sl < slabs; sl++) {
        const uint16_t *ws = w + (int64_t)sl * 8 * k;
        /* the next slab is fetched while this one is computed: with the rows of x from the cache,
         * the slab's arrival from memory is otherwise not overlapped with any arithmetic */
        const uint16_t *next = sl + 1 < slabs ? ws + 8 * k : NULL;
        for (int r = 0; r < m; r += 2) {
            const int r1 = r + 1 < m ? r + 1 : r;      /* an odd last row pairs with itself */
            const uint16_t *x0 = x + r * x_stride, *x1 = x + r1 * x_stride;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int i = 0; i < k; i += 32) {
                const __m512i a0 = _mm512_loadu_si512(x0 + i), a1 = _mm512_loadu_si512(x1 + i);
                if (next)  /* row pair p of x fetches rows p, p + pairs, ... of the next slab */
                    for (int j = r / 2; j < 8; j += pairs) _mm_prefetch((const char *)(next + (int64_t)j * k + i), _MM_HINT_T0);
                for (int j = 0; j < 8; j++) {
                    const __m512i b = _mm512_loadu_si512(ws + (int64_t)j * k + i);
                    acc[j] = dot(acc[j], a0, b);
                    acc[8 + j] = dot(acc[8 + j], a1, b);
                }
            }
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(sum16(acc));
            _mm_storeu_si128((__m128i *)(y + (int64_t)r * n + sl * 8), _mm256_castsi256_si128(out));
            if (r1 != r) _mm_storeu_si128((__m128i *)(y + (int64_t)r1 * n + sl * 8), _mm256_extracti128_si256(out, 1));
        }
    }
    return 0;
}
