// The int4 GEMM on AMX tiles, from AMX_INT4_MIN_ROWS rows (part of quant_gemm.cpp, AMX build only; after
// amx_int8.h and int4_slabs.h).
//
// A group of 32 inputs is one tile product: tdpbsud multiplies the activations' signed codes (A, 16
// rows × 32 bytes) by the weights' unsigned codes (B, 8 quads × 16 rows × 4: the slab group's 256
// bytes of nibbles unpacked into 512), and each C element is the exact int32 sum the vector loops
// make. The float steps after it are int4_slab's (fma with fp32(scale · d), then with min and d·Σc),
// so every output is the vector builds' to the bit.
//
// Tiles: A 0, 1 (32 rows; 16 for a last block of ≤ 16), B 2, 3 (two slabs), C 4-7, through amx_chunks
// as for int8 (amx_configure(32, 8)); at ≤ 16 rows one slab at a time (amx4_slab16).

// The group's codes of one slab, unpacked to the int8 slab layout (8 quads × 64 bytes).
inline void unpack_group(const uint8_t* group, int8_t* dst) {
    for (int q = 0; q < 4; ++q) {
        const __m512i packed = _mm512_loadu_si512(group + 64 + 64 * q);
        _mm512_store_si512(dst + 64 * q, low_nibbles(packed));
        _mm512_store_si512(dst + 256 + 64 * q, high_nibbles(packed));
    }
}

template <int ma>
void amx4_rows(const Acts& a, const AmxActs& x, const uint8_t* w, int slabs, int s0, int cu, int M, int m0,
               float* res, int ld, int32_t* scratch) {
    const int8_t* xa = x.q + static_cast<size_t>(m0) * x.stride;
    const bool stream = m0 == 0;  // the first row block meets the weights in memory
    const int groups = a.K / G;
    const size_t slab_bytes = static_cast<size_t>(groups) * SLAB4_BYTES;
    const int rows = std::min(16 * ma, M - m0);
    alignas(64) int8_t b[2][512];
    for (int g = 0; g < groups; ++g) {
        for (int j = 0; j < cu; ++j) {
            const int s = s0 + j * AMX_UNIT, ns = std::min(AMX_UNIT, slabs - s);
            const uint8_t* p0 = w + s * slab_bytes + static_cast<size_t>(g) * SLAB4_BYTES;
            const uint8_t* p1 = ns > 1 ? p0 + slab_bytes : p0;  // one slab: tile 3's results are dropped
            if (stream)
                for (int line = 0; line < SLAB4_BYTES; line += 64) {
                    _mm_prefetch(reinterpret_cast<const char*>(p0) + SB_PREFETCH + line, _MM_HINT_T0);
                    _mm_prefetch(reinterpret_cast<const char*>(p1) + SB_PREFETCH + line, _MM_HINT_T0);
                }
            unpack_group(p0, b[0]);
            unpack_group(p1, b[1]);
            _tile_loadd(2, b[0], 64);
            _tile_loadd(3, b[1], 64);
            _tile_loadd(0, xa + x.start[g], x.stride);
            _tile_zero(4);
            _tile_zero(5);
            _tile_dpbsud(4, 0, 2);
            _tile_dpbsud(5, 0, 3);
            _tile_stored(4, scratch, 64);
            _tile_stored(5, scratch + 256, 64);
            if constexpr (ma > 1) {
                _tile_loadd(1, xa + 16 * static_cast<size_t>(x.stride) + x.start[g], x.stride);
                _tile_zero(6);
                _tile_zero(7);
                _tile_dpbsud(6, 1, 2);
                _tile_dpbsud(7, 1, 3);
                _tile_stored(6, scratch + 512, 64);
                _tile_stored(7, scratch + 768, 64);
            }
            const __m512 scale0 = half_load(p0), mins0 = half_load(p0 + 32);
            const __m512 scale1 = half_load(p1), mins1 = half_load(p1 + 32);
            for (int m = 0; m < rows; ++m) {
                const size_t at = static_cast<size_t>(m0 + m) * a.stride + g;
                const __m512 d = _mm512_set1_ps(a.d[at]), sx = _mm512_set1_ps(a.s[at]);
                const int32_t* c = scratch + (m / 16) * 512 + (m % 16) * 16;
                float* r = res + static_cast<size_t>(m) * ld + j * SLAB * AMX_UNIT;
                __m512 v = _mm512_fmadd_ps(vcvt(vload(c)), _mm512_mul_ps(scale0, d), _mm512_loadu_ps(r));
                _mm512_storeu_ps(r, _mm512_fmadd_ps(mins0, sx, v));
                if (ns > 1) {
                    v = _mm512_fmadd_ps(vcvt(vload(c + 256)), _mm512_mul_ps(scale1, d), _mm512_loadu_ps(r + SLAB));
                    _mm512_storeu_ps(r + SLAB, _mm512_fmadd_ps(mins1, sx, v));
                }
            }
        }
    }
}

// Up to 16 rows (decode batches) against one slab, all groups, the results in registers: one B tile per
// group, and two C tiles taking turns, so one group's tile product runs while the one before it is
// scaled into the results (with its results in memory and one C tile, the scaling was 2/3 of the time).
void amx4_slab16(const Acts& a, const AmxActs& x, const uint8_t* slab, int M, float* res, int32_t* scratch) {
    const int groups = a.K / G;
    const int last = M - 1;  // rows past M (zero tiles) read row M - 1's scales; they are never stored
    alignas(64) int8_t b[2][512];
    // Named results, not an array: GCC 12 keeps an array of vectors on the stack (see int8_group).
#define SB_R16(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
#define SB_RDECL(m) __m512 r##m = _mm512_setzero_ps();
#define SB_RSTEP(m)                                                                                       \
    {                                                                                                     \
        const size_t at = static_cast<size_t>(std::min(m, last)) * a.stride + g;                          \
        const __m512 v = _mm512_fmadd_ps(vcvt(vload(c + (m) * 16)), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[at])), r##m); \
        r##m = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.s[at]), v);                                         \
    }
#define SB_RSTORE(m) _mm512_storeu_ps(res + (m) * SLAB, r##m);
    SB_R16(SB_RDECL)
    for (int g = 0; g <= groups; ++g) {
        if (g < groups) {  // group g's product into C tile 4 + g % 2
            const uint8_t* p = slab + static_cast<size_t>(g) * SLAB4_BYTES;
            for (int line = 0; line < SLAB4_BYTES; line += 64)  // each slab streams from memory once
                _mm_prefetch(reinterpret_cast<const char*>(p) + SB_PREFETCH + line, _MM_HINT_T0);
            _tile_loadd(0, x.q + x.start[g], x.stride);
            if (g % 2 == 0) {
                unpack_group(p, b[0]);
                _tile_loadd(2, b[0], 64);
                _tile_zero(4);
                _tile_dpbsud(4, 0, 2);
            } else {
                unpack_group(p, b[1]);
                _tile_loadd(3, b[1], 64);
                _tile_zero(5);
                _tile_dpbsud(5, 0, 3);
            }
        }
        if (g == 0) continue;
        {  // the group before it into the results, while that product runs
            const int h = g - 1;
            const uint8_t* p = slab + static_cast<size_t>(h) * SLAB4_BYTES;
            int32_t* c = scratch + (h % 2) * 256;
            if (h % 2 == 0)
                _tile_stored(4, c, 64);
            else
                _tile_stored(5, c, 64);
            const __m512 scale = half_load(p), mins = half_load(p + 32);
            const int g = h;
            SB_R16(SB_RSTEP)
        }
    }
    SB_R16(SB_RSTORE)
#undef SB_R16
#undef SB_RDECL
#undef SB_RSTEP
#undef SB_RSTORE
}

void int4_linear_amx(const Acts& a, int M, int N, const uint8_t* w, const float* bias, void* out, int out_bf16) {
    const AmxActs xp(a, M, G);
    const int slabs = (N + SLAB - 1) / SLAB;
    const size_t slab_bytes = static_cast<size_t>(a.K / G) * SLAB4_BYTES;
    if (M <= 16) {
#pragma omp parallel
        {
            amx_configure(G, 8);
            alignas(64) float res[16 * SLAB];
            alignas(64) int32_t scratch[512];
#pragma omp for schedule(static)
            for (int s = 0; s < slabs; ++s) {
                amx4_slab16(a, xp, w + s * slab_bytes, M, res, scratch);
                emit(res, SLAB, 0, M, s * SLAB, std::min(SLAB, N - s * SLAB), N, nullptr, bias, out, out_bf16);
            }
            _tile_release();
        }
        return;
    }
    amx_chunks(M, N, AMX_UNIT * slab_bytes, G, 8,
               [&](int s0, int nu, int m0, int mb, int n0, int nr, float* res, int ld, int32_t* scratch) {
                   if (mb > 16)
                       amx4_rows<2>(a, xp, w, slabs, s0, nu, M, m0, res, ld, scratch);
                   else
                       amx4_rows<1>(a, xp, w, slabs, s0, nu, M, m0, res, ld, scratch);
                   emit(res, ld, m0, mb, n0, nr, N, nullptr, bias, out, out_bf16);
               });
}
