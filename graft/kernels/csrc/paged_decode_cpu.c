/* Paged-attention decode on a CPU: one query token per sequence over its cached keys and values,
 * read in place from the paged cache (no gather copy), grouped-query, float32 arithmetic.
 *
 * Layouts (all contiguous): q and out [B, H, d]; k_cache and v_cache [num_blocks, block_size,
 * n_kv, d]; block_tables [B, max_blocks] int32; context_lens [B] int32. Query head qh reads KV
 * head qh / (H / n_kv), as in graft.engine.attention.
 *
 * One work item is one sequence: each token's keys (then values) for all KV heads are one
 * contiguous row of the cache, read once and converted to float32 once, in order through each
 * block, which is what a decode step is bound by (the cache is cold: every layer's weights have
 * streamed through since). With fewer sequences than twice the threads, an item is one KV head
 * of a sequence instead. Items run in parallel on the OpenMP threads of the process (the runtime
 * torch has loaded, with torch's thread count).
 *
 * Entry points return 0; -1 when a block table names a block outside the cache or a length is out
 * of range (that item is skipped: nothing is read out of bounds); -2 when memory ran out.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (a score minus its row's maximum), within a couple of float32 ulps: the
 * argument reduction x = n ln2 + r, |r| <= ln2 / 2, and Cephes' degree-5 polynomial for e^r, in
 * plain arithmetic the compiler vectorises (libm's expf is a scalar call per score).
 * Below CUTOFF (e^-69 < 1e-30 of the row's largest weight) the weight is 0: left in, a weight that
 * small times a value makes a subnormal float, and x86 computes with subnormals about a hundred
 * times slower; dropping it changes no float32 sum the row could make. */
#define CUTOFF (-69.f)
static inline float exp_nonpositive(float x) {
    const float clamped = fmaxf(x, CUTOFF);
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.f;
    union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return x < CUTOFF ? 0.f : y * scale.f;
}

typedef void (*load_row_fn)(const void *src, int64_t offset, float *restrict dst, int d);
typedef void (*store_row_fn)(const float *restrict src, void *dst, int64_t offset, int d);

static void load_bf16(const void *src, int64_t offset, float *restrict dst, int d) {
    const uint16_t *restrict s = (const uint16_t *)src + offset;
    uint32_t *restrict u = (uint32_t *)dst;
    for (int j = 0; j < d; j++) u[j] = (uint32_t)s[j] << 16;
}

static void store_bf16(const float *restrict src, void *dst, int64_t offset, int d) {
    const uint32_t *restrict u = (const uint32_t *)src;
    uint16_t *restrict o = (uint16_t *)dst + offset;
    for (int j = 0; j < d; j++) {
        uint32_t x = u[j];
        /* round to nearest, ties to even, as torch does; a NaN stays a quiet NaN */
        o[j] = (x & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((x >> 16) | 0x40u)
                                                 : (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
}

static void load_f32(const void *src, int64_t offset, float *restrict dst, int d) {
    memcpy(dst, (const float *)src + offset, sizeof(float) * d);
}

static void store_f32(const float *restrict src, void *dst, int64_t offset, int d) {
    memcpy((float *)dst + offset, src, sizeof(float) * d);
}

/* One sequence, KV heads [h0, h1) and their query heads: scores[qh][t] = q_qh . k_t over its n
 * cached tokens, softmax, then the weighted sum of the values. A token's keys (or values) for
 * those KV heads are one contiguous stretch of a cache row, read once, in order through each
 * block. Returns 0 or -1 (a bad block number). */
static int attend(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, void *out,
                  load_row_fn load, store_row_fn store, int64_t q_offset, int n, int h0, int h1, int g, int d,
                  int64_t row_stride, int block_size, int64_t num_blocks, float scale, float *restrict work) {
    const int heads = (h1 - h0) * g, width = (h1 - h0) * d;
    float *restrict qf = work, *restrict acc = qf + heads * d, *restrict row = acc + heads * d;
    float *restrict scores = row + width;
    for (int t = 0; t < n; t += block_size)
        if (table[t / block_size] < 0 || table[t / block_size] >= num_blocks) return -1;
    load(q, q_offset, qf, heads * d);
    for (int j = 0; j < heads * d; j++) qf[j] *= scale;
    float max[heads];
    for (int qh = 0; qh < heads; qh++) max[qh] = -FLT_MAX;
    for (int t0 = 0; t0 < n; t0 += block_size) {
        const int64_t base = (int64_t)table[t0 / block_size] * block_size * row_stride + (int64_t)h0 * d;
        const int len = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < len; t++) {
            load(k_cache, base + (int64_t)t * row_stride, row, width);
            for (int qh = 0; qh < heads; qh++) {
                const float *restrict qi = qf + qh * d, *restrict ki = row + (qh / g) * d;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int j = 0; j < d; j++) s += qi[j] * ki[j];
                scores[(int64_t)qh * n + t0 + t] = s;
                max[qh] = s > max[qh] ? s : max[qh];
            }
        }
    }
    float inv[heads];
    for (int qh = 0; qh < heads; qh++) {
        float *restrict si = scores + (int64_t)qh * n, total = 0.f;
        const float m = max[qh];
#pragma omp simd
        for (int t = 0; t < n; t++) si[t] = exp_nonpositive(si[t] - m);
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < n; t++) total += si[t];
        inv[qh] = 1.f / total;
    }
    memset(acc, 0, sizeof(float) * heads * d);
    for (int t0 = 0; t0 < n; t0 += block_size) {
        const int64_t base = (int64_t)table[t0 / block_size] * block_size * row_stride + (int64_t)h0 * d;
        const int len = n - t0 < block_size ? n - t0 : block_size;
        for (int t = 0; t < len; t++) {
            load(v_cache, base + (int64_t)t * row_stride, row, width);
            for (int qh = 0; qh < heads; qh++) {
                const float p = scores[(int64_t)qh * n + t0 + t], *restrict vi = row + (qh / g) * d;
                float *restrict ai = acc + qh * d;
                for (int j = 0; j < d; j++) ai[j] += p * vi[j];
            }
        }
    }
    for (int qh = 0; qh < heads; qh++)
        for (int j = 0; j < d; j++) acc[qh * d + j] *= inv[qh];
    store(acc, out, q_offset, heads * d);
    return 0;
}

static int decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                  const int32_t *context_lens, void *out, int B, int H, int n_kv, int d, int block_size,
                  int max_blocks, int64_t num_blocks, float scale, load_row_fn load, store_row_fn store) {
    const int g = H / n_kv;
    /* a work item is a sequence (whole cache rows, read in order); with fewer sequences than
     * twice the threads, a (sequence, KV head) pair, so that one long sequence still uses every
     * core */
    const int split = B < 2 * omp_get_max_threads() ? n_kv : 1, per_item = n_kv / split;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < B * split; item++) {
        const int b = item / split, h0 = (item % split) * per_item, n = context_lens[b];
        int rc = -1;
        if (n >= 1 && n <= max_blocks * block_size) {
            const size_t heads = (size_t)per_item * g;
            float *work = malloc(sizeof(float) * (2 * heads * d + (size_t)per_item * d + heads * (size_t)n));
            rc = -2;
            if (work) {
                rc = attend(q, k_cache, v_cache, block_tables + (int64_t)b * max_blocks, out, load, store,
                            ((int64_t)b * H + (int64_t)h0 * g) * d, n, h0, h0 + per_item, g, d,
                            (int64_t)n_kv * d, block_size, num_blocks, scale, work);
                free(work);
            }
        }
        if (rc) {
#pragma omp atomic write
            status = rc;
        }
    }
    return status;
}

int graft_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_tables, const int32_t *context_lens, uint16_t *out, int B, int H,
                            int n_kv, int d, int block_size, int max_blocks, int64_t num_blocks, float scale) {
    return decode(q, k_cache, v_cache, block_tables, context_lens, out, B, H, n_kv, d, block_size, max_blocks,
                  num_blocks, scale, load_bf16, store_bf16);
}

int graft_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                           const int32_t *context_lens, float *out, int B, int H, int n_kv, int d, int block_size,
                           int max_blocks, int64_t num_blocks, float scale) {
    return decode(q, k_cache, v_cache, block_tables, context_lens, out, B, H, n_kv, d, block_size, max_blocks,
                  num_blocks, scale, load_f32, store_f32);
}
