// The Qwen2 decoder: embedding -> N x (RMSNorm -> QKV (+bias) -> RoPE -> causal GQA attention over the
// paged KV pool -> O proj -> residual -> RMSNorm -> gate/up -> SwiGLU -> down -> residual) -> final norm ->
// LM head (tied or untied). A step takes several sequences at once, each with its own cached context.
#pragma once
#include "llaisys/linear_weight.hpp"
#include "llaisys/quant.hpp"
#include "llaisys/tensor.hpp"

#include <cstdint>
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

class Qwen2 {
public:
    // The layer math of one step over a batch: the model owns its weights only. The KV cache, the batch, the
    // CUDA graphs and sampling belong to the runtime (llaisys/runner.hpp). fused: fused projections on or
    // off; unset, on for CUDA only (the caller's settings decide: EngineConfig.fused_projections).
    Qwen2(const Qwen2Config &config, DType dtype, Device device, std::optional<bool> fused = std::nullopt);
    ~Qwen2();
    Qwen2(const Qwen2 &) = delete; // owns device weights; the Runner and bindings hold it by reference
    Qwen2 &operator=(const Qwen2 &) = delete;

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
    // CUDA with quantized weights: the bytes of the one buffer multi-row steps decode each quantized
    // weight into before the dense GEMM (the compute dtype, sized to the largest such weight: on the 1.5B
    // shape the LM head, 151936 x 1536 bf16 = 467 MB); 0 otherwise or before prepare(). Not part of
    // weight_bytes.
    int64_t decode_scratch_bytes() const;
    std::vector<std::string> missing_weights() const;
    // Checks every weight is loaded, fuses projections and (CUDA, quantized) allocates the decode
    // scratch; the first step does it otherwise. Call it before sizing a KV cache from the free device
    // memory, and before capturing a step into a CUDA graph (which then holds no memory of its own for
    // decoded weights: every step decodes into the model's one scratch, in stream order).
    void prepare() { check_ready(); }
    // Bumped by every load_weight / load_quant_weight: a captured step holds the weights' addresses, so
    // its owner (the Runner) drops it when this changes.
    uint64_t weights_version() const { return weights_version_; }

    // One step of a batch over a paged KV pool (the serving path): stores each token's key/value at its
    // slot and returns the logits of the rows batch.last [B, vocab] (all_logits: of every token, [T, vocab]),
    // in the model dtype, not synchronized. Every input is a device tensor, so a CUDA graph can capture it.
    Tensor forward_step(const runtime::StepBatch &batch, const runtime::KVPool &pool, bool all_logits = false);

    // Fused projections: one GEMV for q/k/v, RoPE and the cache write in one kernel, gate/up and SwiGLU in
    // one GEMV. Fixed at construction: on by default on CUDA, off on the CPU (where the checkpoint's
    // memory-mapped tensors are used without a copy); see the constructor.
    bool fused_projections() const { return fused_; }

    const Qwen2Config &config() const { return config_; }
    DType dtype() const { return dtype_; }
    Device device() const { return device_; }

    struct Layer; // one decoder layer's weights (models/qwen2/layer.hpp)

private:
    void check_ready();
    struct Slot;
    Slot weight_slot(const std::string &name);
    void allocate_fused_biases();
    void fuse_layer(Layer &layer); // builds the fused projections its loaded parts allow
    std::pair<LinearWeight *, int64_t> fused_home(Layer &layer, const LinearWeight *part) const;
    int64_t fused_rows(bool qkv) const;
    const LinearWeight &lm_head() const { return config_.tie_word_embeddings ? embed_ : lm_head_; }
    std::vector<const LinearWeight *> projections() const; // every weight a step passes to linear()
    Tensor project_out(const Layer &L, const Tensor &attn, int64_t T);
    struct BlockIn; // the input of an attention or MLP block (models/qwen2/step.cpp)
    void project_in(const Tensor &out, const BlockIn &in, const LinearWeight &w, const Tensor &bias, bool swiglu);
    bool norm_in_projections(const Layer &L, int64_t T) const;
    Tensor attention(int layer, const BlockIn &in, const runtime::StepBatch &batch, const runtime::KVPool &pool);
    Tensor mlp(int layer, const BlockIn &in);

    Qwen2Config config_;
    DType dtype_;
    Device device_;
    LinearWeight embed_, lm_head_;
    Tensor decode_scratch_; // see decode_scratch_bytes(); made by check_ready
    Tensor final_norm_;
    std::vector<Layer> layers_;
    bool fused_ = false;
    std::set<std::string> loaded_; // names of the weights loaded so far
    bool ready_ = false; // every weight loaded and fused (reset by load_weight)
    uint64_t weights_version_ = 0;
};

} // namespace llaisys::models
