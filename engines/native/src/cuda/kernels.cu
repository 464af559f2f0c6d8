// Native engine, CUDA backend: the kernels of one forward pass (everything but the matrix
// products, which cuBLAS runs). Compiled at load by NVRTC for the device's own architecture
// (`cuda/mod.rs`), so the plugin ships no device code and needs no CUDA toolkit to build.
//
// No headers are included (NVRTC gets no include path in the image): the f16 conversions are
// single PTX instructions, bf16 is the top half of an f32, and -inf is spelled by its bits.
// Activations are f32 throughout; the arithmetic follows the CPU backend's (`cpu/ops.rs`):
// RMSNorm's mean in double, rotate-half RoPE with f32 angles, softmax with the max subtracted.
//
// Sizes are ints: the host checks every count against i32 before a launch.

typedef unsigned short u16;

#define NEG_INF __int_as_float(0xff800000)
// Up to 8 values of a head per lane of a warp: head_dim <= 256 (checked at load).
#define MAX_PER_LANE 8

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, NaN kept NaN (as torch and ggml round).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

// dtype codes shared with the host: 0 = f32, 1 = f16, 2 = bf16.
__device__ __forceinline__ float load_f32(const void* p, long i, int dtype) {
    if (dtype == 0) {
        return ((const float*)p)[i];
    }
    if (dtype == 1) {
        return f16_to_f32(((const u16*)p)[i]);
    }
    return bf16_to_f32(((const u16*)p)[i]);
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)(n); \
         i += (long)gridDim.x * blockDim.x)

// out[t][d] = table[tokens[t]][d] * scale. One block per token.
extern "C" __global__ void embed(const void* table, int dtype, const int* tokens, int dim,
                                 float scale, float* out, int n_tokens) {
    int t = blockIdx.x;
    if (t >= n_tokens) {
        return;
    }
    long row = (long)tokens[t] * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        out[(long)t * dim + d] = load_f32(table, row + d, dtype) * scale;
    }
}

// RMSNorm of each `dim`-row: x / sqrt(mean(x^2) + eps) * w (w + 1 for Gemma). One block per
// row; `out` may be `x` (each thread rewrites only what it read).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int dim,
                                    float eps, int plus_one, int rows) {
    __shared__ double part[32];
    int r = blockIdx.x;
    if (r >= rows) {
        return;
    }
    const float* xr = x + (long)r * dim;
    float* o = out + (long)r * dim;
    double ss = 0.0;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = xr[d];
        ss += (double)(v * v);
    }
    for (int off = 16; off > 0; off >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, off);
    }
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    if (lane == 0) {
        part[warp] = ss;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = (blockDim.x + 31) >> 5;
        double s = lane < nw ? part[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, off);
        }
        if (lane == 0) {
            part[0] = s;
        }
    }
    __syncthreads();
    float scale = (float)(1.0 / sqrt(part[0] / (double)dim + (double)eps));
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float wv = plus_one ? 1.0f + w[d] : w[d];
        o[d] = xr[d] * scale * wv;
    }
}

// Rotary embedding, rotate-half layout (pair i is (x[i], x[i + half])), of every head of
// every token: x is [n_tokens][n_heads][head_dim].
extern "C" __global__ void rope(float* x, const int* positions, const float* inv_freq,
                                float attn_factor, int n_heads, int head_dim, int n_tokens) {
    int half = head_dim / 2;
    FOR_EACH(i, (long)n_tokens * n_heads * half) {
        int k = (int)(i % half);
        long th = i / half;
        int t = (int)(th / n_heads);
        float a = (float)positions[t] * inv_freq[k];
        float c = cosf(a) * attn_factor;
        float s = sinf(a) * attn_factor;
        float* h = x + th * head_dim;
        float x1 = h[k];
        float x2 = h[k + half];
        h[k] = x1 * c - x2 * s;
        h[k + half] = x2 * c + x1 * s;
    }
}

// Append this step's K and V rows ([n_tokens][kvd]) at each token's cache cell.
extern "C" __global__ void kv_store(const float* k, const float* v, const int* cells,
                                    float* k_cache, float* v_cache, int kvd, int n_tokens) {
    FOR_EACH(i, (long)n_tokens * kvd) {
        long t = i / kvd;
        long at = (long)cells[t] * kvd + i % kvd;
        k_cache[at] = k[i];
        v_cache[at] = v[i];
    }
}

// Copy n floats from offset src to offset dst of one buffer (prefix reuse's copy on write:
// the ranges are different blocks, never overlapping).
extern "C" __global__ void copy_range(float* buf, long src, long dst, long n) {
    FOR_EACH(i, n) {
        buf[dst + i] = buf[src + i];
    }
}

// Causal attention over the paged cache. One block per (token, head); each warp takes every
// nwarps-th position of the token's span with an online softmax (running max, sum and
// weighted V in registers), then the warps' partial results are merged in shared memory.
// q and out are [n_tokens][n_heads][head_dim]; the caches are [cell][n_kv_heads][head_dim];
// `tables` holds every sequence's block table, the one of sequence s starting at
// table_off[s]. window > 0: only the last `window` positions (sliding layers). softcap > 0:
// scores go through cap * tanh(score / cap).
extern "C" __global__ void attention(const float* q, const float* k_cache, const float* v_cache,
                                     const int* positions, const int* seq_of,
                                     const int* table_off, const unsigned int* tables,
                                     float* out, int n_heads, int n_kv_heads, int head_dim,
                                     int block_size, int window, float scale, float softcap) {
    extern __shared__ float sh[];
    int t = blockIdx.x;
    int h = blockIdx.y;
    int g = h / (n_heads / n_kv_heads);
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int pos = positions[t];
    const unsigned int* table = tables + table_off[seq_of[t]];
    int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const float* qh = q + ((long)t * n_heads + h) * head_dim;

    float qr[MAX_PER_LANE];
    float acc[MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; j++) {
        int d = lane + 32 * j;
        qr[j] = d < head_dim ? qh[d] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = NEG_INF;
    float l = 0.0f;
    for (int p = lo + warp; p <= pos; p += nwarps) {
        long cell = (long)table[p / block_size] * block_size + p % block_size;
        const float* kr = k_cache + (cell * n_kv_heads + g) * head_dim;
        const float* vr = v_cache + (cell * n_kv_heads + g) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) {
                s += qr[j] * kr[d];
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, off);
        }
        s *= scale;
        if (softcap > 0.0f) {
            s = tanhf(s / softcap) * softcap;
        }
        float mn = fmaxf(m, s);
        float corr = expf(m - mn);
        float e = expf(s - mn);
        l = l * corr + e;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) {
                acc[j] = acc[j] * corr + e * vr[d];
            }
        }
        m = mn;
    }

    // Merge the warps: sh = [nwarps] maxima, [nwarps] sums, [nwarps][head_dim] accumulators.
    float* wm = sh;
    float* wl = sh + nwarps;
    float* wacc = sh + 2 * nwarps;
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; j++) {
        int d = lane + 32 * j;
        if (d < head_dim) {
            wacc[warp * head_dim + d] = acc[j];
        }
    }
    __syncthreads();
    float big = NEG_INF;
    for (int w = 0; w < nwarps; w++) {
        big = fmaxf(big, wm[w]);
    }
    float total = 0.0f;
    for (int w = 0; w < nwarps; w++) {
        if (wm[w] > NEG_INF) {
            total += wl[w] * expf(wm[w] - big);
        }
    }
    float* o = out + ((long)t * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < nwarps; w++) {
            if (wm[w] > NEG_INF) {
                sum += wacc[w * head_dim + d] * expf(wm[w] - big);
            }
        }
        o[d] = sum / total;
    }
}

// g = SiLU(g) * u
extern "C" __global__ void silu_mul(float* g, const float* u, int n) {
    FOR_EACH(i, n) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// g = GELU(g) * u, tanh approximation.
extern "C" __global__ void gelu_tanh_mul(float* g, const float* u, int n) {
    FOR_EACH(i, n) {
        float x = g[i];
        float y = 0.7978846f * (x + 0.044715f * x * x * x);
        g[i] = 0.5f * x * (1.0f + tanhf(y)) * u[i];
    }
}

// x += y
extern "C" __global__ void add(float* x, const float* y, int n) {
    FOR_EACH(i, n) {
        x[i] += y[i];
    }
}

// y[r][c] += b[c]
extern "C" __global__ void add_bias(float* y, const float* b, int cols, int n) {
    FOR_EACH(i, n) {
        y[i] += b[i % cols];
    }
}

// x = cap * tanh(x / cap)
extern "C" __global__ void softcap(float* x, float cap, int n) {
    FOR_EACH(i, n) {
        x[i] = tanhf(x[i] / cap) * cap;
    }
}

// out[r] = x[rows[r]], rows of `dim`.
extern "C" __global__ void gather_rows(const float* x, const int* rows, float* out, int dim,
                                       int n_rows) {
    FOR_EACH(i, (long)n_rows * dim) {
        long r = i / dim;
        out[i] = x[(long)rows[r] * dim + i % dim];
    }
}

// The activations in the weights' 16-bit type, for cuBLAS's mixed-precision product.
extern "C" __global__ void to_bf16(const float* x, u16* out, int n) {
    FOR_EACH(i, n) {
        out[i] = f32_to_bf16(x[i]);
    }
}

extern "C" __global__ void to_f16(const float* x, u16* out, int n) {
    FOR_EACH(i, n) {
        out[i] = f32_to_f16(x[i]);
    }
}
