// Native engine, CUDA backend: sampling on the device. One block per sampled row reads the
// row's logits (f32, [rows][vocab]) and its parameters from the step's input area and writes
// only the token, its log-probability and the top log-probabilities a request asked for.
//
// The order is the CPU sampler's (`sampler.rs`, itself llama.cpp's): the allowed-token mask,
// log-probabilities of that distribution, logit bias, penalties, then argmax, or top-k ->
// top-p -> min-p -> temperature -> a draw. Top-k and top-p find their threshold by radix
// select (four passes of a 256-bin histogram of order-preserving keys, counting tokens for
// top-k and probability mass for top-p) instead of sorting the vocabulary. The draw inverts
// the kept tokens' cumulative distribution: each thread sums the tempered weights of its
// tokens, a block scan gives each thread its share of [0, total), one uniform from
// Philox-4x32-10 (keyed by the request's seed, counted by the sequence's draw index) picks the
// share, and its thread walks its tokens to the one. The order of the walk is fixed by the
// vocabulary and the block size, not the batch, so a seeded sequence draws the same whatever
// batch it is in.
//
// One block reads a whole row (1 MiB of logits for a 262,144-token vocabulary), so a pass is
// bound by how many loads the block keeps in flight, not by the memory's bandwidth: every pass
// goes through `for_row`, which reads 16-byte vectors four at a time ahead of using them.

// Parameter words of a row (`cuda/pack.rs` writes them).
#define P_FLAGS 0
#define P_TEMP 1
#define P_TOP_K 2
#define P_TOP_P 3
#define P_MIN_P 4
#define P_REP 5
#define P_FREQ 6
#define P_PRES 7
#define P_SEED_LO 8
#define P_SEED_HI 9
#define P_DRAW_LO 10
#define P_DRAW_HI 11
#define P_ADJ_OFF 12
#define P_ADJ_LEN 13
#define P_MASK 14
#define P_N_TOP 15
#define P_WORDS 16

#define F_GREEDY 1
#define F_LOGPROB 2
#define F_SKIP 4

// Output words of a row: token, logprob, then up to 20 (id, logprob) pairs, id -1 ending.
#define OUT_WORDS 42
#define MAX_TOP 20

#define SAMPLE_THREADS 1024

__device__ __forceinline__ uint4 philox(uint2 key, uint4 c) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        u32 hi0 = __umulhi(0xD2511F53u, c.x);
        u32 lo0 = 0xD2511F53u * c.x;
        u32 hi1 = __umulhi(0xCD9E8D57u, c.z);
        u32 lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
        key.x += 0x9E3779B9u;
        key.y += 0xBB67AE85u;
    }
    return c;
}

// A uniform in [0, 1) with 53 random bits for (seed, draw).
__device__ __forceinline__ double uniform01(const u32* p) {
    uint2 key = make_uint2(p[P_SEED_LO], p[P_SEED_HI]);
    uint4 c = philox(key, make_uint4(0u, p[P_DRAW_LO], p[P_DRAW_HI], 0x5eedu));
    return ((double)(c.x >> 5) * 67108864.0 + (double)(c.y >> 6)) * (1.0 / 9007199254740992.0);
}

// Exclusive prefix sum of one double per thread over the block (blockDim.x a multiple of 32,
// at most 1024): `excl` gets every thread's start (blockDim.x + 1 entries, the last one the
// total). `warp_tot` holds 32.
__device__ void block_exclusive_scan(double v, double* excl, double* warp_tot) {
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    double inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        double o = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) {
            inc += o;
        }
    }
    __syncthreads();
    if (lane == 31) {
        warp_tot[warp] = inc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nw = blockDim.x >> 5;
        double run = 0.0;
        for (int w = 0; w < nw; w++) {
            double t = warp_tot[w];
            warp_tot[w] = run;
            run += t;
        }
        excl[blockDim.x] = run;
    }
    __syncthreads();
    excl[threadIdx.x] = warp_tot[warp] + inc - v;
    __syncthreads();
}

// Order-preserving key of a float (larger float, larger key).
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float row_value(const float* l, const u32* mask, int i) {
    if (mask && !((mask[i >> 5] >> (i & 31)) & 1u)) {
        return NEG_INF;
    }
    return l[i];
}

// Visit a row's values in the sampler's one fixed order: thread t owns the groups of four tokens
// g = t, t + blockDim.x, t + 2 blockDim.x, ... (tokens 4g .. 4g + 3), masked tokens as -inf.
// `f(i, v)` returns false to stop this thread's visit. Four groups are loaded (as float4 where
// the row allows) before any is used, so each thread keeps four 16-byte loads in flight.
template <typename F>
__device__ __forceinline__ void for_row(const float* l, const u32* mask, int vocab, F f) {
    int groups = (vocab + 3) >> 2;
    bool vec = (vocab & 3) == 0;
    for (int g0 = threadIdx.x; g0 < groups; g0 += 4 * blockDim.x) {
        float v[4][4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int g = g0 + u * blockDim.x;
            if (vec && g < groups) {
                float4 q = ((const float4*)l)[g];
                v[u][0] = q.x;
                v[u][1] = q.y;
                v[u][2] = q.z;
                v[u][3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int i = 4 * g + j;
                    v[u][j] = g < groups && i < vocab ? l[i] : NEG_INF;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int g = g0 + u * blockDim.x;
            if (g >= groups) {
                return;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int i = 4 * g + j;
                if (i >= vocab) {
                    return;
                }
                float x = v[u][j];
                if (mask && !((mask[i >> 5] >> (i & 31)) & 1u)) {
                    x = NEG_INF;
                }
                if (!f(i, x)) {
                    return;
                }
            }
        }
    }
}

// The key K with weight(key > K) < target <= weight(key >= K) among finite values whose key
// is >= lower, where weight is 1 per token (by_mass 0) or exp(v - mx) (by_mass 1).
__device__ u32 radix_select(const float* l, const u32* mask, int vocab, u32 lower, float target,
                            int by_mass, float mx, float* hist, u32* shared_state) {
    u32 prefix = 0, pmask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            hist[b] = 0.0f;
        }
        __syncthreads();
        for_row(l, mask, vocab, [&](int, float v) {
            if (v != NEG_INF) {
                u32 key = fkey(v);
                if (key >= lower && (key & pmask) == prefix) {
                    atomicAdd(&hist[(key >> shift) & 255u], by_mass ? expf(v - mx) : 1.0f);
                }
            }
            return true;
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            float cum = 0.0f;
            int digit = -1, last = 0;
            for (int b = 255; b >= 0; b--) {
                if (hist[b] > 0.0f) {
                    last = b;
                    if (cum + hist[b] >= target) {
                        digit = b;
                        target -= cum;
                        break;
                    }
                    cum += hist[b];
                }
            }
            if (digit < 0) {
                // Rounding left the target above what is there: take the lowest bucket.
                digit = last;
                target = 0.0f;
            }
            shared_state[0] = prefix | ((u32)digit << shift);
            shared_state[1] = __float_as_uint(target);
        }
        __syncthreads();
        prefix = shared_state[0];
        target = __uint_as_float(shared_state[1]);
        pmask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample(float* logits, int vocab, const int* in, float* adj_orig, int* out) {
    __shared__ float fpart[32];
    __shared__ int ipart[32];
    __shared__ double dpart[32];
    __shared__ float hist[256];
    __shared__ u32 state[2];
    __shared__ double excl[SAMPLE_THREADS + 1];
    __shared__ int chosen;
    int row = blockIdx.x;
    if (row >= in[IN_N_ROWS]) {
        return;
    }
    const u32* p = (const u32*)(in + in[IN_PARAMS]) + (long)row * P_WORDS;
    int* o = out + (long)row * OUT_WORDS;
    u32 flags = p[P_FLAGS];
    if (flags & F_SKIP) {
        if (threadIdx.x == 0) {
            o[0] = -2;
        }
        return;
    }
    float* l = logits + (long)row * vocab;
    int mslot = (int)p[P_MASK];
    const u32* mask =
        mslot >= 0 ? (const u32*)(in + in[IN_MASKS]) + (long)mslot * in[IN_MASK_WORDS] : 0;
    int n_top = min((int)p[P_N_TOP], MAX_TOP);
    bool want_lp = (flags & F_LOGPROB) || n_top > 0;

    // Log-probabilities of the masked distribution, before bias and penalties.
    float lse = 0.0f;
    if (want_lp) {
        float mx = NEG_INF;
        for_row(l, mask, vocab, [&](int, float v) {
            mx = fmaxf(mx, v);
            return true;
        });
        int dummy = 0;
        block_argmax(mx, dummy, fpart, ipart);
        double s = 0.0;
        for_row(l, mask, vocab, [&](int, float v) {
            if (v != NEG_INF) {
                s += (double)expf(v - mx);
            }
            return true;
        });
        s = block_sum(s, dpart);
        lse = mx + (float)log(s);
        float pv = POS_INF;
        int pi = -1;
        for (int j = 0; j < MAX_TOP; j++) {
            if (j >= n_top) {
                if (threadIdx.x == 0) {
                    o[2 + 2 * j] = -1;
                }
                continue;
            }
            float bv = NEG_INF;
            int bi = 0x7fffffff;
            for_row(l, mask, vocab, [&](int i, float v) {
                bool after = v < pv || (v == pv && i > pi);
                if (v != NEG_INF && after && better(v, i, bv, bi)) {
                    bv = v;
                    bi = i;
                }
                return true;
            });
            block_argmax(bv, bi, fpart, ipart);
            if (threadIdx.x == 0) {
                o[2 + 2 * j] = bv == NEG_INF ? -1 : bi;
                o[3 + 2 * j] = __float_as_int(bv - lse);
            }
            pv = bv;
            pi = bi;
        }
    } else if (threadIdx.x == 0) {
        o[2] = -1;
    }

    // Logit bias and penalties, in place (the originals kept for the log-probability).
    int adj_off = (int)p[P_ADJ_OFF];
    int adj_len = (int)p[P_ADJ_LEN];
    const int* adj = in + in[IN_ADJ] + 3 * adj_off;
    float rep = __uint_as_float(p[P_REP]);
    float freq = __uint_as_float(p[P_FREQ]);
    float pres = __uint_as_float(p[P_PRES]);
    __syncthreads();
    for (int a = threadIdx.x; a < adj_len; a += blockDim.x) {
        int tok = adj[3 * a];
        int count = adj[3 * a + 1];
        float bias = __int_as_float(adj[3 * a + 2]);
        float v = row_value(l, mask, tok);
        adj_orig[adj_off + a] = v;
        float nv = v + bias;
        if (count > 0) {
            if (rep != 1.0f) {
                nv = nv > 0.0f ? nv / rep : nv * rep;
            }
            nv -= (float)count * freq + pres;
        }
        l[tok] = nv;
    }
    __syncthreads();

    int token;
    if (flags & F_GREEDY) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for_row(l, mask, vocab, [&](int i, float v) {
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
            return true;
        });
        block_argmax(bv, bi, fpart, ipart);
        token = bv == NEG_INF ? -1 : bi;
    } else {
        float mx = NEG_INF;
        float finite = 0.0f;
        for_row(l, mask, vocab, [&](int, float v) {
            mx = fmaxf(mx, v);
            finite += v != NEG_INF ? 1.0f : 0.0f;
            return true;
        });
        int dummy = 0;
        block_argmax(mx, dummy, fpart, ipart);
        finite = block_sum(finite, fpart);
        u32 lower = 0;
        int top_k = (int)p[P_TOP_K];
        if (mx != NEG_INF && top_k > 0 && (float)top_k < finite) {
            lower = radix_select(l, mask, vocab, 0, (float)top_k, 0, mx, hist, state);
        }
        float top_p = __uint_as_float(p[P_TOP_P]);
        if (mx != NEG_INF && top_p < 1.0f) {
            float z = 0.0f;
            for_row(l, mask, vocab, [&](int, float v) {
                if (v != NEG_INF && fkey(v) >= lower) {
                    z += expf(v - mx);
                }
                return true;
            });
            z = block_sum(z, fpart);
            lower = radix_select(l, mask, vocab, lower, top_p * z, 1, mx, hist, state);
        }
        float min_p = __uint_as_float(p[P_MIN_P]);
        float inv_t = 1.0f / fmaxf(__uint_as_float(p[P_TEMP]), 1e-6f);
        // Each thread's tempered weight of its kept tokens (its groups of four, as for_row
        // visits them).
        double own = 0.0;
        auto kept = [&](float v) {
            return v != NEG_INF && fkey(v) >= lower && !(min_p > 0.0f && expf(v - mx) < min_p);
        };
        for_row(l, mask, vocab, [&](int, float v) {
            if (kept(v)) {
                own += (double)expf((v - mx) * inv_t);
            }
            return true;
        });
        block_exclusive_scan(own, excl, dpart);
        double total = excl[blockDim.x];
        double target = uniform01(p) * total;
        if (threadIdx.x == 0) {
            chosen = -1;
        }
        __syncthreads();
        double lo = excl[threadIdx.x];
        if (mx != NEG_INF && lo <= target && target < excl[threadIdx.x + 1]) {
            // This thread's share holds the target: walk its tokens in the same order. Where
            // rounding leaves the target past the walk, its last kept token is the one.
            double cum = lo;
            int pick = -1;
            for_row(l, mask, vocab, [&](int i, float v) {
                if (!kept(v)) {
                    return true;
                }
                pick = i;
                cum += (double)expf((v - mx) * inv_t);
                return cum <= target;
            });
            chosen = pick;
        }
        __syncthreads();
        token = chosen;
    }
    if (threadIdx.x == 0) {
        o[0] = token;
        float lp = __int_as_float(0x7fc00000);
        if ((flags & F_LOGPROB) && token >= 0) {
            float v = row_value(l, mask, token);
            for (int a = 0; a < adj_len; a++) {
                if (adj[3 * a] == token) {
                    v = adj_orig[adj_off + a];
                }
            }
            lp = v - lse;
        }
        o[1] = __float_as_int(lp);
    }
}
