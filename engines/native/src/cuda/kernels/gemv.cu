// Native engine, CUDA backend: the matrix products of small decode batches (`cuda/gemm.rs`
// picks these kernels for one or two tokens and 16-bit weights, cuBLAS otherwise).
//
// y[t][r] = sum_c W[r][c] * x[t][c] for the m tokens t: W is [rows][cols] in f16 or bf16, x
// [m][cols] in the same type, y [m][rows] f32 (as cuBLAS writes it). With a few tokens a
// product reads its weights once and does little else, so what counts is keeping enough loads
// in flight: each warp takes GEMV_ROWS rows of W, and each lane issues the 16-byte loads of
// GEMV_UNROLL chunks of every one of its rows, and of the tokens' inputs at the same columns,
// before using any of them. A product with few rows (an output or down projection) would leave
// the GPU with too few warps, so `split` warps of a block (1, 2 or GEMV_WARPS, chosen on the
// host) share a warp's rows, each over every split-th stretch of columns, and add their sums in
// shared memory. gemv<M> is compiled for M = 1 and 2 tokens (the host takes the
// smallest that holds m; for 4 and 8 tokens it lost to cuBLAS on an H200). cols % 8 == 0 and
// every row 16-byte aligned (checked on the host).

#define GEMV_ROWS 4
#define GEMV_UNROLL 2
// Warps per block (`GEMV_WARPS` on the host).
#define GEMV_WARPS 4

template <int M>
__device__ __forceinline__ void gemv_rows(const u16* __restrict__ w, const u16* __restrict__ x,
                                          float* __restrict__ y, int rows, int cols, int m,
                                          int dt, int split) {
    __shared__ float red[GEMV_WARPS][GEMV_ROWS][M];
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int part = warp % split;
    long r0 = ((long)blockIdx.x * (GEMV_WARPS / split) + warp / split) * GEMV_ROWS;
    if (r0 >= rows && split == 1) {
        return;
    }
    // Rows past the end: a split block's warps still meet at its barrier.
    int nv = r0 < rows ? cols >> 3 : 0;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int k = 0; k < GEMV_ROWS; k++) {
        // Rows past the end read the last row again and are not stored.
        long r = min(r0 + k, (long)rows - 1);
        wr[k] = (const uint4*)(w + r * cols);
    }
    float acc[GEMV_ROWS][M];
#pragma unroll
    for (int k = 0; k < GEMV_ROWS; k++) {
#pragma unroll
        for (int t = 0; t < M; t++) {
            acc[k][t] = 0.0f;
        }
    }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int i0 = lane + 32 * GEMV_UNROLL * part; i0 < nv; i0 += 32 * GEMV_UNROLL * split) {
        uint4 wq[GEMV_ROWS][GEMV_UNROLL];
        uint4 xq[M][GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int i = i0 + 32 * u;
            bool ok = i < nv;
#pragma unroll
            for (int k = 0; k < GEMV_ROWS; k++) {
                wq[k][u] = ok ? wr[k][i] : zero;
            }
#pragma unroll
            for (int t = 0; t < M; t++) {
                xq[t][u] = ok && t < m ? ((const uint4*)(x + (long)t * cols))[i] : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
#pragma unroll
            for (int k = 0; k < GEMV_ROWS; k++) {
                float wf[8];
                unpack8(wq[k][u], dt, wf);
#pragma unroll
                for (int t = 0; t < M; t++) {
                    float xf[8];
                    unpack8(xq[t][u], dt, xf);
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        acc[k][t] = fmaf(wf[j], xf[j], acc[k][t]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < GEMV_ROWS; k++) {
#pragma unroll
        for (int t = 0; t < M; t++) {
            float v = acc[k][t];
            for (int off = 16; off > 0; off >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, off);
            }
            acc[k][t] = v;
        }
    }
    if (split > 1) {
        if (lane == 0) {
#pragma unroll
            for (int k = 0; k < GEMV_ROWS; k++) {
#pragma unroll
                for (int t = 0; t < M; t++) {
                    red[warp][k][t] = acc[k][t];
                }
            }
        }
        __syncthreads();
        if (part != 0) {
            return;
        }
        for (int j = 1; j < split; j++) {
#pragma unroll
            for (int k = 0; k < GEMV_ROWS; k++) {
#pragma unroll
                for (int t = 0; t < M; t++) {
                    acc[k][t] += red[warp + j][k][t];
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < GEMV_ROWS; k++) {
#pragma unroll
            for (int t = 0; t < M; t++) {
                if (r0 + k < rows && t < m) {
                    y[(long)t * rows + r0 + k] = acc[k][t];
                }
            }
        }
    }
}

extern "C" __global__ void gemv1(const u16* w, const u16* x, float* y, int rows, int cols, int m,
                                 int dt, int split) {
    gemv_rows<1>(w, x, y, rows, cols, m, dt, split);
}

extern "C" __global__ void gemv2(const u16* w, const u16* x, float* y, int rows, int cols, int m,
                                 int dt, int split) {
    gemv_rows<2>(w, x, y, rows, cols, m, dt, split);
}
