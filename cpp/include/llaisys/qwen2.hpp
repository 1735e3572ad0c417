// The Qwen2 decoder: embedding -> N x (RMSNorm -> QKV (+bias) -> RoPE -> causal GQA attention over the
// KV cache -> O proj -> residual -> RMSNorm -> gate/up -> SwiGLU -> down -> residual) -> final norm ->
// LM head (tied or untied). A step takes several sequences at once, each with its own cached context.
#pragma once
#include "llaisys/linear_weight.hpp"
#include "llaisys/quant.hpp"
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace llaisys::runtime {
class KVPool;
struct StepBatch;
} // namespace llaisys::runtime

namespace llaisys::models {

struct Qwen2Config {
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int64_t num_layers = 0;
    int64_t num_heads = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    float rms_norm_eps = 1e-6f;
    float rope_theta = 10000.f;
    bool tie_word_embeddings = false;
    void validate() const; // ValueError naming the inconsistent field
};

// Keys and values of every sequence slot. Callers only see views: rows(layer, slot, start, n) are where
// a step writes its new keys/values and, from 0, what attention reads. The layout (today one dense
// [max_seq, nkvh, hd] block per layer and slot) can change, e.g. to paged blocks, behind this interface.
class KVCache {
public:
    KVCache(int64_t num_layers, int num_slots, int64_t max_seq_len, int64_t num_kv_heads, int64_t head_dim,
            DType dtype, Device device);
    int num_slots() const { return int(lengths_.size()); }
    int64_t capacity() const { return max_seq_len_; }
    int64_t length(int slot) const;
    void truncate(int slot, int64_t length); // keep the first `length` positions (multi-turn prefix reuse)
    void advance(int slot, int64_t n);       // called once a step has written n new positions everywhere
    // Stores k/v [n, nkvh, hd] at the positions held in `positions` [n] (device i64): position-free on
    // the host, so a captured CUDA graph can replay the write for any step.
    void write(int layer, int slot, const Tensor &positions, const Tensor &k, const Tensor &v);
    Tensor keys(int layer, int slot, int64_t start, int64_t n) const;   // [n, nkvh, hd]
    Tensor values(int layer, int slot, int64_t start, int64_t n) const; // [n, nkvh, hd]

private:
    void check_slot(int slot) const;
    Tensor k_, v_; // [layers, slots, max_seq, nkvh, hd]
    int64_t max_seq_len_;
    std::vector<int64_t> lengths_;
};

struct SamplingParams {
    float temperature = 0.f; // 0 = greedy
    int32_t top_k = 0;       // 0 = off
    float top_p = 1.f;       // 1 = off
    float min_p = 0.f;       // 0 = off
    float repetition_penalty = 1.f;
    std::vector<int64_t> penalty_ids; // distinct ids seen so far, penalised when repetition_penalty != 1
};

class Qwen2 {
public:
    // fused: fused projections on or off; unset, LLAISYS_FUSED=0|1 decides, else on for CUDA only.
    Qwen2(const Qwen2Config &config, DType dtype, Device device, int64_t max_seq_len, int num_slots = 1,
          std::optional<bool> fused = std::nullopt);
    ~Qwen2();

    // Takes the weight named as in HF checkpoints ("model.layers.3.mlp.up_proj.weight"), copying or
    // converting it to the model's dtype and device. Unknown names and wrong shapes raise.
    void load_weight(const std::string &name, const Tensor &value);
    // Takes a projection or embedding weight as GGUF blocks, kept quantized (copied to the model device;
    // on the CPU the matrix itself is kept, zero-copy). Norms and biases go through load_weight.
    void load_quant_weight(const std::string &name, const QuantMatrix &value);
    // (HF name, stored format "bf16" / "q4_k" / ..., bytes) of every weight, and the bytes all weights
    // take on the device (each buffer once).
    std::vector<std::tuple<std::string, std::string, int64_t>> weight_formats() const;
    int64_t weight_bytes() const;
    std::vector<std::string> missing_weights() const;
    // Checks every weight is loaded, fuses projections and (CUDA, quantized) makes the decoded copies
    // multi-row steps use; the first step does it otherwise. Call it before sizing a KV cache from the
    // free device memory.
    void prepare() { check_ready(); }

    // Appends tokens[i] to the context of slots[i] (for every i) and returns the logits of each
    // sequence's last token, [B, vocab] in the model dtype on the model device (not synchronized);
    // with all_logits, the logits of every token instead, [total tokens, vocab].
    Tensor forward(const std::vector<int> &slots, const std::vector<std::vector<int64_t>> &tokens,
                   bool all_logits = false);
    // forward(), then one token per sequence sampled on the device; only the ids are copied back.
    // offset is the sampler's step counter (the engine passes the generation step). Logits without a
    // finite max (NaN, +inf, all -inf) raise std::runtime_error naming that step and the row; the step's
    // tokens stay in the cache, as after any forward().
    std::vector<int64_t> forward_sample(const std::vector<int> &slots,
                                        const std::vector<std::vector<int64_t>> &tokens,
                                        const std::vector<SamplingParams> &params, uint64_t seed, uint64_t offset);

    // One step of a batch over a paged KV pool (the serving path): stores each token's key/value at its
    // slot and returns the logits of the rows batch.last [B, vocab] (all_logits: of every token, [T, vocab]),
    // in the model dtype, not synchronized. Every input is a device tensor, so a CUDA graph can capture it.
    Tensor forward_step(const runtime::StepBatch &batch, const runtime::KVPool &pool, bool all_logits = false);

    // CUDA only: replay one captured graph per decode step (single sequence, one token). On by default
    // on CUDA; LLAISYS_CUDA_GRAPHS=0 in the environment turns it off.
    void set_cuda_graphs(bool enabled);
    bool cuda_graphs() const { return graphs_enabled_; }
    // Fused projections: one GEMV for q/k/v, RoPE and the cache write in one kernel, gate/up and SwiGLU in
    // one GEMV. Fixed at construction: on by default on CUDA, off on the CPU (where the checkpoint's
    // memory-mapped tensors are used without a copy); see the constructor.
    bool fused_projections() const { return fused_; }

    KVCache &cache() { return *cache_; }
    const Qwen2Config &config() const { return config_; }
    DType dtype() const { return dtype_; }
    Device device() const { return device_; }

    struct Layer;       // one decoder layer's weights (models/qwen2/layer.hpp)
    struct Staging;     // pinned-memory input uploads
    struct DecodeGraph; // the captured decode step and its fixed input buffers

private:
    void check_step(const std::vector<int> &slots, const std::vector<std::vector<int64_t>> &tokens);
    void check_ready();
    struct Slot;
    Slot weight_slot(const std::string &name);
    void allocate_fused_biases();
    void fuse_layer(Layer &layer); // builds the fused projections its loaded parts allow
    std::pair<LinearWeight *, int64_t> fused_home(Layer &layer, const LinearWeight *part) const;
    int64_t fused_rows(bool qkv) const;
    // The layers and head for ids/pos (device tensors) of the given sequences. With kv_len defined (one
    // sequence), attention reads the cache length from it instead of the host: the graph-safe path.
    Tensor run(const Tensor &ids, const Tensor &pos, const std::vector<int> &slots,
               const std::vector<std::vector<int64_t>> &tokens, const Tensor &kv_len, bool all_logits);
    Tensor attention(int layer, const Tensor &x, const Tensor &pos, const std::vector<int> &slots,
                     const std::vector<std::vector<int64_t>> &tokens, const Tensor &kv_len);
    Tensor project_out(const Layer &L, const Tensor &attn, int64_t T);
    Tensor attention_paged(int layer, const Tensor &x, const runtime::StepBatch &batch, const runtime::KVPool &pool);
    Tensor decode_graphed(int slot, int64_t token);
    void upload_step(DecodeGraph &g, int64_t token, int64_t pos, int64_t len);
    Tensor mlp(int layer, const Tensor &x);
    void sample_into(const Tensor &out, const Tensor &logits, const std::vector<SamplingParams> &params,
                     uint64_t seed, uint64_t offset);
    Tensor last_rows(const Tensor &x, const std::vector<std::vector<int64_t>> &tokens);

    Qwen2Config config_;
    DType dtype_;
    Device device_;
    LinearWeight embed_, lm_head_;
    Tensor final_norm_;
    std::vector<Layer> layers_;
    std::unique_ptr<KVCache> cache_;
    std::unique_ptr<Staging> staging_;
    std::unique_ptr<DecodeGraph> graph_;
    bool graphs_enabled_ = false;
    bool fused_ = false;
    std::set<std::string> loaded_; // names of the weights loaded so far
    bool ready_ = false; // every weight loaded and fused (reset by load_weight)
};

} // namespace llaisys::models
