/* Paged decode attention for the CPU: each single-token query attends to its own KV blocks in place.
 *
 * Compiled on the machine that runs it (decode_kernel.py: cc -O3 -march=native), loaded with ctypes.
 * Layouts (float32, 16-token blocks):
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

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16f vmax(v16f a, v16f b) { v16i m = a > b; return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }
static inline float hsum(v16f v) { float s = 0.0f; for (int i = 0; i < BS; i++) s += v[i]; return s; }
static inline float hmax(v16f v) { float m = v[0]; for (int i = 1; i < BS; i++) m = v[i] > m ? v[i] : m; return m; }

/* exp(x) lane-wise for x <= 0: Cephes expf's range reduction and polynomial (about 1 ulp); x below -87
 * gives about 1e-38, i.e. nothing next to the maximum's exp(0) = 1. */
static inline v16f vexp_neg(v16f x) {
    x = vmax(x, splat(-87.0f));
    v16f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16f y = p * r * r + r + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return y * (v16f)e;
}

/* Probabilities of one query head over its context, one vector per block, into scores[0 .. nblocks). */
static void softmax_scores(const float *qq, const float *k_head, const int64_t *table, int64_t nblocks,
                           int64_t len, int64_t head_dim, float scale, float *scores) {
    v16f mv = splat(-1e30f);
    for (int64_t j = 0; j < nblocks; j++) {
        const float *kt = k_head + table[j] * head_dim * BS;
        v16f s0 = splat(0.0f), s1 = splat(0.0f); /* two chains: head_dim is even */
        for (int64_t d = 0; d < head_dim; d += 2) {
            s0 += qq[d] * load(kt + d * BS);
            s1 += qq[d + 1] * load(kt + (d + 1) * BS);
        }
        v16f s = (s0 + s1) * scale;
        for (int64_t i = len - j * BS; i < BS; i++) s[i] = -1e30f; /* past the context (last block) */
        store(scores + j * BS, s);
        mv = vmax(mv, s);
    }
    const float m = hmax(mv);
    v16f sv = splat(0.0f);
    for (int64_t j = 0; j < nblocks; j++) {
        v16f e = vexp_neg(load(scores + j * BS) - m);
        store(scores + j * BS, e);
        sv += e;
    }
    const float inv = 1.0f / hsum(sv);
    for (int64_t j = 0; j < nblocks; j++) store(scores + j * BS, load(scores + j * BS) * inv);
}

/* out[0 .. head_dim) = sum over the context of p[t] * v[t]; 16 dims at a time, four accumulators. */
static void weighted_values(const float *p, const float *v_head, const int64_t *table, int64_t nblocks,
                            int64_t head_dim, float *out) {
    const int64_t D = head_dim;
    for (int64_t dc = 0; dc < D; dc += 16) {
        v16f a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
        for (int64_t j = 0; j < nblocks; j++) {
            const float *vb = v_head + table[j] * BS * D + dc;
            const float *pj = p + j * BS; /* 0 past the context, so whole blocks are summed */
            for (int i = 0; i < BS; i += 4) {
                a0 += pj[i] * load(vb + i * D);
                a1 += pj[i + 1] * load(vb + (i + 1) * D);
                a2 += pj[i + 2] * load(vb + (i + 2) * D);
                a3 += pj[i + 3] * load(vb + (i + 3) * D);
            }
        }
        store(out + dc, (a0 + a1) + (a2 + a3));
    }
}

/* Returns 0, or 1 when the shapes are not supported (head_dim not a multiple of 16, heads not a multiple
 * of kv_heads); nothing is written then. */
int epd_decode_attention(const float *q, int64_t q_stride_h, int64_t q_stride_b, const float *k_cache,
                         const float *v_cache, const int64_t *tables, int64_t width, const int64_t *lengths,
                         int64_t batch, int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t head_dim,
                         float scale, float *out, float *scratch) {
    if (head_dim % 16 != 0 || kv_heads <= 0 || heads % kv_heads != 0) return 1;
    const int64_t group = heads / kv_heads, head_stride = num_blocks * BS * head_dim;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lengths[b], nblocks = (len + BS - 1) / BS;
        const int64_t *table = tables + b * width;
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int64_t qi = 0; qi < group; qi++) {
                const float *qq = q + (g * group + qi) * q_stride_h + b * q_stride_b;
                softmax_scores(qq, k_cache + g * head_stride, table, nblocks, len, head_dim, scale,
                               scratch + qi * width * BS);
            }
            for (int64_t qi = 0; qi < group; qi++)
                weighted_values(scratch + qi * width * BS, v_cache + g * head_stride, table, nblocks, head_dim,
                                out + (b * heads + g * group + qi) * head_dim);
        }
    }
    return 0;
}
