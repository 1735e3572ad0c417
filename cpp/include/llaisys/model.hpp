// The model interface the runtime, the bindings and the engine know: weights plus the layer math of one
// step over a batch (forward_step). Which architecture it is lives in data: a ModelConfig (the config
// fields every family shares, and the family's traits) and an Architecture table per family
// (cpp/models/arch/<family>.cpp: where each config field is read in an HF config.json or GGUF metadata,
// and every weight's HF name, GGUF name, shape, fusion group and tensor-parallel split dim). The Python
// loader reads the same table through _core (never a second copy).
#pragma once
#include "llaisys/comm.hpp"
#include "llaisys/quant.hpp"
#include "llaisys/step_batch.hpp"
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

namespace llaisys::models {

enum class NormKind { rms, layer };
enum class Activation { silu, gelu, gelu_tanh };
enum class RopeScalingType { none, linear, llama3 };

// One model's configuration. The names of the shared fields are HF's (config.json); a family's traits
// (norm, activation, biases, ...) come from its Architecture's defaults, some of them read from the config.
struct ModelConfig {
    std::string arch; // an Architecture's name: "qwen2", "llama", ...
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int64_t num_hidden_layers = 0;
    int64_t num_attention_heads = 0;
    int64_t num_key_value_heads = 0;
    int64_t head_dim = 0;
    float norm_eps = 1e-6f;
    float rope_theta = 10000.f;
    float partial_rotary_factor = 1.f; // rotary_dim = head_dim * factor (GPT-NeoX's rotary_pct)
    RopeScalingType rope_scaling = RopeScalingType::none;
    float rope_factor = 1.f, rope_low_freq_factor = 1.f, rope_high_freq_factor = 4.f;
    int64_t rope_original_max_position_embeddings = 8192;
    bool tie_word_embeddings = false;
    // traits
    NormKind norm = NormKind::rms;
    bool norm_plus_one = false; // the stored norm weight is w and the norm multiplies by 1 + w (Gemma)
    Activation activation = Activation::silu;
    bool gated_mlp = true;          // act(gate(x)) * up(x), else act(up(x)) (GPT-NeoX)
    bool parallel_residual = false; // x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)
    bool qkv_bias = false, o_bias = false, mlp_bias = false;
    bool qk_norm = false;         // RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    bool sandwich_norm = false;   // norms after attention and after the MLP too (Gemma 2/3)
    int64_t sliding_window = 0;   // 0: full attention
    int64_t sliding_window_pattern = 0; // with a window: every Nth layer attends globally (0: none does)
    float rope_local_theta = 0.f;       // RoPE base of the windowed layers (0: rope_theta)
    bool scale_embeddings = false;      // embeddings times sqrt(hidden_size) (Gemma)
    float query_pre_attn_scalar = 0.f;  // attention scale 1/sqrt(this) (0: head_dim)

    void validate() const; // ValueError naming the field
    int64_t rotary_dim() const;
    bool layer_has_window(int64_t layer) const;
};

// Every ModelConfig field by name, for the bindings and the loader: ints, floats, bools and strings (an
// enum is its name: "rms", "layer"; "silu", "gelu", "gelu_tanh"; "none", "linear", "llama3").
using ConfigValue = std::variant<int64_t, double, bool, std::string>;
const std::vector<std::string> &config_field_names();
ConfigValue get_config_field(const ModelConfig &c, const std::string &name);
void set_config_field(ModelConfig &c, const std::string &name, const ConfigValue &value); // raises naming it

// A weight of a concrete config: HF name, GGUF name, shape, the fused matrix it may join ("qkv",
// "gate_up" or ""), the dim a tensor-parallel shard splits (0 rows, 1 columns, -1 replicated), and the
// decoder role it fills ("q", "attn_norm", ... in layer `layer`; -1 for whole-model weights).
struct WeightSpec {
    std::string hf_name, gguf_name;
    Shape shape;
    std::string group;
    int split_dim = -1;
    std::string role;
    int64_t layer = -1;
};

// Where a ModelConfig field is read: its HF config.json key and its GGUF metadata key ("{arch}." is the
// file's general.architecture prefix). An empty key: not read from that kind of file.
struct ConfigKey {
    std::string field, hf_key, gguf_key;
};

// One family: the names it answers to, its traits (defaults), where each field is read, and its weights.
struct Architecture {
    std::string name;
    std::vector<std::string> hf_architectures; // config.json "architectures" / "model_type" values
    std::string gguf_arch;                     // GGUF general.architecture
    ModelConfig defaults;
    std::vector<ConfigKey> keys;
    std::vector<WeightSpec> (*weights)(const ModelConfig &) = nullptr;
    // llama.cpp's converter permutes the rows of q and k of this family (to its interleaved rotary layout);
    // a GGUF load undoes it.
    bool gguf_permuted_qk = false;
};

// One rank's share of a model split over `world` ranks (Megatron): its query heads, its KV heads (split
// when there are at least `world`, else one replicated head per rank) and its MLP width; the vocabulary
// stays whole (the embedding is replicated, the LM head's rows split by tensor_parallel_vocab). ValueError
// naming what does not divide.
ModelConfig tensor_parallel_config(const ModelConfig &config, int world);
// The rows [rank * n, (rank + 1) * n) of the LM head (token ids) each of `world` ranks holds: n = vocab / world.
int64_t tensor_parallel_vocab(const ModelConfig &config, int world);

// Every architecture llaisys runs, and lookup by name, HF architecture, model_type or GGUF name (nullptr
// when unknown).
const std::vector<Architecture> &architectures();
const Architecture *find_architecture(const std::string &name);
const Architecture &architecture(const std::string &name); // ValueError listing the known ones

class Model {
public:
    virtual ~Model() = default;
    // Takes the weight named as in HF checkpoints, copying or converting it to the model's dtype and device.
    // Unknown names and wrong shapes raise.
    virtual void load_weight(const std::string &name, const Tensor &value) = 0;
    // Takes a projection or embedding weight as GGUF blocks, kept quantized.
    virtual void load_quant_weight(const std::string &name, const QuantMatrix &value) = 0;
    virtual std::vector<std::string> missing_weights() const = 0;
    // (HF name, stored format "bf16" / "q4_k" / ..., bytes) of every weight; bytes of all weights on the
    // device (each buffer once).
    virtual std::vector<std::tuple<std::string, std::string, int64_t>> weight_formats() const = 0;
    virtual int64_t weight_bytes() const = 0;
    // CUDA with quantized weights: the buffer multi-row steps decode each quantized weight into (0 otherwise).
    virtual int64_t decode_scratch_bytes() const = 0;
    // Checks every weight is loaded, fuses projections and allocates scratch; before sizing a KV cache from
    // free memory and before capturing a step into a CUDA graph.
    virtual void prepare() = 0;
    // Bumped by every load: a captured step holds the weights' addresses, its owner drops it on a change.
    virtual uint64_t weights_version() const = 0;
    // One step of a batch over the paged KV cache: stores each token's key/value at its slot and returns the
    // logits of the rows batch.last [B, vocab] (all_logits: of every token, [T, vocab]), in the model dtype,
    // not synchronized. Every input is a device tensor, so a CUDA graph can capture it. batch.last undefined
    // (and all_logits false): the layers only (the KV cache written), no LM head; returns an undefined tensor.
    virtual Tensor forward_step(const StepBatch &batch, const KVView &kv, bool all_logits = false) = 0;
    // StreamingLLM's K-shift: in every layer, the keys at cache rows src turned by delta positions with that
    // layer's own RoPE table (ops::kv_shift), written with their values to rows dst [n] (device i64).
    // Stream-ordered, not synchronized; never inside a captured step.
    virtual void shift_kv(const KVView &kv, const Tensor &src, const Tensor &dst, int64_t delta) = 0;
    virtual bool fused_projections() const = 0;
    virtual const ModelConfig &config() const = 0;
    virtual DType dtype() const = 0;
    virtual Device device() const = 0;
    // Tensor parallelism: this model is rank comm->rank() of comm->world() (config() is then the rank's
    // share: tensor_parallel_config); null when it holds the whole model.
    virtual const std::shared_ptr<Communicator> &communicator() const = 0;
    // The KV cache layout a step expects: per layer [*, nkvh, kv_head_dim].
    int64_t kv_heads() const { return config().num_key_value_heads; }
    int64_t kv_head_dim() const { return config().head_dim; }
};

// The model of config.arch. fused: fused projections on or off; unset, on for CUDA only. comm: one rank of
// a tensor-parallel group (on the model's device), which then holds that rank's share of config.
std::unique_ptr<Model> create_model(const ModelConfig &config, DType dtype, Device device,
                                    std::optional<bool> fused = std::nullopt,
                                    std::shared_ptr<Communicator> comm = nullptr);

} // namespace llaisys::models
