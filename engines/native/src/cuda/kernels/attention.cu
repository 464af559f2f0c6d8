// Native engine, CUDA backend: causal attention over the paged K/V cache.

// Up to 8 values of a head per lane of a warp: head_dim <= 256 (checked at load).
#define MAX_PER_LANE 8

// One block per (token, query head); each warp takes every nwarps-th position of the token's
// span with an online softmax (running max, sum and weighted V in registers), then the warps'
// partial results are merged in shared memory. q is read in place from the fused QKV output
// (row stride `q_stride`); the caches are [cell][n_kv_heads][head_dim] in their type; `out`
// is [token][n_heads][head_dim] in the activation type (the output product's input). The
// block table of sequence s starts at table_off[s] of the step's tables. window > 0: only
// the last `window` positions (sliding layers read their window and nothing before it).
// softcap > 0: scores go through cap * tanh(score / cap).
extern "C" __global__ void attention(const float* q, long q_stride, const void* k_cache,
                                     const void* v_cache, int kvdt, const int* in, void* out,
                                     int odt, int n_heads, int n_kv_heads, int head_dim,
                                     int block_size, int window, float scale, float softcap) {
    extern __shared__ float sh[];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    int h = blockIdx.y;
    int g = h / (n_heads / n_kv_heads);
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int pos = in[in[IN_POSITIONS] + t];
    const int* table = in + in[IN_TABLES] + in[in[IN_TABLE_OFF] + in[in[IN_SEQ_OF] + t]];
    int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const float* qh = q + (long)t * q_stride + (long)h * head_dim;

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
        long base = (cell * n_kv_heads + g) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (d < head_dim) {
                s += qr[j] * ld(k_cache, base + d, kvdt);
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
                acc[j] = acc[j] * corr + e * ld(v_cache, base + d, kvdt);
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
    long o = ((long)t * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < nwarps; w++) {
            if (wm[w] > NEG_INF) {
                sum += wacc[w * head_dim + d] * expf(wm[w] - big);
            }
        }
        st(out, o + d, odt, sum / total);
    }
}
