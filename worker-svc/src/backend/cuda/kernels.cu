// kvlease worker kernels, compiled at run time with NVRTC. The host
// prepends `#define`s for HEAD_DIM, GROUP (query heads per KV head),
// KV_HEADS, TOKENS_PER_BLOCK and KV_F16, KV_BF16 or KV_FP8 (element type
// of the arena). The residual stream, Q/K/V and logits are f32; the inputs
// of the matrix products (normed rows, attention output, SwiGLU output) are
// bf16, like the weights; the arena stores 16-bit K/V, or fp8 (e4m3, no
// scale: values saturate at +-448) when KV_FP8 is defined (sm_89 or newer).

#define D HEAD_DIM
#define G GROUP
#define B TOKENS_PER_BLOCK
#define NEG_INF __int_as_float(0xff800000)

#ifdef KV_FP8
typedef unsigned char kv_t;
#else
typedef unsigned short kv_t;
#endif

// Widest load that divides a head row: 8, 4 or 2 elements.
#if (D % 8) == 0
#define VEC 8
#ifdef KV_FP8
typedef uint2 vec_t;
#else
typedef uint4 vec_t;
#endif
#elif (D % 4) == 0
#define VEC 4
#ifdef KV_FP8
typedef unsigned int vec_t;
#else
typedef uint2 vec_t;
#endif
#else
#define VEC 2
#ifdef KV_FP8
typedef unsigned short vec_t;
#else
typedef unsigned int vec_t;
#endif
#endif
#define CH (D / VEC)
// Columns of an output head row per lane.
#define COLS ((D + 31) / 32)
// Padded row of the K/V tiles in shared memory, in elements.
#define ROW (D + 8)

// The 16-bit type of the attention's tensor-core operands: the arena's, or
// f16 for an fp8 arena (every e4m3 value is exact in f16).
#if defined(KV_F16) || defined(KV_FP8)
#define OPERAND_F16 1
#endif

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// An operand (f16 or bf16 bits) as f32.
__device__ __forceinline__ float operand_to_f32(unsigned short h) {
#ifdef OPERAND_F16
    return f16_to_f32(h);
#else
    return __uint_as_float(((unsigned int)h) << 16);
#endif
}

#ifdef KV_FP8
// Two e4m3 values (x0 in the low byte) as a packed f16 pair (x0 low).
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned short x) {
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
    return r;
}

__device__ __forceinline__ float kv_to_f32(unsigned char b) {
    return f16_to_f32((unsigned short)(fp8x2_to_f16x2((unsigned short)b) & 0xffffu));
}
#else
__device__ __forceinline__ float kv_to_f32(unsigned short h) { return operand_to_f32(h); }
#endif

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ kv_t f32_to_kv(float f) {
#if defined(KV_FP8)
    // Round to nearest even, finite values past 448 saturate; NaN stays NaN.
    unsigned short h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(f));
    return (kv_t)(h & 0xffu);
#elif defined(KV_F16)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return f32_to_bf16(f);
#endif
}

// bf16 bits: the element type of the products' inputs.
typedef unsigned short act_t;

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A row's attention output when its keys make one split: what
// `combine_splits` computes from that split alone (its max is the split's,
// so every scale is exp2f(0) = 1 and the sums start from 0), bit for bit,
// so a row gives the same bits whether its batch needed splits or not.
__device__ __forceinline__ unsigned short final_out(float o, float l) {
    return f32_to_bf16((0.0f + o * 1.0f) / (0.0f + l * 1.0f));
}

// 1 / rms of a row of h values from each thread's share `s` of its sum of
// squares, for every thread of the block (at most 1024 threads, a whole
// number of warps).
__device__ __forceinline__ float rms_from_partials(float s, int h, float eps) {
    __shared__ float partial[32];
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) partial[0] = v;
    }
    __syncthreads();
    return rsqrtf(partial[0] / (float)h + eps);
}

// 1 / rms(row) over h values, for every thread of the block.
__device__ __forceinline__ float rms_scale(const float* row, int h, float eps) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s += row[i] * row[i];
    return rms_from_partials(s, h, eps);
}

// x[r] = table[tokens[r]] * scale (Gemma scales by sqrt(hidden), others
// by 1); one block per row.
extern "C" __global__ void embed(const float* __restrict__ table,
                                 const unsigned int* __restrict__ tokens,
                                 float* __restrict__ x, int h, float scale) {
    const int r = blockIdx.x;
    const float* src = table + (unsigned long long)tokens[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        x[(unsigned long long)r * h + i] = src[i] * scale;
    }
}

// Before RoPE, in place over each row of qkv (Q | K | V heads of D): the
// Q/K/V biases when has_bias (Qwen2; `bias` holds the (q_heads + 2 KV_HEADS)
// * D of them), then when has_norm the per-head RMSNorm of every query head
// by q_norm and every key head by k_norm (Qwen3, Gemma 3). One block per
// row; warp w takes heads w, w + warps, ...
extern "C" __global__ void qkv_prep(float* __restrict__ qkv, int stride, int q_heads,
                                    int has_bias, const float* __restrict__ bias,
                                    int has_norm, const float* __restrict__ q_norm,
                                    const float* __restrict__ k_norm, float eps) {
    float* row = qkv + (unsigned long long)blockIdx.x * stride;
    const int heads = q_heads + 2 * KV_HEADS;
    if (has_bias) {
        for (int i = threadIdx.x; i < heads * D; i += blockDim.x) row[i] += bias[i];
        __syncthreads();
    }
    if (!has_norm) return;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int head = threadIdx.x >> 5; head < q_heads + KV_HEADS; head += warps) {
        float* x = row + head * D;
        const float* w = head < q_heads ? q_norm : k_norm;
        float s = 0.0f;
        for (int i = lane; i < D; i += 32) s += x[i] * x[i];
        s = warp_sum(s);
        const float scale = rsqrtf(s / (float)D + eps);
        for (int i = lane; i < D; i += 32) x[i] = x[i] * scale * w[i];
    }
}

// x[r] += y[r] / rms(y[r]) * w: a post-norm before the residual add
// (Gemma). One block of 256 threads per row.
extern "C" __global__ void rms_norm_add(float* __restrict__ x, const float* __restrict__ y,
                                        const float* __restrict__ w, int h, float eps) {
    const unsigned long long r = blockIdx.x;
    const float* row = y + r * h;
    const float scale = rms_scale(row, h, eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[r * h + i] += row[i] * scale * w[i];
}

// v = cap * tanh(v / cap) over n values (Gemma 2's final logit soft-cap).
extern "C" __global__ void soft_cap(float* __restrict__ v, long long n, float cap) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = tanhf(v[i] / cap) * cap;
}

// Four bf16 bits in the order of their elements, as one 8-byte store.
__device__ __forceinline__ uint2 pack_bf16x4(float a, float b, float c, float d) {
    return make_uint2((unsigned int)f32_to_bf16(a) | ((unsigned int)f32_to_bf16(b) << 16),
                      (unsigned int)f32_to_bf16(c) | ((unsigned int)f32_to_bf16(d) << 16));
}

// out[r] = x[src] / rms(x[src]) * w, src = rows[r] when use_rows else r,
// rounded to bf16 (the input of a product). One block of 256 threads per
// row; rows whose width is a multiple of 4 move as float4 (every buffer
// here starts an allocation, so such rows are 16-byte aligned).
extern "C" __global__ void rms_norm(const float* __restrict__ x,
                                    const unsigned int* __restrict__ rows, int use_rows,
                                    const float* __restrict__ w, act_t* __restrict__ out,
                                    int h, float eps) {
    const int r = blockIdx.x;
    const unsigned long long src = use_rows ? rows[r] : (unsigned int)r;
    const float* row = x + src * h;
    act_t* dst = out + (unsigned long long)r * h;
    if ((h & 3) != 0) {
        const float scale = rms_scale(row, h, eps);
        for (int i = threadIdx.x; i < h; i += blockDim.x) dst[i] = f32_to_bf16(row[i] * scale * w[i]);
        return;
    }
    const float4* row4 = (const float4*)row;
    const float4* w4 = (const float4*)w;
    const int h4 = h >> 2;
    float s = 0.0f;
    for (int i = threadIdx.x; i < h4; i += blockDim.x) {
        const float4 v = row4[i];
        s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float scale = rms_from_partials(s, h, eps);
    for (int i = threadIdx.x; i < h4; i += blockDim.x) {
        const float4 v = row4[i], g = w4[i];
        ((uint2*)dst)[i] = pack_bf16x4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
    }
}

// RoPE over the query and key heads of every row of qkv (in place), then
// the row's K and V into the arena: dst_base[r] is the element offset of
// the row's (block, slot) in the pool, layer_off that of the layer within a
// block (a block is runs of B * D elements per (K or V, KV head)). One
// block per row.
extern "C" __global__ void rope_write_kv(float* __restrict__ qkv, int stride, int q_heads,
                                         const int* __restrict__ positions,
                                         const float* __restrict__ inv_freq,
                                         const long long* __restrict__ dst_base,
                                         long long layer_off, kv_t* __restrict__ arena) {
    const int r = blockIdx.x;
    const float p = (float)positions[r];
    float* row = qkv + (unsigned long long)r * stride;
    const int half = D / 2;
    const long long base = dst_base[r] + layer_off;
    // every head turns by the same angles: each taken once per row
    __shared__ float turn_cos[D / 2], turn_sin[D / 2];
    for (int k = threadIdx.x; k < half; k += blockDim.x) sincosf(p * inv_freq[k], &turn_sin[k], &turn_cos[k]);
    __syncthreads();
    for (int i = threadIdx.x; i < (q_heads + KV_HEADS) * half; i += blockDim.x) {
        const int head = i / half, k = i % half;
        const float s = turn_sin[k], c = turn_cos[k];
        float* a = row + head * D + k;
        const float x1 = a[0], x2 = a[half];
        const float y1 = x1 * c - x2 * s;
        const float y2 = x2 * c + x1 * s;
        a[0] = y1;
        a[half] = y2;
        if (head >= q_heads) {
            kv_t* key = arena + base + (long long)(head - q_heads) * B * D + k;
            key[0] = f32_to_kv(y1);
            key[half] = f32_to_kv(y2);
        }
    }
    const float* v = row + (q_heads + KV_HEADS) * D;
    kv_t* values = arena + base + (long long)KV_HEADS * B * D;
    for (int i = threadIdx.x; i < KV_HEADS * D; i += blockDim.x) {
        values[(long long)(i / D) * B * D + i % D] = f32_to_kv(v[i]);
    }
}

// act(g): silu, or GELU with the tanh approximation when gelu is 1.
__device__ __forceinline__ float gate_act(float g, int gelu) {
    // sqrt(2 / pi) and 0.044715, as PyTorch's gelu(approximate="tanh").
    return gelu ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)))
                : g / (1.0f + __expf(-g));
}

// out[r][c] = act(gate) * up over rows [gate | up] of width 2f, in bf16
// (the input of the down product); out rows are f wide; act is silu, or
// GeLU (tanh) when gelu is 1 (Gemma's GeGLU). n = rows * f. When f is a
// multiple of 4 a thread takes 4 columns (float4 loads, one 8-byte store)
// and the launch covers n / 4 threads, else one column and n threads.
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, int f, int n,
                                  act_t* __restrict__ out, int gelu) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if ((f & 3) != 0) {
        if (i >= n) return;
        const int r = i / f, c = i % f;
        const float* row = gate_up + (unsigned long long)r * 2 * f;
        out[i] = f32_to_bf16(gate_act(row[c], gelu) * row[f + c]);
        return;
    }
    const int f4 = f >> 2;
    if (i >= (n >> 2)) return;
    const int r = i / f4, c = i % f4;
    const float4* row = (const float4*)(gate_up + (unsigned long long)r * 2 * f);
    const float4 g = row[c], u = row[f4 + c];
    ((uint2*)out)[i] = pack_bf16x4(gate_act(g.x, gelu) * u.x, gate_act(g.y, gelu) * u.y,
                                   gate_act(g.z, gelu) * u.z, gate_act(g.w, gelu) * u.w);
}

// Partial-block reuse: copies slots [0, n) of one block into another block
// of the same pool. A block is runs of B * D elements, one per (layer of the
// pool, K or V, KV head); one thread block per run copies its first n * D
// elements from src_base + run * B * D to dst_base + run * B * D. The blocks
// differ (checked on the host), so no element is both read and written.
extern "C" __global__ void copy_kv_slots(kv_t* arena, long long src_base, long long dst_base,
                                         int n) {
    const long long run = (long long)blockIdx.x * B * D;
    for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        arena[dst_base + run + i] = arena[src_base + run + i];
    }
}

// Paged attention, one warp per (key split, KV head, query row); rows come
// as groups of one (`group_first[z]` is the row of block z, less
// `row_base`, the first row of the launch). The warp
// attends the G query heads of its KV head over keys
// [lo + split * split_len, min(lo + (split + 1) * split_len, pos + 1)),
// lo = window start, in tiles of 32 keys staged in shared memory, with an
// online softmax in base 2 (queries arrive pre-scaled by log2(e)/sqrt(D)).
// Writes the unnormalised partial output and (max, sum) per split; or, when
// `out` is given (one split), the row's output itself (`final_out`).
extern "C" __global__ void __launch_bounds__(32)
paged_attention(const float* __restrict__ q, int q_stride, float scale,
                const kv_t* __restrict__ arena, long long layer_off, long long elems_per_block,
                const unsigned int* __restrict__ tables, const int* __restrict__ seq_table_off,
                const int* __restrict__ seq_first_block, const int* __restrict__ tok_seq,
                const int* __restrict__ tok_pos, const int* __restrict__ group_first,
                int row_base, int window, int split_len,
                float* __restrict__ part_o, float* __restrict__ part_ml,
                act_t* __restrict__ out, int out_stride) {
    // Groups of one row here: row group_first[z] - row_base.
    const int split = blockIdx.x, kvh = blockIdx.y, r = group_first[blockIdx.z] - row_base;
    const int num_splits = gridDim.x, heads = gridDim.y * G;
    const int lane = threadIdx.x;
    const int pos = tok_pos[r], s = tok_seq[r];
    const int lo = window == 0 ? 0 : max(0, pos - window + 1);
    const int begin = lo + split * split_len;
    const int end = min(begin + split_len, pos + 1);

    __shared__ __align__(16) float qs[G][D];
    __shared__ __align__(16) kv_t ks[32][ROW];
    __shared__ __align__(16) kv_t vs[32][ROW];
    for (int i = lane; i < G * D; i += 32) {
        qs[i / D][i % D] = q[(unsigned long long)r * q_stride + (unsigned long long)kvh * G * D + i] * scale;
    }
    __syncwarp();

    float m[G], l[G], acc[G][COLS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[g][c] = 0.0f;
    }
    const unsigned int* table = tables + seq_table_off[s];
    const int first_block = seq_first_block[s];
    const long long per_kv = (long long)KV_HEADS * B * D;
    const long long head_off = layer_off + (long long)kvh * B * D;

    // Software pipeline: the next tile's K/V loads are in flight while the
    // warp computes on the current tile in shared memory.
    vec_t kr[CH], vr[CH];
    auto load_tile = [&](int t0) {
        const int n = min(32, end - t0);
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int e = lane + i * 32, j = e / CH, c = e % CH;
            if (j < n) {
                const int p = t0 + j;
                const long long blk = table[p / B - first_block];
                const kv_t* src = arena + blk * elems_per_block + head_off + (p % B) * D + c * VEC;
                kr[i] = *(const vec_t*)src;
                vr[i] = *(const vec_t*)(src + per_kv);
            }
        }
    };
    if (begin < end) load_tile(begin);
    for (int t0 = begin; t0 < end; t0 += 32) {
        const int n = min(32, end - t0);
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int e = lane + i * 32, j = e / CH, c = e % CH;
            if (j < n) {
                *(vec_t*)&ks[j][c * VEC] = kr[i];
                *(vec_t*)&vs[j][c * VEC] = vr[i];
            }
        }
        __syncwarp();
        if (t0 + 32 < end) load_tile(t0 + 32);

        // Lane j scores key j against the G queries.
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) sc[g] = 0.0f;
        if (lane < n) {
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                union { vec_t v; kv_t h[VEC]; } u;
                u.v = *(const vec_t*)&ks[lane][c * VEC];
                float kf[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) kf[e] = kv_to_f32(u.h[e]);
#pragma unroll
                for (int g = 0; g < G; ++g) {
#if (VEC % 4) == 0
#pragma unroll
                    for (int e = 0; e < VEC; e += 4) {
                        const float4 qv = *(const float4*)&qs[g][c * VEC + e];
                        sc[g] += qv.x * kf[e] + qv.y * kf[e + 1] + qv.z * kf[e + 2] + qv.w * kf[e + 3];
                    }
#else
#pragma unroll
                    for (int e = 0; e < VEC; ++e) sc[g] += qs[g][c * VEC + e] * kf[e];
#endif
                }
            }
#ifdef ATTN_SOFTCAP
            // Scores are in base 2 (score * log2 e): cap the natural score,
            // cap * tanh(score / cap), in the same units.
            const float cap2 = ATTN_SOFTCAP * 1.4426950408889634f;
#pragma unroll
            for (int g = 0; g < G; ++g) sc[g] = cap2 * tanhf(sc[g] / cap2);
#endif
        } else {
#pragma unroll
            for (int g = 0; g < G; ++g) sc[g] = NEG_INF;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mn = fmaxf(m[g], warp_max(sc[g]));
            const float corr = exp2f(m[g] - mn);
            const float pr = lane < n ? exp2f(sc[g] - mn) : 0.0f;
            l[g] = l[g] * corr + warp_sum(pr);
#pragma unroll
            for (int c = 0; c < COLS; ++c) acc[g][c] *= corr;
            m[g] = mn;
            sc[g] = pr;
        }
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
            float vj[COLS];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int d = lane * COLS + c;
                vj[c] = d < D ? kv_to_f32(vs[j][d]) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pj = __shfl_sync(0xffffffffu, sc[g], j);
#pragma unroll
                for (int c = 0; c < COLS; ++c) acc[g][c] += pj * vj[c];
            }
        }
        __syncwarp();
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (out != nullptr) {
            act_t* dst = out + (unsigned long long)r * out_stride + (unsigned long long)(kvh * G + g) * D;
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int d = lane * COLS + c;
                if (d < D) dst[d] = final_out(acc[g][c], l[g]);
            }
            continue;
        }
        const unsigned long long idx = ((unsigned long long)r * heads + (unsigned long long)kvh * G + g) * num_splits + split;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const int d = lane * COLS + c;
            if (d < D) part_o[idx * D + d] = acc[g][c];
        }
        if (lane == 0) {
            part_ml[idx * 2] = m[g];
            part_ml[idx * 2 + 1] = l[g];
        }
    }
}

#if defined(ATTN_MMA)
// Paged attention on the tensor cores, for head widths of 64 or 128 and up
// to 8 query heads per KV head (the host defines ATTN_MMA only then, on
// sm_80 or newer). Same arguments and partial outputs as paged_attention.
//
// One CTA of MMA_WARPS warps per (key split, KV head, group of query rows).
// A group (rows group_first[z] - row_base .. group_first[z + 1] - row_base)
// is up to ROWS_CTA consecutive rows of one sequence, one row where the
// layer has a window; its rows share every K/V tile the CTA loads. Keys go in
// tiles of 16 positions aligned to multiples of 16; a split is split_len
// keys (a multiple of 16) from the tile of the window start. Warp w takes
// the split's tiles w, w + MMA_WARPS, ... through its own MMA_STAGES-deep
// cp.async pipeline of K and V tiles in shared memory (rows gathered from
// the block table, 16-byte chunks XOR-swizzled by row so ldmatrix is free
// of bank conflicts; rows outside [window start, pos] are zero-filled).
//
// Both products are mma.m16n8k16 with f32 accumulation. S = Q K^T: A rows
// 0-7 hold the query heads rounded to 16 bits (hi), rows 8-15 what that
// rounding lost (lo), so hi + lo carries the f32 query to ~16 mantissa bits;
// a lane's score is c0 + c2 (row g) and c1 + c3. O = P V: A rows 0-7 are
// the probabilities' hi halves, rows 8-15 their lo halves, and B comes from
// the V tile through ldmatrix.trans. A rows 0-7 hold PACK = 8 / G query
// rows of G heads each (A row g: row g / G, head g % G), and a warp runs
// MMA_FRAGS such A operands against each K and V tile it loads. Lane
// (g = lane / 4, c = lane % 4) holds scores of its (row, head) for keys 2c,
// 2c+1, 8+2c, 9+2c of a tile and the output columns 8n + 2c, +1; unused A
// rows are zero. A row's arithmetic is the same whatever shares its group
// (its own mask, its own online softmax; keys past its position score
// -inf and add exact zeros), so a row gives the same bits alone or in a
// group: batch invariance, and prefill rows equal to decode rows.
// At the end the warps merge their (max, sum, output) in shared memory and
// the CTA writes one partial per (row, query head).
#ifndef MMA_WARPS
#define MMA_WARPS 4
#endif
#ifndef MMA_STAGES
#define MMA_STAGES 3
#endif
#ifndef MMA_FRAGS
#define MMA_FRAGS 2
#endif
#define PACK (8 / G)
#define TILE 16
#define CHUNKS (D / 8)
#define TILE_ELEMS (TILE * D)
#define STAGE_ELEMS (2 * TILE_ELEMS)
#define KSTEPS (D / 16)
#define NTILES (D / 8)
#define MERGE_ROW (D + 4)
#ifdef KV_FP8
// A warp's shared memory: its stages of fp8 K/V tiles as loaded, then one K
// and V tile converted to f16 for ldmatrix.
#define WARP_SMEM (MMA_STAGES * STAGE_ELEMS + STAGE_ELEMS * 2)
#else
#define WARP_SMEM (MMA_STAGES * STAGE_ELEMS * 2)
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}

// 16 bytes global -> shared, bypassing L1; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

#ifdef KV_FP8
// 8 bytes global -> shared, through L1; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// A stage's fp8 K and V tiles (rows of D bytes, as loaded) into f16 tiles
// in the layout ldmatrix reads: 16-byte chunks XOR-swizzled by row.
__device__ __forceinline__ void widen_tiles(const unsigned char* raw, unsigned short* tile, int lane) {
#pragma unroll
    for (int i = 0; i < 2 * TILE * CHUNKS / 32; ++i) {
        const int e = lane + i * 32, kv = e / (TILE * CHUNKS), rest = e % (TILE * CHUNKS);
        const int row = rest / CHUNKS, ch = rest % CHUNKS;
        const uint2 x = *(const uint2*)(raw + kv * TILE_ELEMS + row * D + ch * 8);
        uint4 y;
        y.x = fp8x2_to_f16x2((unsigned short)(x.x & 0xffffu));
        y.y = fp8x2_to_f16x2((unsigned short)(x.x >> 16));
        y.z = fp8x2_to_f16x2((unsigned short)(x.y & 0xffffu));
        y.w = fp8x2_to_f16x2((unsigned short)(x.y >> 16));
        *(uint4*)(tile + kv * TILE_ELEMS + row * D + ((ch ^ (row & 7)) * 8)) = y;
    }
}
#endif

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// acc (16x8 f32) += a (16x16) * b (16x8), 16-bit operands (OPERAND_F16).
__device__ __forceinline__ void mma16816(float* acc, const unsigned* a, unsigned b0, unsigned b1) {
#ifdef OPERAND_F16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
#endif
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> a packed pair of the operand type (x0 in the low half).
__device__ __forceinline__ unsigned pack2(float x0, float x1) {
    unsigned r;
#ifdef OPERAND_F16
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
#endif
    return r;
}

// Splits (x0, x1) into a rounded pair (hi) and the pair of what rounding lost (lo).
__device__ __forceinline__ void split2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack2(x0, x1);
    const float h0 = operand_to_f32((unsigned short)(hi & 0xffffu));
    const float h1 = operand_to_f32((unsigned short)(hi >> 16));
    lo = pack2(x0 - h0, x1 - h1);
}

template <int FRAGS>
__device__ __forceinline__ void attention_mma(const float* __restrict__ q, int q_stride, float scale,
                    const kv_t* __restrict__ arena, long long layer_off, long long elems_per_block,
                    const unsigned int* __restrict__ tables, const int* __restrict__ seq_table_off,
                    const int* __restrict__ seq_first_block, const int* __restrict__ tok_seq,
                    const int* __restrict__ tok_pos, const int* __restrict__ group_first,
                    int row_base, int window, int split_len,
                    float* __restrict__ part_o, float* __restrict__ part_ml,
                    act_t* __restrict__ out, int out_stride) {
    constexpr int MROWS = FRAGS * 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const int split = blockIdx.x, kvh = blockIdx.y;
    const int r0 = group_first[blockIdx.z] - row_base;
    const int n_rows = group_first[blockIdx.z + 1] - group_first[blockIdx.z];
    const int num_splits = gridDim.x, heads = gridDim.y * G;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int hh = g % G, jg = g / G;
    const int s = tok_seq[r0];
    const int pos_last = tok_pos[r0 + n_rows - 1];
    // The group's window start: its only row's when the layer has a window.
    const int lo = window == 0 ? 0 : max(0, tok_pos[r0] - window + 1);
    const int t_begin = lo / TILE + split * (split_len / TILE);
    const int t_end = min(t_begin + split_len / TILE, pos_last / TILE + 1);
    const int n_tiles = t_end - t_begin;
    const int mine = n_tiles > warp ? (n_tiles - warp + MMA_WARPS - 1) / MMA_WARPS : 0;

    // Each fragment's row for this lane, and that row's keys [lo_f, pos_f].
    bool live[FRAGS];
    int row_f[FRAGS], pos_f[FRAGS], lo_f[FRAGS];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        const int j = f * PACK + jg;
        live[f] = g < PACK * G && j < n_rows;
        row_f[f] = r0 + (live[f] ? j : 0);
        pos_f[f] = live[f] ? tok_pos[row_f[f]] : pos_last;
        lo_f[f] = window == 0 ? 0 : max(0, pos_f[f] - window + 1);
    }

    const unsigned int* table = tables + seq_table_off[s];
    const int first_block = seq_first_block[s];
    const long long per_kv = (long long)KV_HEADS * B * D;
    const long long head_off = layer_off + (long long)kvh * B * D;
    unsigned char* stages = smem + warp * WARP_SMEM;
    const unsigned stages_addr = smem_addr(stages);

    // Query fragments (A of S = Q K^T), pre-scaled, hi rows 0-7, lo rows 8-15.
    unsigned qa[FRAGS][KSTEPS][4];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        const float* qrow = q + (unsigned long long)row_f[f] * q_stride + ((unsigned long long)kvh * G + (live[f] ? hh : 0)) * D;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float2 x = make_float2(0.0f, 0.0f);
                if (live[f]) x = *(const float2*)(qrow + ks * 16 + h * 8 + 2 * c);
                split2(x.x * scale, x.y * scale, qa[f][ks][2 * h], qa[f][ks][2 * h + 1]);
            }
        }
    }

    // Issues the cp.async copies of tile t (keys 16t..16t+15) into stage st;
    // keys outside the group's [lo, last position] are zero-filled.
    auto issue = [&](int t, int st) {
        const unsigned k_addr = stages_addr + st * (STAGE_ELEMS * (int)sizeof(kv_t));
        const int p0 = t * TILE;
#if (B % TILE) == 0
        const long long blk = table[p0 / B - first_block];
        const kv_t* base = arena + blk * elems_per_block + head_off + (p0 % B) * D;
#endif
#pragma unroll
        for (int i = 0; i < TILE * CHUNKS / 32; ++i) {
            const int e = lane + i * 32, row = e / CHUNKS, ch = e % CHUNKS;
            const int p = p0 + row;
            const bool ok = p >= lo && p <= pos_last;
#if (B % TILE) == 0
            const kv_t* src = base + row * D + ch * 8;
#else
            const long long blk = ok ? table[p / B - first_block] : 0;
            const kv_t* src = arena + blk * elems_per_block + head_off + (p % B) * D + ch * 8;
#endif
#ifdef KV_FP8
            const unsigned dst = k_addr + row * D + ch * 8;
            cp_async8(dst, ok ? src : arena, ok ? 8 : 0);
            cp_async8(dst + TILE_ELEMS, ok ? src + per_kv : arena, ok ? 8 : 0);
#else
            const unsigned dst = k_addr + (row * D + ((ch ^ (row & 7)) * 8)) * 2;
            cp_async16(dst, ok ? src : arena, ok ? 16 : 0);
            cp_async16(dst + TILE_ELEMS * 2, ok ? src + per_kv : arena, ok ? 16 : 0);
#endif
        }
    };

    float o[FRAGS][NTILES][4];
    float m[FRAGS], l[FRAGS];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
        for (int n = 0; n < NTILES; ++n) o[f][n][0] = o[f][n][1] = o[f][n][2] = o[f][n][3] = 0.0f;
        m[f] = NEG_INF;
        l[f] = 0.0f;
    }

    // ldmatrix row addresses: matrix mi = lane / 8, row rr = lane % 8.
    const int mi = lane >> 3, rr = lane & 7;
    // K (non-trans): token rr + 8 (mi / 2), chunk 2 ks + mi % 2.
    const int k_tok = rr + 8 * (mi >> 1), k_ch = mi & 1;
    // V (trans): token rr + 8 (mi % 2), chunk 2 nb + mi / 2.
    const int v_tok = rr + 8 * (mi & 1), v_ch = mi >> 1;

#pragma unroll
    for (int i = 0; i < MMA_STAGES - 1; ++i) {
        if (i < mine) issue(t_begin + warp + i * MMA_WARPS, i);
        cp_async_commit();
    }
    for (int i = 0; i < mine; ++i) {
        cp_async_wait<MMA_STAGES - 2>();
        __syncwarp();
        {
            const int nxt = i + MMA_STAGES - 1;
            if (nxt < mine) issue(t_begin + warp + nxt * MMA_WARPS, nxt % MMA_STAGES);
            cp_async_commit();
        }
        const int st = i % MMA_STAGES;
#ifdef KV_FP8
        widen_tiles(stages + st * STAGE_ELEMS, (unsigned short*)(stages + MMA_STAGES * STAGE_ELEMS), lane);
        __syncwarp();
        const unsigned k_addr = stages_addr + MMA_STAGES * STAGE_ELEMS;
#else
        const unsigned k_addr = stages_addr + st * (STAGE_ELEMS * 2);
#endif
        const unsigned v_addr = k_addr + TILE_ELEMS * 2;
        const int t = t_begin + warp + i * MMA_WARPS;

        float sc[FRAGS][2][4];
#pragma unroll
        for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
            for (int n = 0; n < 2; ++n) sc[f][n][0] = sc[f][n][1] = sc[f][n][2] = sc[f][n][3] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(k_addr + (k_tok * D + (((2 * ks + k_ch) ^ rr) * 8)) * 2, b0, b1, b2, b3);
#pragma unroll
            for (int f = 0; f < FRAGS; ++f) {
                mma16816(sc[f][0], qa[f][ks], b0, b1);
                mma16816(sc[f][1], qa[f][ks], b2, b3);
            }
        }

        unsigned pa[FRAGS][4];
#pragma unroll
        for (int f = 0; f < FRAGS; ++f) {
            // Scores of keys 16t + 8n + 2c + e, masked to the row's [lo, pos].
            float sv[2][2];
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < 2; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int p = t * TILE + 8 * n + 2 * c + e;
                    const float v = sc[f][n][e] + sc[f][n][2 + e];
                    sv[n][e] = (p >= lo_f[f] && p <= pos_f[f]) ? v : NEG_INF;
                    mx = fmaxf(mx, sv[n][e]);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[f], mx);
            if (__any_sync(0xffffffffu, mn > m[f])) {
                // A row with no key yet (m = mn = -inf) keeps its zeros.
                const float corr = mn == m[f] ? 1.0f : exp2f(m[f] - mn);
                l[f] *= corr;
#pragma unroll
                for (int n = 0; n < NTILES; ++n) {
                    o[f][n][0] *= corr;
                    o[f][n][1] *= corr;
                    o[f][n][2] *= corr;
                    o[f][n][3] *= corr;
                }
                m[f] = mn;
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const float p0 = live[f] && sv[n][0] != NEG_INF ? exp2f(sv[n][0] - m[f]) : 0.0f;
                const float p1 = live[f] && sv[n][1] != NEG_INF ? exp2f(sv[n][1] - m[f]) : 0.0f;
                l[f] += p0 + p1;
                split2(p0, p1, pa[f][2 * n], pa[f][2 * n + 1]);
            }
        }

#pragma unroll
        for (int nb = 0; nb < D / 16; ++nb) {
            unsigned b0, b1, b2, b3;
            ldsm_x4_t(v_addr + (v_tok * D + (((2 * nb + v_ch) ^ rr) * 8)) * 2, b0, b1, b2, b3);
#pragma unroll
            for (int f = 0; f < FRAGS; ++f) {
                mma16816(o[f][2 * nb], pa[f], b0, b1);
                mma16816(o[f][2 * nb + 1], pa[f], b2, b3);
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        l[f] += __shfl_xor_sync(0xffffffffu, l[f], 1);
        l[f] += __shfl_xor_sync(0xffffffffu, l[f], 2);
    }

    // Merge the warps: per warp MROWS rows of MERGE_ROW floats (output, then
    // m, l), row f * 8 + g for fragment f's A row g.
    __syncthreads();
    float* mrg = (float*)smem;
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        if (live[f]) {
            float* row = mrg + (warp * MROWS + f * 8 + g) * MERGE_ROW;
#pragma unroll
            for (int n = 0; n < NTILES; ++n) {
                *(float2*)(row + 8 * n + 2 * c) = make_float2(o[f][n][0] + o[f][n][2], o[f][n][1] + o[f][n][3]);
            }
            if (c == 0) {
                row[D] = m[f];
                row[D + 1] = l[f];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_rows * G * D; i += MMA_WARPS * 32) {
        const int pair = i / D, d = i % D;
        const int j = pair / G, gg = pair % G;
        const int at = (j / PACK) * 8 + (j % PACK) * G + gg;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) mx = fmaxf(mx, mrg[(w * MROWS + at) * MERGE_ROW + D]);
        float acc = 0.0f, sum = 0.0f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < MMA_WARPS; ++w) {
                const float* row = mrg + (w * MROWS + at) * MERGE_ROW;
                const float f = exp2f(row[D] - mx);
                acc += row[d] * f;
                sum += row[D + 1] * f;
            }
        }
        if (out != nullptr) {
            out[(unsigned long long)(r0 + j) * out_stride + (unsigned long long)(kvh * G + gg) * D + d] = final_out(acc, sum);
            continue;
        }
        const unsigned long long idx = ((unsigned long long)(r0 + j) * heads + (unsigned long long)kvh * G + gg) * num_splits + split;
        part_o[idx * D + d] = acc;
        if (d == 0) {
            part_ml[idx * 2] = mx;
            part_ml[idx * 2 + 1] = sum;
        }
    }
}

#define ATTN_MMA_PARAMS                                                                              \
    const float* __restrict__ q, int q_stride, float scale, const kv_t* __restrict__ arena,          \
        long long layer_off, long long elems_per_block, const unsigned int* __restrict__ tables,    \
        const int* __restrict__ seq_table_off, const int* __restrict__ seq_first_block,             \
        const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,                           \
        const int* __restrict__ group_first, int row_base, int window, int split_len,               \
        float* __restrict__ part_o, float* __restrict__ part_ml, act_t* __restrict__ out, int out_stride
#define ATTN_MMA_ARGS                                                                                \
    q, q_stride, scale, arena, layer_off, elems_per_block, tables, seq_table_off, seq_first_block, \
        tok_seq, tok_pos, group_first, row_base, window, split_len, part_o, part_ml, out, out_stride

// Groups of up to PACK rows (decode: one row per sequence).
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) paged_attention_mma(ATTN_MMA_PARAMS) {
    attention_mma<1>(ATTN_MMA_ARGS);
}

// Groups of up to MMA_FRAGS * PACK rows (prefill chunks): MMA_FRAGS A
// operands share each K and V tile.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) paged_attention_mma_rows(ATTN_MMA_PARAMS) {
    attention_mma<MMA_FRAGS>(ATTN_MMA_ARGS);
}
#endif

__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(act_t* p, float v) { *p = f32_to_bf16(v); }

// Merges the splits of one (query row, head) into out[r][head * D ..].
template <typename T>
__device__ __forceinline__ void combine_splits(const float* __restrict__ part_o,
                                               const float* __restrict__ part_ml, int num_splits,
                                               T* __restrict__ out, int out_stride) {
    const int r = blockIdx.x, h = blockIdx.y, heads = gridDim.y;
    const unsigned long long base = ((unsigned long long)r * heads + h) * num_splits;
    float mx = NEG_INF;
    for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    float total = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
        const float ms = part_ml[(base + s) * 2];
        if (ms != NEG_INF) total += part_ml[(base + s) * 2 + 1] * exp2f(ms - mx);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            const float ms = part_ml[(base + s) * 2];
            if (ms != NEG_INF) o += part_o[(base + s) * D + d] * exp2f(ms - mx);
        }
        store_out(out + (unsigned long long)r * out_stride + (unsigned long long)h * D + d, o / total);
    }
}

// The merge in f32 (the kernel check compares it with f64).
extern "C" __global__ void attention_combine(const float* __restrict__ part_o,
                                             const float* __restrict__ part_ml, int num_splits,
                                             float* __restrict__ out, int out_stride) {
    combine_splits(part_o, part_ml, num_splits, out, out_stride);
}

// The merge in bf16, the input of the output product.
extern "C" __global__ void attention_combine_bf16(const float* __restrict__ part_o,
                                                  const float* __restrict__ part_ml, int num_splits,
                                                  act_t* __restrict__ out, int out_stride) {
    combine_splits(part_o, part_ml, num_splits, out, out_stride);
}

// (v, i) becomes the better of itself and (ov, oi): the larger value, of
// equal values the smaller index; NaN is never better. Every pair starts
// at (-inf, none), so the first -inf counts too.
__device__ __forceinline__ void keep_best(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// out[r] = the first index of the largest value of row r of `logits` (NaN
// never wins; a row of NaN gives 0), as `ops::argmax` on the host. One
// block of 1024 threads per row, reading it once (as float4 when the width
// is a multiple of 4).
extern "C" __global__ void __launch_bounds__(1024)
argmax_rows(const float* __restrict__ logits, int vocab, unsigned int* __restrict__ out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* row = logits + (unsigned long long)r * vocab;
    float v = NEG_INF;
    int at = vocab;
    if ((vocab & 3) == 0) {
        const float4* row4 = (const float4*)row;
        for (int i = threadIdx.x; i < (vocab >> 2); i += blockDim.x) {
            const float4 x = row4[i];
            keep_best(v, at, x.x, 4 * i);
            keep_best(v, at, x.y, 4 * i + 1);
            keep_best(v, at, x.z, 4 * i + 2);
            keep_best(v, at, x.w, 4 * i + 3);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) keep_best(v, at, row[i], i);
    }
    for (int o = 16; o > 0; o >>= 1) {
        keep_best(v, at, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, at, o));
    }
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = at;
    }
    __syncthreads();
    if (warp == 0) {
        const bool held = lane < (int)(blockDim.x >> 5);
        v = held ? best_v[lane] : NEG_INF;
        at = held ? best_i[lane] : vocab;
        for (int o = 16; o > 0; o >>= 1) {
            keep_best(v, at, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, at, o));
        }
        if (lane == 0) out[r] = at < vocab ? (unsigned int)at : 0u;
    }
}

// tokens[pairs[2i]] = argmax[pairs[2i + 1]] for i < n: the tokens of a pass
// fed from the argmax rows of the pass before it (pairs checked on the host).
extern "C" __global__ void feed_tokens(unsigned int* __restrict__ tokens,
                                       const unsigned int* __restrict__ argmax,
                                       const unsigned int* __restrict__ pairs, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tokens[pairs[2 * i]] = argmax[pairs[2 * i + 1]];
}

// === sampling (the definition is `sampling.rs`'s; these follow it) ===

// Entry i changes logit (rows[i], tokens[i]): + bias, the repetition
// penalty, - penalty, each rounded as on the host (no contraction). The
// host gives each (row, token) at most once, so no two threads share one.
extern "C" __global__ void adjust_logits(float* __restrict__ logits, int vocab, int n,
                                         const unsigned int* __restrict__ rows,
                                         const unsigned int* __restrict__ tokens,
                                         const float* __restrict__ bias,
                                         const float* __restrict__ repetition,
                                         const float* __restrict__ penalty) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float* l = logits + (unsigned long long)rows[i] * vocab + tokens[i];
    float v = __fadd_rn(*l, bias[i]);
    v = v > 0.0f ? __fdiv_rn(v, repetition[i]) : __fmul_rn(v, repetition[i]);
    *l = __fsub_rn(v, penalty[i]);
}

// Structured output: logits row rows[b] keeps only the tokens its grammar
// allows (bit t % 32 of words[b * words_per_row + t / 32], as
// `sampling::apply_mask`); the others become -inf. Launched after
// adjust_logits and before argmax_rows / sample_rows; grid (vocab / 256
// rounded up, n), so no full row leaves the device.
extern "C" __global__ void mask_logits(float* __restrict__ logits, int vocab, int words_per_row,
                                       const unsigned int* __restrict__ rows,
                                       const unsigned int* __restrict__ words) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (t >= vocab) return;
    const unsigned int w = words[(unsigned long long)b * words_per_row + (t >> 5)];
    if (!((w >> (t & 31)) & 1u)) logits[(unsigned long long)rows[b] * vocab + t] = NEG_INF;
}

// The total order of `sampling::key`: larger logit, larger key.
__device__ __forceinline__ unsigned int logit_key(float l) {
    const unsigned int b = __float_as_uint(l);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

struct SumOp {
    template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
    __device__ __forceinline__ int operator()(int a, int b) const { return max(a, b); }
    __device__ __forceinline__ unsigned long long operator()(unsigned long long a,
                                                             unsigned long long b) const {
        return a > b ? a : b;
    }
};

// `op` of v over the block (SAMPLE_THREADS threads), for every thread; the
// order is fixed by the block's shape, so a row always reduces alike.
#define SAMPLE_THREADS 1024
template <typename T, typename Op>
__device__ T block_reduce(T v, T* scratch, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = scratch[lane];
        for (int o = 16; o > 0; o >>= 1) w = op(w, __shfl_xor_sync(0xffffffffu, w, o));
        if (lane == 0) scratch[32] = w;
    }
    __syncthreads();
    return scratch[32];
}

// exp((l - mx) / T) as the host computes it: l - mx in f32, the rest in f64.
__device__ __forceinline__ double sample_prob(float l, float mx, double inv_t) {
    return exp(__dmul_rn((double)__fsub_rn(l, mx), inv_t));
}

__device__ __forceinline__ bool sample_kept(float l, unsigned int cut, float mx, double inv_t,
                                            double min_p) {
    return !isnan(l) && logit_key(l) >= cut && sample_prob(l, mx, inv_t) >= min_p;
}

// Pick b draws a token from logits row rows[b] (already adjusted) as
// `sampling::sample` does: top_k by radix select on the keys, min_p, the
// top_p cut by a bitwise search on the keys for the largest one whose
// tokens at or above it hold top_p of the kept mass, then the draw walked in
// token-id order (each thread a contiguous run of ids). A row whose every
// logit is -inf or NaN keeps the argmax `out` already holds. One block of
// SAMPLE_THREADS threads per pick.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ logits, int vocab,
            const unsigned int* __restrict__ rows, const float* __restrict__ temperature,
            const unsigned int* __restrict__ top_k, const float* __restrict__ top_p,
            const float* __restrict__ min_p_in, const double* __restrict__ draw_in,
            unsigned int* __restrict__ out) {
    __shared__ double scratch_d[33];
    __shared__ unsigned int scratch_u[33];
    __shared__ float scratch_f[33];
    __shared__ int scratch_i[33];
    __shared__ double run_mass[SAMPLE_THREADS];
    __shared__ int chosen;
    __shared__ double chosen_before;
    const int b = blockIdx.x, t = threadIdx.x;
    const unsigned int r = rows[b];
    const float* row = logits + (unsigned long long)r * vocab;

    float mx = NEG_INF;
    for (int i = t; i < vocab; i += blockDim.x) mx = fmaxf(mx, row[i]);
    mx = block_reduce(mx, scratch_f, MaxOp());
    if (mx == NEG_INF || isnan(mx)) return;
    const double inv_t = 1.0 / (double)temperature[b];
    const double min_p = (double)min_p_in[b];

    unsigned int cut = 0;
    const unsigned int k = top_k[b];
    if (k > 0 && k < (unsigned int)vocab) {
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned int cand = cut | (1u << bit);
            unsigned int n = 0;
            for (int i = t; i < vocab; i += blockDim.x) {
                const float l = row[i];
                n += (!isnan(l) && logit_key(l) >= cand) ? 1u : 0u;
            }
            if (block_reduce(n, scratch_u, SumOp()) >= k) cut = cand;
        }
    }
    if (top_p[b] < 1.0f) {
        double m = 0.0;
        for (int i = t; i < vocab; i += blockDim.x) {
            const float l = row[i];
            if (sample_kept(l, cut, mx, inv_t, min_p)) m += sample_prob(l, mx, inv_t);
        }
        const double target = (double)top_p[b] * block_reduce(m, scratch_d, SumOp());
        unsigned int p_cut = 0;
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned int cand = p_cut | (1u << bit);
            double part = 0.0;
            for (int i = t; i < vocab; i += blockDim.x) {
                const float l = row[i];
                if (sample_kept(l, cut, mx, inv_t, min_p) && logit_key(l) >= cand)
                    part += sample_prob(l, mx, inv_t);
            }
            if (block_reduce(part, scratch_d, SumOp()) >= target) p_cut = cand;
        }
        cut = max(cut, p_cut);
    }

    // each thread's contiguous run of ids, summed in id order
    const int per = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min(vocab, t * per), hi = min(vocab, lo + per);
    double mine = 0.0;
    int last_kept = -1;
    for (int i = lo; i < hi; ++i) {
        const float l = row[i];
        if (sample_kept(l, cut, mx, inv_t, min_p)) {
            mine += sample_prob(l, mx, inv_t);
            last_kept = i;
        }
    }
    run_mass[t] = mine;
    const double mass = block_reduce(mine, scratch_d, SumOp());
    const double draw = draw_in[b] * mass;
    if (t == 0) {
        chosen = -1;
        double before = 0.0;
        for (int j = 0; j < (int)blockDim.x; ++j) {
            if (run_mass[j] > 0.0 && before + run_mass[j] > draw) {
                chosen = j;
                break;
            }
            before += run_mass[j];
        }
        chosen_before = before;
    }
    __syncthreads();
    if (chosen == t) {
        double acc = chosen_before;
        int pick = last_kept;
        for (int i = lo; i < hi; ++i) {
            const float l = row[i];
            if (sample_kept(l, cut, mx, inv_t, min_p)) {
                acc += sample_prob(l, mx, inv_t);
                if (acc > draw) {
                    pick = i;
                    break;
                }
            }
        }
        out[r] = (unsigned int)pick;
    }
    if (chosen == -1) {
        // rounding left the draw unreached: the last kept token
        const int last = block_reduce(last_kept, scratch_i, MaxOp());
        if (t == 0 && last >= 0) out[r] = (unsigned int)last;
    }
}

// === log-probabilities (the definition is `logprobs.rs`'s) ===

// Entry i of `vals` and logit (rows[i], tokens[i]) swap roles: with
// `restore` 0, vals[i] = the logit (saved before `adjust_logits` changes
// it); with 1, the logit = vals[i] (the raw value back, once the tokens are
// picked). Each (row, token) at most once (the host's adjustments).
extern "C" __global__ void keep_logits(float* __restrict__ logits, int vocab, int n,
                                       const unsigned int* __restrict__ rows,
                                       const unsigned int* __restrict__ tokens,
                                       float* __restrict__ vals, int restore) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float* l = logits + (unsigned long long)rows[i] * vocab + tokens[i];
    if (restore) *l = vals[i];
    else vals[i] = *l;
}

// Whole rows the same way: with `restore` 0, vals[b * vocab + t] = logit
// (rows[b], t), saved before `adjust_logits` and `mask_logits` change a
// constrained row; with 1 the row back from vals. blockIdx.y is the entry,
// one thread per token; each row at most once (the host's masks).
extern "C" __global__ void keep_rows(float* __restrict__ logits, int vocab,
                                     const unsigned int* __restrict__ rows,
                                     float* __restrict__ vals, int restore) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (t >= vocab) return;
    float* l = logits + (unsigned long long)rows[b] * vocab + t;
    float* v = vals + (unsigned long long)b * vocab + t;
    if (restore) *l = *v;
    else *v = *l;
}

// Entry b reports logits row rows[b] as `logprobs::row_logprobs` does:
// the chosen token (chosen[b], or picked[rows[b]] where chosen[b] is
// 0xffffffff) and its logprob, then the top[b] most likely tokens (by key,
// ties by lower id; NaN never) and their logprobs: out[b * stride] = token,
// [+1] = logprob's bits, [+2 + j] = j-th token (0xffffffff: none),
// [+2 + kmax + j] = its logprob's bits, stride = 2 + 2 * kmax. l - max in
// f32, the exponentials and their sum in f64, as on the host. The top list
// takes one reduction over the row per entry of it (at most 20). One block
// of SAMPLE_THREADS threads per entry.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
logprob_rows(const float* __restrict__ logits, int vocab,
             const unsigned int* __restrict__ rows, const unsigned int* __restrict__ chosen,
             const unsigned int* __restrict__ top, const unsigned int* __restrict__ picked,
             int kmax, unsigned int* __restrict__ out) {
    __shared__ double scratch_d[33];
    __shared__ float scratch_f[33];
    __shared__ unsigned long long scratch_l[33];
    const int b = blockIdx.x, t = threadIdx.x;
    const unsigned int r = rows[b];
    const float* row = logits + (unsigned long long)r * vocab;
    unsigned int* o = out + (unsigned long long)b * (2 + 2 * kmax);

    float mx = NEG_INF;
    for (int i = t; i < vocab; i += blockDim.x) {
        const float l = row[i];
        if (!isnan(l)) mx = fmaxf(mx, l);
    }
    mx = block_reduce(mx, scratch_f, MaxOp());
    double sum = 0.0;
    if (mx != NEG_INF) {
        for (int i = t; i < vocab; i += blockDim.x) {
            const float l = row[i];
            if (!isnan(l)) sum += exp((double)__fsub_rn(l, mx));
        }
    }
    sum = block_reduce(sum, scratch_d, SumOp());
    const double ln_sum = mx != NEG_INF ? log(sum) : 0.0;
    // logprob of logit l, as `logprobs::logprob`
#define LOGPROB(l) \
    ((mx == NEG_INF || isnan(l)) ? NEG_INF : (float)((double)__fsub_rn((l), mx) - ln_sum))

    if (t == 0) {
        const unsigned int c = chosen[b] != 0xffffffffu ? chosen[b] : picked[r];
        o[0] = c;
        o[1] = __float_as_uint(c < (unsigned int)vocab ? LOGPROB(row[c]) : NEG_INF);
    }
    // (key << 32 | ~id): larger is better, then the lower id; 0 is none
    // (key 0 is a NaN, never ranked)
    unsigned long long prev = ~0ull;
    for (int j = 0; j < kmax; ++j) {
        unsigned long long best = 0;
        if (j < (int)top[b]) {
            for (int i = t; i < vocab; i += blockDim.x) {
                const float l = row[i];
                if (isnan(l)) continue;
                const unsigned long long c =
                    ((unsigned long long)logit_key(l) << 32) | (unsigned long long)(~(unsigned int)i);
                if (c < prev && c > best) best = c;
            }
        }
        // every thread runs every reduction: `top[b]` is the block's own
        best = block_reduce(best, scratch_l, MaxOp());
        if (t == 0) {
            if (best == 0) {
                o[2 + j] = 0xffffffffu;
                o[2 + kmax + j] = __float_as_uint(NEG_INF);
            } else {
                const unsigned int id = ~(unsigned int)(best & 0xffffffffu);
                o[2 + j] = id;
                o[2 + kmax + j] = __float_as_uint(LOGPROB(row[id]));
            }
        }
        prev = best == 0 ? 0 : best;
    }
#undef LOGPROB
}

// a[i] = a value in [-0.5, 0.5) hashed from (i, seed); for benchmarks.
extern "C" __global__ void fill_random(kv_t* __restrict__ a, long long n, unsigned int seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned int x = (unsigned int)i * 2654435761u ^ seed ^ (unsigned int)(i >> 32);
        x ^= x >> 16;
        x *= 0x7feb352du;
        x ^= x >> 15;
        x *= 0x846ca68bu;
        x ^= x >> 16;
        a[i] = f32_to_kv((float)(x & 0xffffu) / 65536.0f - 0.5f);
    }
}
