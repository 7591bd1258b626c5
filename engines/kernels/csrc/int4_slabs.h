// int4 weights in slabs of 16 rows, one kernel for every batch size (part of quant_gemm.cpp, included there).
//
// Why slabs: the old layout (blocks of 4 rows, each output's 8 lanes summed in float per group) read
// at memory speed for one row but repeated all its float work per activation row: 16 rows ran at a
// fifth of int8's speed. Here, as for int8, one vpdpbusd adds 16 outputs' products for one input
// quad, so the integer work per row is int8's, the unpacking of nibbles is shared by every row of a
// tile, and the same group sums feed AMX tiles (amx_int4.h).
//
// Layout: per slab (16 weight rows, N padded with zero rows) and group of 32 inputs, 320 bytes: 16
// fp16 scales, 16 fp16 mins (w = code · scale + min, code 0..15), then 256 bytes of codes: byte b
// holds unpacked byte b (low nibble) and b + 256 (high nibble), where the 512 unpacked bytes are the
// int8 slab layout of the group (per quad of inputs, the 16 rows' 4 codes).
//
// The rule every int4 output follows, whatever the batch, tile or build: per group in order, the
// exact int32 sum Σ code · c (c the row's 8-bit activation codes) takes one fused multiply-add with
// fp32(scale · d), then the min takes one with the group's d · Σc; then the bias.
constexpr int SLAB4_BYTES = 320;  // per slab and group: 32 + 32 header bytes, 256 of codes

#if SB_ZMM
constexpr int VPS = 1;  // vectors per 16-row slab
constexpr int MR4 = 8;  // activation rows per register tile: 8 accumulators + 8 results + 8 weight quads
inline VI low_nibbles(VI p) { return _mm512_and_si512(p, _mm512_set1_epi8(0x0F)); }
inline VI high_nibbles(VI p) { return _mm512_and_si512(_mm512_srli_epi16(p, 4), _mm512_set1_epi8(0x0F)); }
inline __m512 vcvt(VI v) { return _mm512_cvtepi32_ps(v); }
inline __m512 half_load(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
using VF = __m512;
inline VF fset1(float f) { return _mm512_set1_ps(f); }
inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF ffma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline void fstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
constexpr int VPS = 2;
constexpr int MR4 = 2;  // 16 ymm: 8 weight quads, 2 accumulators, 2 × 2 results (halves one at a time)
inline VI low_nibbles(VI p) { return _mm256_and_si256(p, _mm256_set1_epi8(0x0F)); }
inline VI high_nibbles(VI p) { return _mm256_and_si256(_mm256_srli_epi16(p, 4), _mm256_set1_epi8(0x0F)); }
inline __m256 vcvt(VI v) { return _mm256_cvtepi32_ps(v); }
inline __m256 half_load(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
using VF = __m256;
inline VF fset1(float f) { return _mm256_set1_ps(f); }
inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF ffma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline void fstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif

// vpdpbusd with the weights unsigned (codes 0..15) and the activations signed. AVX2: 15·127·2 per
// int16 pair cannot saturate, so the same int32s.
inline VI vdot_u(VI acc, VI w, VI x) {
#if SB_ZMM
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
#else
    return dot_add(acc, w, x);
#endif
}

// One slab against rows m0 .. m0 + mr - 1, all groups: res[m][0..16) (row stride 16).
template <int mr>
void int4_slab(const uint8_t* slab, int groups, const Acts& a, int m0, float* res, bool stream) {
    const int8_t* xq[mr];
    for (int m = 0; m < mr; ++m) xq[m] = a.q + static_cast<size_t>(m0 + m) * a.K;
    for (int h = 0; h < VPS; ++h) {  // AVX2: rows 0-7, then 8-15
        VF r[mr];
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) r[m] = fzero();
        const uint8_t* p = slab;
        for (int g = 0; g < groups; ++g, p += SLAB4_BYTES) {
            if (stream && h == 0)
                for (int line = 0; line < SLAB4_BYTES; line += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(p) + SB_PREFETCH + line, _MM_HINT_T0);
            VI w[8];
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) {
                const VI packed = vload(p + 64 + 64 * q + h * 32);
                w[q] = low_nibbles(packed);
                w[q + 4] = high_nibbles(packed);
            }
            const VF scale = half_load(p + h * 16), mins = half_load(p + 32 + h * 16);
#pragma GCC unroll 8
            for (int m = 0; m < mr; ++m) {
                const int8_t* x = xq[m] + static_cast<size_t>(g) * G;
                VI acc = vzero();
#pragma GCC unroll 8
                for (int q = 0; q < 8; ++q) acc = vdot_u(acc, w[q], vset1(load4(x + 4 * q)));
                const size_t at = static_cast<size_t>(m0 + m) * a.stride + g;
                r[m] = ffma(vcvt(acc), fmul(scale, fset1(a.d[at])), r[m]);
                r[m] = ffma(mins, fset1(a.s[at]), r[m]);
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < mr; ++m) fstore(res + m * SLAB + h * VR, r[m]);
    }
}

void int4_linear_vec(const Acts& a, int M, int N, const uint8_t* w, const float* bias, void* out,
                     int out_bf16) {
    const int groups = a.K / G, slabs = (N + SLAB - 1) / SLAB;
    const size_t slab_bytes = static_cast<size_t>(groups) * SLAB4_BYTES;
#pragma omp parallel for schedule(static)
    for (int s = 0; s < slabs; ++s) {
        const uint8_t* slab = w + s * slab_bytes;
        const int n0 = s * SLAB, nr = std::min(SLAB, N - n0);
        alignas(64) float res[MR4 * SLAB];
        for (int m0 = 0; m0 < M; m0 += MR4) {  // the slab (10 KB at K = 1536) stays in L1/L2 across m
            const int mr = std::min(MR4, M - m0);
            switch (mr) {
#if SB_ZMM
                case 8: int4_slab<8>(slab, groups, a, m0, res, m0 == 0); break;
                case 7: int4_slab<7>(slab, groups, a, m0, res, m0 == 0); break;
                case 6: int4_slab<6>(slab, groups, a, m0, res, m0 == 0); break;
                case 5: int4_slab<5>(slab, groups, a, m0, res, m0 == 0); break;
                case 4: int4_slab<4>(slab, groups, a, m0, res, m0 == 0); break;
                case 3: int4_slab<3>(slab, groups, a, m0, res, m0 == 0); break;
#endif
                case 2: int4_slab<2>(slab, groups, a, m0, res, m0 == 0); break;
                default: int4_slab<1>(slab, groups, a, m0, res, m0 == 0); break;
            }
            emit(res, SLAB, m0, mr, n0, nr, N, nullptr, bias, out, out_bf16);
        }
    }
}
