/* A llama-family decoder layer's elementwise arithmetic for the CPU, with torch's bits: RMSNorm (after the residual
 * add) and the rotary embedding, each one call where torch makes six to ten.
 *
 * Compiled on the machine that runs it (layer_kernel.py, with -ffp-contract=off: a product and a sum are two
 * roundings, as torch's kernels round them, never one fused multiply-add), loaded with ctypes. Tensors hold float32,
 * or bfloat16 (the bf16 flag), whose values are widened to float32 and every result rounded to nearest even, as
 * torch's bfloat16 kernels compute.
 *
 * RMSNorm as transformers writes it: x = float32(h); var = mean(x * x); y = x * (1 / sqrt(var + eps)); out =
 * weight * y (float32) or weight * bfloat16(y) (bfloat16). torch's CPU `mean` is a `sum` divided by the width, and its
 * sum of a contiguous row has an order of its own (aten/src/ATen/native/cpu/SumKernel.cpp, `vectorized_inner_sum`):
 * the row as vectors of `lanes` floats (torch's vector width: 8 for AVX2 builds, 16 for AVX-512), the vectors as rows of
 * four summed in a four-level cascade, the four partial vectors added, then the scalar tail and the lanes in order.
 * `row_sum_squares` follows that order exactly; the engine uses this file only after a probe found the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LANES 16
#define LEVELS 4 /* torch's num_levels */
#define ILP 4    /* torch's ilp_factor */

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* c10::BFloat16's round to nearest even */
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

static int64_t ceil_log2(int64_t x) { /* torch's utils::CeilLog2 */
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* sum(x[i] * x[i]) over a row of n float32 values in the order of torch's vectorized inner sum (see the top). Always
 * inlined with a constant `lanes`, so the lane loops become vector operations (each lane's sums keep their order). */
static inline __attribute__((always_inline)) float row_sum_squares(const float *x, int64_t n, const int lanes) {
    const int64_t vectors = n / lanes, size = vectors / ILP;
    int64_t power = ceil_log2(size) / LEVELS;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) {
                    const float v = x[(i * ILP + k) * lanes + l];
                    acc[0][k][l] += v * v;
                }
        for (int level = 1; level < LEVELS; ++level) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) {
                const float v = x[(i * ILP + k) * lanes + l];
                acc[0][k][l] += v * v;
            }
    for (int level = 1; level < LEVELS; ++level)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = size * ILP; v < vectors; ++v) /* row_sum's vectors past the last group of four */
        for (int l = 0; l < lanes; ++l) {
            const float e = x[v * lanes + l];
            acc[0][0][l] += e * e;
        }
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; ++t) total += x[t] * x[t];
    for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
    return total;
}

/* One row of `norm_f32`: h += residual in place, then out = RMSNorm(h). */
static inline __attribute__((always_inline)) void norm_row_f32(float *h, const float *residual, int64_t width,
                                                               const float *weight, float eps, float *out,
                                                               const int lanes) {
    if (residual)
        for (int64_t i = 0; i < width; ++i) h[i] = h[i] + residual[i];
    const float inverse = 1.0f / sqrtf(row_sum_squares(h, width, lanes) / (float)width + eps);
    for (int64_t i = 0; i < width; ++i) out[i] = (h[i] * inverse) * weight[i];
}

/* One row of `norm_bf16`: h += residual in place (rounded), then out = weight * bfloat16(RMSNorm's float32 value). */
static inline __attribute__((always_inline)) void norm_row_bf16(uint16_t *h, const uint16_t *residual, int64_t width,
                                                                const uint16_t *weight, float eps, uint16_t *out,
                                                                float *x, const int lanes) {
    for (int64_t i = 0; i < width; ++i) {
        float v = from_bf16(h[i]);
        if (residual) {
            h[i] = to_bf16(v + from_bf16(residual[i]));
            v = from_bf16(h[i]);
        }
        x[i] = v;
    }
    const float inverse = 1.0f / sqrtf(row_sum_squares(x, width, lanes) / (float)width + eps);
    for (int64_t i = 0; i < width; ++i) out[i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(x[i] * inverse)));
}

static void norm_f32(float *h, const float *residual, int64_t rows, int64_t width, const float *weight, float eps,
                     float *out, const int lanes) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = r * width;
        if (lanes == 16)
            norm_row_f32(h + at, residual ? residual + at : NULL, width, weight, eps, out + at, 16);
        else
            norm_row_f32(h + at, residual ? residual + at : NULL, width, weight, eps, out + at, 8);
    }
}

static void norm_bf16(uint16_t *h, const uint16_t *residual, int64_t rows, int64_t width, const uint16_t *weight,
                      float eps, uint16_t *out, float *x, const int lanes) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = r * width;
        if (lanes == 16)
            norm_row_bf16(h + at, residual ? residual + at : NULL, width, weight, eps, out + at, x, 16);
        else
            norm_row_bf16(h + at, residual ? residual + at : NULL, width, weight, eps, out + at, x, 8);
    }
}

/* For each of `rows` contiguous rows of `width`: with `residual` (else NULL), h += residual (h written back, as
 * torch's `add_`); then out = RMSNorm(h) with `weight` and `eps`. `lanes`: torch's vector width, 8 or 16. Returns 0,
 * or -1 for another lane count or no memory for one row. */
int epd_add_rms_norm(void *h, const void *residual, int64_t rows, int64_t width, const void *weight, float eps,
                     void *out, int bf16, int lanes) {
    if (lanes != 8 && lanes != 16) return -1;
    if (!bf16) {
        norm_f32(h, residual, rows, width, weight, eps, out, lanes);
        return 0;
    }
    float *x = malloc((size_t)width * sizeof(float));
    if (!x) return -1;
    norm_bf16(h, residual, rows, width, weight, eps, out, x, lanes);
    free(x);
    return 0;
}

/* out[h][r] = x[h][r] * cos[r] + rotate_half(x[h][r]) * sin[r] for `heads` x `rows` vectors of `dim` (even), where
 * rotate_half(v) = cat(-v[dim/2:], v[:dim/2]). x's element (h, r, d) is at h * stride_h + r * stride_r + d; cos and
 * sin's (r, d) at r * stride_cs + d; out is contiguous [heads, rows, dim]. Each product is rounded, then the sum. */
void epd_rotary(const void *x, int64_t heads, int64_t rows, int64_t dim, int64_t stride_h, int64_t stride_r,
                const void *cos, const void *sin, int64_t stride_cs, void *out, int bf16) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = h * stride_h + r * stride_r, cs = r * stride_cs, o = (h * rows + r) * dim;
            if (!bf16) {
                const float *v = (const float *)x + at, *c = (const float *)cos + cs, *s = (const float *)sin + cs;
                float *y = (float *)out + o;
                for (int64_t d = 0; d < half; ++d) y[d] = v[d] * c[d] + (-v[d + half]) * s[d];
                for (int64_t d = half; d < dim; ++d) y[d] = v[d] * c[d] + v[d - half] * s[d];
                continue;
            }
            const uint16_t *v = (const uint16_t *)x + at, *c = (const uint16_t *)cos + cs;
            const uint16_t *s = (const uint16_t *)sin + cs;
            uint16_t *y = (uint16_t *)out + o;
            for (int64_t d = 0; d < dim; ++d) {
                const float rotated = d < half ? -from_bf16(v[d + half]) : from_bf16(v[d - half]);
                const float a = from_bf16(to_bf16(from_bf16(v[d]) * from_bf16(c[d])));
                const float b = from_bf16(to_bf16(rotated * from_bf16(s[d])));
                y[d] = to_bf16(a + b);
            }
        }
}
