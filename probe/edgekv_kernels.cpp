// edgekv_kernels: is ggml's mul_mat batch-invariant, kernel by kernel? For each weight type and
// buffer (the plain CPU buffer: vec_dot, tinyBLAS, the tiled K-quant path; CPU_REPACK: the
// repacked gemv/gemm), every src1 column computed alone (a decode step) must equal, bit for bit,
// the same column inside batches of 2..64 columns (a prefill, drafts verified together).
//
// The model probe (edgekv_probe.cpp, engines/probe.py) sees a kernel only through a model's
// logits and KV, and a one-ulp change in a small product can round away in the residual sum; this
// checks each product itself. It runs natively and under qemu-aarch64 (scripts/arm_check.sh).
//
//   edgekv_kernels [--json OUT] [--threads 1,2] [--invariant 0|1]
// --invariant sets ggml_cpu_set_batch_invariant (default: GGML_CPU_BATCH_INVARIANT, as ggml reads
// it). Exit status: 0 every column equal, 3 some differ, 2 bad usage.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Shape {
    int k;  // src0 row length (the dot product's length)
    int m;  // src0 rows (output features)
};

// the weight types edge models ship as, and the types their tensors fall back to
const ggml_type TYPES[] = {
    GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
    GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
    GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_F16,
};
// an even row count with K-blocks enough for the narrow path, and an odd one (a lone last row
// for the kernels that take rows in pairs)
const Shape SHAPES[] = { { 1536, 576 }, { 768, 97 } };
const int BATCHES[] = { 2, 3, 7, 8, 9, 16, 17, 33, 64 };
const int MAX_COLS = 64;

struct Row {
    std::string type, buffer;
    Shape shape;
    int threads;
    int checked = 0, differ = 0;
    std::string first;  // the first differing (batch, column)
    std::string skipped;
};

ggml_backend_buffer_type_t repack_buft(ggml_backend_t be) {
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get == nullptr) {
        return nullptr;
    }
    for (ggml_backend_buffer_type_t * b = get(dev); b != nullptr && *b != nullptr; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

struct Weight {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * t = nullptr;
    ~Weight() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }
};

// the weight in `buft`; false where that buffer does not take this type and shape
bool make_weight(Weight & w, ggml_type type, Shape s, ggml_backend_buffer_type_t buft, const std::vector<float> & values) {
    ggml_init_params p = { ggml_tensor_overhead() * 2, nullptr, true };
    w.ctx = ggml_init(p);
    w.t = ggml_new_tensor_2d(w.ctx, type, s.k, s.m);
    w.buf = ggml_backend_alloc_ctx_tensors_from_buft(w.ctx, buft);
    if (w.buf == nullptr) {
        return false;
    }
    if (strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") == 0 && w.t->extra == nullptr) {
        return false;  // no repacked layout for it here: the plain buffer's row covers it
    }
    std::vector<uint8_t> q(ggml_nbytes(w.t));
    ggml_quantize_chunk(type, values.data(), q.data(), 0, s.m, s.k, nullptr);
    ggml_backend_tensor_set(w.t, q.data(), 0, q.size());
    return true;
}

// dst = w x (the first n columns of x); returns n columns of m floats
std::vector<float> mul(ggml_backend_t be, const Weight & w, Shape s, const std::vector<float> & x, int n) {
    ggml_init_params p = { ggml_tensor_overhead() * 4 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(p);
    ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, s.k, n);
    ggml_tensor * c = ggml_mul_mat(ctx, w.t, b);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, c);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_tensor_set(b, x.data(), 0, sizeof(float) * s.k * n);
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "edgekv_kernels: graph compute failed\n");
        exit(1);
    }
    std::vector<float> out((size_t) s.m * n);
    ggml_backend_tensor_get(c, out.data(), 0, sizeof(float) * out.size());
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return out;
}

void check(Row & row, ggml_backend_t be, const Weight & w, const std::vector<float> & x) {
    const Shape s = row.shape;
    std::vector<std::vector<float>> alone(MAX_COLS);
    for (int j = 0; j < MAX_COLS; j++) {
        std::vector<float> col(x.begin() + (size_t) j * s.k, x.begin() + (size_t) (j + 1) * s.k);
        alone[j] = mul(be, w, s, col, 1);
    }
    for (int n : BATCHES) {
        const std::vector<float> many = mul(be, w, s, x, n);
        for (int j = 0; j < n; j++) {
            row.checked++;
            if (memcmp(&many[(size_t) j * s.m], alone[j].data(), sizeof(float) * s.m) != 0) {
                if (row.differ++ == 0) {
                    row.first = "batch " + std::to_string(n) + " column " + std::to_string(j);
                }
            }
        }
    }
}

// what this build uses and the CPU it runs on: ggml's feature checks (the build's, which under
// qemu are the emulated CPU's), and on x86 the model name of /proc/cpuinfo
std::string machine() {
    std::string m;
#if defined(__x86_64__)
    m = "x86_64";
    if (FILE * f = fopen("/proc/cpuinfo", "r")) {
        char line[512];
        while (fgets(line, sizeof(line), f)) {
            if (strncmp(line, "model name", 10) == 0 && strchr(line, ':')) {
                std::string name = strchr(line, ':') + 2;
                name.erase(name.find_last_not_of(" \n") + 1);
                m += " " + name;
                break;
            }
        }
        fclose(f);
    }
#elif defined(__aarch64__)
    m = "aarch64";
#else
    m = "unknown";
#endif
    const struct { const char * name; int (*has)(void); } feats[] = {
        { "AVX2", ggml_cpu_has_avx2 }, { "FMA", ggml_cpu_has_fma }, { "AVX512", ggml_cpu_has_avx512 },
        { "AVX512_VNNI", ggml_cpu_has_avx512_vnni }, { "AVX512_BF16", ggml_cpu_has_avx512_bf16 },
        { "NEON", ggml_cpu_has_neon }, { "FP16_VA", ggml_cpu_has_fp16_va }, { "DOTPROD", ggml_cpu_has_dotprod },
        { "MATMUL_INT8", ggml_cpu_has_matmul_int8 }, { "SVE", ggml_cpu_has_sve }, { "LLAMAFILE", ggml_cpu_has_llamafile },
    };
    std::string f;
    for (const auto & x : feats) {
        if (x.has()) {
            f += (f.empty() ? "" : " ") + std::string(x.name);
        }
    }
    return m + " (" + f + ")";
}

std::vector<int> parse_list(const char * s) {
    std::vector<int> out;
    for (const char * p = s; *p;) {
        char * end = nullptr;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 1) {
            return {};
        }
        out.push_back((int) v);
        p = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0') {
            return {};
        }
    }
    return out;
}

}  // namespace

int main(int argc, char ** argv) {
    const char * json = nullptr;
    std::vector<int> threads = { 1, 2 };
    int invariant = -1;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (a == "--json" && i + 1 < argc) {
            json = argv[++i];
        } else if (a == "--threads" && i + 1 < argc) {
            threads = parse_list(argv[++i]);
            if (threads.empty()) {
                fprintf(stderr, "edgekv_kernels: --threads takes positive integers, e.g. 1,2\n");
                return 2;
            }
        } else if (a == "--invariant" && i + 1 < argc) {
            invariant = atoi(argv[++i]) != 0;
        } else {
            fprintf(stderr, "usage: edgekv_kernels [--json OUT] [--threads 1,2] [--invariant 0|1]\n");
            return 2;
        }
    }
    ggml_backend_t be = ggml_backend_cpu_init();
    if (invariant >= 0) {
        ggml_cpu_set_batch_invariant(invariant == 1);
    }
    const bool on = ggml_cpu_batch_invariant();
    ggml_backend_buffer_type_t bufts[2] = { ggml_backend_cpu_buffer_type(), repack_buft(be) };

    std::mt19937 rng(20261204);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<Row> rows;
    bool equal = true;
    for (const Shape & s : SHAPES) {
        std::vector<float> w(s.k * (size_t) s.m), x(s.k * (size_t) MAX_COLS);
        for (float & v : w) v = 0.05f * nd(rng);
        for (float & v : x) v = nd(rng);
        for (ggml_type type : TYPES) {
            for (ggml_backend_buffer_type_t buft : bufts) {
                if (buft == nullptr) {
                    continue;
                }
                Weight wt;
                const bool ok = make_weight(wt, type, s, buft, w);
                for (int nth : threads) {
                    Row row{ ggml_type_name(type), ggml_backend_buft_name(buft), s, nth, 0, 0, "", "" };
                    if (!ok) {
                        row.skipped = "no repacked layout";
                        rows.push_back(row);
                        break;  // one row says so, not one per thread count
                    }
                    ggml_backend_cpu_set_n_threads(be, nth);
                    check(row, be, wt, x);
                    equal = equal && row.differ == 0;
                    printf("%-7s %-10s k %4d m %3d threads %d: %s\n", row.type.c_str(), row.buffer.c_str(), s.k, s.m, nth,
                           row.differ ? (std::to_string(row.differ) + " of " + std::to_string(row.checked) +
                                         " columns differ, first " + row.first).c_str()
                                      : ("all " + std::to_string(row.checked) + " columns equal").c_str());
                    rows.push_back(row);
                }
            }
        }
    }
    printf("batch-invariant mode %s: %s\n", on ? "on" : "off", equal ? "every column equal" : "some columns differ");
    if (json) {
        FILE * f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "edgekv_kernels: cannot write %s\n", json);
            return 1;
        }
        fprintf(f, "{\"machine\": \"%s\", \"batch_invariant\": %s, \"equal\": %s, \"batches\": [", machine().c_str(),
                on ? "true" : "false", equal ? "true" : "false");
        for (size_t i = 0; i < sizeof(BATCHES) / sizeof(BATCHES[0]); i++) fprintf(f, "%s%d", i ? ", " : "", BATCHES[i]);
        fprintf(f, "], \"rows\": [");
        for (size_t i = 0; i < rows.size(); i++) {
            const Row & r = rows[i];
            fprintf(f, "%s\n  {\"type\": \"%s\", \"buffer\": \"%s\", \"k\": %d, \"m\": %d, \"threads\": %d, "
                       "\"columns\": %d, \"differ\": %d, \"first\": %s%s%s, \"skipped\": %s%s%s}",
                    i ? "," : "", r.type.c_str(), r.buffer.c_str(), r.shape.k, r.shape.m, r.threads, r.checked, r.differ,
                    r.first.empty() ? "" : "\"", r.first.empty() ? "null" : r.first.c_str(), r.first.empty() ? "" : "\"",
                    r.skipped.empty() ? "" : "\"", r.skipped.empty() ? "null" : r.skipped.c_str(), r.skipped.empty() ? "" : "\"");
        }
        fprintf(f, "\n]}\n");
        fclose(f);
    }
    ggml_backend_free(be);
    return equal ? 0 : 3;
}
