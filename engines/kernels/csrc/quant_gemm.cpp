// int4 and int8 weight GEMMs for x86 CPUs with AVX2 (AVX-512 VNNI, AMX: see SB_VARIANT): weights stay
// packed, activations are quantized on the fly (8 bits per 32 inputs for int4 weights, as llama.cpp's
// Q8_0; 7 bits per 256 for int8 weights, see int8_tile), and dot products run on vpmaddubsw or vpdpbusd.
//
// Why: decode reads every weight once per step; torch's int4 kernel dequantizes to float and is
// compute-bound (~14 G weights/s on 2 AVX2 cores), while an integer dot product keeps pace with memory.
//
// Layouts (engines/cpu_kernels.py packs them). Output rows come in slabs of 16, N padded with zero
// rows, and each slab is one contiguous run of bytes read front to back, so a thread streams its share
// of the weight sequentially and a software prefetch a few KB ahead keeps memory busy.
//   int4: per group of 32 inputs, 16 fp16 scales, 16 fp16 mins and 256 bytes of nibbles (int4_slabs.h).
//   int8: a slab is, per 4 inputs, the 16 rows' 4 codes each (64 bytes); one fp32 scale per row, and
//         per row and activation group −64 × its codes' sum (the activations' offset, see int8_tile).
// The AMX build multiplies the same layouts on tiles from a few rows up (amx_int8.h, amx_int4.h).
// Activations: bf16 or fp32 rows (M, K), K a multiple of 32; out (M, N) bf16 or fp32; optional fp32
// bias. Each output row is computed the same way whatever M is, so results do not depend on the batch.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifndef SB_PREFETCH
#define SB_PREFETCH 4096  // bytes ahead of the read position: 4-16 KB measured best (64 B-1 KB: -25-40%)
#endif

namespace {

constexpr int G = 32;  // values per weight group, and per activation group against int4 weights

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline __m256 load8(const void* x, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256 lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

inline __m256i sum_pairs(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }

// acc + the sums of four unsigned × signed byte products per int32 lane. VNNI does it in one vpdpbusd;
// AVX2 in vpmaddubsw (pairs into int16) + vpmaddwd. The same int32s: our codes never saturate the int16
// pairs (int4: 15·127·2; int8: 127·127·2 < 32,767, see int8_tile).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SB_ZMM 1  // the 512-bit int8 loops (VNNI and AMX builds)
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define SB_VARIANT 3  // VNNI's code plus AMX tiles for multi-row int8 calls (amx_int8.h)
#else
#define SB_VARIANT 2
#endif
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
#define SB_ZMM 0
#define SB_VARIANT 1
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, sum_pairs(_mm256_maddubs_epi16(u, s)));
}
#endif

// Quantized activations: per row, int8 codes with one scale d per group of `ag` values (32 for int4
// weights, whose own scales change every 32 inputs anyway; more for int8 weights, so the integer dot
// product runs longer between float steps), and per group d·Σcodes (s). With the quantized sum, an int4
// weight's min term sees the same activations as its code term, so the two cancel as in the float
// product (the exact float sum made errors about 2x larger). d and s rows are padded with zeros to a
// multiple of 8 groups, so a chunk's vector loads never read garbage. For int8 weights the codes are
// 7-bit and stored with +64, unsigned: see int8_tile for why. Optional outlier channels are
// taken out before quantizing (zeroed, their float values kept in `side`): a calibrated int8 layer adds
// their products in fp32 (LLM.int8()'s decomposition with fixed channels).
struct Acts {
    int8_t* q = nullptr;
    float* d = nullptr;
    float* s = nullptr;
    float* side = nullptr;
    int K = 0;
    int ag = G;      // values per activation group
    int stride = 0;  // groups per row of d and s, padded
    int n_out = 0;
    int side_stride = 0;  // n_out padded to a multiple of 8

    int offset = 0;  // 64: codes are 7-bit, stored as code + 64 (unsigned; see int8_tile)
    float top = 127.0f;  // the largest code: 63 for 7-bit codes (int8 weights), 127 for 8-bit

    // `seven_bit`: 7-bit codes without the offset (the AMX path multiplies signed bytes; amx_int8.h).
    Acts(const void* x, int bf16, int M, int K_, int ag_, int offset_ = 0, const int32_t* out_idx = nullptr,
         int n_out_ = 0, bool seven_bit = false)
        : K(K_), ag(ag_), n_out(n_out_), offset(offset_), top(offset_ || seven_bit ? 63.0f : 127.0f) {
        const int groups = (K + ag - 1) / ag;
        stride = (groups + 7) / 8 * 8;
        q = static_cast<int8_t*>(aligned_alloc(64, (static_cast<size_t>(M) * K + 63) / 64 * 64));
        const size_t fbytes = (static_cast<size_t>(M) * stride * 4 + 63) / 64 * 64;
        d = static_cast<float*>(aligned_alloc(64, fbytes));
        s = static_cast<float*>(aligned_alloc(64, fbytes));
        memset(d, 0, fbytes);
        memset(s, 0, fbytes);
        side_stride = (n_out + 7) / 8 * 8;
        if (n_out) {
            const size_t bytes = (static_cast<size_t>(M) * side_stride * 4 + 63) / 64 * 64;
            side = static_cast<float*>(aligned_alloc(64, bytes));
            memset(side, 0, bytes);
        }
        const size_t elem = bf16 ? 2 : 4;
#pragma omp parallel if (M > 1)
        {
            std::vector<float> row(n_out ? K : 0);
#pragma omp for schedule(static)
            for (int m = 0; m < M; ++m) {
                const void* src = static_cast<const char*>(x) + m * K * elem;
                int src_bf16 = bf16;
                if (n_out) {  // a float copy with the outlier channels moved to `side`
                    for (int i = 0; i < K; i += 8) _mm256_storeu_ps(&row[i], load8(src, bf16, i));
                    for (int j = 0; j < n_out; ++j) {
                        side[static_cast<size_t>(m) * side_stride + j] = row[out_idx[j]];
                        row[out_idx[j]] = 0.0f;
                    }
                    src = row.data();
                    src_bf16 = 0;
                }
                quantize_row(src, src_bf16, q + static_cast<size_t>(m) * K, d + static_cast<size_t>(m) * stride,
                             s + static_cast<size_t>(m) * stride);
            }
        }
    }
    ~Acts() {
        free(q);
        free(d);
        free(s);
        free(side);
    }
    Acts(const Acts&) = delete;
    Acts& operator=(const Acts&) = delete;

    void quantize_row(const void* x, int bf16, int8_t* qr, float* dr, float* sr) const {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int k0 = 0, g = 0; k0 < K; k0 += ag, ++g) {
            const int len = K - k0 < ag ? K - k0 : ag;
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < len; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(x, bf16, k0 + i)));
            __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            m = _mm_max_ss(m, _mm_movehdup_ps(m));
            const float mx = _mm_cvtss_f32(m);
            dr[g] = mx / top;
            const __m256 inv = _mm256_set1_ps(mx > 0.0f ? top / mx : 0.0f);
            const __m256i shift = _mm256_set1_epi32(offset);
            __m256i isum = _mm256_setzero_si256();
            for (int i = 0; i < len; i += G) {
                const size_t at = static_cast<size_t>(k0) + i;
                const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, bf16, at), inv));  // half to even
                const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, bf16, at + 8), inv));
                const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, bf16, at + 16), inv));
                const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, bf16, at + 24), inv));
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
                __m256i p = _mm256_packs_epi16(
                    _mm256_packs_epi32(_mm256_add_epi32(i0, shift), _mm256_add_epi32(i1, shift)),
                    _mm256_packs_epi32(_mm256_add_epi32(i2, shift), _mm256_add_epi32(i3, shift)));
                p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo lane interleave
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + at), p);
            }
            sr[g] = dr[g] * hsum(_mm256_cvtepi32_ps(isum));
        }
    }
};

inline void store(void* out, int out_bf16, size_t i, float v) {
    if (out_bf16)
        static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(out)[i] = v;
}

// ---- int8 weights ----
// Layout: weight rows in slabs of 16 (N padded with zero rows); a slab is, per 4 consecutive inputs
// (a quad), the 16 rows' 4 codes each: 64 bytes, one zmm (AVX2: two ymm). An activation quad is
// broadcast to every lane and one vpdpbusd adds the 16 rows' 4 products: every lane is one output, so
// no lanes are summed across at the end, and the same loop serves one decode row or a prefill tile.
//
// Activations are 7-bit per group of 256 (the act_group), stored as code + 64 in 1..127: AVX2's
// vpmaddubsw multiplies unsigned by signed bytes into int16 pairs, and 127·127·2 cannot saturate
// (8-bit unsigned activations would: 255·127·2, fbgemm's failure without VNNI). The offset comes back
// out exactly in int32: each group's accumulator starts at −64·Σw (`neg_off`, precomputed per row and
// group). 7-bit activations cost SmolLM2 +0.8% perplexity against +0.5% for 8-bit.
//
// The rule every int8 output follows, whatever the batch and tile: each activation group's exact
// integer sum Σ w·c takes one fused multiply-add with the group's scale, groups in order, from 0;
// then each outlier channel's fp32 product takes one fused multiply-add, channels in order, then
// the row scale and bias. So an output's bits do not depend on how many rows its batch has, nor on
// the build (AVX2 or VNNI).
constexpr int SLAB = 16;  // weight rows per slab

inline int32_t load4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if SB_ZMM
using VI = __m512i;
constexpr int VR = 16;   // weight rows per vector
constexpr int MR = 6;    // activation rows per register tile: 6 × 4 zmm accumulators
constexpr int NS = 4;    // slabs per work unit: 64 output rows, 4 vectors per activation row
inline VI vload(const void* p) { return _mm512_loadu_si512(p); }
inline VI vzero() { return _mm512_setzero_si512(); }
inline VI vset1(int32_t v) { return _mm512_set1_epi32(v); }
// Inline asm, not _mm512_dpbusd_epi32: GCC 12 copies the tied accumulator in and out of a spare
// register around every intrinsic call (2 moves per vpdpbusd, measured 40% slower at 6 × 4).
inline VI vdot(VI acc, VI u, VI s) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}
inline void vfma_store(float* f, VI sums, float d) {
    _mm512_storeu_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d), _mm512_loadu_ps(f)));
}
// f[0..16) += side[j] · codes[j·stride + 0..16) for j in order, one fused multiply-add each.
inline void vfma_codes(float* f, const float* side, const int8_t* codes, int n, int stride) {
    __m512 acc = _mm512_loadu_ps(f);
    for (int j = 0; j < n; ++j) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + static_cast<size_t>(j) * stride));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(side[j]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), acc);
    }
    _mm512_storeu_ps(f, acc);
}
#else
using VI = __m256i;
constexpr int VR = 8;
constexpr int MR = 2;  // 16 ymm registers: 2 × 4 accumulators, 4 weight vectors
constexpr int NS = 2;  // slabs per work unit: 32 output rows, 4 vectors per activation row
inline VI vload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VI vzero() { return _mm256_setzero_si256(); }
inline VI vset1(int32_t v) { return _mm256_set1_epi32(v); }
inline VI vdot(VI acc, VI u, VI s) { return dot_add(acc, u, s); }
inline void vfma_store(float* f, VI sums, float d) {
    _mm256_storeu_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), _mm256_loadu_ps(f)));
}
inline void vfma_codes(float* f, const float* side, const int8_t* codes, int n, int stride) {
    __m256 acc = _mm256_loadu_ps(f);
    for (int j = 0; j < n; ++j) {
        const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + static_cast<size_t>(j) * stride));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(side[j]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), acc);
    }
    _mm256_storeu_ps(f, acc);
}
#endif

struct Int8Args {
    const int8_t* w;
    const int32_t* neg_off;  // (slabs, groups, 16): −64·Σw per row and activation group
    const int8_t* outlier_w;  // (n_out, N padded to 16): the outlier columns' codes, transposed, or null
    int groups;
    int n_rows;  // N padded to 16: the row stride of outlier_w
};

// One activation group (inputs k0 .. end-1, group g) of mr activation rows from m0 against ns slabs
// from s0 (ns ≤ NS), fused into res (row stride `ld`): res[m][r] = fma(Σ w·c, d, res[m][r]).
// `stream`: the first row tile to meet this slice of weights, which comes from memory (prefetched);
// the other tiles find it in L1 (64 rows × 256 inputs = 16 KB).
template <int mr, int ns>
void int8_group(const Int8Args& p, const Acts& a, int s0, int m0, int g, int k0, int end, float* res, int ld,
                bool stream) {
    constexpr int nv = ns * SLAB / VR;
    const size_t slab_bytes = static_cast<size_t>(SLAB) * a.K;
    const int8_t* w = p.w + static_cast<size_t>(s0) * slab_bytes;
    const int8_t* xq[mr];
    float d[mr];
    for (int m = 0; m < mr; ++m) {
        xq[m] = a.q + static_cast<size_t>(m0 + m) * a.K;
        d[m] = a.d[static_cast<size_t>(m0 + m) * a.stride + g];
    }
    // The accumulators are named variables, not an array: GCC 12 keeps an array of vectors in memory
    // and stores every element back each iteration (measured: half the speed at 6 × 4).
#define SB_EACH_V(F, m) F(m, 0) F(m, 1) F(m, 2) F(m, 3)
#define SB_EACH(F) SB_EACH_V(F, 0) SB_EACH_V(F, 1) SB_EACH_V(F, 2) SB_EACH_V(F, 3) SB_EACH_V(F, 4) SB_EACH_V(F, 5)
#define SB_DECL(m, v) VI c##m##v = vzero();
#define SB_INIT(m, v) \
    if constexpr (m < mr && v < nv) c##m##v = start##v;
#define SB_STEP(m, v) \
    if constexpr (m < mr && v < nv) c##m##v = vdot(c##m##v, x##m, w##v);
#define SB_ROW(m)                                                                \
    if constexpr (m < mr) {                                                      \
        const VI x##m = vset1(load4(xq[m] + k));                                 \
        SB_EACH_V(SB_STEP, m)                                                    \
    }
#define SB_FINISH(m, v) \
    if constexpr (m < mr && v < nv) vfma_store(res + (m0 + m) * ld + v * VR, c##m##v, d[m]);
    static_assert(MR <= 6 && NS * SLAB / VR <= 4, "the named accumulators cover 6 rows × 4 vectors");
    auto neg = [&](int v) {
        return p.neg_off + (static_cast<size_t>(s0 + v / (SLAB / VR)) * p.groups + g) * SLAB + (v % (SLAB / VR)) * VR;
    };
    auto wat = [&](int v) { return w + static_cast<size_t>(v / (SLAB / VR)) * slab_bytes + (v % (SLAB / VR)) * VR * 4; };
    const int8_t* wp0 = wat(0);
    const int8_t* wp1 = wat(nv > 1 ? 1 : 0);
    const int8_t* wp2 = wat(nv > 2 ? 2 : 0);
    const int8_t* wp3 = wat(nv > 3 ? 3 : 0);
    const VI start0 = vload(neg(0));
    const VI start1 = nv > 1 ? vload(neg(1)) : start0;
    const VI start2 = nv > 2 ? vload(neg(2)) : start0;
    const VI start3 = nv > 3 ? vload(neg(3)) : start0;
    SB_EACH(SB_DECL)
    SB_EACH(SB_INIT)
    for (int k = k0; k < end; k += 4) {
        const size_t at = static_cast<size_t>(k) * SLAB;
        if (stream)  // one 64-byte line per slab and quad
            for (int j = 0; j < ns; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(w + j * slab_bytes + at) + SB_PREFETCH, _MM_HINT_T0);
        const VI w0 = vload(wp0 + at);
        const VI w1 = nv > 1 ? vload(wp1 + at) : w0;
        const VI w2 = nv > 2 ? vload(wp2 + at) : w0;
        const VI w3 = nv > 3 ? vload(wp3 + at) : w0;
        SB_ROW(0) SB_ROW(1) SB_ROW(2) SB_ROW(3) SB_ROW(4) SB_ROW(5)
    }
    SB_EACH(SB_FINISH)
}

template <int ns>
void int8_rows(const Int8Args& p, const Acts& a, int s0, int m0, int mr, int g, int k0, int end, float* res, int ld,
               bool stream) {
    switch (mr) {
#if SB_ZMM
        case 6: return int8_group<6, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
        case 5: return int8_group<5, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
        case 4: return int8_group<4, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
        case 3: return int8_group<3, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
#endif
        case 2: return int8_group<2, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
        default: return int8_group<1, ns>(p, a, s0, m0, g, k0, end, res, ld, stream);
    }
}

// All M activation rows against one unit of ns slabs from s0: res (M, NS·16), groups outermost so each
// slice of weights is read from memory once and then serves every row tile from L1.
void int8_unit(const Int8Args& p, const Acts& a, int M, int s0, int ns, float* res) {
    constexpr int ld = NS * SLAB;
    std::fill(res, res + static_cast<size_t>(M) * ld, 0.0f);
    for (int k0 = 0, g = 0; k0 < a.K; k0 += a.ag, ++g) {
        const int end = a.K - k0 < a.ag ? a.K : k0 + a.ag;
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int mr = std::min(MR, M - m0);
            switch (ns) {
#if SB_ZMM
                case 4: int8_rows<4>(p, a, s0, m0, mr, g, k0, end, res, ld, m0 == 0); break;
                case 3: int8_rows<3>(p, a, s0, m0, mr, g, k0, end, res, ld, m0 == 0); break;
#endif
                case 2: int8_rows<2>(p, a, s0, m0, mr, g, k0, end, res, ld, m0 == 0); break;
                default: int8_rows<1>(p, a, s0, m0, mr, g, k0, end, res, ld, m0 == 0); break;
            }
        }
    }
    // The outlier channels, vectorized over the rows: each channel's fp32 value times its column's codes.
    for (int m = 0; m < M && a.n_out; ++m) {
        const float* side = a.side + static_cast<size_t>(m) * a.side_stride;
        for (int v = 0; v < ns * SLAB / VR; ++v)
            vfma_codes(res + static_cast<size_t>(m) * ld + v * VR, side,
                       p.outlier_w + static_cast<size_t>(s0) * SLAB + v * VR, a.n_out, p.n_rows);
    }
}

// Row scale, bias and the store, for rows m0 .. m0+mb-1 and weight rows n0 .. n0+nr-1 (`res` row stride `ld`).
inline void emit(const float* res, int ld, int m0, int mb, int n0, int nr, int N, const float* row_scale,
                 const float* bias, void* out, int out_bf16) {
    for (int m = 0; m < mb; ++m) {
        const size_t at = static_cast<size_t>(m0 + m) * N + n0;
        int r = 0;
        for (; r + 8 <= nr; r += 8) {  // the scalar loop's operations, 8 at a time: the same bits
            __m256 v = _mm256_loadu_ps(res + m * ld + r);
            if (row_scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(row_scale + n0 + r));
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + r));
            if (!out_bf16) {
                _mm256_storeu_ps(static_cast<float*>(out) + at + r, v);
                continue;
            }
            // Round to nearest even as f32_to_bf16 does, NaNs kept quiet.
            const __m256i u = _mm256_castps_si256(v);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                                   _mm256_set1_epi32(0x7f800000));
            h = _mm256_blendv_epi8(h, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), _MM_SHUFFLE(3, 1, 2, 0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + at + r),
                             _mm256_castsi256_si128(packed));
        }
        for (; r < nr; ++r) {
            float v = res[m * ld + r];
            if (row_scale) v *= row_scale[n0 + r];
            if (bias) v += bias[n0 + r];
            store(out, out_bf16, at + r, v);
        }
    }
}

#include "int4_slabs.h"

#if SB_VARIANT == 3
#include "amx_int8.h"
#include "amx_int4.h"
#endif

}  // namespace

extern "C" {

int sb_version() { return 5; }

int sb_variant() { return SB_VARIANT; }  // 1: avx2, 2: avx512-vnni, 3: amx

size_t sb_int4_bytes(int N, int K) {
    return static_cast<size_t>((N + SLAB - 1) / SLAB) * (K / G) * SLAB4_BYTES;
}

// out (M, N) = x (M, K) · wᵀ for an int4 weight in the slab layout (int4_slabs.h).
void sb_int4_linear(const void* x, int x_bf16, int M, int K, int N, const uint8_t* w, const float* bias, void* out,
                    int out_bf16) {
    const Acts a(x, x_bf16, M, K, G);
#if SB_VARIANT == 3
    if (M >= AMX_INT4_MIN_ROWS && amx_permitted()) return int4_linear_amx(a, M, N, w, bias, out, out_bf16);
#endif
    int4_linear_vec(a, M, N, w, bias, out, out_bf16);
}

// out (M, N) = x (M, K) · (w · scale)ᵀ for an int8 weight in the slab layout (scales padded to 16 rows),
// activations quantized to 7 bits per `act_group` values (a multiple of 32, at most 256); `neg_off`
// (slabs, groups, 16) holds −64 × each row's sum of codes per group. With `n_out` outlier channels
// `out_idx`, those inputs skip the int8 product and meet their weight columns in fp32: `outlier_w`,
// the columns' int8 codes, (n_out, N padded to 16 rows).
void sb_int8_linear(const void* x, int x_bf16, int M, int K, int N, const int8_t* w, const float* scales,
                    const int32_t* neg_off, int act_group, const int32_t* out_idx, int n_out,
                    const int8_t* outlier_w, const float* bias, void* out, int out_bf16) {
#if SB_VARIANT == 3
    if (M >= AMX_MIN_ROWS && amx_permitted())
        return int8_linear_amx(x, x_bf16, M, K, N, w, scales, act_group, out_idx, n_out, outlier_w, bias, out,
                               out_bf16);
#endif
    const Acts a(x, x_bf16, M, K, act_group, 64, out_idx, n_out);
    const Int8Args p{w, neg_off, outlier_w, (K + act_group - 1) / act_group, (N + SLAB - 1) / SLAB * SLAB};
    const int slabs = (N + SLAB - 1) / SLAB, units = (slabs + NS - 1) / NS;
    // Units of NS slabs (64 weight rows; 32 on AVX2) split statically over the threads.
#pragma omp parallel
    {
        std::vector<float> res(static_cast<size_t>(M) * NS * SLAB);
#pragma omp for schedule(static)
        for (int u = 0; u < units; ++u) {
            const int s0 = u * NS, ns = std::min(NS, slabs - s0), n0 = s0 * SLAB, nr = std::min(ns * SLAB, N - n0);
            int8_unit(p, a, M, s0, ns, res.data());
            emit(res.data(), NS * SLAB, 0, M, n0, nr, N, scales, bias, out, out_bf16);
        }
    }
}

// Whether the int8 and int4 GEMMs run on AMX tiles from AMX_MIN_ROWS rows (the AMX build, where Linux grants the tiles).
int sb_amx() {
#if SB_VARIANT == 3
    return amx_permitted();
#else
    return 0;
#endif
}

// The activation quantization alone, for tests: q (M, K) int8, d and s (M, ceil(K/act_group)) fp32.
void sb_quantize_acts(const void* x, int x_bf16, int M, int K, int act_group, int offset, int8_t* q, float* d,
                      float* s) {
    const Acts a(x, x_bf16, M, K, act_group, offset);
    const int groups = (K + act_group - 1) / act_group;
    memcpy(q, a.q, static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m) {
        memcpy(d + static_cast<size_t>(m) * groups, a.d + static_cast<size_t>(m) * a.stride, groups * 4);
        memcpy(s + static_cast<size_t>(m) * groups, a.s + static_cast<size_t>(m) * a.stride, groups * 4);
    }
}
}
