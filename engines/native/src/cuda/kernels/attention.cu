// Native engine, CUDA backend: causal attention over the paged K/V cache.

// Up to 8 values of a head per lane of a warp: head_dim <= 256 (checked at load).
#define MAX_PER_LANE 8

// Query heads one block serves (of one K/V head): each K/V row it reads serves all of them.
#define ATTN_HEADS 4

// Eight values of a K or V row from `at` (fewer where the head ends: `avail`), as f32: one
// 16-byte load for 16-bit rows, two for f32 rows, where the head size keeps them aligned.
__device__ __forceinline__ void load8(const void* p, long at, int dt, int avail, int hd,
                                      float* out) {
    if (dt != 0 && avail >= 8 && (hd & 7) == 0) {
        unpack8(*(const uint4*)((const u16*)p + at), dt, out);
        return;
    }
    if (dt == 0 && avail >= 8 && (hd & 3) == 0) {
        float4 a = *(const float4*)((const float*)p + at);
        float4 b = *(const float4*)((const float*)p + at + 4);
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        out[j] = j < avail ? ld(p, at + j, dt) : 0.0f;
    }
}

// 16-byte chunks of K and of V each thread loads before storing any (all in flight at once).
#define TILE_LOADS 4

// Split over the key span (flash-decoding): one block per (token, K/V head and up to
// ATTN_HEADS of its query heads, split); the token's span is cut into n_split pieces of at
// least 16 positions, so a decode step with few sequences still spreads over the GPU, and
// grouped-query models read their cache once per K/V head. The block's warps are its query
// heads (warp j serves head h0 + j). Per tile of `tile` positions (8, 16 or 32: the host sizes
// it to the shared memory), the block looks up the tile's cells and loads every K and V row of
// the tile into shared memory as f32 with all its loads in flight, instead of a warp reading a
// position at a time with two round trips each (the kernel this one replaced, docs/benchmarks.md:
// 0.70 against 0.34 ms a step at 64 sequences on an H200); then each warp scores the tile's
// rows for its head (32 / tile lanes per row), updates its online softmax and accumulates the
// weighted V rows (lane i owns values i, i + 32, ...). Rows are `stride` floats apart, 4 past a
// multiple of 32 (`tiled_stride` on the host): the 16-byte stores of a row and the 16-byte
// score reads of 8 lanes on 8 rows meet no bank twice.
//
// q is read in place from the fused QKV output (row stride `q_stride`); the caches are
// [cell][n_kv_heads][head_dim] in their type, and the block table of sequence s starts at
// table_off[s] of the step's tables. window > 0: only the last `window` positions (sliding
// layers read their window and nothing before it). softcap > 0: scores go through
// cap * tanh(score / cap).
//
// The pieces merge in the same launch: each block writes its piece, unnormalised, to `part`
// ([token][head][split][2 + head_dim]: maximum, sum, weighted V) and counts itself in
// `done[token][blockIdx.y]`; the block that counts last merges the pieces into `out` (the
// output product's input, [token][n_heads][head_dim] in the activation type) and sets the
// counter back to zero, ready for the next step (or graph replay). One piece (a long prompt, a
// full batch) goes straight to `out`. n_split <= 16 (the host's attention_splits).
extern "C" __global__ void __launch_bounds__(ATTN_HEADS * 32, 5)
attention_tiled(const float* q, long q_stride, const void* k_cache, const void* v_cache, int kvdt,
                const int* in, float* part, int* done, void* out, int odt, int n_heads,
                int n_kv_heads, int head_dim, int block_size, int window, float scale,
                float softcap, int n_split, int tile, int stride) {
    extern __shared__ float sh[];
    __shared__ int last;
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
    int pos = in[in[IN_POSITIONS] + t];
    const int* table = in + in[IN_TABLES] + in[in[IN_TABLE_OFF] + in[in[IN_SEQ_OF] + t]];
    int start = window > 0 ? max(0, pos + 1 - window) : 0;
    int chunk = max((pos - start + n_split) / n_split, 16);
    int lo = start + split * chunk;
    int hi = min(pos, lo + chunk - 1);

    int lpr = 32 / tile;
    float* qs = sh;
    float* ks = qs + ATTN_HEADS * head_dim;
    float* vs = ks + tile * stride;
    float* ps = vs + tile * stride;
    int* cells = (int*)(ps + ATTN_HEADS * tile);

    const float* qt = q + (long)t * q_stride + (long)h0 * head_dim;
    for (int i = threadIdx.x; i < nhb * head_dim; i += blockDim.x) {
        qs[i] = qt[i];
    }
    int per = (head_dim + 31) >> 5;
    float acc[MAX_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) {
        acc[k] = 0.0f;
    }
    float m = NEG_INF;
    float l = 0.0f;
    int cpr = (head_dim + 7) >> 3;
    for (int base = lo; base <= hi; base += tile) {
        int rows = min(tile, hi - base + 1);
        if (threadIdx.x < rows) {
            int p = base + threadIdx.x;
            cells[threadIdx.x] = table[p / block_size] * block_size + p % block_size;
        }
        __syncthreads();
        int chunks = rows * cpr;
        if (kvdt != 0 && (head_dim & 7) == 0) {
            // 16-bit rows: TILE_LOADS 16-byte loads of K and of V per thread in flight, kept
            // packed until stored.
            for (int i0 = threadIdx.x; i0 < chunks; i0 += TILE_LOADS * blockDim.x) {
                uint4 kw[TILE_LOADS];
                uint4 vw[TILE_LOADS];
#pragma unroll
                for (int u = 0; u < TILE_LOADS; u++) {
                    int i = i0 + u * blockDim.x;
                    if (i < chunks) {
                        int r = i / cpr;
                        long at = ((long)cells[r] * n_kv_heads + g) * head_dim + (i - r * cpr) * 8;
                        kw[u] = *(const uint4*)((const u16*)k_cache + at);
                        vw[u] = *(const uint4*)((const u16*)v_cache + at);
                    }
                }
#pragma unroll
                for (int u = 0; u < TILE_LOADS; u++) {
                    int i = i0 + u * blockDim.x;
                    if (i < chunks) {
                        int r = i / cpr;
                        int off = r * stride + (i - r * cpr) * 8;
                        float f[8];
                        unpack8(kw[u], kvdt, f);
                        *(float4*)(ks + off) = make_float4(f[0], f[1], f[2], f[3]);
                        *(float4*)(ks + off + 4) = make_float4(f[4], f[5], f[6], f[7]);
                        unpack8(vw[u], kvdt, f);
                        *(float4*)(vs + off) = make_float4(f[0], f[1], f[2], f[3]);
                        *(float4*)(vs + off + 4) = make_float4(f[4], f[5], f[6], f[7]);
                    }
                }
            }
        } else {
            // f32 rows (f32 checkpoints), or a head size not a multiple of 8.
            for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
                int r = i / cpr;
                int c = (i - r * cpr) * 8;
                long at = ((long)cells[r] * n_kv_heads + g) * head_dim + c;
                float kf[8];
                float vf[8];
                load8(k_cache, at, kvdt, head_dim - c, head_dim, kf);
                load8(v_cache, at, kvdt, head_dim - c, head_dim, vf);
                int n = min(8, head_dim - c);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (j < n) {
                        ks[r * stride + c + j] = kf[j];
                        vs[r * stride + c + j] = vf[j];
                    }
                }
            }
        }
        __syncthreads();
        if (warp < nhb) {
            const float* qh = qs + warp * head_dim;
            int r = lane % tile;
            int sub = lane / tile;
            float s = 0.0f;
            if (r < rows) {
                const float* kr = ks + r * stride;
                if ((head_dim & 3) == 0) {
                    // Four partial sums: independent chains over 16-byte reads.
                    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    for (int d = 4 * sub; d < head_dim; d += 4 * lpr) {
                        float4 qv = *(const float4*)(qh + d);
                        float4 kv = *(const float4*)(kr + d);
                        a.x = fmaf(qv.x, kv.x, a.x);
                        a.y = fmaf(qv.y, kv.y, a.y);
                        a.z = fmaf(qv.z, kv.z, a.z);
                        a.w = fmaf(qv.w, kv.w, a.w);
                    }
                    s = (a.x + a.y) + (a.z + a.w);
                } else {
                    for (int d = sub; d < head_dim; d += lpr) {
                        s = fmaf(qh[d], kr[d], s);
                    }
                }
            }
            for (int off = tile; off < 32; off <<= 1) {
                s += __shfl_xor_sync(0xffffffffu, s, off);
            }
            float sc = NEG_INF;
            if (r < rows) {
                sc = s * scale;
                if (softcap > 0.0f) {
                    sc = tanhf(sc / softcap) * softcap;
                }
            }
            float top = sc;
            for (int off = 16; off > 0; off >>= 1) {
                top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
            }
            float mn = fmaxf(m, top);
            float corr = expf(m - mn);
            float e = r < rows && sub == 0 ? expf(sc - mn) : 0.0f;
            float es = e;
            for (int off = 16; off > 0; off >>= 1) {
                es += __shfl_xor_sync(0xffffffffu, es, off);
            }
            l = l * corr + es;
            m = mn;
            if (r < rows && sub == 0) {
                ps[warp * tile + r] = e;
            }
            __syncwarp();
#pragma unroll
            for (int k = 0; k < MAX_PER_LANE; k++) {
                acc[k] *= corr;
            }
            for (int rr = 0; rr < rows; rr++) {
                float w = ps[warp * tile + rr];
                const float* vr = vs + rr * stride + lane;
#pragma unroll
                for (int k = 0; k < MAX_PER_LANE; k++) {
                    if (k < per && lane + 32 * k < head_dim) {
                        acc[k] = fmaf(w, vr[32 * k], acc[k]);
                    }
                }
            }
        }
        __syncthreads();
    }

    if (n_split == 1) {
        if (warp < nhb) {
            long o = ((long)t * n_heads + h0 + warp) * head_dim;
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
            for (int k = 0; k < MAX_PER_LANE; k++) {
                int d = lane + 32 * k;
                if (k < per && d < head_dim) {
                    st(out, o + d, odt, acc[k] * inv);
                }
            }
        }
        return;
    }
    long piece = 2 + head_dim;
    if (warp < nhb) {
        float* pr = part + (((long)t * n_heads + h0 + warp) * n_split + split) * piece;
        if (lane == 0) {
            pr[0] = m;
            pr[1] = l;
        }
#pragma unroll
        for (int k = 0; k < MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (k < per && d < head_dim) {
                pr[2 + d] = acc[k];
            }
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* counter = done + (long)t * gridDim.y + blockIdx.y;
        last = atomicAdd(counter, 1) == n_split - 1;
        if (last) {
            *counter = 0;
        }
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    // The last piece in: merge every piece of each head (n_split <= 16 < 32: lane s holds piece
    // s's maximum and weight), reading through L2 what the other blocks wrote.
    if (warp < nhb) {
        const float* prh = part + ((long)t * n_heads + h0 + warp) * n_split * piece;
        float ms = lane < n_split ? __ldcg(prh + lane * piece) : NEG_INF;
        float ls = lane < n_split ? __ldcg(prh + lane * piece + 1) : 0.0f;
        float big = ms;
        for (int off = 16; off > 0; off >>= 1) {
            big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, off));
        }
        float w = ms > NEG_INF ? expf(ms - big) : 0.0f;
        float total = ls * w;
        for (int off = 16; off > 0; off >>= 1) {
            total += __shfl_xor_sync(0xffffffffu, total, off);
        }
        float sum[MAX_PER_LANE];
#pragma unroll
        for (int k = 0; k < MAX_PER_LANE; k++) {
            sum[k] = 0.0f;
        }
        for (int s = 0; s < n_split; s++) {
            float ws = __shfl_sync(0xffffffffu, w, s);
            if (ws > 0.0f) {
                const float* vals = prh + s * piece + 2 + lane;
#pragma unroll
                for (int k = 0; k < MAX_PER_LANE; k++) {
                    if (k < per && lane + 32 * k < head_dim) {
                        sum[k] = fmaf(ws, __ldcg(vals + 32 * k), sum[k]);
                    }
                }
            }
        }
        long o = ((long)t * n_heads + h0 + warp) * head_dim;
        float inv = 1.0f / total;
#pragma unroll
        for (int k = 0; k < MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (k < per && d < head_dim) {
                st(out, o + d, odt, sum[k] * inv);
            }
        }
    }
}
