// edgekv_probe: EdgeKV's batch-invariance probe (src/edgekv/engines/probe.py, probe_batch.py,
// probe_spec.py) as a small C++ program over llama.h, for machines where llama-cpp-python's
// Python side cannot run (an aarch64 build under qemu-user: scripts/arm_check.sh).
//
// It opens the model as EdgeKV's llama.cpp adapter does (n_ctx 2048, n_batch 2048, n_ubatch
// 512, one sequence, F16 KV, flash attention on where the batch-invariant kernels are loaded),
// feeds the same probe tokens (the text file given, tokenized with BOS and special tokens, as
// `probe_tokens` tokenizes Python's heapq source) by the same schedules, and compares the last
// token's logits and the KV of every position bit for bit with a one-batch run:
//   - prefix 131 then the rest; inject 200, keep 193 (the sequence's state blob taken with
//     llama_state_seq_get_data, cut to 193 cells mid-fragment, cleared, set back with
//     llama_state_seq_set_data), then the rest; a lone last token; 250 + rest (before the
//     256-cell padding); 4 decode steps; 128-aligned chunks;
//   - on 2,040 tokens (where the context holds them): a lone last token and 4 decode steps;
//   - 3 sequences in one batch, a KV stream each (prompts, then 4 decode steps), against each
//     alone; a prompt in pieces of 5, 16, 33, 69 tokens beside the other two's decode steps
//     (a server's step budget); 3 sequences with a unified KV (recorded in notes, not deciding);
//   - drafts verified in one batch against decode steps (notes).
// The KV is compared as the state blob the Python probe parses (seq 0, or the whole cache for
// sliding-window models), byte for byte.
//
// It prints one JSON object with the keys of ProbeResult.to_json() (invariant, key, describe,
// tokens, results [[name, max |logit diff|, KV identical]], sensitivity, seconds, measured_at,
// version, long_tokens, sequences, notes, pending, granularity) plus what only this program
// knows (engine, flash_attn, batch_invariant, threads, system_info).
//
// Usage: edgekv_probe --model M.gguf --text FILE [--threads N] [--n-ctx 2048]
//                     [--flash-attn auto|on|off] [--tokens 280] [--long 2040 (0: none)]
//                     [--no-multi] [--no-spec] [--json OUT]

#include "llama.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

extern "C" {
// the patch series' switch (patch 0002); weak: a stock build has none, and then reports false
__attribute__((weak)) bool ggml_cpu_batch_invariant(void);
__attribute__((weak)) void ggml_cpu_init(void);
}

namespace {

constexpr int PROBE_VERSION = 3;  // probe.py's PROBE_VERSION: the same schedules
constexpr int DRAFTS = 7, KEPT = 5, MULTI_STEPS = 4;

struct Result {
    std::string name;
    double diff;
    bool same;
};

using Logits = std::vector<float>;
using Blob = std::vector<uint8_t>;

[[noreturn]] void fail(const std::string & why) { throw std::runtime_error(why); }

double max_diff(const Logits & a, const Logits & b) {
    if (a.size() != b.size()) fail("logit rows of different sizes");
    double m = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        // as numpy: float32 difference, then abs (a NaN anywhere makes the max NaN)
        const float d = std::fabs(a[i] - b[i]);
        if (std::isnan(d)) return NAN;
        m = std::max(m, (double) d);
    }
    return m;
}

// One sequence in one context, fed as llama-cpp-python's Llama.eval feeds it.
struct Engine {
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    llama_context_params params{};
    const llama_vocab * vocab = nullptr;
    int n_vocab = 0, n_ctx = 0, n_batch = 0;
    int n_tokens = 0;
    bool swa = false;

    void clear() {
        llama_memory_clear(llama_get_memory(ctx), true);
        n_tokens = 0;
    }

    // Llama.eval: drop cells from n_tokens on, then batches of n_batch, logits of the last only
    void eval(const int * toks, int n) {
        llama_memory_seq_rm(llama_get_memory(ctx), -1, n_tokens, -1);
        for (int i = 0; i < n; i += n_batch) {
            const int m = std::min(n_batch, n - i);
            llama_batch b = llama_batch_init(m, 0, 1);
            b.n_tokens = m;
            for (int j = 0; j < m; ++j) {
                b.token[j] = toks[i + j];
                b.pos[j] = n_tokens + j;
                b.n_seq_id[j] = 1;
                b.seq_id[j][0] = 0;
                b.logits[j] = j == m - 1;
            }
            const int rc = llama_decode(ctx, b);
            llama_batch_free(b);
            if (rc != 0) fail("llama_decode returned " + std::to_string(rc));
            n_tokens += m;
        }
    }

    Logits last_logits() const {
        const float * p = llama_get_logits(ctx);
        return Logits(p, p + n_vocab);
    }

    // the adapter's prefill: [n_tokens, n_tokens + n) split at multiples of `align`
    Logits prefill(const std::vector<int> & toks, size_t lo, size_t hi, int align) {
        if (hi <= lo) fail("prefill needs at least one token");
        if (n_tokens + (int) (hi - lo) > n_ctx) fail("prefill past the context window");
        int pos = n_tokens;
        const int end = n_tokens + (int) (hi - lo);
        size_t at = lo;
        while (pos < end) {
            const int stop = std::min(end, (pos / align + 1) * align);
            eval(toks.data() + at, stop - pos);
            at += stop - pos;
            pos = stop;
        }
        return last_logits();
    }

    Blob state(llama_seq_id seq) const {
        const size_t size = llama_state_seq_get_size(ctx, seq);
        Blob buf(size);
        const size_t written = llama_state_seq_get_data(ctx, buf.data(), size, seq);
        if (written != size) fail("llama_state_seq_get_data wrote " + std::to_string(written));
        return buf;
    }

    // what the Python probe compares: seq 0's KV, the whole cache's with sliding-window layers
    Blob kv() const { return state(swa ? -1 : 0); }

    void restore(const Blob & blob, int n) {
        clear();
        const size_t read = llama_state_seq_set_data(ctx, blob.data(), blob.size(), 0);
        if (read != blob.size()) {
            clear();
            fail("llama.cpp refused the cut state (" + std::to_string(read) + " of " +
                 std::to_string(blob.size()) + " bytes)");
        }
        n_tokens = n;
    }
};

// A sequence-state blob (llama_state_seq_get_data; layout in engines/llamacpp_state.py) cut
// to its first `keep` positions: every cache section's cells with pos < keep, which must be
// the leading cells, and their K and V rows.
struct Reader {
    const Blob & b;
    size_t at = 0;
    template <typename T> T get() {
        if (at + sizeof(T) > b.size()) fail("state blob ends early");
        T v;
        std::memcpy(&v, b.data() + at, sizeof(T));
        at += sizeof(T);
        return v;
    }
    void copy(Blob & out, size_t n) {
        if (at + n > b.size()) fail("state blob ends early");
        out.insert(out.end(), b.begin() + at, b.begin() + at + n);
        at += n;
    }
    void skip(size_t n) {
        if (at + n > b.size()) fail("state blob ends early");
        at += n;
    }
};

template <typename T> void put(Blob & out, T v) {
    const auto * p = reinterpret_cast<const uint8_t *>(&v);
    out.insert(out.end(), p, p + sizeof(T));
}

Blob cut_state(const Blob & blob, int keep) {
    Reader r{blob};
    Blob out;
    put(out, r.get<uint32_t>());  // magic
    put(out, r.get<int32_t>());   // seq id
    while (r.at < blob.size()) {  // one cache, or two (sliding-window models)
        const uint32_t n_stream = r.get<uint32_t>();
        put(out, n_stream);
        for (uint32_t s = 0; s < n_stream; ++s) {
            const uint32_t cells = r.get<uint32_t>();
            if (cells == 0) {
                put(out, cells);
                continue;
            }
            Blob meta;
            uint32_t m = 0;
            bool past = false;
            for (uint32_t i = 0; i < cells; ++i) {
                const int32_t pos = r.get<int32_t>();
                const uint32_t n_seq = r.get<uint32_t>();
                const bool kept = pos < keep;
                if (kept && past) fail("state cells are not in position order");
                past = past || !kept;
                if (kept) {
                    ++m;
                    put(meta, pos);
                    put(meta, n_seq);
                    r.copy(meta, 4u * n_seq);
                } else {
                    r.skip(4u * n_seq);
                }
            }
            put(out, m);
            if (m == 0) fail("nothing kept of a state stream");
            out.insert(out.end(), meta.begin(), meta.end());
            const uint32_t v_trans = r.get<uint32_t>();
            const uint32_t n_layer = r.get<uint32_t>();
            put(out, v_trans);
            put(out, n_layer);
            for (uint32_t l = 0; l < n_layer; ++l) {  // K: a row per cell
                put(out, r.get<int32_t>());
                const uint64_t row = r.get<uint64_t>();
                put(out, row);
                r.copy(out, row * m);
                r.skip(row * (cells - m));
            }
            for (uint32_t l = 0; l < n_layer; ++l) {
                put(out, r.get<int32_t>());
                if (!v_trans) {  // V: a row per cell
                    const uint64_t row = r.get<uint64_t>();
                    put(out, row);
                    r.copy(out, row * m);
                    r.skip(row * (cells - m));
                } else {  // V transposed: per embedding element, one value per cell
                    const uint32_t el = r.get<uint32_t>();
                    const uint32_t n_embd = r.get<uint32_t>();
                    put(out, el);
                    put(out, n_embd);
                    for (uint32_t j = 0; j < n_embd; ++j) {
                        r.copy(out, (size_t) el * m);
                        r.skip((size_t) el * (cells - m));
                    }
                }
            }
        }
    }
    return out;
}

// A schedule: batch lengths, or an injection (extract [0, n), clear, restore the first keep)
struct Step {
    int n;
    int inject_keep = -1;
};
struct Schedule {
    std::string name;
    std::vector<Step> steps;
};

std::vector<Schedule> schedules(int n) {
    std::vector<Step> aligned;
    for (int i = 0; i < n; i += 128) aligned.push_back({std::min(128, n - i)});
    return {
        {"prefix 131 then the rest", {{131}, {n - 131}}},
        {"inject 200, keep 193, then the rest", {{200}, {200, 193}, {n - 193}}},
        {"lone last token", {{n - 1}, {1}}},
        {"split before the KV padding (250 + rest)", {{250}, {n - 250}}},
        {"4 decode steps", {{n - 4}, {1}, {1}, {1}, {1}}},
        {"128-aligned chunks", aligned},
    };
}

std::vector<Schedule> long_schedules(int n) {
    const std::string p = "long " + std::to_string(n) + ": ";
    return {
        {p + "lone last token", {{n - 1}, {1}}},
        {p + "4 decode steps", {{n - 4}, {1}, {1}, {1}, {1}}},
    };
}

struct Run {
    Logits logits;
    Blob kv;
};

Run run(Engine & e, const std::vector<int> & toks, const std::vector<Step> & steps) {
    e.clear();
    size_t pos = 0;
    Logits logits;
    const int big = e.n_ctx;  // an alignment no batch reaches: each step is one batch
    for (const Step & s : steps) {
        if (s.inject_keep >= 0) {
            const Blob cut = cut_state(e.state(0), s.inject_keep);
            e.restore(cut, s.inject_keep);
            pos = s.inject_keep;
            continue;
        }
        logits = e.prefill(toks, pos, pos + s.n, big);
        pos += s.n;
    }
    if (pos != toks.size() || logits.empty()) fail("a schedule fed the wrong number of tokens");
    return {std::move(logits), e.kv()};
}

std::vector<Result> compare(Engine & e, const std::vector<int> & toks,
                            const std::vector<Schedule> & plan, const Run * ref_in = nullptr) {
    Run ref = ref_in ? *ref_in : run(e, toks, {{(int) toks.size()}});
    std::vector<Result> out;
    for (const Schedule & s : plan) {
        const Run got = run(e, toks, s.steps);
        const double d = max_diff(got.logits, ref.logits);
        out.push_back({s.name, d, got.kv == ref.kv});
        std::fprintf(stderr, "edgekv_probe: %-44s max |logit diff| = %-10.3g KV %s\n",
                     s.name.c_str(), d, got.kv == ref.kv ? "identical" : "DIFFERS");
    }
    return out;
}

// probe_spec.draft_verify_diff
Result draft_verify(Engine & e, const std::vector<int> & all) {
    const std::string name = "draft verify: 1 + " + std::to_string(DRAFTS) +
        " drafts in one batch, logits at every position, " + std::to_string(DRAFTS + 1 - KEPT) +
        " rejected and removed, vs " + std::to_string(DRAFTS + 1) + " decode steps";
    const size_t n_prompt = all.size() - (DRAFTS + 1);
    const int big = e.n_ctx;
    e.clear();
    e.prefill(all, 0, n_prompt, big);
    std::vector<Logits> ref;
    for (size_t i = n_prompt; i < all.size(); ++i) ref.push_back(e.prefill(all, i, i + 1, 1));
    const Blob ref_kv = e.kv();

    e.clear();
    e.prefill(all, 0, n_prompt, big);
    // the last token and the drafts in one batch, logits at every position
    llama_batch b = llama_batch_init(DRAFTS + 1, 0, 1);
    b.n_tokens = DRAFTS + 1;
    for (int i = 0; i <= DRAFTS; ++i) {
        int t = all[n_prompt + i];
        if (i >= KEPT) t = (t + 1) % e.n_vocab;  // wrong drafts
        b.token[i] = t;
        b.pos[i] = (int) n_prompt + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = 1;
    }
    const int rc = llama_decode(e.ctx, b);
    llama_batch_free(b);
    if (rc != 0) fail("llama_decode (verify) returned " + std::to_string(rc));
    std::vector<Logits> got;
    for (int i = 0; i < KEPT; ++i) {
        const float * p = llama_get_logits_ith(e.ctx, i);
        got.emplace_back(p, p + e.n_vocab);
    }
    e.n_tokens = (int) n_prompt + DRAFTS + 1;
    if (!llama_memory_seq_rm(llama_get_memory(e.ctx), 0, (int) n_prompt + KEPT, -1))
        fail("llama_memory_seq_rm refused");
    e.n_tokens = (int) n_prompt + KEPT;
    for (size_t i = n_prompt + KEPT; i < all.size(); ++i) got.push_back(e.prefill(all, i, i + 1, 1));
    const Blob kv = e.kv();
    e.clear();
    double d = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) d = std::max(d, max_diff(ref[i], got[i]));
    return {name, d, d == 0.0 && kv == ref_kv};
}

// A second context of the model holding 3 sequences (LlamaCppAdapter.sequence_context):
// batches of (token, position, sequence id, wants logits), the rows asked for.
struct SeqContext {
    llama_context * ctx = nullptr;
    int n_vocab = 0;

    SeqContext(const Engine & e, int total, bool unified) : n_vocab(e.n_vocab) {
        llama_context_params p = e.params;
        p.n_seq_max = 3;
        p.n_ctx = std::max(1024, total + 64);
        p.n_batch = std::max((int) e.params.n_batch, total);
        p.kv_unified = unified;
        ctx = llama_init_from_model(e.model, p);
        if (!ctx) fail("llama.cpp could not create a context for 3 sequences");
    }
    SeqContext(const SeqContext &) = delete;
    SeqContext & operator=(const SeqContext &) = delete;
    ~SeqContext() { llama_free(ctx); }

    std::vector<Logits> decode(const std::vector<std::array<int, 4>> & items) {
        llama_batch b = llama_batch_init((int) items.size(), 0, 3);
        b.n_tokens = (int) items.size();
        std::vector<int> want;
        for (size_t i = 0; i < items.size(); ++i) {
            b.token[i] = items[i][0];
            b.pos[i] = items[i][1];
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = items[i][2];
            b.logits[i] = items[i][3];
            if (items[i][3]) want.push_back((int) i);
        }
        const int rc = llama_decode(ctx, b);
        llama_batch_free(b);
        if (rc != 0) fail("llama_decode (3 sequences) returned " + std::to_string(rc));
        std::vector<Logits> out;
        for (int i : want) {
            const float * q = llama_get_logits_ith(ctx, i);
            out.emplace_back(q, q + n_vocab);
        }
        return out;
    }
};

constexpr int MULTI_CUTS[3] = {97, 150, 123};  // probe_batch.multi_sequence_prompts

// each of the 3 sequences alone through the probe's context: its prompt in one batch, then
// one token a step (probe_batch._alone); the tokens they hold in all
std::vector<std::vector<Logits>> alone(Engine & e, const std::vector<int> & toks, int & total) {
    std::vector<std::vector<Logits>> ref(3);
    total = 0;
    for (int s = 0; s < 3; ++s) {
        const int c = MULTI_CUTS[s];
        e.clear();
        ref[s].push_back(e.prefill(toks, 0, c, e.n_ctx));
        for (int k = 0; k < MULTI_STEPS; ++k)
            ref[s].push_back(e.prefill(toks, c + k, c + k + 1, e.n_ctx));
        e.clear();
        total += c + MULTI_STEPS;
    }
    return ref;
}

Result verdict(const std::string & name, const std::vector<std::vector<Logits>> & ref,
               const std::vector<std::vector<Logits>> & got) {
    double d = 0.0;
    for (int s = 0; s < 3; ++s) {
        if (ref[s].size() != got[s].size()) fail(name + ": a sequence got the wrong number of rows");
        for (size_t k = 0; k < ref[s].size(); ++k) d = std::max(d, max_diff(ref[s][k], got[s][k]));
    }
    std::fprintf(stderr, "edgekv_probe: %-44s max |logit diff| = %-10.3g\n", name.c_str(), d);
    return {name, d, d == 0.0};
}

// probe_batch.multi_sequence_diff
Result multi_sequence(Engine & e, const std::vector<int> & toks, bool unified) {
    const std::string layout = unified ? "unified KV" : "a KV stream each";
    const std::string name = "3 sequences in one batch, " + layout + " (prompts, " +
        std::to_string(MULTI_STEPS) + " decode steps)";
    int total = 0;
    const auto ref = alone(e, toks, total);
    SeqContext sc(e, total, unified);
    std::vector<std::vector<Logits>> got(3);
    std::vector<std::array<int, 4>> items;
    for (int s = 0; s < 3; ++s)
        for (int pos = 0; pos < MULTI_CUTS[s]; ++pos)
            items.push_back({toks[pos], pos, s, pos == MULTI_CUTS[s] - 1});
    auto out = sc.decode(items);
    for (int s = 0; s < 3; ++s) got[s].push_back(out[s]);
    for (int k = 0; k < MULTI_STEPS; ++k) {
        items.clear();
        for (int s = 0; s < 3; ++s) items.push_back({toks[MULTI_CUTS[s] + k], MULTI_CUTS[s] + k, s, 1});
        out = sc.decode(items);
        for (int s = 0; s < 3; ++s) got[s].push_back(out[s]);
    }
    return verdict(name, ref, got);
}

// probe_batch.split_prefill_diff: sequences 0 and 1's prompts in one batch; then the third's
// prompt in pieces (SPLIT_PIECES, then the rest), each piece batched with one decode token of
// each of the two (logits at each piece's last token); then the third's decode steps alone.
// A KV stream per sequence.
Result split_prefill(Engine & e, const std::vector<int> & toks) {
    const int pieces[3] = {5, 16, 33};
    const int a = MULTI_CUTS[0], b = MULTI_CUTS[1], c = MULTI_CUTS[2];
    std::vector<int> cuts = {0};
    for (int p : pieces) cuts.push_back(cuts.back() + p);
    cuts.push_back(c);
    if (cuts[cuts.size() - 2] >= c || (int) cuts.size() - 1 != MULTI_STEPS)
        fail("the split-prefill probe needs a longer third prompt");
    std::string sizes;
    for (size_t i = 1; i < cuts.size(); ++i)
        sizes += (i > 1 ? ", " : "") + std::to_string(cuts[i] - cuts[i - 1]);
    const std::string name = "a prompt in pieces of " + sizes +
        " tokens beside 2 sequences' decode steps, a KV stream each";
    int total = 0;
    const auto ref = alone(e, toks, total);
    SeqContext sc(e, total, false);
    std::vector<std::vector<Logits>> got(3);
    std::vector<std::array<int, 4>> items;
    for (int s = 0; s < 2; ++s)
        for (int pos = 0; pos < MULTI_CUTS[s]; ++pos)
            items.push_back({toks[pos], pos, s, pos == MULTI_CUTS[s] - 1});
    auto out = sc.decode(items);
    got[0].push_back(out[0]);
    got[1].push_back(out[1]);
    for (int k = 0; k < MULTI_STEPS; ++k) {
        const int lo = cuts[k], hi = cuts[k + 1];
        items = {{toks[a + k], a + k, 0, 1}, {toks[b + k], b + k, 1, 1}};
        for (int i = lo; i < hi; ++i) items.push_back({toks[i], i, 2, i == hi - 1});
        out = sc.decode(items);
        got[0].push_back(out[0]);
        got[1].push_back(out[1]);
        if (hi == c) got[2].push_back(out[2]);
    }
    for (int k = 0; k < MULTI_STEPS; ++k)
        got[2].push_back(sc.decode({{toks[c + k], c + k, 2, 1}})[0]);
    return verdict(name, ref, got);
}

std::string esc(const std::string & s) {
    std::string o;
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') { o += '\\'; o += (char) c; }
        else if (c < 0x20) { char buf[8]; std::snprintf(buf, sizeof buf, "\\u%04x", c); o += buf; }
        else o += (char) c;
    }
    return o;
}

std::string num(double d) {
    if (std::isnan(d)) return "NaN";  // as Python's json writes it
    if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", d);
    std::string s = buf;
    if (s.find_first_of(".eE") == std::string::npos) s += ".0";
    return s;
}

std::string rows(const std::vector<Result> & rs) {
    std::string o = "[";
    for (size_t i = 0; i < rs.size(); ++i) {
        o += (i ? ",\n  [\"" : "\n  [\"") + esc(rs[i].name) + "\", " + num(rs[i].diff) + ", " +
             (rs[i].same ? "true" : "false") + "]";
    }
    return o + (rs.empty() ? "]" : "\n ]");
}

std::vector<int> probe_tokens(const Engine & e, const std::string & text, int n) {
    std::vector<int> ids(text.size() + 16);
    int got = llama_tokenize(e.vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(),
                             true, true);
    if (got < 0) {
        ids.resize(-got);
        got = llama_tokenize(e.vocab, text.data(), (int) text.size(), ids.data(),
                             (int) ids.size(), true, true);
    }
    if (got <= 0) fail("the probe text tokenized to nothing");
    ids.resize(got);
    std::vector<int> out;
    while ((int) out.size() < n) out.insert(out.end(), ids.begin(), ids.end());  // probe_tokens
    out.resize(n);
    return out;
}

uint64_t fnv1a(const std::string & s) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) { h ^= c; h *= 1099511628211ull; }
    return h;
}

}  // namespace

int main(int argc, char ** argv) {
    std::string model_path, text_path, json_path, fa = "auto";
    int threads = 2, n_ctx = 2048, n_tokens = 280, n_long = 2040;
    bool multi = true, spec = true;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
            return argv[++i];
        };
        if (a == "--model") model_path = val();
        else if (a == "--text") text_path = val();
        else if (a == "--json") json_path = val();
        else if (a == "--threads") threads = std::atoi(val().c_str());
        else if (a == "--n-ctx") n_ctx = std::atoi(val().c_str());
        else if (a == "--tokens") n_tokens = std::atoi(val().c_str());
        else if (a == "--long") n_long = std::atoi(val().c_str());
        else if (a == "--flash-attn") fa = val();
        else if (a == "--no-multi") multi = false;
        else if (a == "--no-spec") spec = false;
        else { std::fprintf(stderr, "unknown option %s (see the head of edgekv_probe.cpp)\n", a.c_str()); return 2; }
    }
    if (model_path.empty() || text_path.empty()) {
        std::fprintf(stderr, "usage: edgekv_probe --model M.gguf --text FILE [options]\n");
        return 2;
    }
    std::ifstream tf(text_path, std::ios::binary);
    if (!tf) { std::fprintf(stderr, "cannot read %s\n", text_path.c_str()); return 2; }
    std::stringstream ss;
    ss << tf.rdbuf();
    const std::string text = ss.str();

    const auto t0 = std::chrono::steady_clock::now();
    llama_log_set([](ggml_log_level level, const char * msg, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(msg, stderr);
    }, nullptr);
    llama_backend_init();
    if (ggml_cpu_init) ggml_cpu_init();
    const bool invariant_kernels = ggml_cpu_batch_invariant ? ggml_cpu_batch_invariant() : false;
    const bool flash = fa == "on" || (fa == "auto" && invariant_kernels);

    Engine e;
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots
    e.model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!e.model) { std::fprintf(stderr, "cannot load %s\n", model_path.c_str()); return 1; }
    e.params = llama_context_default_params();
    e.params.n_ctx = n_ctx;
    e.params.n_batch = std::min(n_ctx, 2048);
    e.params.n_ubatch = std::min((int) e.params.n_batch, 512);
    e.params.n_threads = threads;
    e.params.n_threads_batch = threads;
    e.params.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    e.params.no_perf = true;
    e.ctx = llama_init_from_model(e.model, e.params);
    if (!e.ctx) { std::fprintf(stderr, "cannot create a context\n"); return 1; }
    e.vocab = llama_model_get_vocab(e.model);
    e.n_vocab = llama_vocab_n_tokens(e.vocab);
    e.n_ctx = (int) llama_n_ctx(e.ctx);
    e.n_batch = (int) llama_n_batch(e.ctx);
    e.swa = llama_model_n_swa(e.model) > 0;

    std::string system = llama_print_system_info();
    std::string sys1;
    for (std::istringstream is(system); is >> system;) sys1 += (sys1.empty() ? "" : " ") + system;
    const char * env = std::getenv("GGML_CPU_BATCH_INVARIANT");
    char arch[64] = "unknown";
#if defined(__aarch64__)
    std::snprintf(arch, sizeof arch, "aarch64");
#elif defined(__x86_64__)
    std::snprintf(arch, sizeof arch, "x86_64");
#endif
    const std::string describe = std::string("llama.cpp (edgekv_probe, C++) [") + sys1 +
        "] flash_attn_type=" + (flash ? "1" : "0") + " type_k=" + std::to_string((int) e.params.type_k) +
        " n_ubatch=" + std::to_string(e.params.n_ubatch) + " threads=" + std::to_string(threads) +
        (env ? std::string(" GGML_CPU_BATCH_INVARIANT=") + env : std::string()) + " on " + arch;

    std::vector<Result> results, notes;
    double sensitivity = 0.0;
    int long_tokens = 0, sequences = 0;
    try {
        const std::vector<int> toks = probe_tokens(e, text, n_tokens);
        const int n = (int) toks.size();
        if (n < 261) fail("the probe needs at least 261 tokens");
        const Run ref = run(e, toks, {{n}});
        // the probe can see a difference: one early token changed moves the logits
        std::vector<int> shorter(toks.begin(), toks.begin() + 64);
        const Logits base = run(e, shorter, {{64}}).logits;
        shorter[5] = (shorter[5] + 1) % std::max(2, e.n_vocab);
        sensitivity = max_diff(run(e, shorter, {{64}}).logits, base);
        results = compare(e, toks, schedules(n), &ref);
        if (spec) {
            const std::vector<int> head(toks.begin(), toks.begin() + 256 + DRAFTS + 1);
            notes.push_back(draft_verify(e, head));
        }
        if (n_long > 0 && n_long <= e.n_ctx - 8) {
            const std::vector<int> lt = probe_tokens(e, text, n_long);
            const auto more = compare(e, lt, long_schedules(n_long));
            results.insert(results.end(), more.begin(), more.end());
            long_tokens = n_long;
        }
        if (multi) {
            results.push_back(multi_sequence(e, toks, false));
            sequences = 3;
            results.push_back(split_prefill(e, toks));  // what a server's step budget does
            notes.push_back(multi_sequence(e, toks, true));
        }
        e.clear();
    } catch (const std::exception & ex) {
        std::fprintf(stderr, "edgekv_probe: %s\n", ex.what());
        return 1;
    }
    bool invariant = sensitivity > 0;
    for (const Result & r : results) invariant = invariant && r.diff == 0.0 && r.same;
    std::vector<std::string> pending;
    if (!long_tokens && n_long > 0 && n_long > e.n_ctx - 8) {}  // the context cannot hold it
    else if (!long_tokens) pending.push_back("long schedules");
    if (!multi) pending.push_back("multi-sequence batch");
    if (!pending.empty()) invariant = false;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double now = std::chrono::duration<double>(
        std::chrono::system_clock::now().time_since_epoch()).count();
    char key[32];
    std::snprintf(key, sizeof key, "%016llx", (unsigned long long) fnv1a(describe + model_path));

    std::string o = "{\n";
    o += " \"invariant\": " + std::string(invariant ? "true" : "false") + ",\n";
    o += " \"key\": \"" + std::string(key) + "\",\n";
    o += " \"describe\": \"" + esc(describe) + "\",\n";
    o += " \"tokens\": " + std::to_string(n_tokens) + ",\n";
    o += " \"results\": " + rows(results) + ",\n";
    o += " \"sensitivity\": " + num(sensitivity) + ",\n";
    o += " \"seconds\": " + num(secs) + ",\n";
    o += " \"measured_at\": " + num(now) + ",\n";
    o += " \"version\": " + std::to_string(PROBE_VERSION) + ",\n";
    o += " \"long_tokens\": " + std::to_string(long_tokens) + ",\n";
    o += " \"sequences\": " + std::to_string(sequences) + ",\n";
    o += " \"notes\": " + rows(notes) + ",\n";
    o += " \"pending\": [";
    for (size_t i = 0; i < pending.size(); ++i) o += (i ? ", \"" : "\"") + pending[i] + "\"";
    o += "],\n";
    o += " \"granularity\": \"" + std::string(invariant ? "token" : "chunk") + "\",\n";
    o += " \"engine\": \"edgekv_probe\",\n";
    o += " \"arch\": \"" + std::string(arch) + "\",\n";
    o += " \"flash_attn\": " + std::string(flash ? "true" : "false") + ",\n";
    o += " \"batch_invariant\": " + std::string(invariant_kernels ? "true" : "false") + ",\n";
    o += " \"threads\": " + std::to_string(threads) + ",\n";
    o += " \"model\": \"" + esc(model_path) + "\",\n";
    o += " \"system_info\": \"" + esc(sys1) + "\"\n}\n";
    std::fputs(o.c_str(), stdout);
    if (!json_path.empty()) {
        std::ofstream jf(json_path);
        jf << o;
    }
    llama_free(e.ctx);
    llama_model_free(e.model);
    llama_backend_free();
    return 0;
}
