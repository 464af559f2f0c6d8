// Native engine, CUDA backend: what every kernel file shares. The files are concatenated in
// one NVRTC program (`cuda/nvrtc.rs`): this one first, then layer.cu, attention.cu, gemv.cu,
// sample.cu.
//
// No headers are included (NVRTC gets no include path in the image): the f16 conversions are
// single PTX instructions, bf16 is the top half of an f32, and -inf is spelled by its bits.
//
// dtype codes shared with the host: 0 = f32, 1 = f16, 2 = bf16. Activations that feed a
// matrix product and the K/V cache are in the model's 16-bit type (f32 for f32 checkpoints);
// the residual stream, the products' outputs and the logits are f32.
//
// Every per-step value a kernel needs is read from the step's input area on the device (`in`,
// written by one host copy per step): a header of word offsets, then the sections. So a
// captured CUDA graph replays any step of the same batch size. Sizes are ints: the host checks
// every count against i32.

typedef unsigned short u16;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// The input area's header: word offsets of its sections (`cuda/pack.rs` writes it).
#define IN_N_TOKENS 0
#define IN_TOKENS 1
#define IN_POSITIONS 2
#define IN_CELLS 3
#define IN_SEQ_OF 4
#define IN_TABLE_OFF 5
#define IN_TABLES 6
#define IN_ROWS 7
#define IN_PARAMS 8
#define IN_ADJ 9
#define IN_MASKS 10
#define IN_MASK_WORDS 11
#define IN_N_ROWS 12

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept NaN (as torch and ggml round).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
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

__device__ __forceinline__ float ld(const void* p, long i, int dt) {
    if (dt == 0) {
        return ((const float*)p)[i];
    }
    if (dt == 1) {
        return f16_to_f32(((const u16*)p)[i]);
    }
    return bf16_to_f32(((const u16*)p)[i]);
}

__device__ __forceinline__ void st(void* p, long i, int dt, float v) {
    if (dt == 0) {
        ((float*)p)[i] = v;
    } else if (dt == 1) {
        ((u16*)p)[i] = f32_to_f16(v);
    } else {
        ((u16*)p)[i] = f32_to_bf16(v);
    }
}

// Eight 16-bit values (f16 for dt 1, bf16 otherwise) of one 16-byte load, as f32.
__device__ __forceinline__ void unpack8(uint4 q, int dt, float* f) {
    u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u16 lo = (u16)(w[i] & 0xffffu);
        u16 hi = (u16)(w[i] >> 16);
        f[2 * i] = dt == 1 ? f16_to_f32(lo) : bf16_to_f32(lo);
        f[2 * i + 1] = dt == 1 ? f16_to_f32(hi) : bf16_to_f32(hi);
    }
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)(n); \
         i += (long)gridDim.x * blockDim.x)

// Sum over the block (any size up to 1024); every thread gets the total. `part` holds 32.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* part) {
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        part[warp] = v;
    }
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    T s = 0;
    for (int w = 0; w < nw; w++) {
        s += part[w];
    }
    return s;
}

// (value, index) pairs: the larger value wins, the lower index on a tie.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Argmax over the block; every thread gets the winner. `pv`/`pi` hold 32 each.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* pv, int* pi) {
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, off);
        int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        pv[warp] = v;
        pi[warp] = i;
    }
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = pv[0];
    i = pi[0];
    for (int w = 1; w < nw; w++) {
        if (better(pv[w], pi[w], v, i)) {
            v = pv[w];
            i = pi[w];
        }
    }
}
