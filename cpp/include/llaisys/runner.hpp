// The step runner: takes one step's batch as host arrays (built by the Python scheduler), uploads it in
// two copies, runs the model over the paged KV pool (replaying a captured CUDA graph for decode
// batches, padded to the next graph batch size) and samples one token per sequence with that
// sequence's own parameters and random stream: inside the graph (repetition penalties included) when no
// row has logit biases or a token mask, else after it. The model is only the layer math; the runner owns
// the graphs, the input staging and sampling (its settings come from the caller: EngineConfig).
#pragma once
#include "llaisys/graph.hpp"
#include "llaisys/kv_pool.hpp"
#include "llaisys/model.hpp"

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

namespace llaisys::runtime {

class InputStaging;

// One step as the scheduler sees it (StepBatch's fields, on the host). Block tables are row-major
// [B, max_blocks]; unused entries may hold anything in [0, num_blocks).
struct HostBatch {
    std::vector<int64_t> ids, pos, slots; // [T]
    std::vector<int32_t> q_start;         // [B + 1]
    std::vector<int32_t> kv_len;          // [B]
    std::vector<int32_t> block_tables;    // [B * max_blocks]
    int64_t max_blocks = 0;
    // false: no row samples a token this step (each is a prompt chunk before its prompt's last one), so an
    // eager step runs the layers without the LM head and gives each row token 0, which no one reads. On the
    // CPU a 128-token prompt in chunks of 32 otherwise read the LM head (Gemma 3: 178 MB of Q8_0) 4 times.
    bool logits = true;
    int64_t num_seqs() const { return int64_t(kv_len.size()); }
};

// Sampling for one sequence of the batch: its parameters, its request's random stream and logit biases.
// Its random draw depends only on (seed, step): the same request samples the same tokens whatever its
// row or its neighbours.
struct RowSampling {
    float temperature = 0.f; // 0 (or negative, or NaN) = greedy
    int32_t top_k = 0;       // 0 = off
    float top_p = 1.f;       // 1 = off
    float min_p = 0.f;       // 0 = off
    float repetition_penalty = 1.f;
    // The sequence's row of the runner's "seen" bitmasks (set_seen; prompt and output tokens so far), penalised
    // by repetition_penalty; the token sampled for it is added on the device. -1: none (no penalty).
    int32_t seen_row = -1;
    uint64_t seed = 0, step = 0;
    // Added to the logits at these ids (distinct) after the repetition penalty: presence/frequency
    // penalties, and -inf for tokens banned this step (EOS before min_tokens).
    std::vector<int64_t> bias_ids;
    std::vector<float> bias;
    // Structured output: llguidance's allowed-token bitmask of this step ([ceil(vocab / 32)] words, bit v % 32
    // of word v / 32 set = token v allowed), applied last (token_mask: the rest -> -inf). Empty = no constraint.
    std::vector<int32_t> allowed;
};

struct RunnerConfig {
    std::vector<int64_t> graph_batch_sizes; // decode batches up to the largest are padded and replayed
    int64_t max_blocks_per_seq = 1;         // block-table width of the graphs (max_seq_len / block_size)
    bool cuda_graphs = true;                // CUDA only
};

class Runner {
public:
    Runner(models::Model &model, KVPool &pool, RunnerConfig config);
    ~Runner();
    // Runs the step and returns one sampled token id per sequence (the only host sync of a step).
    std::vector<int64_t> step(const HostBatch &batch, const std::vector<RowSampling> &rows);
    // Overlapped steps: the host prepares the next step while the device runs this one. launch() runs a
    // step as step() would, without waiting for its tokens, which finish() returns later (oldest launch
    // first). With chain, the step's input ids are the tokens of the step launched just before it, copied
    // on the device: a decode of the same sequences in the same rows, whose tokens the host does not know
    // yet (the host's ids are ignored; biases, applied from host lists, must not need them; a repetition
    // penalty's seen set got them on the device).
    // step() and a graphed logits() raise while launched steps are unfinished.
    //
    // defer_sampling: only the forward is enqueued (a graph's forward, its sampler off); sample_deferred()
    // enqueues the sampling later with the rows' token masks (structured output), so the host computes
    // those masks, which need the tokens of the step ahead, while the device runs this step's forward.
    // Until then no other launch, step or logits call is taken; finish() of the step ahead is.
    //
    // chain_rows (with chain; empty: every row): the step ahead's rows this step continues, increasing, when
    // some of them ended (a length limit reached, an EOS read meanwhile): row i's input id is the step ahead's
    // token of row chain_rows[i], so the next step drops ended rows without waiting for the step ahead.
    void launch(const HostBatch &batch, const std::vector<RowSampling> &rows, bool chain,
                bool defer_sampling = false, const std::vector<int64_t> &chain_rows = {});
    // Completes the deferred launch of num_rows rows: row mask_rows[j] gets the token bitmask mask[j]
    // (mask: [M, W] i32, C-contiguous, W = ceil(vocab / 32); M = 0: no row masked). The masks reach the
    // device in one copy (straight from `mask` when every row is masked, in order): on the host's path from
    // the step ahead's tokens to this sampling. Its tokens come from finish() like any launch's.
    void sample_deferred(const int32_t *mask, int64_t M, int64_t W, const std::vector<int64_t> &mask_rows,
                         int64_t num_rows);
    std::vector<int64_t> finish();
    // Logprobs (OpenAI's) of the step launched last, on the device behind it, so a chained step may follow
    // at once: output row r is the step's row rows[r] (increasing or not), with its temperature (temperature
    // [B]; 0 means 1) and its k (1..20) most likely tokens (ops::logprobs). The copies back join the step's
    // tokens: finished_logprobs() holds them once finish() returned that step's tokens.
    void enqueue_logprobs(const std::vector<int64_t> &rows, const std::vector<float> &temperature, int64_t k);
    struct FinishedLogprobs {
        std::vector<float> chosen; // [R]
        std::vector<int64_t> top_ids; // [R * k]
        std::vector<float> top_lp;    // [R * k]
        int64_t k = 0;                // 0: the last finished step had none
    };
    // What enqueue_logprobs computed for the step finish() returned last (k = 0: nothing).
    const FinishedLogprobs &finished_logprobs() const { return finished_lp_; }
    // Writes a sequence's seen set (for its repetition penalty): row `row` of the device bitmask [S, W]
    // becomes words ([W = ceil(vocab / 32)] i32, bit v % 32 of word v / 32 = token v), stream-ordered behind
    // every launched step (a row may be reused: a finished sequence's last step marks it first). S grows
    // as rows are named (the rows kept).
    void set_seen(int64_t row, const std::vector<int32_t> &words);
    // Launched steps not finished yet (a deferred one included: finish() samples it unmasked first).
    size_t launched() const { return inflight_.size() + (deferred_ ? 1 : 0); }
    // Whether the oldest launch is still running on the device (finish() would wait for it); false with
    // nothing launched and on the CPU, whose launches are done when they return. The step loop does host work
    // that can wait (building logprobs entries) only while this holds.
    bool busy() const;
    // The step's logits without sampling: [B, vocab], or [T, vocab] with all_logits (scoring).
    Tensor logits(const HostBatch &batch, bool all_logits);
    // The logits the last step() sampled from ([B, vocab], after penalties and biases, before
    // temperature), valid until the next step: what logprobs are computed from.
    const Tensor &last_logits() const { return last_logits_; }
    // StreamingLLM's K-shift before the next step (model.shift_kv over the pool), stream-ordered behind
    // every step launched so far: cache rows src -> dst, keys turned by delta positions.
    void shift_kv(const std::vector<int64_t> &src, const std::vector<int64_t> &dst, int64_t delta);
    models::Model &model() const { return model_; }
    // Graphs captured so far, by padded batch size.
    std::vector<int64_t> captured_batch_sizes() const;
    // A host buffer [rows, ceil(vocab / 32)] i32 for the token masks of the next sample_deferred(): pinned on
    // CUDA, so that sample_deferred copies it to the device as it is, without staging it first (a 64-row mask
    // of a 152k vocabulary is 1.2 MB). Two alternate; each is handed out again only once its last copy ran.
    Tensor mask_buffer(int64_t rows);
    // Steps whose tokens were sampled inside a CUDA graph (no sampling launch of their own), so far.
    uint64_t steps_sampled_in_graph() const { return steps_sampled_in_graph_; }

private:
    struct Graphed; // one captured decode step and its fixed input buffers
    StepBatch upload(const HostBatch &batch);
    void check(const HostBatch &batch) const;
    int64_t begin(const HostBatch &batch, bool all_logits);
    int64_t graph_size_for(const HostBatch &batch) const;
    // chained: device ids that replace the first input ids (chain_ids)
    const Graphed &replay(const HostBatch &batch, int64_t size, const std::vector<RowSampling> *rows,
                          const Tensor *chained = nullptr, const std::vector<int64_t> &chain_rows = {});
    void chain_ids(const Tensor &dst, const Tensor &from, const std::vector<int64_t> &rows);
    std::unique_ptr<Graphed> capture(const std::vector<int64_t> &h64, const std::vector<int32_t> &h32,
                                     int64_t size);
    void forward(const HostBatch &batch, int64_t size, bool chain, const std::vector<int64_t> &chain_rows = {});
    // masks: [B, W] token bitmasks on the device for every row, instead of the rows' `allowed` (sample_deferred)
    void sample(const Tensor &out, const Tensor &logits, const std::vector<RowSampling> &rows,
                const Tensor *masks = nullptr);
    Tensor upload_masks(const int32_t *mask, int64_t M, int64_t W, const std::vector<int64_t> &mask_rows,
                        int64_t B);
    void draw(const Tensor &out, const Tensor &logits, const std::vector<RowSampling> &rows);
    void record(const Tensor &ids, const std::vector<RowSampling> &rows);
    void apply_masks(const Tensor &logits, const std::vector<RowSampling> &rows);
    void reserve_seen(int64_t rows);
    static void check_ids(const std::vector<int64_t> &ids, const std::vector<RowSampling> &rows);
    struct Inflight; // a launched step whose tokens are on their way to the host
    std::unique_ptr<Inflight> make_inflight(int64_t capacity) const;

    models::Model &model_;
    KVPool &pool_;
    RunnerConfig config_;
    std::unique_ptr<InputStaging> staging_;
    std::map<int64_t, std::unique_ptr<Graphed>> graphs_;
    uint64_t graphs_weights_version_ = 0; // the model's weights_version() the graphs were captured with
    Tensor last_logits_;
    uint64_t steps_sampled_in_graph_ = 0;
    std::deque<std::unique_ptr<Inflight>> inflight_;
    std::vector<std::unique_ptr<Inflight>> spare_; // finished ones, their pinned buffers reused
    FinishedLogprobs finished_lp_;
    Tensor last_launched_; // the newest launch's tokens on the device (i64 [B])
    Tensor no_tokens_;     // zeros (i64, grown by doubling): the tokens of a step without the LM head
    std::unique_ptr<std::vector<RowSampling>> deferred_; // a launch whose sampling waits for sample_deferred()
    std::vector<int32_t> masks_host_; // sample_deferred's [B, W] masks when only some rows are masked (reused)
    struct MaskBuffer {
        Tensor host; // i32 [capacity rows, W], pinned on CUDA
        std::unique_ptr<Event> copied; // recorded behind the last copy out of it
    };
    MaskBuffer mask_buffers_[2];
    int mask_next_ = 0; // the buffer mask_buffer() hands out next
    Tensor seen_; // i32 [S, ceil(vocab / 32)]: the sequences' seen sets (set_seen), on the model's device
};

} // namespace llaisys::runtime
