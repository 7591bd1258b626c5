// LoRA deltas of a mixed batch in one call per linear layer (engines/layers/lora.py): each row's adapter's
// shrink t = x·Aᵀ, then for each part of the layer the adapter trains out[row, part] += t[part's columns]·Bᵀ.
// The weights stay in the model's dtype (bf16: half the bytes a step reads); the arithmetic is fp32.
//
// Every value a row gets is computed by one thread, in one fixed order, from that row's input and its adapter's
// weights only: the same bits whatever else is in the batch, however many rows share the adapter, however many
// threads run (BLAS-style matmuls choose their blocking from the row count: MKL's sgemm gave a row other bits
// from 16 rows on). In fp32 throughout; a bf16 output is rounded once, from fp32(out) + delta.
//
// Work: phase 1 is rows × rank dot products of length K; phase 2 is, per part and 64 output columns, each of
// the adapter's rows times its B block (rank × 64, read once per block for all of that adapter's rows).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch rounds (inputs are finite)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float load(const void* base, int bf16, long i) {
    return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// Eight weights from fp32 or bf16 storage, as fp32 (bf16 widens exactly: its bits are fp32's top half).
inline __m256 load8w(const void* w, int bf16, long i) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
}

// Σ x[k]·a[k] over 32 lanes in a fixed order (4 × 8 accumulators, then a fixed tree), then the tail; x and a
// each fp32 or bf16 (widened exactly).
inline float dot(const void* x, int x_bf16, long x0, const void* a, int a_bf16, long a0, int K) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        s0 = _mm256_fmadd_ps(load8w(x, x_bf16, x0 + k), load8w(a, a_bf16, a0 + k), s0);
        s1 = _mm256_fmadd_ps(load8w(x, x_bf16, x0 + k + 8), load8w(a, a_bf16, a0 + k + 8), s1);
        s2 = _mm256_fmadd_ps(load8w(x, x_bf16, x0 + k + 16), load8w(a, a_bf16, a0 + k + 16), s2);
        s3 = _mm256_fmadd_ps(load8w(x, x_bf16, x0 + k + 24), load8w(a, a_bf16, a0 + k + 24), s3);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s);
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; k < K; ++k) total += load(x, x_bf16, x0 + k) * load(a, a_bf16, a0 + k);
    return total;
}

// out[0..8) (bf16) = round(out + v), to nearest even as f32_to_bf16 does, eight at once.
inline void add_store8_bf16(uint16_t* out, __m256 v) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out));
    const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)), v);
    __m256i u = _mm256_castps_si256(sum);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);  // lanes 0 and 2: 8 × u16
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

constexpr int BLOCK = 64;  // output columns per work item of phase 2

}  // namespace

extern "C" {

// x: rows of K (bf16 or fp32) at x + m·x_stride; out: rows at out + m·out_stride. Groups (one per adapter):
// group_rows[group_start[g] .. group_start[g+1]) are its rows, a[g] its A (ranks[g] × K, fp32; rank 0: none). Parts: part p
// adds to output columns [part_row[p], + part_cols[p]) of group part_group[p]'s rows, from t's columns
// [part_col[p], + part_rank[p]), with bt[p] its Bᵀ (part_rank[p] × part_cols[p]; A and B in fp32, or bf16 where
// w_bf16, widened exactly). t: scratch of
// (group_start[n_groups] × max_rank) floats.
void sb_lora_add(const void* x, int x_bf16, int K, long x_stride, void* out, int out_bf16, long out_stride,
                 int n_groups, const int* group_rows, const int* group_start, const void* const* a, const int* ranks,
                 int n_parts, const int* part_group, const int* part_row, const int* part_cols, const int* part_col,
                 const int* part_rank, const void* const* bt, float* t, int max_rank, int w_bf16) {
    int pairs = 0;  // (group, rank row): phase 1 reads each row of A once for all of its group's rows
    for (int g = 0; g < n_groups; ++g) pairs += ranks[g];
#pragma omp parallel for schedule(static)
    for (int w = 0; w < pairs; ++w) {
        int g = 0, j = w;
        while (j >= ranks[g]) j -= ranks[g++];
        for (int i = group_start[g]; i < group_start[g + 1]; ++i)
            t[static_cast<long>(i) * max_rank + j] =
                dot(x, x_bf16, group_rows[i] * x_stride, a[g], w_bf16, static_cast<long>(j) * K, K);
    }
    int items = 0;
    for (int p = 0; p < n_parts; ++p) items += (part_cols[p] + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static)
    for (int w = 0; w < items; ++w) {  // phase 2: one part's 64 output columns for each of its adapter's rows
        int p = 0, first = w;
        while (first >= (part_cols[p] + BLOCK - 1) / BLOCK) first -= (part_cols[p++] + BLOCK - 1) / BLOCK;
        const int c0 = first * BLOCK, width = part_cols[p] - c0 < BLOCK ? part_cols[p] - c0 : BLOCK;
        const int g = part_group[p], rank = part_rank[p];
        const void* b = bt[p];
        for (int i = group_start[g]; i < group_start[g + 1]; ++i) {
            alignas(32) float acc[BLOCK] = {};
            const float* ti = t + static_cast<long>(i) * max_rank + part_col[p];
            if (width == BLOCK) {  // eight lanes of eight columns in registers; j ascending: one order per column
                __m256 v[BLOCK / 8];
                for (int l = 0; l < BLOCK / 8; ++l) v[l] = _mm256_setzero_ps();
                for (int j = 0; j < rank; ++j) {
                    const __m256 tj = _mm256_set1_ps(ti[j]);
                    const long bj = static_cast<long>(j) * part_cols[p] + c0;
                    for (int l = 0; l < BLOCK / 8; ++l) v[l] = _mm256_fmadd_ps(tj, load8w(b, w_bf16, bj + 8 * l), v[l]);
                }
                const long base = static_cast<long>(group_rows[i]) * out_stride + part_row[p] + c0;
                for (int l = 0; l < BLOCK / 8; ++l) {
                    if (out_bf16) {
                        add_store8_bf16(static_cast<uint16_t*>(out) + base + 8 * l, v[l]);
                    } else {
                        float* o = static_cast<float*>(out) + base + 8 * l;
                        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v[l]));
                    }
                }
                continue;
            } else {
                for (int j = 0; j < rank; ++j) {
                    const long bj = static_cast<long>(j) * part_cols[p] + c0;
                    for (int c = 0; c < width; ++c) acc[c] = std::fma(ti[j], load(b, w_bf16, bj + c), acc[c]);
                }
            }
            const long base = static_cast<long>(group_rows[i]) * out_stride + part_row[p] + c0;
            if (out_bf16) {
                uint16_t* o = static_cast<uint16_t*>(out) + base;
                for (int c = 0; c < width; ++c) o[c] = f32_to_bf16(bf16_to_f32(o[c]) + acc[c]);
            } else {
                float* o = static_cast<float*>(out) + base;
                for (int c = 0; c < width; ++c) o[c] += acc[c];
            }
        }
    }
}

}  // extern "C"
