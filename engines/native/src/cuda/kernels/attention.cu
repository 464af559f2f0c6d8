// Native engine, CUDA backend: causal attention over the paged K/V cache.

// Up to 8 values of a head per lane of a warp: head_dim <= 256 (checked at load).
#define MAX_PER_LANE 8

// Query heads one block serves (of one K/V head): each K/V row it reads serves all of them.
#define ATTN_HEADS 4

// A lane's `per` consecutive values of a K or V row (lane * per .. of the head), as f32; the
// rest of `out` zero. 16-bit rows go in one 16- or 8-byte load where the head size keeps every
// lane's start aligned (head_dim a multiple of 8 or 4).
__device__ __forceinline__ void load_lane(const void* p, long at, int dt, int per, int avail,
                                          int hd, float* out) {
    if (dt != 0 && per == 8 && avail >= 8 && (hd & 7) == 0) {
        unpack8(*(const uint4*)((const u16*)p + at), dt, out);
        return;
    }
    if (dt != 0 && per == 4 && avail >= 4 && (hd & 3) == 0) {
        uint2 q = *(const uint2*)((const u16*)p + at);
        u32 w[2] = {q.x, q.y};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u16 lo = (u16)(w[i] & 0xffffu);
            u16 hi = (u16)(w[i] >> 16);
            out[2 * i] = dt == 1 ? f16_to_f32(lo) : bf16_to_f32(lo);
            out[2 * i + 1] = dt == 1 ? f16_to_f32(hi) : bf16_to_f32(hi);
        }
#pragma unroll
        for (int j = 4; j < MAX_PER_LANE; j++) {
            out[j] = 0.0f;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < MAX_PER_LANE; j++) {
        out[j] = j < per && j < avail ? ld(p, at + j, dt) : 0.0f;
    }
}

// Split over the key span (flash-decoding): one block per (token, K/V head and up to
// ATTN_HEADS of its query heads, split); the token's span is cut into n_split pieces of at
// least 16 positions, and each block's warps take every nwarps-th position of its piece: a
// warp reads the position's K and V rows once (each lane `per` consecutive values) and keeps,
// for each of its query heads, an online softmax (running max, sum and weighted V in
// registers); the warps are merged in shared memory into the piece's (max, sum, weighted V)
// per head, written unnormalised to `part`; attention_merge combines the pieces. So a decode
// step with few sequences still spreads over the GPU, and grouped-query models read their
// cache once per K/V head. q is read in place from the fused QKV output (row stride
// `q_stride`); the caches are [cell][n_kv_heads][head_dim] in their type. The block table of
// sequence s starts at table_off[s] of the step's tables. window > 0: only the last `window`
// positions (sliding layers read their window and nothing before it). softcap > 0: scores go
// through cap * tanh(score / cap). part is [token][head][split][2 + head_dim].
//
// Measured against the variants tried (docs/benchmarks.md): two or four positions' loads
// issued together with the queries in shared memory ran slower on 256-wide heads (the lanes'
// query reads, 8 floats apart, meet in the same banks), so the queries stay in registers.
extern "C" __global__ void attention(const float* q, long q_stride, const void* k_cache,
                                     const void* v_cache, int kvdt, const int* in, float* part,
                                     int n_heads, int n_kv_heads, int head_dim, int block_size,
                                     int window, float scale, float softcap, int n_split) {
    extern __shared__ float sh[];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    int group = n_heads / n_kv_heads;
    int hgroups = (group + ATTN_HEADS - 1) / ATTN_HEADS;
    int g = blockIdx.y / hgroups;
    int h0 = g * group + (blockIdx.y % hgroups) * ATTN_HEADS;
    int nhb = min(ATTN_HEADS, (g + 1) * group - h0);
    int split = blockIdx.z;
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int pos = in[in[IN_POSITIONS] + t];
    const int* table = in + in[IN_TABLES] + in[in[IN_TABLE_OFF] + in[in[IN_SEQ_OF] + t]];
    int start = window > 0 ? max(0, pos + 1 - window) : 0;
    int chunk = max((pos - start + n_split) / n_split, 16);
    int lo = start + split * chunk;
    int hi = min(pos, lo + chunk - 1);
    long piece = 2 + head_dim;
    float* pr0 = part + (((long)t * n_heads + h0) * n_split + split) * piece;
    long head_step = (long)n_split * piece;
    if (lo > hi) {
        if (threadIdx.x < nhb) {
            pr0[threadIdx.x * head_step] = NEG_INF;
            pr0[threadIdx.x * head_step + 1] = 0.0f;
        }
        return;
    }
    int per = (head_dim + 31) >> 5;
    int d0 = lane * per;
    int avail = head_dim - d0;

    float qr[ATTN_HEADS][MAX_PER_LANE];
    float acc[ATTN_HEADS][MAX_PER_LANE];
    float m[ATTN_HEADS];
    float l[ATTN_HEADS];
#pragma unroll
    for (int hj = 0; hj < ATTN_HEADS; hj++) {
        const float* qh = q + (long)t * q_stride + (long)(h0 + hj) * head_dim + d0;
#pragma unroll
        for (int j = 0; j < MAX_PER_LANE; j++) {
            qr[hj][j] = hj < nhb && j < per && j < avail ? qh[j] : 0.0f;
            acc[hj][j] = 0.0f;
        }
        m[hj] = NEG_INF;
        l[hj] = 0.0f;
    }
    for (int p = lo + warp; p <= hi; p += nwarps) {
        long cell = (long)table[p / block_size] * block_size + p % block_size;
        long at = (cell * n_kv_heads + g) * head_dim + d0;
        float kr[MAX_PER_LANE];
        float vr[MAX_PER_LANE];
        load_lane(k_cache, at, kvdt, per, avail, head_dim, kr);
        load_lane(v_cache, at, kvdt, per, avail, head_dim, vr);
        float s[ATTN_HEADS];
#pragma unroll
        for (int hj = 0; hj < ATTN_HEADS; hj++) {
            s[hj] = 0.0f;
#pragma unroll
            for (int j = 0; j < MAX_PER_LANE; j++) {
                s[hj] = fmaf(qr[hj][j], kr[j], s[hj]);
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int hj = 0; hj < ATTN_HEADS; hj++) {
                s[hj] += __shfl_xor_sync(0xffffffffu, s[hj], off);
            }
        }
#pragma unroll
        for (int hj = 0; hj < ATTN_HEADS; hj++) {
            if (hj < nhb) {
                float sc = s[hj] * scale;
                if (softcap > 0.0f) {
                    sc = tanhf(sc / softcap) * softcap;
                }
                float mn = fmaxf(m[hj], sc);
                float corr = expf(m[hj] - mn);
                float e = expf(sc - mn);
                l[hj] = l[hj] * corr + e;
#pragma unroll
                for (int j = 0; j < MAX_PER_LANE; j++) {
                    acc[hj][j] = acc[hj][j] * corr + e * vr[j];
                }
                m[hj] = mn;
            }
        }
    }

    // Merge the warps, per head: sh = [heads][nwarps] maxima, [heads][nwarps] sums, then
    // [heads][nwarps][head_dim] accumulators.
    float* wm = sh;
    float* wl = sh + ATTN_HEADS * nwarps;
    float* wacc = sh + 2 * ATTN_HEADS * nwarps;
#pragma unroll
    for (int hj = 0; hj < ATTN_HEADS; hj++) {
        if (hj < nhb) {
            if (lane == 0) {
                wm[hj * nwarps + warp] = m[hj];
                wl[hj * nwarps + warp] = l[hj];
            }
#pragma unroll
            for (int j = 0; j < MAX_PER_LANE; j++) {
                if (j < per && j < avail) {
                    wacc[((long)hj * nwarps + warp) * head_dim + d0 + j] = acc[hj][j];
                }
            }
        }
    }
    __syncthreads();
    for (int hj = 0; hj < nhb; hj++) {
        const float* hm = wm + hj * nwarps;
        const float* hl = wl + hj * nwarps;
        float big = NEG_INF;
        for (int w = 0; w < nwarps; w++) {
            big = fmaxf(big, hm[w]);
        }
        float* pr = pr0 + hj * head_step;
        if (threadIdx.x == 0) {
            float total = 0.0f;
            for (int w = 0; w < nwarps; w++) {
                if (hm[w] > NEG_INF) {
                    total += hl[w] * expf(hm[w] - big);
                }
            }
            pr[0] = big;
            pr[1] = total;
        }
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < nwarps; w++) {
                if (hm[w] > NEG_INF) {
                    sum += wacc[((long)hj * nwarps + w) * head_dim + d] * expf(hm[w] - big);
                }
            }
            pr[2 + d] = sum;
        }
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
