// Fused decoder ops for x86 CPUs with AVX2: RMSNorm with the residual add, RoPE in place, SiLU·mul,
// and attention over the paged KV cache.
//
// Why: a decode step of a 28-layer model ran ~60 small torch ops per layer (norm, rotary, softmax,
// masks, casts), and bf16 matmuls on AVX2 have no hardware path (4 GFLOP/s for attention's bmm):
// ~17 ms of a 60 ms Qwen-1.5B step. One call per op here.
//
// Tensors are row-major; "bf16" flags say whether activations (and a non-int8 KV cache) are bf16 or
// fp32. Elementwise ops round where torch rounds (after each bf16 op), so they match torch's bits but
// for the last place of exp and of a sum's order. Attention works in fp32 throughout and rounds its
// output once; each query row is computed alone, the same way in a decode step and in a prefill chunk.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

namespace {

inline __m256 load8(const void* x, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

inline __m256 round_bf16(__m256 v) {  // to the nearest bf16 (ties to even), kept as fp32
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256 maybe_round(__m256 v, int bf16) { return bf16 ? round_bf16(v) : v; }

inline void store8(void* x, int bf16, size_t i, __m256 v) {  // v already rounded when bf16
    if (bf16) {
        __m256i r = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(x) + i), _mm256_castsi256_si128(r));
    } else {
        _mm256_storeu_ps(static_cast<float*>(x) + i, v);
    }
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp(x) in fp32: Cephes' expf polynomial after range reduction, ~1 ulp.
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace

extern "C" {

// residual (if given) += x, rounded; out = weight · (r · rsqrt(mean(r²) + eps)), rounded as HF does
// (normalized value to the model dtype first, then times the weight). H a multiple of 8.
void sb_rms_norm(const void* x, void* residual, const void* weight, void* out, int M, int H, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int m = 0; m < M; ++m) {
        const size_t row = static_cast<size_t>(m) * H;
        const void* src = x;
        if (residual) {  // r = r + x, then normalize r
            for (int i = 0; i < H; i += 8)
                store8(residual, bf16, row + i,
                       maybe_round(_mm256_add_ps(load8(residual, bf16, row + i), load8(x, bf16, row + i)), bf16));
            src = residual;
        }
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < H; i += 8) {
            const __m256 v = load8(src, bf16, row + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(ss) / static_cast<float>(H) + eps));
        for (int i = 0; i < H; i += 8) {
            const __m256 n = maybe_round(_mm256_mul_ps(load8(src, bf16, row + i), inv), bf16);
            store8(out, bf16, row + i, maybe_round(_mm256_mul_ps(load8(weight, bf16, i), n), bf16));
        }
    }
}

// Neox-style RoPE in place on q and k heads of each token: x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin,
// each product and the sum rounded as torch rounds them. q/k: row t at x + t·stride, heads of D
// contiguous; cos/sin: (T, D/2) rows. D/2 a multiple of 8.
void sb_rope(void* q, int q_heads, void* k, int k_heads, long stride, const void* cos, const void* sin, int T, int D,
             int bf16) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (T > 4)
    for (int t = 0; t < T; ++t) {
        for (int which = 0; which < 2; ++which) {
            void* base = which ? k : q;
            const int heads = which ? k_heads : q_heads;
            for (int h = 0; h < heads; ++h) {
                const size_t off = static_cast<size_t>(t) * stride + static_cast<size_t>(h) * D;
                for (int i = 0; i < half; i += 8) {
                    const size_t ci = static_cast<size_t>(t) * half + i;
                    const __m256 c = load8(cos, bf16, ci), s = load8(sin, bf16, ci);
                    const __m256 x1 = load8(base, bf16, off + i), x2 = load8(base, bf16, off + half + i);
                    const __m256 a = maybe_round(_mm256_mul_ps(x1, c), bf16);
                    const __m256 b = maybe_round(_mm256_mul_ps(x2, s), bf16);
                    const __m256 e = maybe_round(_mm256_mul_ps(x2, c), bf16);
                    const __m256 f = maybe_round(_mm256_mul_ps(x1, s), bf16);
                    store8(base, bf16, off + i, maybe_round(_mm256_sub_ps(a, b), bf16));
                    store8(base, bf16, off + half + i, maybe_round(_mm256_add_ps(e, f), bf16));
                }
            }
        }
    }
}

// out (M, I) = silu(gate) · up for rows [gate | up] of width 2I. I a multiple of 8.
void sb_silu_mul(const void* gate_up, void* out, int M, int I, int bf16) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int m = 0; m < M; ++m) {
        const size_t in = static_cast<size_t>(m) * 2 * I, o = static_cast<size_t>(m) * I;
        for (int i = 0; i < I; i += 8) {
            const __m256 g = load8(gate_up, bf16, in + i);
            const __m256 act = maybe_round(
                _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))),
                bf16);
            store8(out, bf16, o + i, maybe_round(_mm256_mul_ps(act, load8(gate_up, bf16, in + I + i)), bf16));
        }
    }
}

// Attention of T query rows over the paged KV cache of one layer.
//   q: row t at q + t·q_stride, H heads of D; out (T, H, D) contiguous, in the activation dtype.
//   kc, vc: (KVH, num_blocks, bs, D) in the activation dtype, or int8 with ks, vs (KVH, num_blocks, bs)
//           scales in the activation dtype (kv_int8 = 1).
//   tables: block ids of all sequences, flat; row t reads tables[row_table[t]...] and attends to its
//           first row_len[t] positions (causal: its own position + 1).
// Query heads h·G .. h·G+G-1 share KV head h (G = H / KVH). Scores, softmax and the weighted sum are
// fp32; D a multiple of 8.
void sb_paged_attention(const void* q, long q_stride, void* out, int T, int H, int KVH, int D, const void* kc,
                        const void* vc, const void* ks, const void* vs, int kv_int8, int num_blocks, int bs,
                        const int32_t* tables, const int32_t* row_table, const int32_t* row_len, float scale,
                        int bf16, int window) {
    const int G = H / KVH;
    const int chunks = D / 8;
#pragma omp parallel
    {
        std::vector<float> qf, scores, acc;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < static_cast<long>(T) * KVH; ++task) {
            const int t = static_cast<int>(task / KVH), h = static_cast<int>(task % KVH);
            // A sliding-window layer: the row sees its last `window` positions, [lo, row_len).
            const int lo = window > 0 && row_len[t] > window ? row_len[t] - window : 0;
            const int L = row_len[t] - lo;
            const int32_t* table = tables + row_table[t];
            qf.resize(static_cast<size_t>(G) * D);
            scores.resize(static_cast<size_t>(G) * L);
            acc.resize(static_cast<size_t>(G) * D);  // every element is written by the value sum below
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < chunks; ++c)
                    _mm256_storeu_ps(&qf[static_cast<size_t>(g) * D + 8 * c],
                                     _mm256_mul_ps(load8(q, bf16, static_cast<size_t>(t) * q_stride +
                                                                      static_cast<size_t>(h * G + g) * D + 8 * c),
                                                   _mm256_set1_ps(scale)));
            const size_t head_base = static_cast<size_t>(h) * num_blocks * bs;
            auto key_row = [&](int j) {
                const int p = lo + j;
                return head_base + static_cast<size_t>(table[p / bs]) * bs + p % bs;
            };
            auto load_kv = [&](const void* cache, size_t row, int c) {
                if (kv_int8) {
                    const int8_t* p = static_cast<const int8_t*>(cache) + row * D + 8 * c;
                    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
                    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                }
                return load8(cache, bf16, row * D + 8 * c);
            };
            auto scale_of = [&](const void* s, size_t row) {
                if (!bf16) return static_cast<const float*>(s)[row];
                const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(s)[row]) << 16;
                float f;
                memcpy(&f, &u, 4);
                return f;
            };
            // Scores: each key is loaded once for the G query heads that share it.
            for (int j = 0; j < L; ++j) {
                const size_t row = key_row(j);
                __m256 dot[16];
                for (int g = 0; g < G; ++g) dot[g] = _mm256_setzero_ps();
                for (int c = 0; c < chunks; ++c) {
                    const __m256 kv = load_kv(kc, row, c);
                    for (int g = 0; g < G; ++g)
                        dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(&qf[static_cast<size_t>(g) * D + 8 * c]), kv, dot[g]);
                }
                const float ksc = kv_int8 ? scale_of(ks, row) : 1.0f;
                for (int g = 0; g < G; ++g) scores[static_cast<size_t>(g) * L + j] = hsum(dot[g]) * ksc;
            }
            // Softmax per head.
            for (int g = 0; g < G; ++g) {
                float* s = &scores[static_cast<size_t>(g) * L];
                float mx = -INFINITY;
                for (int j = 0; j < L; ++j) mx = s[j] > mx ? s[j] : mx;
                __m256 sum8 = _mm256_setzero_ps();
                int j = 0;
                for (; j + 8 <= L; j += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
                    _mm256_storeu_ps(s + j, e);
                    sum8 = _mm256_add_ps(sum8, e);
                }
                float sum = hsum(sum8);
                if (j < L) {  // the last few: through a padded vector, so every element sees the same exp
                    float tmp[8] = {0};
                    for (int i = j; i < L; ++i) tmp[i - j] = s[i] - mx;
                    alignas(32) float e[8];
                    _mm256_store_ps(e, exp8(_mm256_loadu_ps(tmp)));
                    for (int i = j; i < L; ++i) {
                        s[i] = e[i - j];
                        sum += e[i - j];
                    }
                }
                const float inv = 1.0f / sum;
                for (int i = 0; i < L; ++i) s[i] *= inv;
            }
            // Weighted sum of values: acc = fma(p_j, v_j, acc) for j in order, per element. Each 8 dimensions
            // of the G heads run through every key in registers (loading and storing acc per key was 2 of
            // every 3 instructions: ~2x slower prefill attention); the same operations in the same order.
            if (kv_int8)
                for (int j = 0; j < L; ++j) {
                    const float vsc = scale_of(vs, key_row(j));
                    for (int g = 0; g < G; ++g) scores[static_cast<size_t>(g) * L + j] *= vsc;
                }
            auto weighted = [&](auto group) {
                constexpr int GG = decltype(group)::value;  // GG > 0: G, unrolled; 0: any G
                const int n = GG ? GG : G;
                for (int c = 0; c < chunks; ++c) {
                    __m256 a[GG ? GG : 16];
#pragma GCC unroll 16
                    for (int g = 0; g < n; ++g) a[g] = _mm256_setzero_ps();
                    for (int j = 0; j < L; ++j) {
                        const __m256 vv = load_kv(vc, key_row(j), c);
#pragma GCC unroll 16
                        for (int g = 0; g < n; ++g)
                            a[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[static_cast<size_t>(g) * L + j]), vv, a[g]);
                    }
                    for (int g = 0; g < n; ++g) _mm256_storeu_ps(&acc[static_cast<size_t>(g) * D + 8 * c], a[g]);
                }
            };
            switch (G) {  // the common group sizes with their accumulators in registers
                case 1: weighted(std::integral_constant<int, 1>{}); break;
                case 2: weighted(std::integral_constant<int, 2>{}); break;
                case 4: weighted(std::integral_constant<int, 4>{}); break;
                case 6: weighted(std::integral_constant<int, 6>{}); break;
                case 7: weighted(std::integral_constant<int, 7>{}); break;
                case 8: weighted(std::integral_constant<int, 8>{}); break;
                default: weighted(std::integral_constant<int, 0>{}); break;
            }
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < chunks; ++c)
                    store8(out, bf16, (static_cast<size_t>(t) * H + h * G + g) * D + 8 * c,
                           maybe_round(_mm256_loadu_ps(&acc[static_cast<size_t>(g) * D + 8 * c]), bf16));
        }
    }
}
}
