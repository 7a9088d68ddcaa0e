// kvlease worker kernels, compiled at run time with NVRTC. The host
// prepends `#define`s for HEAD_DIM, GROUP (query heads per KV head),
// KV_HEADS, TOKENS_PER_BLOCK and KV_F16 or KV_BF16 (element type of the
// arena). Activations and weights are f32; the arena stores 16-bit K/V.

#define D HEAD_DIM
#define G GROUP
#define B TOKENS_PER_BLOCK
#define NEG_INF __int_as_float(0xff800000)

// Widest load that divides a head row: 8, 4 or 2 elements of 2 bytes.
#if (D % 8) == 0
#define VEC 8
typedef uint4 vec_t;
#elif (D % 4) == 0
#define VEC 4
typedef uint2 vec_t;
#else
#define VEC 2
typedef unsigned int vec_t;
#endif
#define CH (D / VEC)
// Columns of an output head row per lane.
#define COLS ((D + 31) / 32)
// Padded row of the K/V tiles in shared memory, in elements.
#define ROW (D + 8)

typedef unsigned short kv_t;

__device__ __forceinline__ float kv_to_f32(unsigned short h) {
#ifdef KV_F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((unsigned int)h) << 16);
#endif
}

__device__ __forceinline__ unsigned short f32_to_kv(float f) {
#ifdef KV_F16
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// x[r] = table[tokens[r]]; one block per row.
extern "C" __global__ void embed(const float* __restrict__ table,
                                 const unsigned int* __restrict__ tokens,
                                 float* __restrict__ x, int h) {
    const int r = blockIdx.x;
    const float* src = table + (unsigned long long)tokens[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(unsigned long long)r * h + i] = src[i];
}

// out[r] = x[src] / rms(x[src]) * w, src = rows[r] when use_rows else r.
// One block of 256 threads per row.
extern "C" __global__ void rms_norm(const float* __restrict__ x,
                                    const unsigned int* __restrict__ rows, int use_rows,
                                    const float* __restrict__ w, float* __restrict__ out,
                                    int h, float eps) {
    __shared__ float partial[32];
    const int r = blockIdx.x;
    const unsigned long long src = use_rows ? rows[r] : (unsigned int)r;
    const float* row = x + src * h;
    float s = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s += row[i] * row[i];
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) partial[0] = v;
    }
    __syncthreads();
    const float scale = rsqrtf(partial[0] / (float)h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[(unsigned long long)r * h + i] = row[i] * scale * w[i];
}

// Rotates the first `heads` heads of every qkv row ("rotate half" pairs
// (i, i + D/2)) to the row's position. inv_freq has D/2 entries.
extern "C" __global__ void rope(float* __restrict__ qkv, int stride, int heads,
                                const int* __restrict__ positions,
                                const float* __restrict__ inv_freq) {
    const int r = blockIdx.x;
    const float p = (float)positions[r];
    float* row = qkv + (unsigned long long)r * stride;
    const int half = D / 2;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int head = i / half, k = i % half;
        float s, c;
        sincosf(p * inv_freq[k], &s, &c);
        float* a = row + head * D + k;
        const float x1 = a[0], x2 = a[half];
        a[0] = x1 * c - x2 * s;
        a[half] = x2 * c + x1 * s;
    }
}

// gate = silu(gate) * up over rows [gate | up] of width 2f.
extern "C" __global__ void swiglu(float* __restrict__ gate_up, int f, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int r = i / f, c = i % f;
    float* row = gate_up + (unsigned long long)r * 2 * f;
    const float g = row[c];
    row[c] = g / (1.0f + __expf(-g)) * row[f + c];
}

// Copies the new K and V of every row (columns k_col.. of qkv) into the
// arena: dst_base[r] is the element offset of (block, slot) in the pool,
// layer_off that of the layer within a block. One block per row.
extern "C" __global__ void write_kv(const float* __restrict__ qkv, int stride, int k_col,
                                    const long long* __restrict__ dst_base, long long layer_off,
                                    kv_t* __restrict__ arena) {
    const int r = blockIdx.x;
    const int kvd = KV_HEADS * D;
    const long long per_kv = (long long)KV_HEADS * B * D;
    const long long base = dst_base[r] + layer_off;
    for (int i = threadIdx.x; i < 2 * kvd; i += blockDim.x) {
        const int kv = i / kvd, rem = i % kvd, head = rem / D, d = rem % D;
        arena[base + kv * per_kv + (long long)head * B * D + d] =
            f32_to_kv(qkv[(unsigned long long)r * stride + k_col + i]);
    }
}

// Paged attention, one warp per (key split, KV head, query row). The warp
// attends the G query heads of its KV head over keys
// [lo + split * split_len, min(lo + (split + 1) * split_len, pos + 1)),
// lo = window start, in tiles of 32 keys staged in shared memory, with an
// online softmax in base 2 (queries arrive pre-scaled by log2(e)/sqrt(D)).
// Writes the unnormalised partial output and (max, sum) per split.
extern "C" __global__ void __launch_bounds__(32)
paged_attention(const float* __restrict__ q, int q_stride, float scale,
                const kv_t* __restrict__ arena, long long layer_off, long long elems_per_block,
                const unsigned int* __restrict__ tables, const int* __restrict__ seq_table_off,
                const int* __restrict__ seq_first_block, const int* __restrict__ tok_seq,
                const int* __restrict__ tok_pos, int window, int split_len,
                float* __restrict__ part_o, float* __restrict__ part_ml) {
    const int split = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z;
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

// Merges the splits of one (query row, head) into out[r][head * D ..].
extern "C" __global__ void attention_combine(const float* __restrict__ part_o,
                                             const float* __restrict__ part_ml, int num_splits,
                                             float* __restrict__ out, int out_stride) {
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
        out[(unsigned long long)r * out_stride + (unsigned long long)h * D + d] = o / total;
    }
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
