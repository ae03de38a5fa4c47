/* Paged decode attention for the CPU: each single-token query attends to its own KV blocks in place.
 *
 * Compiled on the machine that runs it (decode_kernel.py: cc -O3 -march=native), loaded with ctypes.
 * Layouts (16-token blocks; K/V float32, or bfloat16 (the bf16 flag), whose values are widened to float32 as they
 * are loaded: every product and sum is float32 in both):
 *   keys    [kv_heads, num_blocks, head_dim, 16]   dim-major inside a block: 16 tokens' scores are one vector
 *   values  [kv_heads, num_blocks, 16, head_dim]
 *   q       [heads, batch, head_dim] with strides (q_stride_h, q_stride_b, 1)
 *   tables  [batch, width] block ids (row b uses its first ceil(lengths[b] / 16))
 *   out     [batch, heads, head_dim]
 *   scratch group * width * 16 floats
 * Query heads h sharing KV head g = h / (heads / kv_heads) read g's blocks (GQA without repeating K/V).
 * Softmax is exact (max subtracted, then normalised), as SDPA computes it; only the summation order differs.
 */
#include <stdint.h>
#include <string.h>

#define BS 16 /* tokens per block */

/* VL lanes per vector: 16 (one AVX-512 register, a block's 16 tokens in one vector) where the compiler targets
 * AVX-512, else 8 (one AVX2 register, a block is two vectors): 16-lane GCC vectors went through the stack on every
 * operation without AVX-512 (GCC 12 for znver1), 2-3x slower there. Each lane's arithmetic and the order of every
 * sum are the same at either width, so the outputs are the same bits. */
#ifndef VL /* a build may choose (tests build both widths) */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#endif
#define NV (BS / VL) /* vectors per block */
#ifndef BLK
#define BLK 4 /* blocks whose scores are computed together */
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
/* VL bfloat16 values as float32: a bfloat16 is the upper half of the float32 with the same bits. With AVX-512 the
 * widening is one instruction (vpmovzxwd zmm, m256); GCC lowers the generic 16-lane conversion as two 8-lane ones
 * and an insert, which made the kernel ~20 % slower on cached K/V. */
#if VL == 16 && defined(__AVX512F__)
#include <immintrin.h>
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#else
static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}
#endif
/* K/V element i of a cache that holds float32 (bf16 == 0) or bfloat16; the flag is a constant in each entry point */
static inline __attribute__((always_inline)) vf load_kv(const void *base, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)base + i) : load((const float *)base + i);
}
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { vf v = {0}; return v + x; }
static inline vf vmax(vf a, vf b) { vi m = a > b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline float hmax(vf v) { float m = v[0]; for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m; return m; }
/* Ask for `bytes` from `p` into L2 (prefetcht1) ahead of their use: a step's K/V (megabytes over its layers) is
 * evicted by the rest of the step before the next, and a sequence's blocks lie anywhere in the pool, which the
 * hardware prefetchers cannot follow from one block to the next (docs/engine.md). */
static inline void prefetch_lines(const char *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 2);
}

/* exp(x) lane-wise for x <= 0: Cephes expf's range reduction and polynomial (about 1 ulp); x below -87
 * gives about 1e-38, i.e. nothing next to the maximum's exp(0) = 1. */
static inline vf vexp_neg(vf x) {
    x = vmax(x, splat(-87.0f));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

/* scores[0 .. nblocks * 16) = exp(scores - their maximum) / their sum; m: the maxima of each lane. */
static inline __attribute__((always_inline)) void normalise(float *scores, int64_t nblocks, const vf *m) {
    vf mm = m[0];
    for (int k = 1; k < NV; k++) mm = vmax(mm, m[k]);
    const float top = hmax(mm);
    vf s[NV];
    for (int k = 0; k < NV; k++) s[k] = splat(0.0f);
    for (int64_t j = 0; j < nblocks; j++) {
        float *sj = scores + j * BS;
        for (int k = 0; k < NV; k++) {
            const vf e = vexp_neg(load(sj + k * VL) - top);
            store(sj + k * VL, e);
            s[k] += e;
        }
    }
    float sum = 0.0f; /* a block's lanes 0 .. 15 in order */
    for (int k = 0; k < NV; k++)
        for (int i = 0; i < VL; i++) sum += s[k][i];
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < nblocks * BS; j += VL) store(scores + j, load(scores + j) * inv);
}

/* Scores of blocks j .. j + NB - 1 (NB a constant: the blocks' chains are independent, so the FMA units overlap
 * them; each score's own sum is the same, in the same order, as one block at a time) for head qa (and qb with pair),
 * scaled, masked past the context, into sa (sb); ma (mb) take the lanes' maxima. A pair loads each key vector once
 * for both heads: even and odd dims in two chains per vector, added at the end of the block. */
static inline __attribute__((always_inline)) void block_scores(
    const float *qa, const float *qb, const void *k_head, int64_t k_off, const int64_t *table, int64_t j, int NB,
    int64_t len, int64_t head_dim, float scale, float *sa, float *sb, vf *ma, vf *mb, int pair, int bf16,
    const char *v_head, int64_t nblocks) {
    int64_t kt[BLK];
    /* fetched while these blocks' scores are computed, a share per dim pair: the next group's key blocks and
     * these blocks' values (summed right after the scores) */
    const int64_t esz = bf16 ? 2 : 4, share = 2 * BS * esz;
    const char *next_k[BLK], *values[BLK];
    for (int u = 0; u < NB; u++) {
        next_k[u] = j + NB + u < nblocks ? (const char *)k_head + (k_off + table[j + NB + u] * head_dim * BS) * esz : 0;
        values[u] = v_head + (k_off + table[j + u] * head_dim * BS) * esz; /* V's blocks are laid out as K's */
    }
    vf a0[BLK][NV], a1[BLK][NV], b0[BLK][NV], b1[BLK][NV];
    for (int u = 0; u < NB; u++) {
        kt[u] = k_off + table[j + u] * head_dim * BS;
        for (int k = 0; k < NV; k++) a0[u][k] = a1[u][k] = b0[u][k] = b1[u][k] = splat(0.0f);
    }
    for (int64_t d = 0; d < head_dim; d += 2) {
        const float qa0 = qa[d], qa1 = qa[d + 1], qb0 = qb[d], qb1 = qb[d + 1];
        for (int u = 0; u < NB; u++) {
            if (next_k[u]) prefetch_lines(next_k[u] + d * BS * esz, share);
            prefetch_lines(values[u] + d * BS * esz, share);
        }
        for (int u = 0; u < NB; u++) {
            for (int k = 0; k < NV; k++) {
                const vf k0 = load_kv(k_head, kt[u] + d * BS + k * VL, bf16);
                const vf k1 = load_kv(k_head, kt[u] + (d + 1) * BS + k * VL, bf16);
                a0[u][k] += qa0 * k0;
                a1[u][k] += qa1 * k1;
                if (pair) {
                    b0[u][k] += qb0 * k0;
                    b1[u][k] += qb1 * k1;
                }
            }
        }
    }
    for (int u = 0; u < NB; u++) {
        const int64_t past = len - (j + u) * BS; /* tokens of this block inside the context */
        float *aj = sa + (j + u) * BS;
        for (int k = 0; k < NV; k++) store(aj + k * VL, (a0[u][k] + a1[u][k]) * scale);
        for (int64_t i = past; i < BS; i++) aj[i] = -1e30f; /* past the context (last block) */
        for (int k = 0; k < NV; k++) ma[k] = vmax(ma[k], load(aj + k * VL));
        if (pair) {
            float *bj = sb + (j + u) * BS;
            for (int k = 0; k < NV; k++) store(bj + k * VL, (b0[u][k] + b1[u][k]) * scale);
            for (int64_t i = past; i < BS; i++) bj[i] = -1e30f;
            for (int k = 0; k < NV; k++) mb[k] = vmax(mb[k], load(bj + k * VL));
        }
    }
}

/* Probabilities of query head qa (and, with pair, of qb: a second head of the same KV head) over its context, 16
 * per block, into sa (sb): BLK blocks at a time, then the rest one by one. */
static inline __attribute__((always_inline)) void softmax_scores(
    const float *qa, const float *qb, const void *k_head, int64_t k_off, const int64_t *table, int64_t nblocks,
    int64_t len, int64_t head_dim, float scale, float *sa, float *sb, int pair, int bf16, const char *v_head) {
    vf ma[NV], mb[NV];
    for (int k = 0; k < NV; k++) ma[k] = mb[k] = splat(-1e30f);
    int64_t j = 0;
    for (; j + BLK <= nblocks; j += BLK)
        block_scores(qa, qb, k_head, k_off, table, j, BLK, len, head_dim, scale, sa, sb, ma, mb, pair, bf16, v_head,
                     nblocks);
    for (; j < nblocks; j++)
        block_scores(qa, qb, k_head, k_off, table, j, 1, len, head_dim, scale, sa, sb, ma, mb, pair, bf16, v_head,
                     nblocks);
    normalise(sa, nblocks, ma);
    if (pair) normalise(sb, nblocks, mb);
}

/* out[0 .. head_dim) = sum over the context of p[t] * v[t] for head pa's probabilities into oa (and pb's into ob,
 * with pair: each value vector loaded once for both); VL dims at a time, four accumulators per head, in the same
 * order either way. */
static inline __attribute__((always_inline)) void weighted_values(
    const float *pa, const float *pb, const void *v_head, int64_t v_off, const int64_t *table, int64_t nblocks,
    int64_t head_dim, float *oa, float *ob, int pair, int bf16) {
    const int64_t D = head_dim;
    for (int64_t dc = 0; dc < D; dc += VL) {
        vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t j = 0; j < nblocks; j++) {
            const int64_t vb = v_off + table[j] * BS * D + dc;
            const float *pja = pa + j * BS, *pjb = pb + j * BS; /* 0 past the context: whole blocks are summed */
            for (int i = 0; i < BS; i += 4) {
                const vf v0 = load_kv(v_head, vb + i * D, bf16), v1 = load_kv(v_head, vb + (i + 1) * D, bf16);
                const vf v2 = load_kv(v_head, vb + (i + 2) * D, bf16), v3 = load_kv(v_head, vb + (i + 3) * D, bf16);
                a0 += pja[i] * v0;
                a1 += pja[i + 1] * v1;
                a2 += pja[i + 2] * v2;
                a3 += pja[i + 3] * v3;
                if (pair) {
                    b0 += pjb[i] * v0;
                    b1 += pjb[i + 1] * v1;
                    b2 += pjb[i + 2] * v2;
                    b3 += pjb[i + 3] * v3;
                }
            }
        }
        store(oa + dc, (a0 + a1) + (a2 + a3));
        if (pair) store(ob + dc, (b0 + b1) + (b2 + b3));
    }
}

static inline __attribute__((always_inline)) int attention(
    const float *q, int64_t q_stride_h, int64_t q_stride_b, const void *k_cache, const void *v_cache,
    const int64_t *tables, int64_t width, const int64_t *lengths, int64_t batch, int64_t heads, int64_t kv_heads,
    int64_t num_blocks, int64_t head_dim, float scale, float *out, float *scratch, int bf16) {
    if (head_dim % 16 != 0 || kv_heads <= 0 || heads % kv_heads != 0) return 1;
    const int64_t group = heads / kv_heads, head_stride = num_blocks * BS * head_dim;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lengths[b], nblocks = (len + BS - 1) / BS;
        const int64_t *table = tables + b * width;
        for (int64_t g = 0; g < kv_heads; g++) {
            /* the group's query heads two at a time (the last alone when the group is odd) */
            for (int64_t qi = 0; qi < group; qi += 2) {
                const float *qa = q + (g * group + qi) * q_stride_h + b * q_stride_b;
                float *sa = scratch + qi * width * BS;
                if (qi + 1 < group)
                    softmax_scores(qa, qa + q_stride_h, k_cache, g * head_stride, table, nblocks, len, head_dim, scale,
                                   sa, sa + width * BS, 1, bf16, (const char *)v_cache);
                else
                    softmax_scores(qa, qa, k_cache, g * head_stride, table, nblocks, len, head_dim, scale, sa, sa, 0,
                                   bf16, (const char *)v_cache);
            }
            /* the first key blocks of the next head (or row), fetched while these values are summed */
            const int64_t next_b = g + 1 < kv_heads ? b : b + 1, next_g = g + 1 < kv_heads ? g + 1 : 0;
            if (next_b < batch) {
                const int64_t esz = bf16 ? 2 : 4, next_blocks = (lengths[next_b] + BS - 1) / BS;
                for (int64_t u = 0; u < BLK && u < next_blocks; u++) {
                    const int64_t block = next_g * head_stride + tables[next_b * width + u] * head_dim * BS;
                    prefetch_lines((const char *)k_cache + block * esz, head_dim * BS * esz);
                }
            }
            for (int64_t qi = 0; qi < group; qi += 2) {
                const float *pa = scratch + qi * width * BS;
                float *oa = out + (b * heads + g * group + qi) * head_dim;
                if (qi + 1 < group)
                    weighted_values(pa, pa + width * BS, v_cache, g * head_stride, table, nblocks, head_dim, oa,
                                    oa + head_dim, 1, bf16);
                else
                    weighted_values(pa, pa, v_cache, g * head_stride, table, nblocks, head_dim, oa, oa, 0, bf16);
            }
        }
    }
    return 0;
}

/* Returns 0, or 1 when the shapes are not supported (head_dim not a multiple of 16, heads not a multiple
 * of kv_heads); nothing is written then. K/V are bfloat16 when bf16 != 0, else float32; q, out and scratch are
 * float32 either way. Each branch is the attention body compiled for its cache's element type. */
int epd_decode_attention(const float *q, int64_t q_stride_h, int64_t q_stride_b, const void *k_cache,
                         const void *v_cache, const int64_t *tables, int64_t width, const int64_t *lengths,
                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t head_dim,
                         float scale, float *out, float *scratch, int bf16) {
    if (bf16)
        return attention(q, q_stride_h, q_stride_b, k_cache, v_cache, tables, width, lengths, batch, heads, kv_heads,
                         num_blocks, head_dim, scale, out, scratch, 1);
    return attention(q, q_stride_h, q_stride_b, k_cache, v_cache, tables, width, lengths, batch, heads, kv_heads,
                     num_blocks, head_dim, scale, out, scratch, 0);
}
