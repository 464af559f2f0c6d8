// Native engine, CUDA backend: the element-wise kernels of one decoder layer, each fused with
// its neighbours so a layer is three products and six kernels: the embedding, the residual add
// with the norms around it, the q/k norms with RoPE and the K/V append, the gated activation.
// The arithmetic follows the CPU backend's (`cpu/ops.rs`): RMSNorm's mean in double,
// rotate-half RoPE with f32 angles.

__device__ __forceinline__ float norm_w(const float* w, int d, int plus_one) {
    return plus_one ? 1.0f + w[d] : w[d];
}

// Values of a row each thread of a norm holds in registers: rows up to NORM_PER x 1024 wide
// (`MAX_HIDDEN` on the host). Thread i owns values i, i + blockDim.x, ...: every load of the
// row is issued before the first sum needs one.
#define NORM_PER 8

// x[t] = table[token t] * scale (the residual stream, f32), and h[t] = RMSNorm(x[t]) * w in
// the activation type (the first layer's input norm). One block per token.
extern "C" __global__ void __launch_bounds__(1024)
embed_norm(const void* table, int tdt, const int* in, float* x, const float* w, void* h, int hdt,
           int dim, float scale, float eps, int plus_one) {
    __shared__ double part[32];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    long row = (long)in[in[IN_TOKENS] + t] * dim;
    float* xr = x + (long)t * dim;
    float v[NORM_PER];
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        v[k] = d < dim ? ld(table, row + d, tdt) * scale : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d < dim) {
            xr[d] = v[k];
            ss += (double)(v[k] * v[k]);
        }
    }
    ss = block_sum(ss, part);
    float r = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d < dim) {
            st(h, (long)t * dim + d, hdt, v[k] * r * norm_w(w, d, plus_one));
        }
    }
}

// The end of a sub-layer: y = d (+ bias) (RMSNorm'd by post_w when given: Gemma's sandwich
// norms), x += y, then h = RMSNorm(x) * next_w in the activation type (the next sub-layer's
// input, or the final norm). One block per token; the row stays in registers between the sums.
// Tokens past the step's count are left alone.
extern "C" __global__ void __launch_bounds__(1024)
residual_norm(float* x, const float* dlt, const float* bias, const float* post_w,
              const float* next_w, void* h, int hdt, int dim, float eps, int plus_one,
              const int* in) {
    __shared__ double part[32];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    float* xr = x + (long)t * dim;
    const float* dr = dlt + (long)t * dim;
    float v[NORM_PER];
    float xv[NORM_PER];
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        v[k] = 0.0f;
        xv[k] = 0.0f;
        if (d < dim) {
            v[k] = dr[d] + (bias ? bias[d] : 0.0f);
            xv[k] = xr[d];
        }
    }
    if (post_w) {
        double ss = 0.0;
#pragma unroll
        for (int k = 0; k < NORM_PER; k++) {
            ss += (double)(v[k] * v[k]);
        }
        ss = block_sum(ss, part);
        float dscale = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
#pragma unroll
        for (int k = 0; k < NORM_PER; k++) {
            int d = threadIdx.x + k * blockDim.x;
            if (d < dim) {
                v[k] = v[k] * dscale * norm_w(post_w, d, plus_one);
            }
        }
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d < dim) {
            xv[k] += v[k];
            xr[d] = xv[k];
            ss += (double)(xv[k] * xv[k]);
        }
    }
    ss = block_sum(ss, part);
    float r = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        int d = threadIdx.x + k * blockDim.x;
        if (d < dim) {
            st(h, (long)t * dim + d, hdt, xv[k] * r * norm_w(next_w, d, plus_one));
        }
    }
}

// After the fused QKV product (qkv is [token][q heads | k heads | v heads] x head_dim, f32):
// the bias, the per-head q/k RMSNorm where the model has one, RoPE on q and k, then q back in
// place and K/V appended to the cache at the token's cell in the cache's type. One block per
// (token, head slot): slots [0, nh) are query heads, [nh, nh + nkv) the K/V heads. A block's
// threads take the rotary pairs (i, i + half).
extern "C" __global__ void qkv_rope_store(float* qkv, const float* bias, const float* q_norm,
                                          const float* k_norm, const float* inv_freq,
                                          float factor, void* k_cache, void* v_cache, int kvdt,
                                          int nh, int nkv, int hd, float eps, int plus_one,
                                          const int* in) {
    __shared__ double part[32];
    int t = blockIdx.x;
    if (t >= in[IN_N_TOKENS]) {
        return;
    }
    int slot = blockIdx.y;
    int half = hd / 2;
    long stride = (long)(nh + 2 * nkv) * hd;
    bool is_q = slot < nh;
    int col = is_q ? slot * hd : nh * hd + (slot - nh) * hd;
    float* head = qkv + (long)t * stride + col;
    const float* nw = is_q ? q_norm : k_norm;
    int k = threadIdx.x;
    float x1 = 0.0f, x2 = 0.0f;
    if (k < half) {
        x1 = head[k] + (bias ? bias[col + k] : 0.0f);
        x2 = head[k + half] + (bias ? bias[col + k + half] : 0.0f);
    }
    if (nw) {
        double ss = k < half ? (double)(x1 * x1) + (double)(x2 * x2) : 0.0;
        ss = block_sum(ss, part);
        float r = (float)(1.0 / sqrt(ss / (double)hd + (double)eps));
        if (k < half) {
            x1 = x1 * r * norm_w(nw, k, plus_one);
            x2 = x2 * r * norm_w(nw, k + half, plus_one);
        }
    }
    if (k >= half) {
        return;
    }
    int pos = in[in[IN_POSITIONS] + t];
    float a = (float)pos * inv_freq[k];
    float c = cosf(a) * factor;
    float s = sinf(a) * factor;
    float y1 = x1 * c - x2 * s;
    float y2 = x2 * c + x1 * s;
    if (is_q) {
        head[k] = y1;
        head[k + half] = y2;
        return;
    }
    int g = slot - nh;
    long at = ((long)in[in[IN_CELLS] + t] * nkv + g) * hd;
    st(k_cache, at + k, kvdt, y1);
    st(k_cache, at + k + half, kvdt, y2);
    const float* vh = qkv + (long)t * stride + nh * hd + nkv * hd + g * hd;
    int vcol = nh * hd + nkv * hd + g * hd;
    st(v_cache, at + k, kvdt, vh[k] + (bias ? bias[vcol + k] : 0.0f));
    st(v_cache, at + k + half, kvdt, vh[k + half] + (bias ? bias[vcol + k + half] : 0.0f));
}

// out[t][c] = act(gate[t][c] + bg) * (up[t][c] + bu) in the activation type, from the fused
// gate/up product ([token][gate ff | up ff], f32). kind 0: SiLU, 1: GELU (tanh approximation).
extern "C" __global__ void gated_act(const float* gu, const float* bias, void* out, int odt,
                                     int ff, int kind, const int* in) {
    long n = (long)in[IN_N_TOKENS] * ff;
    FOR_EACH(i, n) {
        long t = i / ff;
        int c = (int)(i % ff);
        float g = gu[t * 2 * ff + c] + (bias ? bias[c] : 0.0f);
        float u = gu[t * 2 * ff + ff + c] + (bias ? bias[ff + c] : 0.0f);
        float a;
        if (kind == 0) {
            a = g / (1.0f + expf(-g));
        } else {
            float y = 0.7978846f * (g + 0.044715f * g * g * g);
            a = 0.5f * g * (1.0f + tanhf(y));
        }
        st(out, i, odt, a * u);
    }
}

// out[r] = h[rows[r]] (rows of `dim`, the activation type): the tokens whose logits a prompt
// step wants.
extern "C" __global__ void gather_rows(const void* h, int dt, const int* in, void* out,
                                       int dim) {
    long n = (long)in[IN_N_ROWS] * dim;
    const int* rows = in + in[IN_ROWS];
    FOR_EACH(i, n) {
        long r = i / dim;
        st(out, i, dt, ld(h, (long)rows[r] * dim + i % dim, dt));
    }
}

// x = cap * tanh(x / cap) over the first n values (final logit soft-capping).
extern "C" __global__ void softcap(float* x, float cap, long n) {
    FOR_EACH(i, n) {
        x[i] = tanhf(x[i] / cap) * cap;
    }
}

// Copy n 16-bit words from offset src to offset dst of one buffer (prefix reuse's copy on
// write of K/V blocks: different blocks, never overlapping).
extern "C" __global__ void copy_u16(u16* buf, long src, long dst, long n) {
    FOR_EACH(i, n) {
        buf[dst + i] = buf[src + i];
    }
}
