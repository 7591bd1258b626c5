// int4 and int8 weight GEMMs for x86 CPUs with AVX2: weights stay packed, activations are quantized
// on the fly (8 bits per 32 inputs for int4 weights, as llama.cpp's Q8_0; 7 bits per 256 for int8
// weights, see int8_block), and dot products run on vpmaddubsw.
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
//   int8: a block is, per group of 32 inputs, the 4 rows' 32 codes each; one fp32 scale per row, and
//         per row 64 × its codes' sum over each activation group (the activations' offset, below).
// Activations: bf16 or fp32 rows (M, K), K a multiple of 32; out (M, N) bf16 or fp32; optional fp32
// bias. Each output row is computed the same way whatever M is, so results do not depend on the batch.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#ifndef SB_PREFETCH
#define SB_PREFETCH 4096  // bytes ahead of the read position: 4-16 KB measured best (64 B-1 KB: -25-40%)
#endif

namespace {

constexpr int G = 32;    // values per weight group, and per activation group against int4 weights
constexpr int ROWS = 4;  // output rows per block: the activations are loaded once for all four
constexpr int MT = 4;    // activation rows per block call

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
// pairs (int4: 15·127·2; int8: 127·127·2 < 32,767, see int8_block).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SB_VARIANT 2
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
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
// 7-bit and stored with +64, unsigned: see int8_block for why. Optional outlier channels are
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

    int offset = 0;  // 64: codes are 7-bit, stored as code + 64 (unsigned; see int8_block)

    Acts(const void* x, int bf16, int M, int K_, int ag_, int offset_ = 0, const int32_t* out_idx = nullptr,
         int n_out_ = 0)
        : K(K_), ag(ag_), n_out(n_out_), offset(offset_) {
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
            const float top = offset ? 63.0f : 127.0f;
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
                const __m256i p0 = dot_add(_mm256_setzero_si256(), lo, x0);
                acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), lane(f, 2 * j), acc_r);
                if (g0 + 2 * j + 1 < groups) {  // else the pair's second half is padding
                    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + G));
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
                    const __m256i p1 = dot_add(_mm256_setzero_si256(), hi, x1);
                    acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), lane(f, 2 * j + 1), acc_r);
                }
            }
            acc[r] = acc_r;
        }
        blk += ROWS * row_bytes;
    }
    for (int r = 0; r < ROWS; ++r) out[r] = hsum(acc[r]);
}

// One block of 4 int8 rows against MB activation rows (before the rows' scales).
// vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16. With 8-bit codes on both
// sides that needs |w| and x with w's sign (two more ops per product: 20% slower at 16 rows than
// fbgemm); unsigned 8-bit activations would overflow int16 (255·127·2, fbgemm's saturation without
// VNNI). So activations are 7-bit per group of 256, stored as code + 64 in 1..127 (127·127·2 fits),
// and the offset is taken back per group: Σ w·(c + 64) − 64·Σw, with Σw per row and group precomputed
// (`offset_w` = 64·Σw). 7-bit activations cost SmolLM2 +0.8% perplexity against +0.5% for 8-bit.
// Within a group the dot products accumulate in int32 (|sum| < 2^22), then take one float step; each
// weight load serves MB activation rows.
template <int MB>
void int8_block(const int8_t* blk, const int8_t* outlier_w, const float* offset_w, const Acts& a, int m0,
                float out[MT][ROWS]) {
    __m256 acc[ROWS][MB];
    for (int r = 0; r < ROWS; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const int8_t* xq[MB];
    const float* xd[MB];
    for (int m = 0; m < MB; ++m) {
        xq[m] = a.q + static_cast<size_t>(m0 + m) * a.K;
        xd[m] = a.d + static_cast<size_t>(m0 + m) * a.stride;
    }
    for (int k0 = 0, ag = 0; k0 < a.K; k0 += a.ag, ++ag) {
        const int end = a.K - k0 < a.ag ? a.K : k0 + a.ag;
        __m256i dot[ROWS][MB];
        for (int r = 0; r < ROWS; ++r)
            for (int m = 0; m < MB; ++m) dot[r][m] = _mm256_setzero_si256();
        for (int k = k0; k < end; k += G) {
            const int8_t* wg = blk + static_cast<size_t>(k) * ROWS;  // this group's 4 rows × 32 codes
            _mm_prefetch(reinterpret_cast<const char*>(wg) + SB_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wg) + SB_PREFETCH + 64, _MM_HINT_T0);
            __m256i x[MB];
            for (int m = 0; m < MB; ++m) x[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + k));
            for (int r = 0; r < ROWS; ++r) {
                const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + r * G));
                for (int m = 0; m < MB; ++m)
                    dot[r][m] = dot_add(dot[r][m], x[m], wv);
            }
        }
        for (int m = 0; m < MB; ++m) {
            const __m256 dm = _mm256_broadcast_ss(xd[m] + ag);
            for (int r = 0; r < ROWS; ++r) acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][m]), dm, acc[r][m]);
        }
    }
    // The activation offset: −64·Σw of each group times the group's scale (padded groups are zero).
    for (int j = 0; j < a.stride; j += 8)
        for (int m = 0; m < MB; ++m) {
            const __m256 dv = _mm256_load_ps(xd[m] + j);
            for (int r = 0; r < ROWS; ++r)
                acc[r][m] = _mm256_fnmadd_ps(
                    dv, _mm256_loadu_ps(offset_w + static_cast<size_t>(r) * a.stride + j), acc[r][m]);
        }
    // The outlier channels, in fp32 against their weight columns' codes (both padded with zeros to
    // 8s), into the same accumulators.
    for (int j = 0; j < a.side_stride; j += 8)
        for (int m = 0; m < MB; ++m) {
            const __m256 sd = _mm256_loadu_ps(a.side + static_cast<size_t>(m0 + m) * a.side_stride + j);
            for (int r = 0; r < ROWS; ++r) {
                const __m128i codes =
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(outlier_w + static_cast<size_t>(r) * a.side_stride + j));
                acc[r][m] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), acc[r][m]);
            }
        }
    for (int r = 0; r < ROWS; ++r)
        for (int m = 0; m < MB; ++m) out[m][r] = hsum(acc[r][m]);
}

// Blocks of rows split statically over the threads: each thread reads one contiguous part of the weight.
// `block(b, m0, mb, res)` computes rows m0 .. m0+mb-1 (mb ≤ MT) of one 4-row block.
template <typename Block>
void gemm(int M, int N, const float* row_scale, const float* bias, void* out, int out_bf16, Block block) {
    const int blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int n0 = b * ROWS;
        const int nr = N - n0 < ROWS ? N - n0 : ROWS;
        for (int m0 = 0; m0 < M; m0 += MT) {  // the block (a few KB) stays in L1/L2 across m
            const int mb = M - m0 < MT ? M - m0 : MT;
            float res[MT][ROWS];
            block(b, m0, mb, res);
            for (int m = 0; m < mb; ++m)
                for (int r = 0; r < nr; ++r) {
                    float v = res[m][r];
                    if (row_scale) v *= row_scale[n0 + r];
                    if (bias) v += bias[n0 + r];
                    store(out, out_bf16, static_cast<size_t>(m0 + m) * N + n0 + r, v);
                }
        }
    }
}

}  // namespace

extern "C" {

int sb_version() { return 4; }

int sb_variant() { return SB_VARIANT; }  // 1: avx2, 2: avx512-vnni

size_t sb_int4_bytes(int N, int K) { return static_cast<size_t>((N + ROWS - 1) / ROWS) * int4_block_bytes(K / G); }

// out (M, N) = x (M, K) · wᵀ for an int4 weight in the layout above.
void sb_int4_linear(const void* x, int x_bf16, int M, int K, int N, const uint8_t* w, const float* bias, void* out,
                    int out_bf16) {
    const Acts a(x, x_bf16, M, K, G);
    const int groups = K / G;
    const size_t bytes = int4_block_bytes(groups);
    gemm(M, N, nullptr, bias, out, out_bf16, [&](int b, int m0, int mb, float res[MT][ROWS]) {
        for (int m = 0; m < mb; ++m) int4_block(w + b * bytes, groups, a, m0 + m, res[m]);
    });
}

// out (M, N) = x (M, K) · (w · scale)ᵀ for an int8 weight in the layout above (scales padded to 4 rows),
// activations quantized to 7 bits per `act_group` values (a multiple of 32, at most 256); `offset_w`
// (N padded to 4 rows × groups padded to 8) holds 64 × each row's sum of codes per group. With `n_out` outlier
// channels `out_idx`, those inputs skip the int8 product and meet their weight columns in fp32:
// `outlier_w`, the columns' int8 codes (N padded to 4 rows, n_out padded with zeros to 8s).
void sb_int8_linear(const void* x, int x_bf16, int M, int K, int N, const int8_t* w, const float* scales,
                    const float* offset_w, int act_group, const int32_t* out_idx, int n_out,
                    const int8_t* outlier_w, const float* bias, void* out, int out_bf16) {
    const Acts a(x, x_bf16, M, K, act_group, 64, out_idx, n_out);
    const size_t bytes = static_cast<size_t>(ROWS) * K;
    gemm(M, N, scales, bias, out, out_bf16, [&](int b, int m0, int mb, float res[MT][ROWS]) {
        const int8_t* ow = n_out ? outlier_w + static_cast<size_t>(b) * ROWS * a.side_stride : nullptr;
        const float* off = offset_w + static_cast<size_t>(b) * ROWS * a.stride;
        int m = 0;
        for (; m + 2 <= mb; m += 2) {
            float two[MT][ROWS];
            int8_block<2>(w + b * bytes, ow, off, a, m0 + m, two);
            for (int i = 0; i < 2; ++i)
                for (int r = 0; r < ROWS; ++r) res[m + i][r] = two[i][r];
        }
        if (m < mb) {
            float one[MT][ROWS];
            int8_block<1>(w + b * bytes, ow, off, a, m0 + m, one);
            for (int r = 0; r < ROWS; ++r) res[m][r] = one[0][r];
        }
    });
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
