// Every decoder layer of one step in one call: the Python model's per-layer sequence (norm → qkv →
// RoPE → KV store → paged attention → o_proj → norm → gate+up → SiLU·mul → down) over the same
// kernels, in the same order, on the same buffers, so its outputs are the Python path's to the bit.
//
// Why: at batch 1 a step is ~10 library calls per layer from Python, each ~6 µs of ctypes, tensor
// allocation and argument checks: 1.5-3 ms of a SmolLM2 step that computes in ~2 ms. Scope: Llama and
// Qwen2 decoders whose linear layers all run our int8/int4 kernels, bf16 activations and a bf16 KV
// cache; anything else stays on the Python path (engines/models/native_decoder.py decides).
#include <stdint.h>
#include <string.h>

extern "C" {
void sb_int4_linear(const void* x, int x_bf16, int M, int K, int N, const uint8_t* w, const float* bias, void* out,
                    int out_bf16);
void sb_int8_linear(const void* x, int x_bf16, int M, int K, int N, const int8_t* w, const float* scales,
                    const int32_t* neg_off, int act_group, const int32_t* out_idx, int n_out,
                    const int8_t* outlier_w, const float* bias, void* out, int out_bf16);
void sb_rms_norm(const void* x, void* residual, const void* weight, void* out, int M, int H, float eps, int bf16);
void sb_rope(void* q, int q_heads, void* k, int k_heads, long stride, const void* cos, const void* sin, int T, int D,
             int bf16);
void sb_silu_mul(const void* gate_up, void* out, int M, int I, int bf16);
void sb_paged_attention(const void* q, long q_stride, void* out, int T, int H, int KVH, int D, const void* kc,
                        const void* vc, const void* ks, const void* vs, int kv_int8, int num_blocks, int bs,
                        const int32_t* tables, const int32_t* row_table, const int32_t* row_len, float scale,
                        int bf16, int window);
void sb_lora_add(const void* x, int x_bf16, int K, long x_stride, void* out, int out_bf16, long out_stride,
                 int n_groups, const int* group_rows, const int* group_start, const void* const* a, const int* ranks,
                 int n_parts, const int* part_group, const int* part_row, const int* part_cols, const int* part_col,
                 const int* part_rank, const void* const* bt, float* t, int max_rank, int w_bf16);
}

namespace {

// The field order is mirrored by ctypes Structures in engines/models/native_decoder.py.
struct Linear {
    int32_t format;  // 1: int8, 2: int4
    int32_t n, k, act_group, n_out;
    const void* w;
    const float* scales;
    const int32_t* neg_off;
    const int32_t* out_idx;
    const int8_t* outlier_w;
    const float* bias;  // fp32, or null
};

// One linear layer's LoRA adapters for the step's groups (csrc/lora.cpp's fixed arguments; n_parts 0: none).
struct LoraLinear {
    const void* const* a;
    const int32_t* ranks;
    int32_t n_parts, max_rank, w_bf16;
    const int32_t* part_group;
    const int32_t* part_row;
    const int32_t* part_cols;
    const int32_t* part_col;
    const int32_t* part_rank;
    const void* const* bt;
};

struct Layer {
    Linear qkv, o, gate_up, down;
    const void* ln1;  // bf16 norm weights
    const void* ln2;
    uint16_t* k_cache;  // this layer's (kv_heads, blocks, block_size, head_dim), bf16
    uint16_t* v_cache;
};

struct Model {
    int32_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, num_layers;
    float eps, scale;
};

struct Step {
    int32_t rows;
    const int64_t* slots;  // cache slot of each row's new key and value
    const void* cos;       // (rows, head_dim / 2) bf16, each row's position
    const void* sin;
    const int32_t* tables;
    const int32_t* row_table;
    const int32_t* row_len;
    // Workspace, bf16: (rows, hidden) ×3, (rows, q + 2 kv), (rows, q), (rows, 2 inter), (rows, inter)
    void* normed;
    void* out_a;
    void* out_b;
    void* qkv;
    void* attn;
    void* gate_up;
    void* act;
    // LoRA (or null): per layer its qkv, o, gate_up, down; each adapter's rows (csrc/lora.cpp's groups) and scratch
    const LoraLinear* lora;
    int32_t n_groups;
    const int32_t* group_rows;
    const int32_t* group_start;
    float* lora_t;
};

// The base product, then (where the step has adapters on this layer) each row's adapter's delta, as the Python
// path's Linear.forward does: the same kernels in the same order.
void linear(const Linear& l, const void* x, int M, void* out, const Step& s, const LoraLinear* lora) {
    if (l.format == 1)
        sb_int8_linear(x, 1, M, l.k, l.n, static_cast<const int8_t*>(l.w), l.scales, l.neg_off, l.act_group,
                       l.out_idx, l.n_out, l.outlier_w, l.bias, out, 1);
    else
        sb_int4_linear(x, 1, M, l.k, l.n, static_cast<const uint8_t*>(l.w), l.bias, out, 1);
    if (lora != nullptr && lora->n_parts > 0)
        sb_lora_add(x, 1, l.k, l.k, out, 1, l.n, s.n_groups, s.group_rows, s.group_start, lora->a, lora->ranks,
                    lora->n_parts, lora->part_group, lora->part_row, lora->part_cols, lora->part_col, lora->part_rank,
                    lora->bt, s.lora_t, lora->max_rank, lora->w_bf16);
}

// PagedKVCache.store for a bf16 cache: each row's k and v heads into its slot.
void store_kv(const Model& c, const Layer& L, const Step& s, const uint16_t* qkv, int stride) {
    const size_t head_stride = static_cast<size_t>(c.num_blocks) * c.block_size * c.head_dim;
    const int q_size = c.heads * c.head_dim, kv_size = c.kv_heads * c.head_dim;
    for (int t = 0; t < s.rows; ++t) {
        const size_t slot = static_cast<size_t>(s.slots[t]) * c.head_dim;
        const uint16_t* row = qkv + static_cast<size_t>(t) * stride;
        for (int h = 0; h < c.kv_heads; ++h) {
            memcpy(L.k_cache + h * head_stride + slot, row + q_size + h * c.head_dim, c.head_dim * 2);
            memcpy(L.v_cache + h * head_stride + slot, row + q_size + kv_size + h * c.head_dim, c.head_dim * 2);
        }
    }
}

}  // namespace

extern "C" {

// All layers of one step. `hidden` (rows, hidden) holds the embeddings and becomes the residual stream
// (updated in place, as the Python path's first norm makes it); the last layer's MLP output is left
// in step.out_a (returns 0) or step.out_b (returns 1): the caller adds it to the residual in the final norm.
int sb_decoder(const Model* cfg, const Layer* layers, const Step* step, void* hidden) {
    const Model& c = *cfg;
    const Step& s = *step;
    const int M = s.rows;
    const int q_size = c.heads * c.head_dim, kv_size = c.kv_heads * c.head_dim, stride = q_size + 2 * kv_size;
    void* residual = hidden;
    const void* in = hidden;
    void* outs[2] = {s.out_a, s.out_b};
    for (int i = 0; i < c.num_layers; ++i) {
        const Layer& L = layers[i];
        // First layer: no residual yet; its input is the stream (norm reads it, the stream stays it).
        sb_rms_norm(in, i == 0 ? nullptr : residual, L.ln1, s.normed, M, c.hidden, c.eps, 1);
        const LoraLinear* lora = s.lora ? s.lora + 4 * i : nullptr;
        linear(L.qkv, s.normed, M, s.qkv, s, lora ? lora + 0 : nullptr);
        uint16_t* qkv = static_cast<uint16_t*>(s.qkv);
        sb_rope(qkv, c.heads, qkv + q_size, c.kv_heads, stride, s.cos, s.sin, M, c.head_dim, 1);
        store_kv(c, L, s, qkv, stride);
        sb_paged_attention(qkv, stride, s.attn, M, c.heads, c.kv_heads, c.head_dim, L.k_cache, L.v_cache, nullptr,
                           nullptr, 0, c.num_blocks, c.block_size, s.tables, s.row_table, s.row_len, c.scale, 1, 0);
        void* o = outs[i % 2];  // free: the other buffer holds this layer's input
        linear(L.o, s.attn, M, o, s, lora ? lora + 1 : nullptr);
        sb_rms_norm(o, residual, L.ln2, s.normed, M, c.hidden, c.eps, 1);
        linear(L.gate_up, s.normed, M, s.gate_up, s, lora ? lora + 2 : nullptr);
        sb_silu_mul(s.gate_up, s.act, M, c.inter, 1);
        linear(L.down, s.act, M, o, s, lora ? lora + 3 : nullptr);
        in = o;
    }
    return (c.num_layers - 1) % 2;
}
}
