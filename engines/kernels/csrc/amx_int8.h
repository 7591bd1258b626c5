// The int8 GEMM on AMX tiles (Intel Xeons since Sapphire Rapids: amx_tile, amx_int8), for calls of
// AMX_MIN_ROWS activation rows or more. Part of quant_gemm.cpp (included there, AMX build only).
//
// Why: on such a Xeon the vector loops reach ~0.7 TOP/s on two cores, one tile product (tdpbssd:
// 16 rows × 16 columns × 64 inputs) runs in ~16 cycles, ~2.5 TOP/s per core measured. Prefill
// chunks, speculative verification and batched decode are rows, and rows are where this CPU is slow.
//
// No second copy of the weights: a slab (16 weight rows, per input quad the 16 rows' 4 codes) is
// already the tiles' B layout, 16 quads = one 1 KB tile of 64 inputs × 16 columns. Activations are
// the same 7-bit codes as the vector loops' but signed (tdpbssd multiplies signed bytes, so no +64
// and no −64·Σw start), copied into rows padded to 16 and groups padded to 64 inputs with zeros.
//
// The same rule as the vector loops (see the int8 comment in quant_gemm.cpp): each activation
// group's integer sum is exact in int32, then one fused multiply-add with the group's scale, groups
// in order, then the outliers, the row scale and the bias. So every output is the VNNI and AVX2
// builds' to the bit, whatever the batch, and the engine's greedy output does not depend on the kernel.
//
// Blocking: a thread takes units of 2 slabs (32 weight rows; B tiles 2, 3) and runs every row past
// them in blocks of 32 (A tiles 0, 1; C tiles 4-7), or 16 for a last block of ≤ 16 rows. The unit's
// weights (32 × K bytes: 280 KB at K = 8960) stay in L2 across the row blocks.
#include <sys/syscall.h>
#include <unistd.h>

// Fewer rows: the vector loops, faster there (a tile computes 16 rows whatever M is). Measured on a 2-vCPU
// Xeon (family 6 model 207): int8 at 4 rows 0.65x the VNNI loops, at 8 1.06x; int4 at 8 rows 0.84x, 9 ~1x.
constexpr int AMX_MIN_ROWS = 8;
constexpr int AMX_INT4_MIN_ROWS = 9;
constexpr int AMX_K = 64;        // inputs per tile product
constexpr int AMX_UNIT = 2;      // slabs per unit

// Linux gives the tiles' 8 KB register state only to a process that asks for it, once.
bool amx_permitted() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

// A tiles 0, 1 of 16 rows × `a_bytes`, B tiles 2, 3 of `b_rows` × 64 bytes, C tiles 4-7 of 16 × 16 int32
// (int8: 64-input steps, 64 and 16; int4: one 32-input group, 32 and 8). Loaded at the start of each
// parallel region: the thread's last tile user may have been another library (oneDNN) with another shape.
void amx_configure(int a_bytes, int b_rows) {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = t < 2 ? a_bytes : 64;
        cfg.rows[t] = t == 2 || t == 3 ? b_rows : 16;
    }
    _tile_loadconfig(&cfg);
}

// The activation codes for the tiles: rows padded to a multiple of 16, each group to a multiple of `step`
// inputs (int8: 64, a tile step; int4: 32, its group, so nothing is padded).
struct AmxActs {
    int8_t* q = nullptr;
    int stride = 0;            // bytes per padded row
    std::vector<int> start;    // each group's first byte in a row
    AmxActs(const Acts& a, int M, int step) {
        for (int k0 = 0; k0 < a.K; k0 += a.ag) {
            start.push_back(stride);
            stride += (std::min(a.ag, a.K - k0) + step - 1) / step * step;
        }
        const int rows = (M + 15) / 16 * 16;
        const size_t bytes = static_cast<size_t>(rows) * stride;
        q = static_cast<int8_t*>(aligned_alloc(64, (bytes + 63) / 64 * 64));
        if (stride == a.K) {  // no group padded: the rows as they are, then zero rows
            memcpy(q, a.q, static_cast<size_t>(M) * a.K);
            memset(q + static_cast<size_t>(M) * a.K, 0, bytes - static_cast<size_t>(M) * a.K);
            return;
        }
        memset(q, 0, bytes);
        for (int m = 0; m < M; ++m)
            for (size_t g = 0; g < start.size(); ++g) {
                const int k0 = static_cast<int>(g) * a.ag;
                memcpy(q + static_cast<size_t>(m) * stride + start[g], a.q + static_cast<size_t>(m) * a.K + k0,
                       std::min(a.ag, a.K - k0));
            }
    }
    ~AmxActs() { free(q); }
    AmxActs(const AmxActs&) = delete;
    AmxActs& operator=(const AmxActs&) = delete;
};

// The tiles of one activation group for rows m0 .. m0 + 16·ma - 1 (A tiles 0, 1) against one unit's slabs
// w0, w1 (B tiles 2, 3), left in C tiles 4-7.
template <int ma>
inline void amx_group(const AmxActs& x, const int8_t* xa, const int8_t* w0, const int8_t* w1, int k0, int len,
                      int g, bool stream) {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (ma > 1) {
        _tile_zero(6);
        _tile_zero(7);
    }
    alignas(64) int8_t tail[2][1024];
    for (int k = 0; k < len; k += AMX_K) {
        const int8_t* b0 = w0 + static_cast<size_t>(k0 + k) * SLAB;
        const int8_t* b1 = w1 + static_cast<size_t>(k0 + k) * SLAB;
        if (len - k < AMX_K) {  // 32 inputs left: the tile's other 8 quads meet zero activations, but
            // past the last slab they are past the buffer, so they come from a copy
            memcpy(tail[0], b0, 512);
            memcpy(tail[1], b1, 512);
            memset(tail[0] + 512, 0, 512);
            memset(tail[1] + 512, 0, 512);
            b0 = tail[0];
            b1 = tail[1];
        }
        if (stream)  // the first row block meets these weights in memory: ask for them a few KB ahead
            for (int line = 0; line < 1024; line += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(b0) + SB_PREFETCH + line, _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(b1) + SB_PREFETCH + line, _MM_HINT_T0);
            }
        _tile_loadd(0, xa + x.start[g] + k, x.stride);
        _tile_loadd(2, b0, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_loadd(3, b1, 64);
        _tile_dpbssd(5, 0, 3);
        if constexpr (ma > 1) {
            _tile_loadd(1, xa + 16 * static_cast<size_t>(x.stride) + x.start[g] + k, x.stride);
            _tile_dpbssd(6, 1, 2);
            _tile_dpbssd(7, 1, 3);
        }
    }
}

// Rows m0 .. m0 + 16·ma - 1 (those below M kept) against `cu` units from slab s0, fused into res (row stride
// ld, row m0 first, unit j at column 32·j): groups outermost, so a group's activation tiles (8 KB) stay in
// L1 while every unit's weights for it pass. `scratch`: 4 C tiles' int32s.
template <int ma>
void amx_rows(const Acts& a, const AmxActs& x, const int8_t* w, int slabs, int s0, int cu, int M, int m0, float* res,
              int ld, int32_t* scratch) {
    const size_t slab_bytes = static_cast<size_t>(SLAB) * a.K;
    const int8_t* xa = x.q + static_cast<size_t>(m0) * x.stride;
    const int rows = std::min(16 * ma, M - m0);
    for (int g = 0, k0 = 0; k0 < a.K; k0 += a.ag, ++g) {
        const int len = std::min(a.ag, a.K - k0);
        for (int j = 0; j < cu; ++j) {
            const int s = s0 + j * AMX_UNIT, ns = std::min(AMX_UNIT, slabs - s);
            const int8_t* w0 = w + s * slab_bytes;
            amx_group<ma>(x, xa, w0, ns > 1 ? w0 + slab_bytes : w0, k0, len, g, m0 == 0);  // 1 slab: tile 3 dropped
            _tile_stored(4, scratch, 64);
            _tile_stored(5, scratch + 256, 64);
            if constexpr (ma > 1) {
                _tile_stored(6, scratch + 512, 64);
                _tile_stored(7, scratch + 768, 64);
            }
            for (int m = 0; m < rows; ++m) {
                const float d = a.d[static_cast<size_t>(m0 + m) * a.stride + g];
                const int32_t* c = scratch + (m / 16) * 512 + (m % 16) * 16;
                float* r = res + static_cast<size_t>(m) * ld + j * SLAB * AMX_UNIT;
                vfma_store(r, vload(c), d);
                if (ns > 1) vfma_store(r + SLAB, vload(c + 256), d);
            }
        }
    }
}

// The driver both tile GEMMs share: N's units of 2 slabs in chunks whose weights (`unit_bytes` a unit) stay
// in L2 (~1 MB of its 2 MB) while every 32-row block passes, at most 8 units (a block's results are 32 KB);
// a single row block (decode batches, short chunks) takes one unit at a time, so each slab streams front to
// back. Chunks split statically over the threads. `block(s0, nu, m0, mb, n0, nr, res, ld, scratch)` fuses
// rows m0 .. m0 + mb - 1 against the chunk's nu units from slab s0 (columns n0 .. n0 + nr - 1 of the output)
// into res (zeroed, row stride ld) and stores them.
template <typename Block>
void amx_chunks(int M, int N, size_t unit_bytes, int a_bytes, int b_rows, Block block) {
    const int slabs = (N + SLAB - 1) / SLAB, units = (slabs + AMX_UNIT - 1) / AMX_UNIT;
    const int cu = M <= 32 ? 1 : static_cast<int>(std::clamp((size_t{1} << 20) / unit_bytes, size_t{1}, size_t{8}));
    const int chunks = (units + cu - 1) / cu;
    const int ld = cu * SLAB * AMX_UNIT;
#pragma omp parallel
    {
        amx_configure(a_bytes, b_rows);
        std::vector<float> res(static_cast<size_t>(32) * ld);
        alignas(64) int32_t scratch[1024];
#pragma omp for schedule(static)
        for (int c = 0; c < chunks; ++c) {
            const int u0 = c * cu, nu = std::min(cu, units - u0), s0 = u0 * AMX_UNIT;
            const int n0 = s0 * SLAB, nr = std::min(nu * AMX_UNIT * SLAB, N - n0);
            for (int m0 = 0; m0 < M; m0 += 32) {
                std::fill(res.begin(), res.end(), 0.0f);
                block(s0, nu, m0, std::min(32, M - m0), n0, nr, res.data(), ld, scratch);
            }
        }
        _tile_release();
    }
}

void int8_linear_amx(const void* x, int x_bf16, int M, int K, int N, const int8_t* w, const float* scales,
                     int act_group, const int32_t* out_idx, int n_out, const int8_t* outlier_w, const float* bias,
                     void* out, int out_bf16) {
    const Acts a(x, x_bf16, M, K, act_group, 0, out_idx, n_out, true);
    const AmxActs xp(a, M, AMX_K);
    const int slabs = (N + SLAB - 1) / SLAB, n_rows = slabs * SLAB;
    amx_chunks(M, N, static_cast<size_t>(SLAB) * AMX_UNIT * K, 64, 16,
               [&](int s0, int nu, int m0, int mb, int n0, int nr, float* res, int ld, int32_t* scratch) {
                   if (mb > 16)
                       amx_rows<2>(a, xp, w, slabs, s0, nu, M, m0, res, ld, scratch);
                   else
                       amx_rows<1>(a, xp, w, slabs, s0, nu, M, m0, res, ld, scratch);
                   for (int m = 0; m < mb && n_out; ++m) {  // the outlier channels, as int8_unit adds them
                       const float* side = a.side + static_cast<size_t>(m0 + m) * a.side_stride;
                       for (int v = 0; v < (nr + VR - 1) / VR; ++v)
                           vfma_codes(res + static_cast<size_t>(m) * ld + v * VR, side,
                                      outlier_w + static_cast<size_t>(n0) + v * VR, n_out, n_rows);
                   }
                   emit(res, ld, m0, mb, n0, nr, N, scales, bias, out, out_bf16);
               });
}
