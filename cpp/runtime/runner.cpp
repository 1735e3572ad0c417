#include "llaisys/runner.hpp"

#include "core/runtime.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "runtime/packing.hpp"
#include "runtime/penalties.hpp"
#include "runtime/staging.hpp"

#include <algorithm>
#include <cstring>

namespace llaisys::runtime {

// A captured decode step for P sequences of one token each: the forward, the repetition penalty from the
// rows' seen sets (switchable), the argmax of every row into `ids`, as a switchable part sample_rows over
// all P rows into `ids` (sample_rows gives a greedy row the argmax's token and -1, so its result replaces
// the argmax's whole), and the tokens into the seen sets (switchable, with the penalty). The inputs, sampling fields
// included, live in two fixed device buffers (i64 and i32 fields) that every replay refills with one copy
// each. One graph for both kinds of step: a second capture of the forward would hold a second copy of
// its activations.
struct Runner::Graphed {
    Tensor buf64, buf32, logits, ids, max_val; // ids [P]: the replay's tokens
    StepBatch batch;
    SamplingFields fields; // views into buf64 / buf32
    std::unique_ptr<Graph> graph;
    size_t sampler = 0, penalty = 0, mark = 0; // the switchable parts
    bool sampler_on = true, penalty_on = true;  // as captured
};

// Rows of the seen sets a runner starts with (grown by doubling: a growth recaptures the graphs, which hold
// the tensor's address).
constexpr int64_t kMinSeenRows = 64;

// A launched step: its tokens land in `host` (pinned) once `done` has passed on the stream.
struct Runner::Inflight {
    Tensor host; // i64 [capacity] pinned
    std::unique_ptr<Event> done;
    std::vector<RowSampling> rows; // for the error message of a row without a token
    // enqueue_logprobs' results on their way (pinned, reused): chosen [R] f32, ids [R, k] i64, top [R, k] f32
    Tensor lp_chosen, lp_ids, lp_top;
    int64_t lp_rows = 0, lp_k = 0; // 0 rows: none asked for this step
};

// A launched step's record with room for `capacity` tokens (pinned on CUDA) and its event.
std::unique_ptr<Runner::Inflight> Runner::make_inflight(int64_t capacity) const {
    auto f = std::make_unique<Inflight>();
    f->done = std::make_unique<Event>(model_.device());
    f->host = Tensor::empty({capacity}, DType::I64, Device::cpu(), model_.device().is_cuda());
    return f;
}

Runner::Runner(models::Model &model, KVPool &pool, RunnerConfig config)
    : model_(model), pool_(pool), config_(std::move(config)),
      staging_(std::make_unique<InputStaging>(model.device())) {
    LLAISYS_CHECK(pool.device() == model.device() && pool.dtype() == model.dtype(), std::invalid_argument,
                  "Runner: the KV pool must have the model's device and dtype");
    LLAISYS_CHECK(config_.max_blocks_per_seq >= 1, std::invalid_argument,
                  "Runner: max_blocks_per_seq must be >= 1, got ", config_.max_blocks_per_seq);
    auto &sizes = config_.graph_batch_sizes;
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    LLAISYS_CHECK(sizes.empty() || sizes.front() >= 1, std::invalid_argument, "Runner: graph batch sizes must be >= 1");
    config_.cuda_graphs = config_.cuda_graphs && model.device().is_cuda();
    if (model.communicator() && model.device().is_cuda()) { // a rank of a tensor-parallel group
        // Pinned host memory is taken now, not while this rank's collectives wait for another rank: a pinned
        // allocation or free may wait for every device's work, which could then never finish.
        staging_->reserve(size_t(1) << 20);
        for (int i = 0; i < 4; ++i) spare_.push_back(make_inflight(4096));
    }
}


Runner::~Runner() {
    for (auto &f : inflight_) { // copies into pinned buffers that are about to go
        try {
            f->done->synchronize();
        } catch (...) { // a device error the engine's step has reported (or will never read): the wait is over
        }
    }
}

void Runner::check(const HostBatch &b) const {
    const int64_t B = b.num_seqs(), T = int64_t(b.ids.size());
    LLAISYS_CHECK(B >= 1 && int64_t(b.q_start.size()) == B + 1 && b.q_start.front() == 0 && b.q_start.back() == T,
                  std::invalid_argument, "Runner: q_start must have B + 1 entries from 0 to the token count ", T);
    LLAISYS_CHECK(int64_t(b.pos.size()) == T && int64_t(b.slots.size()) == T, std::invalid_argument,
                  "Runner: ids, pos and slots must have one entry per token");
    LLAISYS_CHECK(b.max_blocks >= 1 && int64_t(b.block_tables.size()) == B * b.max_blocks, std::invalid_argument,
                  "Runner: block_tables must hold B * max_blocks = ", B * b.max_blocks, " entries, got ",
                  b.block_tables.size());
    const int64_t vocab = model_.config().vocab_size;
    for (int64_t id : b.ids)
        LLAISYS_CHECK(id >= 0 && id < vocab, std::out_of_range, "Runner: token id ", id, " out of range [0, ", vocab, ")");
    const int64_t rows = pool_.num_blocks() * pool_.block_size();
    for (int64_t s : b.slots)
        LLAISYS_CHECK(s >= 0 && s < rows, std::out_of_range, "Runner: slot ", s, " outside the pool's ", rows, " rows");
    for (int32_t blk : b.block_tables)
        LLAISYS_CHECK(blk >= 0 && blk < pool_.num_blocks(), std::out_of_range, "Runner: block ", blk,
                      " outside the pool's ", pool_.num_blocks(), " blocks");
    for (int64_t i = 0; i < B; ++i) {
        const int64_t n = b.q_start[i + 1] - b.q_start[i];
        LLAISYS_CHECK(n >= 1 && b.kv_len[i] >= n && b.kv_len[i] <= b.max_blocks * pool_.block_size(),
                      std::invalid_argument, "Runner: sequence ", i, " has ", n, " tokens and context ", b.kv_len[i],
                      " (need 1 <= tokens <= context <= ", b.max_blocks * pool_.block_size(), ")");
    }
}

StepBatch Runner::upload(const HostBatch &b) {
    std::vector<int64_t> h64;
    std::vector<int32_t> h32;
    pack(b, b.num_seqs(), b.max_blocks, h64, h32);
    const Tensor buf64 = staging_->upload(h64, DType::I64), buf32 = staging_->upload(h32, DType::I32);
    return views(buf64, buf32, b.num_seqs(), int64_t(b.ids.size()), b.max_blocks, max_q_len(b));
}

int64_t Runner::graph_size_for(const HostBatch &b) const {
    if (!config_.cuda_graphs || config_.graph_batch_sizes.empty()) return 0;
    if (int64_t(b.ids.size()) != b.num_seqs() || b.max_blocks > config_.max_blocks_per_seq) return 0; // not decode
    for (int64_t size : config_.graph_batch_sizes)
        if (size >= b.num_seqs()) return size;
    return 0;
}

// Built aside and installed only once captured, so a failure leaves no half-built graph. The eager run of
// the same work first fills the allocator's cache; the replay after the capture recomputes the same.
std::unique_ptr<Runner::Graphed> Runner::capture(const std::vector<int64_t> &h64, const std::vector<int32_t> &h32,
                                                 int64_t P) {
    const int64_t W = config_.max_blocks_per_seq;
    auto g = std::make_unique<Graphed>();
    Graphed &r = *g;
    r.buf64 = staging_->upload(h64, DType::I64);
    r.buf32 = staging_->upload(h32, DType::I32);
    r.batch = views(r.buf64, r.buf32, P, P, W, 1);
    r.fields = sampling_views(r.buf64, r.buf32, P, W);
    r.ids = Tensor::empty({P}, DType::I64, model_.device());
    auto sampler = [&r] {
        const SamplingFields &f = r.fields;
        ops::sample_rows(r.ids, r.logits, f.temperature, f.top_k, f.top_p, f.min_p, f.seeds, f.steps);
    };
    auto forward = [&] { r.logits = model_.forward_step(r.batch, pool_.view()); };
    auto argmax = [&r] { ops::argmax(r.ids, r.max_val, r.logits); };
    if (!seen_.defined()) reserve_seen(kMinSeenRows);
    const Tensor seen = seen_; // the graph holds this address: set_seen recaptures when it grows
    auto penalty = [&r, seen] { ops::seen_penalty(r.logits, seen, r.fields.seen_row, r.fields.penalty); };
    auto mark = [&r, seen] { ops::seen_mark(seen, r.fields.seen_row, r.ids); };
    forward(); // the penalty and the marks allocate nothing: the warm-up leaves them out
    r.max_val = Tensor::empty({P}, r.logits.dtype(), model_.device());
    argmax();
    sampler();
    r.graph = std::make_unique<Graph>(model_.device());
    r.graph->capture([&] {
        forward();
        r.penalty = r.graph->switchable(penalty);
        argmax();
        r.sampler = r.graph->switchable(sampler);
        r.mark = r.graph->switchable(mark);
    });
    return g;
}

// Replays the decode graph of padded size P (capturing it first if needed). With rows it samples them
// into the graph's ids; without, its sampler is off and ids hold every row's argmax of the raw logits.
const Runner::Graphed &Runner::replay(const HostBatch &b, int64_t P, const std::vector<RowSampling> *rows,
                                      const Tensor *chained, const std::vector<int64_t> &chain_rows) {
    std::vector<int64_t> h64;
    std::vector<int32_t> h32;
    pack(b, P, config_.max_blocks_per_seq, h64, h32);
    pack_sampling(rows, P, h64, h32);
    auto it = graphs_.find(P);
    if (it == graphs_.end()) {
        it = graphs_.emplace(P, capture(h64, h32, P)).first;
    } else {
        staging_->upload_into(it->second->buf64, h64.data(), h64.size() * sizeof(int64_t));
        staging_->upload_into(it->second->buf32, h32.data(), h32.size() * sizeof(int32_t));
    }
    Graphed &g = *it->second;
    if (chained != nullptr) chain_ids(g.buf64, *chained, chain_rows);
    const bool on = rows != nullptr && std::any_of(rows->begin(), rows->end(), [](const RowSampling &r) {
        return r.temperature > 0.f; // all greedy: the argmax is the answer, the sampler can stay off
    });
    if (g.sampler_on != on) {
        g.graph->set_enabled(g.sampler, on);
        g.sampler_on = on;
    }
    const bool penalised = rows != nullptr && std::any_of(rows->begin(), rows->end(), [](const RowSampling &r) {
        return r.seen_row >= 0;
    });
    if (g.penalty_on != penalised) {
        g.graph->set_enabled(g.penalty, penalised);
        g.graph->set_enabled(g.mark, penalised);
        g.penalty_on = penalised;
    }
    g.graph->replay();
    return g;
}

// Checks the batch and readies the model for a step; returns the graph size it replays (0: eager).
int64_t Runner::begin(const HostBatch &b, bool all_logits) {
    check(b);
    // Before any upload: the first step after loading raises here under a capture, touching nothing.
    model_.prepare();
    if (model_.weights_version() != graphs_weights_version_) { // reloaded weights: the graphs hold old addresses
        graphs_.clear();
        graphs_weights_version_ = model_.weights_version();
    }
    return all_logits ? 0 : graph_size_for(b);
}

Tensor Runner::logits(const HostBatch &b, bool all_logits) {
    const int64_t size = begin(b, all_logits);
    DeviceGuard guard(model_.device());
    LLAISYS_CHECK(size == 0 || launched() == 0, std::invalid_argument, "Runner.logits: ", launched(),
                  " launched step(s) not finished (call finish() first)");
    if (size > 0) return replay(b, size, nullptr).logits.slice(0, 0, b.num_seqs());
    const StepBatch s = upload(b);
    return model_.forward_step(s, pool_.view(), all_logits);
}

void Runner::shift_kv(const std::vector<int64_t> &src, const std::vector<int64_t> &dst, int64_t delta) {
    LLAISYS_CHECK(src.size() == dst.size(), std::invalid_argument, "Runner.shift_kv: src has ", src.size(),
                  " rows but dst ", dst.size());
    if (src.empty()) return;
    DeviceGuard guard(model_.device());
    model_.shift_kv(pool_.view(), staging_->upload(src, DType::I64), staging_->upload(dst, DType::I64), delta);
}

std::vector<int64_t> Runner::captured_batch_sizes() const {
    std::vector<int64_t> out;
    for (const auto &[size, g] : graphs_) out.push_back(size);
    return out;
}

// One logit_bias call covering every row's (id, bias) pairs (ids [B, n] padded with -1).
static void apply_biases(const Tensor &logits, const std::vector<RowSampling> &rows, InputStaging &st) {
    size_t width = 0;
    for (const RowSampling &r : rows) width = std::max(width, r.bias_ids.size());
    if (width == 0) return;
    const int64_t B = int64_t(rows.size());
    std::vector<int64_t> ids(size_t(B) * width, -1);
    std::vector<float> bias(size_t(B) * width, 0.f);
    for (size_t b = 0; b < rows.size(); ++b) {
        std::copy(rows[b].bias_ids.begin(), rows[b].bias_ids.end(), ids.begin() + int64_t(b * width));
        std::copy(rows[b].bias.begin(), rows[b].bias.end(), bias.begin() + int64_t(b * width));
    }
    ops::logit_bias(logits, st.upload(ids, DType::I64).view({B, int64_t(width)}),
                    st.upload(bias, DType::F32).view({B, int64_t(width)}));
}

// One token_mask call over the batch when any row is constrained ([B, W]; an unconstrained row's words are
// all ones, so it keeps every logit).
void Runner::apply_masks(const Tensor &logits, const std::vector<RowSampling> &rows) {
    const int64_t B = int64_t(rows.size()), W = (logits.size(1) + 31) / 32;
    if (std::all_of(rows.begin(), rows.end(), [](const RowSampling &r) { return r.allowed.empty(); })) return;
    std::vector<int32_t> mask(size_t(B * W), -1);
    for (int64_t b = 0; b < B; ++b) {
        const std::vector<int32_t> &a = rows[size_t(b)].allowed;
        if (a.empty()) continue;
        LLAISYS_CHECK(int64_t(a.size()) == W, std::invalid_argument, "Runner: the token mask of row ", b, " has ",
                      a.size(), " words; a vocabulary of ", logits.size(1), " needs ", W);
        std::copy(a.begin(), a.end(), mask.begin() + b * W);
    }
    ops::token_mask(logits, staging_->upload(mask, DType::I32).view({B, W}));
}

// The processors in order (repetition penalty, biases, token masks), the draw, then each penalised row's
// token into its seen set (on the device: the next step, chained or not, penalises it).
void Runner::sample(const Tensor &out, const Tensor &logits, const std::vector<RowSampling> &rows,
                    const Tensor *masks) {
    const Tensor seen_rows = apply_repetition_penalties(logits, rows, seen_, *staging_);
    apply_biases(logits, rows, *staging_);
    if (masks) {
        ops::token_mask(logits, *masks);
    } else {
        apply_masks(logits, rows);
    }
    draw(out, logits, rows);
    if (seen_rows.defined()) ops::seen_mark(seen_, seen_rows, out);
}

void Runner::set_seen(int64_t row, const std::vector<int32_t> &words) {
    const int64_t W = (model_.config().vocab_size + 31) / 32;
    LLAISYS_CHECK(int64_t(words.size()) == W, std::invalid_argument, "Runner.set_seen: words has ", words.size(),
                  " entries; a vocabulary of ", model_.config().vocab_size, " needs ", W);
    LLAISYS_CHECK(row >= 0 && row < (int64_t(1) << 20), std::out_of_range, "Runner.set_seen: row ", row,
                  " outside [0, 2^20)");
    DeviceGuard guard(model_.device());
    const int64_t S = seen_.defined() ? seen_.size(0) : 0;
    if (row >= S) reserve_seen(std::max<int64_t>({row + 1, 2 * S, kMinSeenRows}));
    staging_->upload_into(seen_.slice(0, row, row + 1), words.data(), words.size() * sizeof(int32_t));
}

// seen_ with `rows` rows, the old ones kept (copied in stream order, behind the launched steps that mark
// them). The graphs hold the old tensor's address: they are captured again, so no step may be in flight.
void Runner::reserve_seen(int64_t rows) {
    const int64_t W = (model_.config().vocab_size + 31) / 32, S = seen_.defined() ? seen_.size(0) : 0;
    if (rows <= S) return;
    LLAISYS_CHECK(S == 0 || launched() == 0, std::invalid_argument, "Runner.set_seen: the seen sets must grow to ",
                  rows, " rows but ", launched(), " launched step(s) still use them (call finish() first)");
    Tensor grown = Tensor::empty({rows, W}, DType::I32, model_.device());
    if (S) runtime::memcpy_async(grown.data(), model_.device(), seen_.data(), model_.device(),
                                 size_t(S * W) * sizeof(int32_t));
    seen_ = grown;
    graphs_.clear();
}

// Greedy rows take the argmax of every row (one launch); the sampled rows are gathered and drawn in one
// launch, each from its own request's (seed, step), so its tokens never depend on its row.
void Runner::draw(const Tensor &out, const Tensor &logits, const std::vector<RowSampling> &rows) {
    const int64_t B = int64_t(rows.size());
    Tensor max_val = Tensor::empty({B}, logits.dtype(), logits.device());
    ops::argmax(out, max_val, logits);
    std::vector<int64_t> sampled, seeds, steps;
    std::vector<float> temperature, top_p, min_p;
    std::vector<int32_t> top_k;
    for (int64_t b = 0; b < B; ++b) {
        const RowSampling &r = rows[size_t(b)];
        if (!(r.temperature > 0.f)) continue;
        sampled.push_back(b);
        seeds.push_back(int64_t(r.seed));
        steps.push_back(int64_t(r.step));
        temperature.push_back(r.temperature);
        top_k.push_back(r.top_k);
        top_p.push_back(r.top_p);
        min_p.push_back(r.min_p);
    }
    if (sampled.empty()) return;
    const int64_t S = int64_t(sampled.size());
    const bool all = S == B; // else gather the sampled rows and scatter their ids back
    const Tensor rows_d = all ? Tensor() : staging_->upload(sampled, DType::I64);
    Tensor lg = logits, ids = out;
    if (!all) {
        lg = Tensor::empty({S, logits.size(1)}, logits.dtype(), logits.device());
        ops::embedding(lg, rows_d, logits); // a row gather
        ids = Tensor::empty({S}, DType::I64, logits.device());
    }
    ops::sample_rows(ids, lg, staging_->upload(temperature, DType::F32), staging_->upload(top_k, DType::I32),
                     staging_->upload(top_p, DType::F32), staging_->upload(min_p, DType::F32),
                     staging_->upload(seeds, DType::I64), staging_->upload(steps, DType::I64));
    if (!all) ops::index_copy(out, rows_d, ids);
}

// Whether a graph can sample the rows itself: none has a bias or token mask to apply to the logits first
// (the conditions under which apply_biases and apply_masks do nothing; the repetition penalty is in the
// graph). TODO: a mask buffer among the graph's inputs (all ones for free rows) would keep constrained rows in it.
static bool samples_in_graph(const std::vector<RowSampling> &rows) {
    return std::none_of(rows.begin(), rows.end(), [](const RowSampling &r) {
        return !r.bias_ids.empty() || !r.allowed.empty();
    });
}

void Runner::launch(const HostBatch &b, const std::vector<RowSampling> &rows, bool chain, bool defer_sampling,
                    const std::vector<int64_t> &chain_rows) {
    LLAISYS_CHECK(int64_t(rows.size()) == b.num_seqs(), std::invalid_argument, "Runner: need sampling parameters for ",
                  b.num_seqs(), " sequences, got ", rows.size());
    LLAISYS_CHECK(!deferred_, std::invalid_argument, "Runner.launch: the deferred launch before it is not sampled yet "
                  "(call sample_deferred() first)");
    const int64_t B = b.num_seqs();
    LLAISYS_CHECK(!chain || (!inflight_.empty() && (chain_rows.empty() ? last_launched_.numel() == B
                                                                        : int64_t(chain_rows.size()) == B)),
                  std::invalid_argument, "Runner.launch: chain needs the step launched just before it, unfinished, "
                  "with the same ", B, " rows or chain_rows naming ", B, " of its rows (", inflight_.size(),
                  " unfinished, the last with ", last_launched_.numel(), " rows, chain_rows ", chain_rows.size(), ")");
    LLAISYS_CHECK(chain || chain_rows.empty(), std::invalid_argument, "Runner.launch: chain_rows without chain");
    for (size_t i = 0; i < chain_rows.size(); ++i) // a selection of the step ahead's rows, in their order
        LLAISYS_CHECK(chain_rows[i] >= 0 && chain_rows[i] < last_launched_.numel() &&
                          (i == 0 || chain_rows[i] > chain_rows[i - 1]),
                      std::invalid_argument, "Runner.launch: chain_rows must be increasing rows of the step ahead's ",
                      last_launched_.numel(), ", got ", chain_rows[i], " at ", i);
    const int64_t size = begin(b, false);
    DeviceGuard guard(model_.device());
    if (!b.logits && size == 0 && !defer_sampling) { // prompt chunks only: no LM head, no sampling
        StepBatch s = upload(b);
        if (chain) chain_ids(s.ids, last_launched_, chain_rows);
        s.last = Tensor();
        model_.forward_step(s, pool_.view());
        last_logits_ = Tensor();
        if (!no_tokens_.defined() || no_tokens_.numel() < B) // made once (zeros on CUDA wait for the device), then
            no_tokens_ = Tensor::zeros({std::max<int64_t>(2 * B, 64)}, DType::I64, model_.device()); // only read
        record(no_tokens_.slice(0, 0, B), rows);
        return;
    }
    if (size > 0 && !defer_sampling && samples_in_graph(rows)) { // one upload per buffer, one replay, one copy back
        const Graphed &g = replay(b, size, &rows, chain ? &last_launched_ : nullptr, chain_rows);
        last_logits_ = g.logits.slice(0, 0, B);
        ++steps_sampled_in_graph_;
        record(g.ids.slice(0, 0, B), rows);
        return;
    }
    forward(b, size, chain, chain_rows);
    if (defer_sampling) {
        deferred_ = std::make_unique<std::vector<RowSampling>>(rows);
        return;
    }
    const Tensor ids = Tensor::empty({B}, DType::I64, model_.device());
    sample(ids, last_logits_, rows);
    record(ids, rows);
}

// The step's forward into last_logits_: a graph's replay with its sampler off (size > 0), else eager.
void Runner::forward(const HostBatch &b, int64_t size, bool chain, const std::vector<int64_t> &chain_rows) {
    const int64_t B = b.num_seqs();
    if (size > 0) {
        last_logits_ = replay(b, size, nullptr, chain ? &last_launched_ : nullptr, chain_rows).logits.slice(0, 0, B);
        return;
    }
    const StepBatch s = upload(b);
    if (chain) chain_ids(s.ids, last_launched_, chain_rows);
    last_logits_ = model_.forward_step(s, pool_.view());
}

void Runner::sample_deferred(const int32_t *mask, int64_t M, int64_t W, const std::vector<int64_t> &mask_rows,
                             int64_t num_rows) {
    LLAISYS_CHECK(deferred_ != nullptr, std::invalid_argument, "Runner.sample_deferred: no deferred launch");
    std::vector<RowSampling> rows = std::move(*deferred_);
    deferred_.reset(); // taken even if what follows raises: the step is then lost, never half-sampled twice
    const int64_t B = int64_t(rows.size());
    LLAISYS_CHECK(num_rows == B, std::invalid_argument, "Runner.sample_deferred: num_rows ", num_rows,
                  " for a launch of ", B, " rows");
    DeviceGuard guard(model_.device());
    const Tensor masks = upload_masks(mask, M, W, mask_rows, B);
    const Tensor ids = Tensor::empty({B}, DType::I64, model_.device());
    sample(ids, last_logits_, rows, masks.defined() ? &masks : nullptr);
    record(ids, rows);
}

// sample_deferred's masks as one [B, W] device tensor (an unmasked row's words all ones), or undefined when
// M = 0. Every row masked in order (a batch of constrained rows): one copy, from `mask` itself.
Tensor Runner::upload_masks(const int32_t *mask, int64_t M, int64_t W, const std::vector<int64_t> &mask_rows,
                            int64_t B) {
    LLAISYS_CHECK(M == int64_t(mask_rows.size()), std::invalid_argument, "Runner.sample_deferred: token_mask has ",
                  M, " rows but mask_rows names ", mask_rows.size());
    if (M == 0) return Tensor();
    const int64_t words = (last_logits_.size(1) + 31) / 32;
    LLAISYS_CHECK(W == words, std::invalid_argument, "Runner.sample_deferred: the token masks have ", W,
                  " words a row; a vocabulary of ", last_logits_.size(1), " needs ", words);
    bool in_order = M == B;
    for (int64_t j = 0; j < M; ++j) {
        LLAISYS_CHECK(mask_rows[size_t(j)] >= 0 && mask_rows[size_t(j)] < B, std::out_of_range,
                      "Runner.sample_deferred: mask row ", mask_rows[size_t(j)], " outside the batch of ", B);
        in_order = in_order && mask_rows[size_t(j)] == j;
    }
    const size_t row_bytes = size_t(W) * sizeof(int32_t);
    if (in_order) {
        for (MaskBuffer &buf : mask_buffers_) { // mask_buffer()'s pinned memory: copied as it is
            if (!buf.host.defined() || buf.host.data() != static_cast<const void *>(mask) ||
                model_.device().is_cpu() || buf.host.size(0) < B)
                continue;
            Tensor out = Tensor::empty({B, W}, DType::I32, model_.device());
            runtime::memcpy_async(out.data(), model_.device(), mask, Device::cpu(), size_t(B) * row_bytes);
            if (!buf.copied) buf.copied = std::make_unique<Event>(model_.device());
            buf.copied->record(current_stream(model_.device()));
            return out;
        }
        return staging_->upload_bytes(mask, size_t(B) * row_bytes, {B, W}, DType::I32);
    }
    masks_host_.assign(size_t(B * W), -1);
    for (int64_t j = 0; j < M; ++j)
        std::memcpy(masks_host_.data() + mask_rows[size_t(j)] * W, mask + j * W, row_bytes);
    return staging_->upload_bytes(masks_host_.data(), size_t(B) * row_bytes, {B, W}, DType::I32);
}

Tensor Runner::mask_buffer(int64_t rows) {
    LLAISYS_CHECK(rows >= 1, std::invalid_argument, "Runner.mask_buffer: rows must be >= 1, got ", rows);
    const int64_t W = (model_.config().vocab_size + 31) / 32;
    MaskBuffer &buf = mask_buffers_[mask_next_];
    mask_next_ ^= 1;
    if (buf.copied) buf.copied->synchronize(); // its last copy to the device has run
    if (!buf.host.defined() || buf.host.size(0) < rows)
        buf.host = Tensor::empty({std::max<int64_t>(rows, 64), W}, DType::I32, Device::cpu(),
                                 model_.device().is_cuda());
    return buf.host.slice(0, 0, rows);
}

// The launch's tokens `ids` (on the device) on their way to the host: an event finish() waits for.
void Runner::record(const Tensor &ids, const std::vector<RowSampling> &rows) {
    const int64_t B = ids.numel();
    std::unique_ptr<Inflight> f;
    if (!spare_.empty()) {
        f = std::move(spare_.back());
        spare_.pop_back();
    } else {
        f = make_inflight(std::max<int64_t>(B, 64));
    }
    if (f->host.numel() < B) f = make_inflight(B); // a larger batch than this spare holds (rare)
    runtime::memcpy_async(f->host.data(), Device::cpu(), ids.data(), model_.device(), size_t(B) * sizeof(int64_t));
    f->done->record(current_stream(model_.device()));
    f->rows = rows;
    inflight_.push_back(std::move(f));
    last_launched_ = ids; // a graph's ids are overwritten only by its next replay, which a chain reads first
}

// The first input ids (dst: a step's ids, or a graph's input buffer, which the ids lead) are the tokens `from`
// holds on the device: a chained step's, whose tokens the host does not know yet. rows (increasing; empty: all
// of them): the rows of `from` this step keeps, when rows of the step ahead ended. One copy for each run of
// consecutive kept rows: a step usually drops one or two rows, so two or three copies.
void Runner::chain_ids(const Tensor &dst, const Tensor &from, const std::vector<int64_t> &rows) {
    const auto *src = static_cast<const int64_t *>(from.data());
    auto *out = static_cast<int64_t *>(dst.data());
    if (rows.empty()) {
        runtime::memcpy_async(out, model_.device(), src, model_.device(), size_t(from.numel()) * sizeof(int64_t));
        return;
    }
    for (size_t i = 0; i < rows.size();) {
        size_t j = i + 1;
        while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
        runtime::memcpy_async(out + i, model_.device(), src + rows[i], model_.device(), (j - i) * sizeof(int64_t));
        i = j;
    }
}

// The logprobs of the step launched last, computed on the device behind it (its logits and its sampled ids,
// before a chained step overwrites them) and copied back with its tokens: finish() hands them over.
void Runner::enqueue_logprobs(const std::vector<int64_t> &rows, const std::vector<float> &temperature, int64_t k) {
    LLAISYS_CHECK(!inflight_.empty() && !deferred_, std::invalid_argument,
                  "Runner.enqueue_logprobs: needs a launched step whose tokens are sampled (not deferred)");
    const int64_t B = last_launched_.numel(), R = int64_t(rows.size());
    LLAISYS_CHECK(int64_t(temperature.size()) == B, std::invalid_argument, "Runner.enqueue_logprobs: ",
                  temperature.size(), " temperatures for a step of ", B, " rows");
    LLAISYS_CHECK(R >= 1 && R <= B && k >= 1 && k <= 20, std::invalid_argument, "Runner.enqueue_logprobs: ", R,
                  " rows of ", B, " and k ", k, " (1..20)");
    for (int64_t r : rows)
        LLAISYS_CHECK(r >= 0 && r < B, std::out_of_range, "Runner.enqueue_logprobs: row ", r, " outside the step's ", B);
    DeviceGuard guard(model_.device());
    const Device dev = model_.device();
    const Tensor rows_d = staging_->upload(rows, DType::I64);
    const Tensor temp_d = staging_->upload(temperature, DType::F32);
    const Tensor chosen = Tensor::empty({R}, DType::F32, dev), ids = Tensor::empty({R, k}, DType::I64, dev),
                 top = Tensor::empty({R, k}, DType::F32, dev);
    ops::logprobs(chosen, ids, top, last_logits_, temp_d, last_launched_, rows_d);
    Inflight &f = *inflight_.back();
    const bool pinned = dev.is_cuda();
    if (!f.lp_chosen.defined() || f.lp_chosen.numel() < R)
        f.lp_chosen = Tensor::empty({std::max<int64_t>(R, 64)}, DType::F32, Device::cpu(), pinned);
    if (!f.lp_ids.defined() || f.lp_ids.numel() < R * k) {
        f.lp_ids = Tensor::empty({std::max<int64_t>(R * k, 64 * 5)}, DType::I64, Device::cpu(), pinned);
        f.lp_top = Tensor::empty({std::max<int64_t>(R * k, 64 * 5)}, DType::F32, Device::cpu(), pinned);
    }
    runtime::memcpy_async(f.lp_chosen.data(), Device::cpu(), chosen.data(), dev, size_t(R) * sizeof(float));
    runtime::memcpy_async(f.lp_ids.data(), Device::cpu(), ids.data(), dev, size_t(R * k) * sizeof(int64_t));
    runtime::memcpy_async(f.lp_top.data(), Device::cpu(), top.data(), dev, size_t(R * k) * sizeof(float));
    f.done->record(current_stream(dev)); // finish() now waits for these copies too
    f.lp_rows = R;
    f.lp_k = k;
}

bool Runner::busy() const { return !inflight_.empty() && !inflight_.front()->done->query(); }

std::vector<int64_t> Runner::finish() {
    if (inflight_.empty() && deferred_) sample_deferred(nullptr, 0, 0, {}, int64_t(deferred_->size()));
    LLAISYS_CHECK(!inflight_.empty(), std::invalid_argument, "Runner.finish: no launched step to finish");
    std::unique_ptr<Inflight> f = std::move(inflight_.front());
    inflight_.pop_front();
    const auto *p = f->host.data_as<int64_t>();
    try {
        f->done->synchronize();
    } catch (const std::out_of_range &) { // the device's id check: a chained step may have read this step's
        check_ids(std::vector<int64_t>(p, p + f->rows.size()), f->rows); // -1 (no token); this error says why
        throw;
    }
    std::vector<int64_t> ids(p, p + f->rows.size());
    const std::vector<RowSampling> rows = std::move(f->rows);
    finished_lp_ = FinishedLogprobs{};
    if (f->lp_rows > 0) {
        const int64_t R = f->lp_rows, n = R * f->lp_k;
        const auto *c = f->lp_chosen.data_as<float>();
        const auto *ids = f->lp_ids.data_as<int64_t>();
        const auto *top = f->lp_top.data_as<float>();
        finished_lp_ = FinishedLogprobs{std::vector<float>(c, c + R), std::vector<int64_t>(ids, ids + n),
                                        std::vector<float>(top, top + n), f->lp_k};
        f->lp_rows = 0;
    }
    spare_.push_back(std::move(f));
    check_ids(ids, rows);
    return ids;
}

// launch() and at once finish(): the step's one host sync.
std::vector<int64_t> Runner::step(const HostBatch &b, const std::vector<RowSampling> &rows) {
    LLAISYS_CHECK(launched() == 0, std::invalid_argument, "Runner.step: ", launched(),
                  " launched step(s) not finished (call finish() first)");
    launch(b, rows, false);
    return finish();
}

// Raises on a row that got no token.
void Runner::check_ids(const std::vector<int64_t> &ids, const std::vector<RowSampling> &rows) {
    for (size_t i = 0; i < ids.size(); ++i) // argmax and sample mark a row without a finite maximum with -1
        LLAISYS_CHECK(ids[i] >= 0, std::runtime_error, "non-finite logits (NaN or Inf) at generation step ",
                      rows[i].step, " of the request in row ", i,
                      " of the step: the model produced NaN/Inf, no token was sampled (check the weights and the "
                      "dtype)");
}

} // namespace llaisys::runtime
