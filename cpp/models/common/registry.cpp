// ModelConfig's checks and its fields by name, the table of architectures, and create_model.
#include "llaisys/model.hpp"

#include "models/common/decoder.hpp"

#include <cmath>
#include <functional>
#include <map>

namespace llaisys::models {

// The families (cpp/models/arch/*.cpp).
Architecture qwen2_architecture();
Architecture qwen3_architecture();
Architecture llama_architecture();
Architecture mistral_architecture();
Architecture gpt_neox_architecture();
Architecture gemma3_architecture();

const std::vector<Architecture> &architectures() {
    static const std::vector<Architecture> all = {qwen2_architecture(), qwen3_architecture(), llama_architecture(),
                                                  mistral_architecture(), gpt_neox_architecture(),
                                                  gemma3_architecture()};
    return all;
}

const Architecture *find_architecture(const std::string &name) {
    for (const Architecture &a : architectures()) {
        if (a.name == name || a.gguf_arch == name) return &a;
        for (const std::string &hf : a.hf_architectures)
            if (hf == name) return &a;
    }
    return nullptr;
}

const Architecture &architecture(const std::string &name) {
    const Architecture *a = find_architecture(name);
    if (a == nullptr) {
        std::string known;
        for (const Architecture &k : architectures()) known += (known.empty() ? "" : ", ") + k.name;
        LLAISYS_CHECK(false, std::invalid_argument, "architecture '", name, "' is not supported (llaisys runs ", known,
                      ")");
    }
    return *a;
}

namespace {

template <typename E>
struct EnumNames {
    std::vector<std::pair<E, const char *>> names;
    std::string name(E e) const {
        for (auto &[v, n] : names)
            if (v == e) return n;
        return "?";
    }
    E parse(const std::string &field, const std::string &s) const {
        std::string all;
        for (auto &[v, n] : names) {
            if (s == n) return v;
            all += (all.empty() ? "" : ", ") + std::string(n);
        }
        LLAISYS_CHECK(false, std::invalid_argument, "ModelConfig: ", field, " must be one of ", all, ", got '", s, "'");
        return names.front().first;
    }
};
const EnumNames<NormKind> kNorms{{{NormKind::rms, "rms"}, {NormKind::layer, "layer"}}};
const EnumNames<Activation> kActs{{{Activation::silu, "silu"}, {Activation::gelu, "gelu"},
                                   {Activation::gelu_tanh, "gelu_tanh"}}};
const EnumNames<RopeScalingType> kRopes{{{RopeScalingType::none, "none"}, {RopeScalingType::linear, "linear"},
                                         {RopeScalingType::llama3, "llama3"}}};

struct Field {
    std::function<ConfigValue(const ModelConfig &)> get;
    std::function<void(ModelConfig &, const ConfigValue &)> set;
};

template <typename T>
Field member(T ModelConfig::*m, const char *name) {
    return {[m](const ModelConfig &c) -> ConfigValue {
                if constexpr (std::is_same_v<T, float>) return double(c.*m);
                else return c.*m;
            },
            [m, name](ModelConfig &c, const ConfigValue &v) {
                if constexpr (std::is_same_v<T, bool>) {
                    LLAISYS_CHECK(std::holds_alternative<bool>(v), TypeError, "ModelConfig: ", name, " must be a bool");
                    c.*m = std::get<bool>(v);
                } else if constexpr (std::is_same_v<T, std::string>) {
                    LLAISYS_CHECK(std::holds_alternative<std::string>(v), TypeError, "ModelConfig: ", name,
                                  " must be a string");
                    c.*m = std::get<std::string>(v);
                } else if constexpr (std::is_same_v<T, int64_t>) {
                    LLAISYS_CHECK(std::holds_alternative<int64_t>(v), TypeError, "ModelConfig: ", name,
                                  " must be an integer");
                    c.*m = std::get<int64_t>(v);
                } else {
                    LLAISYS_CHECK(std::holds_alternative<double>(v) || std::holds_alternative<int64_t>(v), TypeError,
                                  "ModelConfig: ", name, " must be a number");
                    c.*m = float(std::holds_alternative<double>(v) ? std::get<double>(v) : double(std::get<int64_t>(v)));
                }
            }};
}

template <typename E>
Field enumerated(E ModelConfig::*m, const char *name, const EnumNames<E> &names) {
    return {[m, &names](const ModelConfig &c) -> ConfigValue { return names.name(c.*m); },
            [m, name, &names](ModelConfig &c, const ConfigValue &v) {
                LLAISYS_CHECK(std::holds_alternative<std::string>(v), TypeError, "ModelConfig: ", name,
                              " must be a string");
                c.*m = names.parse(name, std::get<std::string>(v));
            }};
}

const std::vector<std::pair<std::string, Field>> &fields() {
    using C = ModelConfig;
    static const std::vector<std::pair<std::string, Field>> all = {
        {"arch", member(&C::arch, "arch")},
        {"vocab_size", member(&C::vocab_size, "vocab_size")},
        {"hidden_size", member(&C::hidden_size, "hidden_size")},
        {"intermediate_size", member(&C::intermediate_size, "intermediate_size")},
        {"num_hidden_layers", member(&C::num_hidden_layers, "num_hidden_layers")},
        {"num_attention_heads", member(&C::num_attention_heads, "num_attention_heads")},
        {"num_key_value_heads", member(&C::num_key_value_heads, "num_key_value_heads")},
        {"head_dim", member(&C::head_dim, "head_dim")},
        {"norm_eps", member(&C::norm_eps, "norm_eps")},
        {"rope_theta", member(&C::rope_theta, "rope_theta")},
        {"partial_rotary_factor", member(&C::partial_rotary_factor, "partial_rotary_factor")},
        {"rope_scaling", enumerated(&C::rope_scaling, "rope_scaling", kRopes)},
        {"rope_factor", member(&C::rope_factor, "rope_factor")},
        {"rope_low_freq_factor", member(&C::rope_low_freq_factor, "rope_low_freq_factor")},
        {"rope_high_freq_factor", member(&C::rope_high_freq_factor, "rope_high_freq_factor")},
        {"rope_original_max_position_embeddings",
         member(&C::rope_original_max_position_embeddings, "rope_original_max_position_embeddings")},
        {"tie_word_embeddings", member(&C::tie_word_embeddings, "tie_word_embeddings")},
        {"norm", enumerated(&C::norm, "norm", kNorms)},
        {"norm_plus_one", member(&C::norm_plus_one, "norm_plus_one")},
        {"activation", enumerated(&C::activation, "activation", kActs)},
        {"gated_mlp", member(&C::gated_mlp, "gated_mlp")},
        {"parallel_residual", member(&C::parallel_residual, "parallel_residual")},
        {"qkv_bias", member(&C::qkv_bias, "qkv_bias")},
        {"o_bias", member(&C::o_bias, "o_bias")},
        {"mlp_bias", member(&C::mlp_bias, "mlp_bias")},
        {"qk_norm", member(&C::qk_norm, "qk_norm")},
        {"sandwich_norm", member(&C::sandwich_norm, "sandwich_norm")},
        {"sliding_window", member(&C::sliding_window, "sliding_window")},
        {"sliding_window_pattern", member(&C::sliding_window_pattern, "sliding_window_pattern")},
        {"rope_local_theta", member(&C::rope_local_theta, "rope_local_theta")},
        {"scale_embeddings", member(&C::scale_embeddings, "scale_embeddings")},
        {"query_pre_attn_scalar", member(&C::query_pre_attn_scalar, "query_pre_attn_scalar")},
    };
    return all;
}

const Field &field(const std::string &name) {
    for (auto &[n, f] : fields())
        if (n == name) return f;
    LLAISYS_CHECK(false, std::invalid_argument, "ModelConfig has no field '", name, "'");
    return fields().front().second;
}

} // namespace

const std::vector<std::string> &config_field_names() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> out;
        for (auto &[n, f] : fields()) out.push_back(n);
        return out;
    }();
    return names;
}

ConfigValue get_config_field(const ModelConfig &c, const std::string &name) { return field(name).get(c); }

void set_config_field(ModelConfig &c, const std::string &name, const ConfigValue &value) { field(name).set(c, value); }

int64_t ModelConfig::rotary_dim() const {
    // HF: int(head_dim * partial_rotary_factor); the factor is held in f32, so a hair of slack before the floor
    return int64_t(std::floor(double(head_dim) * double(partial_rotary_factor) + 1e-4));
}

bool ModelConfig::layer_has_window(int64_t layer) const {
    if (sliding_window <= 0) return false;
    return sliding_window_pattern <= 0 || (layer + 1) % sliding_window_pattern != 0;
}

void ModelConfig::validate() const {
    auto positive = [](int64_t v, const char *name) {
        LLAISYS_CHECK(v > 0, std::invalid_argument, "ModelConfig: ", name, " must be positive, got ", v);
    };
    architecture(arch);
    positive(vocab_size, "vocab_size");
    positive(hidden_size, "hidden_size");
    positive(intermediate_size, "intermediate_size");
    positive(num_hidden_layers, "num_hidden_layers");
    positive(num_attention_heads, "num_attention_heads");
    positive(num_key_value_heads, "num_key_value_heads");
    positive(head_dim, "head_dim");
    LLAISYS_CHECK(num_attention_heads % num_key_value_heads == 0, std::invalid_argument,
                  "ModelConfig: num_attention_heads (", num_attention_heads,
                  ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
    LLAISYS_CHECK(head_dim % 2 == 0, std::invalid_argument, "ModelConfig: head_dim must be even, got ", head_dim);
    LLAISYS_CHECK(norm_eps > 0 && rope_theta > 0 && std::isfinite(norm_eps) && std::isfinite(rope_theta),
                  std::invalid_argument, "ModelConfig: norm_eps and rope_theta must be finite and positive");
    const int64_t r = rotary_dim();
    LLAISYS_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1 && r % 2 == 0 && r > 0,
                  std::invalid_argument, "ModelConfig: partial_rotary_factor must give an even rotary dim in (0, ",
                  head_dim, "], got ", partial_rotary_factor);
    LLAISYS_CHECK(sliding_window >= 0 && sliding_window_pattern >= 0, std::invalid_argument,
                  "ModelConfig: sliding_window and sliding_window_pattern must be >= 0");
    // What the step (decoder_step.cpp) computes today; the rest of the table's traits raise here, before
    // any weight is read.
    auto unsupported = [](bool bad, const char *what) {
        LLAISYS_CHECK(!bad, std::invalid_argument, "ModelConfig: ", what, " is not supported yet");
    };
    unsupported(parallel_residual && norm != NormKind::layer, "parallel_residual with RMSNorm");
    unsupported(sandwich_norm && norm != NormKind::rms, "sandwich_norm with LayerNorm");
    unsupported(norm == NormKind::layer && norm_plus_one, "norm_plus_one with LayerNorm");
}

ModelConfig tensor_parallel_config(const ModelConfig &config, int world) {
    config.validate();
    LLAISYS_CHECK(world >= 1, std::invalid_argument, "tensor_parallel_size must be >= 1, got ", world);
    if (world == 1) return config;
    const int64_t heads = config.num_attention_heads, kv = config.num_key_value_heads;
    std::string problems; // every one, so a user fixes them at once
    auto need = [&](bool ok, const std::string &what) {
        if (!ok) problems += (problems.empty() ? "" : "; ") + what;
    };
    const std::string tp = " tensor_parallel_size " + std::to_string(world);
    need(heads % world == 0, detail::concat("num_attention_heads ", heads, " is not a multiple of", tp));
    need(kv % world == 0 || world % kv == 0, detail::concat("num_key_value_heads ", kv, " neither divides by nor divides", tp));
    need(config.intermediate_size % world == 0,
         detail::concat("intermediate_size ", config.intermediate_size, " is not a multiple of", tp));
    need(config.vocab_size % world == 0, detail::concat("vocab_size ", config.vocab_size, " is not a multiple of", tp));
    LLAISYS_CHECK(problems.empty(), std::invalid_argument, config.arch, " model cannot be split over ", world,
                  " ranks: ", problems);
    ModelConfig c = config;
    c.num_attention_heads = heads / world;
    c.num_key_value_heads = kv >= world ? kv / world : 1;
    c.intermediate_size = config.intermediate_size / world;
    return c;
}

int64_t tensor_parallel_vocab(const ModelConfig &config, int world) {
    LLAISYS_CHECK(world >= 1 && config.vocab_size % world == 0, std::invalid_argument, "vocab_size ",
                  config.vocab_size, " does not split over ", world, " ranks");
    return config.vocab_size / world;
}

std::unique_ptr<Model> create_model(const ModelConfig &config, DType dtype, Device device, std::optional<bool> fused,
                                    std::shared_ptr<Communicator> comm) {
    return std::make_unique<Decoder>(config, dtype, device, fused, std::move(comm));
}

} // namespace llaisys::models
