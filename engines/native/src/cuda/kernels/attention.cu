// Native engine, CUDA backend: causal attention over the paged K/V cache.

// Up to 8 values of a head per lane of a warp: head_dim <= 256 (checked at load).
#define MAX_PER_LANE 8

// Split over the key span (flash-decoding): one block per (token, query head, split); the
// token's span is cut into n_split pieces of at least 16 positions, and each block's warps
// take every nwarps-th position of its piece with an online softmax (running max, sum and
// weighted V in registers), merged in shared memory into the piece's (max, sum, weighted V),
// written unnormalised to `part`; attention_merge combines the pieces. So a decode step with
// few sequences still spreads over the GPU. q is read in place from the fused QKV output (row
// stride `q_stride`); the caches are [cell][n_kv_heads][head_dim] in their type. The block
// table of sequence s starts at table_off[s] of the step's tables. window > 0: only the last
// `window` positions (sliding layers read their window and nothing before it). softcap > 0:
// scores go through cap * tanh(score / cap). part is [token][head][split][2 + head_dim].
extern "C" __global__ void attention(const float* q, long q_stride, const void* k_cache,
                                     const void* v_cache, int kvdt, const int* in, float* part,
                                     int n_heads, int n_kv_heads, int head_dim, int block_size,
                                     int window, float scale, float softcap, int n_split) {
    extern __shared__ float sh[];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    int h = blockIdx.y;
    int split = blockIdx.z;
    int g = h / (n_heads / n_kv_heads);
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int pos = in[in[IN_POSITIONS] + t];
    const int* table = in + in[IN_TABLES] + in[in[IN_TABLE_OFF] + in[in[IN_SEQ_OF] + t]];
    int start = window > 0 ? max(0, pos + 1 - window) : 0;
    int chunk = max((pos - start + n_split) / n_split, 16);
    int lo = start + split * chunk;
    int hi = min(pos, lo + chunk - 1);
    float* pr = part + (((long)t * n_heads + h) * n_split + split) * (2 + head_dim);
    if (lo > hi) {
        if (threadIdx.x == 0) {
            pr[0] = NEG_INF;
            pr[1] = 0.0f;
        }
        return;
    }
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
    for (int p = lo + warp; p <= hi; p += nwarps) {
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
    if (threadIdx.x == 0) {
        pr[0] = big;
        pr[1] = total;
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < nwarps; w++) {
            if (wm[w] > NEG_INF) {
                sum += wacc[w * head_dim + d] * expf(wm[w] - big);
            }
        }
        pr[2 + d] = sum;
    }
}

// The pieces of attention's split into the output, [token][n_heads][head_dim] in the
// activation type (the output product's input). One block per (token, head).
extern "C" __global__ void attention_merge(const float* part, const int* in, void* out, int odt,
                                           int n_heads, int head_dim, int n_split) {
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    int h = blockIdx.y;
    const float* pr = part + ((long)t * n_heads + h) * n_split * (2 + head_dim);
    float big = NEG_INF;
    for (int s = 0; s < n_split; s++) {
        big = fmaxf(big, pr[s * (2 + head_dim)]);
    }
    float total = 0.0f;
    for (int s = 0; s < n_split; s++) {
        float m = pr[s * (2 + head_dim)];
        if (m > NEG_INF) {
            total += pr[s * (2 + head_dim) + 1] * expf(m - big);
        }
    }
    long o = ((long)t * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < n_split; s++) {
            float m = pr[s * (2 + head_dim)];
            if (m > NEG_INF) {
                sum += pr[s * (2 + head_dim) + 2 + d] * expf(m - big);
            }
        }
        st(out, o + d, odt, sum / total);
    }
}
