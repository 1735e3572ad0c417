// The decoder every family composes: embedding -> N x (norm -> attention block -> residual -> norm -> MLP
// block -> residual) -> final norm -> LM head, with the family's traits (ModelConfig) choosing each block's
// variant: RMSNorm or LayerNorm, q/k biases and norms, rotary dims and scaling, sliding windows, gated or
// plain MLP, serial or parallel residual. Which checkpoint tensor goes where comes from the family's weight
// table (Architecture::weights): every WeightSpec names a role below.
#pragma once
#include "llaisys/linear_weight.hpp"
#include "llaisys/model.hpp"

#include <map>
#include <set>

namespace llaisys::models {

class Decoder final : public Model {
public:
    Decoder(const ModelConfig &config, DType dtype, Device device, std::optional<bool> fused,
            std::shared_ptr<Communicator> comm = nullptr);

    void load_weight(const std::string &name, const Tensor &value) override;
    void load_quant_weight(const std::string &name, const QuantMatrix &value) override;
    std::vector<std::string> missing_weights() const override;
    std::vector<std::tuple<std::string, std::string, int64_t>> weight_formats() const override;
    int64_t weight_bytes() const override;
    int64_t decode_scratch_bytes() const override;
    void prepare() override { check_ready(); }
    uint64_t weights_version() const override { return weights_version_; }
    Tensor forward_step(const StepBatch &batch, const KVView &kv, bool all_logits) override;
    bool fused_projections() const override { return fused_; }
    const ModelConfig &config() const override { return config_; }
    void shift_kv(const KVView &kv, const Tensor &src, const Tensor &dst, int64_t delta) override;
    DType dtype() const override { return dtype_; }
    Device device() const override { return device_; }
    const std::shared_ptr<Communicator> &communicator() const override { return comm_; }

    // One layer's weights on the model device: norms and biases in the model dtype, projections dense or
    // quantized. Fused (fused_projections()): one [(nh + 2 nkvh) hd, H] q/k/v matrix with its bias and one
    // [2I, H] gate/up matrix whose row slices the parts are (dense: filled in place as they load; quantized:
    // stacked once all parts are loaded in one block format). fused_qkv / fused_gate_up: this layer runs fused.
    struct Layer {
        Tensor attn_norm, attn_norm_bias, q_norm, k_norm, post_attn_norm, mlp_norm, mlp_norm_bias, post_mlp_norm;
        LinearWeight wq, wk, wv, wo, w_gate, w_up, w_down;
        Tensor bq, bk, bv, bo, b_gate, b_up, b_down;
        LinearWeight wqkv, w_gate_up;
        Tensor bqkv;
        bool fused_qkv = false, fused_gate_up = false;
        std::vector<float> inv_freq; // RoPE's frequencies for this layer's base and rotary dims
        int64_t window = 0;          // sliding window (0: full attention)
    };

private:
    QuantMatrix on_device(const QuantMatrix &value) const;
    // Where a checkpoint name goes: a tensor or a projection, its shape, its layer and fusion group.
    struct Slot {
        Tensor *tensor = nullptr;
        LinearWeight *linear = nullptr;
        Shape shape;
        Layer *layer = nullptr;
        std::string group; // "qkv" / "gate_up" when the part joins a fused matrix, else ""
        bool norm = false; // a norm weight (stored as w, used as 1 + w when config.norm_plus_one)
        bool heads = false; // GPT-NeoX's q/k/v rows interleaved per head: reordered into wqkv's q | k | v
    };
    struct BlockIn; // the input of an attention or MLP block (decoder_step.cpp)

    void bind_slots();
    const Slot &slot(const std::string &name) const;
    void allocate_fused_biases();
    Tensor to_qkv_order(const Tensor &value) const; // per-head interleaved q/k/v rows -> q | k | v
    void load_heads(const Slot &s, const Tensor &value);
    void fuse_layer(Layer &layer);
    std::pair<LinearWeight *, int64_t> fused_home(Layer &layer, const LinearWeight *part) const;
    void check_ready();
    // Tensor parallel and tied: this rank's rows of the embedding (made by check_ready).
    const LinearWeight &lm_head() const {
        return config_.tie_word_embeddings ? (comm_ ? tied_head_ : embed_) : lm_head_;
    }
    bool first_rank() const { return !comm_ || comm_->rank() == 0; }
    void reduce(const Tensor &partial) { // tensor parallel: the ranks' partial sums -> the whole sum on every rank
        if (comm_) comm_->all_reduce_sum(partial);
    }
    std::vector<const LinearWeight *> projections() const;

    void project_in(const Tensor &out, const BlockIn &in, const LinearWeight &w, const Tensor &bias, bool swiglu);
    bool norm_in_projections(const Layer &L, int64_t T) const;
    void norm(const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &b);
    void add_norm(const Tensor &out, const Tensor &h, const Tensor &delta, const Tensor &delta2, const Tensor &w,
                  const Tensor &b, const Tensor &out2 = Tensor(), const Tensor &w2 = Tensor(),
                  const Tensor &b2 = Tensor(), const Tensor &delta_w = Tensor());
    void forward_serial(Tensor &h, const Tensor &x, const StepBatch &b, const KVView &kv);
    void forward_parallel(Tensor &h, const Tensor &x, const StepBatch &b, const KVView &kv);
    Tensor attention(int layer, const BlockIn &in, const StepBatch &batch, const KVView &kv);
    void qkv_rope_cache(const Layer &L, int layer, const BlockIn &in, const Tensor &q, const StepBatch &b,
                        const KVView &kv);
    Tensor mlp(int layer, const BlockIn &in);
    Tensor logits(const Tensor &x, const StepBatch &b, bool all_logits);

    ModelConfig config_;
    DType dtype_;
    Device device_;
    LinearWeight embed_, lm_head_, tied_head_;
    std::shared_ptr<Communicator> comm_; // tensor parallel: this rank's group (null: the whole model here)
    int64_t vocab_part_ = 0;             // the LM head's rows here (the vocabulary, or its rank's share)
    Tensor final_norm_, final_norm_bias_;
    float embed_scale_ = 1.f; // Gemma: sqrt(hidden) rounded to the compute dtype, as HF multiplies
    Tensor decode_scratch_; // CUDA, quantized: see decode_scratch_bytes(); made by check_ready
    Tensor lm_head_decoded_; // CUDA, a quantized LM head: its bf16 copy for steps past the quantized kernels' rows
    std::vector<Layer> layers_;
    std::vector<WeightSpec> table_;           // the family's weight table for this config
    std::map<std::string, Slot> slots_;       // HF name -> where it goes
    bool fused_ = false;
    std::set<std::string> loaded_;
    bool ready_ = false;
    uint64_t weights_version_ = 0;
};

} // namespace llaisys::models
