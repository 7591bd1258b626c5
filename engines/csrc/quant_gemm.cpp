// int4 and int8 weight GEMMs for x86 CPUs with AVX2: weights stay packed, activations are quantized
// to int8 in groups of 32 on the fly (as llama.cpp's Q8_0), and dot products run on vpmaddubsw.
//
// Why: decode reads every weight once per step; torch's int4 kernel dequantizes to float and is
// compute-bound (~14 G weights/s on 2 AVX2 cores), while an integer dot product keeps pace with memory.
//
// Layouts (engines/cpu_kernels.py packs them). Output rows come in blocks of 4 (N padded with zero
// rows), and each block is one contiguous run of bytes read front to back, so a thread streams its
// share of the weight sequentially and a software prefetch a few KB ahead keeps memory busy.
//   int4: a block is a run of chunks of up to 8 groups of 32 inputs; per chunk, for each of the 4 rows:
//         8 fp16 scales, 8 fp16 mins (zero past the last group), then one 32-byte pair per two groups:
//         byte i = code[i] of the first group | code[i] of the second << 4. w = code · scale + min.
//   int8: a block is, per group of 32 inputs, the 4 rows' 32 codes each; one fp32 scale per row.
// Activations: bf16 or fp32 rows (M, K), K a multiple of 32; out (M, N) bf16 or fp32; optional fp32
// bias. Each output row is computed the same way whatever M is, so results do not depend on the batch.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SB_PREFETCH
#define SB_PREFETCH 4096  // bytes ahead of the read position: 4-16 KB measured best (64 B-1 KB: -25-40%)
#endif

namespace {

constexpr int G = 32;    // values per quantization group (weights and activations)
constexpr int ROWS = 4;  // output rows per block: the activations are loaded once for all four

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

// Quantized activations: per row, int8 codes, a scale per group (d) and d·Σcodes per group (s). With
// the quantized sum, an int4 weight's min term sees the same activations as its code term, so the two
// cancel as in the float product (the exact float sum made errors about 2x larger). d and s rows are
// padded with zeros to a multiple of 8 groups, so a chunk's vector loads never read garbage.
struct Acts {
    int8_t* q = nullptr;
    float* d = nullptr;
    float* s = nullptr;
    int K = 0;
    int stride = 0;  // groups per row of d and s, padded

    Acts(const void* x, int bf16, int M, int K_) : K(K_) {
        const int groups = K / G;
        stride = (groups + 7) / 8 * 8;
        q = static_cast<int8_t*>(aligned_alloc(64, (static_cast<size_t>(M) * K + 63) / 64 * 64));
        const size_t fbytes = (static_cast<size_t>(M) * stride * 4 + 63) / 64 * 64;
        d = static_cast<float*>(aligned_alloc(64, fbytes));
        s = static_cast<float*>(aligned_alloc(64, fbytes));
        memset(d, 0, fbytes);
        memset(s, 0, fbytes);
        const size_t elem = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (M > 1)
        for (int m = 0; m < M; ++m)
            quantize_row(static_cast<const char*>(x) + m * K * elem, bf16, q + static_cast<size_t>(m) * K,
                         d + static_cast<size_t>(m) * stride, s + static_cast<size_t>(m) * stride);
    }
    ~Acts() {
        free(q);
        free(d);
        free(s);
    }
    Acts(const Acts&) = delete;
    Acts& operator=(const Acts&) = delete;

    void quantize_row(const void* x, int bf16, int8_t* qr, float* dr, float* sr) const {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int g = 0; g < K / G; ++g) {
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; ++j) {
                v[j] = load8(x, bf16, static_cast<size_t>(g) * G + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            m = _mm_max_ss(m, _mm_movehdup_ps(m));
            const float mx = _mm_cvtss_f32(m);
            dr[g] = mx / 127.0f;
            const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv));  // rounds half to even
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv));
            const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            sr[g] = dr[g] * hsum(_mm256_cvtepi32_ps(isum));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo lane interleave
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + static_cast<size_t>(g) * G), p);
        }
    }
};

inline void store(void* out, int out_bf16, size_t i, float v) {
    if (out_bf16)
        static_cast<uint16_t*>(out)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(out)[i] = v;
}

size_t int4_block_bytes(int groups) {
    const int full = groups / 8, rest = groups % 8;
    return static_cast<size_t>(ROWS) * (full * 160 + (rest ? 32 + 32 * ((rest + 1) / 2) : 0));
}

// One block of 4 int4 rows against one activation row.
void int4_block(const uint8_t* blk, int groups, const Acts& a, int m, float out[ROWS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int8_t* xq = a.q + static_cast<size_t>(m) * a.K;
    const float* xd = a.d + static_cast<size_t>(m) * a.stride;
    const float* xs = a.s + static_cast<size_t>(m) * a.stride;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int g0 = 0; g0 < groups; g0 += 8) {
        const int pairs = (groups - g0 >= 8) ? 4 : (groups - g0 + 1) / 2;
        const int row_bytes = 32 + 32 * pairs;
        const __m256 dv = _mm256_load_ps(xd + g0);
        const __m256 sv = _mm256_load_ps(xs + g0);
        for (int r = 0; r < ROWS; ++r) {
            const uint8_t* hdr = blk + r * row_bytes;
            _mm_prefetch(reinterpret_cast<const char*>(hdr) + SB_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(hdr) + SB_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(hdr) + SB_PREFETCH + 128, _MM_HINT_T0);
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr)));
            const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hdr + 16)));
            const __m256 f = _mm256_mul_ps(s, dv);  // code scale × activation scale, per group
            __m256 acc_r = _mm256_fmadd_ps(mins, sv, acc[r]);  // lanes are summed at the end
#pragma GCC unroll 4
            for (int j = 0; j < pairs; ++j) {
                const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + 32 + 32 * j));
                const int8_t* x = xq + static_cast<size_t>(g0 + 2 * j) * G;
                const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
                const __m256i lo = _mm256_and_si256(wv, low4);
                const __m256i p0 = sum_pairs(_mm256_maddubs_epi16(lo, x0));
                acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), lane(f, 2 * j), acc_r);
                if (g0 + 2 * j + 1 < groups) {  // else the pair's second half is padding
                    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + G));
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
                    const __m256i p1 = sum_pairs(_mm256_maddubs_epi16(hi, x1));
                    acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), lane(f, 2 * j + 1), acc_r);
                }
            }
            acc[r] = acc_r;
        }
        blk += ROWS * row_bytes;
    }
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
}

// One block of 4 int8 rows against one activation row (before the rows' scales).
void int8_block(const int8_t* blk, int groups, const Acts& a, int m, float out[ROWS]) {
    const int8_t* xq = a.q + static_cast<size_t>(m) * a.K;
    const float* xd = a.d + static_cast<size_t>(m) * a.stride;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        _mm_prefetch(reinterpret_cast<const char*>(blk) + SB_PREFETCH, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blk) + SB_PREFETCH + 64, _MM_HINT_T0);
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + static_cast<size_t>(g) * G));
        const __m256 d = _mm256_broadcast_ss(xd + g);
        for (int r = 0; r < ROWS; ++r) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + r * G));
            // |w| as unsigned times x with w's sign: vpmaddubsw wants one unsigned operand
            const __m256i p = sum_pairs(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r]);
        }
        blk += ROWS * G;
    }
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
}

// Blocks of rows split statically over the threads: each thread reads one contiguous part of the weight.
template <typename Block>
void gemm(int M, int N, size_t block_bytes, const float* row_scale, const float* bias, void* out, int out_bf16,
          Block block) {
    const int blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int n0 = b * ROWS;
        const int nr = N - n0 < ROWS ? N - n0 : ROWS;
        for (int m = 0; m < M; ++m) {  // the block (at most a few KB per row) stays in L1/L2 across m
            float res[ROWS];
            block(static_cast<size_t>(b) * block_bytes, m, res);
            for (int r = 0; r < nr; ++r) {
                float v = res[r];
                if (row_scale) v *= row_scale[n0 + r];
                if (bias) v += bias[n0 + r];
                store(out, out_bf16, static_cast<size_t>(m) * N + n0 + r, v);
            }
        }
    }
}

}  // namespace

extern "C" {

int sb_version() { return 2; }

size_t sb_int4_bytes(int N, int K) { return static_cast<size_t>((N + ROWS - 1) / ROWS) * int4_block_bytes(K / G); }

// out (M, N) = x (M, K) · wᵀ for an int4 weight in the layout above.
void sb_int4_linear(const void* x, int x_bf16, int M, int K, int N, const uint8_t* w, const float* bias, void* out,
                    int out_bf16) {
    const Acts a(x, x_bf16, M, K);
    const int groups = K / G;
    gemm(M, N, int4_block_bytes(groups), nullptr, bias, out, out_bf16,
         [&](size_t off, int m, float res[ROWS]) { int4_block(w + off, groups, a, m, res); });
}

// out (M, N) = x (M, K) · (w · scale)ᵀ for an int8 weight in the layout above (scales padded to 4 rows).
void sb_int8_linear(const void* x, int x_bf16, int M, int K, int N, const int8_t* w, const float* scales,
                    const float* bias, void* out, int out_bf16) {
    const Acts a(x, x_bf16, M, K);
    const int groups = K / G;
    gemm(M, N, static_cast<size_t>(ROWS) * K, scales, bias, out, out_bf16,
         [&](size_t off, int m, float res[ROWS]) { int8_block(w + off, groups, a, m, res); });
}

// The activation quantization alone, for tests: q (M, K) int8, d and s (M, K/32) fp32.
void sb_quantize_acts(const void* x, int x_bf16, int M, int K, int8_t* q, float* d, float* s) {
    const Acts a(x, x_bf16, M, K);
    const int groups = K / G;
    memcpy(q, a.q, static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m) {
        memcpy(d + static_cast<size_t>(m) * groups, a.d + static_cast<size_t>(m) * a.stride, groups * 4);
        memcpy(s + static_cast<size_t>(m) * groups, a.s + static_cast<size_t>(m) * a.stride, groups * 4);
    }
}
}
