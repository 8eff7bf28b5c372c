// tests/cuda/bench/cuda_fwd_bench.cpp — forward and backward throughput of the CUDA backend, as a
// CLI with JSON output. FLOP convention of the FlashAttention benchmarks: fwd FLOPs = 4·b·h·sq·sk·d
// (2·b·h·sq·sk·(d + dv) where --dv gives V and O other columns than Q and K), bwd = 2.5 × fwd, both
// halved when causal; shapes keep batch·seqlen = --tokens and heads·d = --width. Timing: CUDA events around each call (the backward's three kernels together), the
// median of --repeats after --warmup calls.
//
// --decode times decoding instead (split-KV as the heuristic picks it, with its workspace): per
// case batch:context:page (page 0: a contiguous cache; else a paged one whose block table lists
// the pages in a shuffled order), --decode-sq query rows, GQA --decode-heads q/kv heads, each head
// dim of --dims; reported in GB/s of the minimum traffic (K and V read once, q read, out written),
// with the L2 cleared before every timed call. A decoding variant with FLASHATTN_BENCH_INDEX_CHECK=1
// times the device-side index check in front of each call, as the public KV-cache call launches it
// (cache_seqlens, and the block table where paged): "plain:;checked:FLASHATTN_BENCH_INDEX_CHECK=1"
// gives the check's cost on a decoding step; FLASHATTN_BENCH_INDEX_CHECK=2 folds it into the sm80
// forward kernel's prologue instead (AttentionParams::index_fold, as a KV-cache call without new
// keys does by default), where the sm80 family runs the call (a paged call: into its split kernel,
// else the sm80 forward launches the check kernel ahead of the unsplit one); elsewhere it launches
// the check kernel as 1 does.
//
// --gqa G gives the grid G query heads per key/value head (h / G of them; GQA, or MQA where G = h),
// FLOPs counted per query head as for MHA, so that a GQA row reads against the MHA row of its shape.
// --dropout P and --softcap X time the grid with those on (the kernels' full variant); --alibi 1
// with ALiBi slopes per head. --varlen equal|mixed times the same tokens as one varlen batch:
// `equal` b sequences of s (the dense shape through the varlen path), `mixed` lengths s/2 and 3s/2
// alternating (s/4 and 3s/4 where b = 1), FLOPs counted per sequence. --l2-flush 1 clears the L2
// before every timed call of the grid too, as bench/compare.py's timing does.
//
// --env-variants "alt:FLASHATTN_SM90_FWD_L2_SECTION_ALT=1;off:FLASHATTN_SM90_FWD_L2_SECTION_MB=0"
// times every grid case (and every --decode case) under each setting of the runtime knobs
// (name:VAR=V,VAR=V; a name alone: none of the variables set), the settings taking turns call by
// call, so that the GPU's drift (clocks settling under a long load) falls on all of them alike;
// the JSON rows then name their variant. Every variable that any variant names is unset before each variant's own are set.
// A variant may change the call's features too, through FLASHATTN_BENCH_DETERMINISTIC=0|1,
// FLASHATTN_BENCH_SOFTCAP=X, FLASHATTN_BENCH_ALIBI=0|1 and FLASHATTN_BENCH_DROPOUT=P (over the
// command line's), e.g. "plain:;det:FLASHATTN_BENCH_DETERMINISTIC=1" times the deterministic
// backward beside the plain one; the output and lse that the backward reads stay the forward's of
// the command line's features.
//
//   cuda_fwd_bench [--dtype bf16|f16] [--dims 64,128] [--dv 0] [--seqlens 1024,4096] [--causal 0,1]
//                  [--passes fwd,bwd] [--deterministic 0|1] [--dropout P] [--softcap X] [--alibi 0|1]
//                  [--varlen equal|mixed]
//                  [--tokens 16384] [--width 2048] [--gqa 1]
//                  [--repeats 30] [--warmup 5] [--l2-flush 0|1] [--json FILE]
//                  [--env-variants name:VAR=V,...;name:...]
//                  [--decode 1:131072:0,32:32768:16,...] [--decode-sq 1] [--decode-heads 32:8]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "common/params.h"
#include "common/philox.h"
#include "cuda/cuda_backend.h"
#include "cuda/family.h"
#include "cuda/index_check.h"

namespace {

namespace c = flashattn::common;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

std::vector<int> int_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoi(item));
  return out;
}

std::vector<std::string> str_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

struct Args {
  c::Storage storage = c::Storage::bf16;
  std::vector<int> dims = {64, 128};
  int dv = 0;  // V's and O's head dim in the grid; 0: each d (e.g. --dims 192 --dv 128)
  std::vector<int> seqlens = {1024, 4096};
  std::vector<int> causal = {0, 1};
  std::vector<std::string> passes = {"fwd"};
  bool deterministic = false;
  float dropout = 0.0f;
  float softcap = 0.0f;
  bool alibi = false;
  std::string varlen;  // "", "equal" or "mixed"
  int tokens = 16384;
  int width = 2048;
  int gqa = 1;  // query heads per key/value head in the grid (GQA/MQA); must divide the heads
  int repeats = 30;
  int warmup = 5;
  bool l2_flush = false;  // the grid; decoding always clears it
  std::string json;
  struct Decode {
    int batch, context, page;
  };
  std::vector<Decode> decode;
  struct EnvVariant {
    std::string name;
    std::vector<std::pair<std::string, std::string>> vars;
  };
  std::vector<EnvVariant> env_variants;  // empty: one run as the environment is
  int decode_sq = 1;
  int decode_heads = 32, decode_heads_k = 8;
};

// A variant's setting of one of the call's features (FLASHATTN_BENCH_*), else the fallback.
float env_or(const char* name, float fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::stof(v);
}

// "a:b:c" as three ints.
std::vector<int> colon_ints(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ':');) out.push_back(std::stoi(item));
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::runtime_error("missing value after " + flag);
    const std::string v = argv[++i];
    if (flag == "--dtype") a.storage = v == "f16" ? c::Storage::f16 : c::Storage::bf16;
    else if (flag == "--dims") a.dims = int_list(v);
    else if (flag == "--dv") a.dv = std::stoi(v);
    else if (flag == "--seqlens") a.seqlens = int_list(v);
    else if (flag == "--causal") a.causal = int_list(v);
    else if (flag == "--passes") a.passes = str_list(v);
    else if (flag == "--deterministic") a.deterministic = v == "1";
    else if (flag == "--dropout") a.dropout = std::stof(v);
    else if (flag == "--softcap") a.softcap = std::stof(v);
    else if (flag == "--alibi") a.alibi = v == "1";
    else if (flag == "--varlen") {
      if (v != "equal" && v != "mixed") throw std::runtime_error("--varlen takes equal or mixed, not " + v);
      a.varlen = v;
    }
    else if (flag == "--tokens") a.tokens = std::stoi(v);
    else if (flag == "--width") a.width = std::stoi(v);
    else if (flag == "--gqa") a.gqa = std::stoi(v);
    else if (flag == "--repeats") a.repeats = std::stoi(v);
    else if (flag == "--warmup") a.warmup = std::stoi(v);
    else if (flag == "--l2-flush") a.l2_flush = v == "1";
    else if (flag == "--json") a.json = v;
    else if (flag == "--env-variants") {
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ';');) {
        const std::size_t colon = item.find(':');
        Args::EnvVariant ev{item.substr(0, colon), {}};
        if (ev.name.empty()) throw std::runtime_error("--env-variants: a variant without a name in " + v);
        const std::string vars = colon == std::string::npos ? "" : item.substr(colon + 1);
        for (const std::string& var : str_list(vars)) {
          const std::size_t eq = var.find('=');
          if (eq == std::string::npos || eq == 0) throw std::runtime_error("--env-variants takes VAR=VALUE, not " + var);
          ev.vars.emplace_back(var.substr(0, eq), var.substr(eq + 1));
        }
        a.env_variants.push_back(ev);
      }
    }
    else if (flag == "--decode") {
      for (const std::string& item : str_list(v)) {
        const std::vector<int> f = colon_ints(item);
        if (f.size() != 3 || f[0] < 1 || f[1] < 1 || f[2] < 0) {
          throw std::runtime_error("--decode takes batch:context:page (page 0: a contiguous cache), not " + item);
        }
        a.decode.push_back({f[0], f[1], f[2]});
      }
    } else if (flag == "--decode-sq") a.decode_sq = std::stoi(v);
    else if (flag == "--decode-heads") {
      const std::vector<int> f = colon_ints(v);
      if (f.size() != 2 || f[1] < 1 || f[0] % f[1] != 0) throw std::runtime_error("--decode-heads takes h:hk, h % hk == 0");
      a.decode_heads = f[0];
      a.decode_heads_k = f[1];
    }
    else throw std::runtime_error("unknown flag " + flag);
  }
  return a;
}

// Device buffer of n 16-bit values, uniform in ±1 (rounded to the storage type).
void* random_device(std::size_t n, c::Storage storage, std::uint64_t seed) {
  std::vector<std::uint16_t> host(n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (auto& x : host) x = storage == c::Storage::f16 ? c::to_f16(uni(rng)).bits : c::to_bf16(uni(rng)).bits;
  void* dev = nullptr;
  check(cudaMalloc(&dev, n * sizeof(std::uint16_t)), "cudaMalloc");
  check(cudaMemcpy(dev, host.data(), n * sizeof(std::uint16_t), cudaMemcpyHostToDevice), "cudaMemcpy");
  return dev;
}

// lse as (b, h, rows) fp32 and the usual 1/√d scale.
void set_lse_and_scale(c::AttentionParams& p, float* lse, int h, int rows, int d) {
  p.lse = lse;
  p.lse_batch_stride = std::int64_t(h) * rows;
  p.lse_head_stride = rows;
  p.softmax_scale = 1.0f / std::sqrt(float(d));
}

// Sequence lengths of --varlen for b sequences of s tokens in all (b·s).
std::vector<int> varlen_lengths(const std::string& mode, int b, int s) {
  if (mode == "equal") return std::vector<int>(std::size_t(b), s);
  if (b == 1) return {s / 4, s - s / 4};
  std::vector<int> len(static_cast<std::size_t>(b));
  for (int i = 0; i < b; ++i) len[std::size_t(i)] = i % 2 == 0 ? s / 2 : s + s / 2;
  if (b % 2 == 1) len.back() = s;  // keeps the total at b·s
  return len;
}

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* dev = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&dev), host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return dev;
}

// Medians of `repeats` CUDA-event timings of call() per variant after `warmup` untimed calls of
// each: select(v) makes variant v current (a runtime knob set) before each of its calls, and the
// variants take turns call by call, so that the GPU's drift (clocks settling under a long load)
// falls on all of them alike. before_each() runs before every timed call, outside the events.
template <class Call, class Select, class Before>
std::vector<double> medians_ms(int warmup, int repeats, int variants, Call&& call, Select&& select,
                               Before&& before_each) {
  // Every repeat between its own pair of events, all enqueued before the one synchronisation at
  // the end (as triton.testing.do_bench does): the host stays ahead of the GPU, so a call's launch
  // latency is not timed as idle GPU time after its start event.
  const std::size_t timed = std::size_t(repeats) * std::size_t(variants);
  std::vector<cudaEvent_t> events(2 * timed);
  for (cudaEvent_t& e : events) check(cudaEventCreate(&e), "cudaEventCreate");
  for (int v = 0; v < variants; ++v) {
    select(v);
    for (int i = 0; i < warmup; ++i) call();
  }
  for (std::size_t i = 0; i < timed; ++i) {
    select(int(i % std::size_t(variants)));
    before_each();
    check(cudaEventRecord(events[2 * i]), "cudaEventRecord");
    call();
    check(cudaEventRecord(events[2 * i + 1]), "cudaEventRecord");
  }
  check(cudaEventSynchronize(events.back()), "cudaEventSynchronize");
  std::vector<std::vector<float>> ms(static_cast<std::size_t>(variants));
  for (std::size_t i = 0; i < timed; ++i) {
    float t = 0.0f;
    check(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]), "cudaEventElapsedTime");
    ms[i % std::size_t(variants)].push_back(t);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  std::vector<double> out;
  for (std::vector<float>& m : ms) {
    std::sort(m.begin(), m.end());
    out.push_back(m[m.size() / 2]);
  }
  return out;
}

// A buffer larger than the L2 of any current GPU, cleared before a timed call so that the call
// starts with its inputs in device memory only.
struct L2Flush {
  static constexpr std::size_t kBytes = std::size_t(256) << 20;
  void* buffer = nullptr;
  L2Flush() { check(cudaMalloc(&buffer, kBytes), "cudaMalloc"); }
  ~L2Flush() { cudaFree(buffer); }
  L2Flush(const L2Flush&) = delete;
  L2Flush& operator=(const L2Flush&) = delete;
  void operator()() const { check(cudaMemsetAsync(buffer, 0, kBytes), "cudaMemsetAsync"); }
};

// Makes --env-variants entry vi current: every variable that any entry names unset, then the
// entry's own set (nothing where there are none).
void set_env_variant(const Args& args, int vi) {
  if (args.env_variants.empty()) return;
  for (const Args::EnvVariant& other : args.env_variants) {
    for (const auto& kv : other.vars) unsetenv(kv.first.c_str());
  }
  for (const auto& kv : args.env_variants[std::size_t(vi)].vars) setenv(kv.first.c_str(), kv.second.c_str(), 1);
}

// One decoding case: q (b, sq, h, d) against a cache of `context` keys per sequence, contiguous
// (b, context, hk, d) or paged (pages, page, hk, d) with a shuffled block table. Returns the JSON
// objects of the result, one per --env-variants entry (the variants taking turns call by call, as
// in the grid), or one.
std::string run_decode(const Args& args, int d, const Args::Decode& dc) {
  const int b = dc.batch, sq = args.decode_sq, h = args.decode_heads, hk = args.decode_heads_k;
  const int pages_per_seq = dc.page > 0 ? (dc.context + dc.page - 1) / dc.page : 0;
  const std::size_t cache_rows = dc.page > 0 ? std::size_t(b) * pages_per_seq * dc.page : std::size_t(b) * dc.context;
  const std::size_t nq = std::size_t(b) * sq * h * d, nkv = cache_rows * hk * d;
  void* q = random_device(nq, args.storage, 1);
  void* k = random_device(nkv, args.storage, 2);
  void* v = random_device(nkv, args.storage, 3);
  void* o = nullptr;
  float* lse = nullptr;
  std::int32_t* table = nullptr;
  check(cudaMalloc(&o, nq * sizeof(std::uint16_t)), "cudaMalloc");
  check(cudaMalloc(reinterpret_cast<void**>(&lse), std::size_t(b) * h * sq * sizeof(float)), "cudaMalloc");
  c::AttentionParams p;
  p.storage = args.storage;
  p.batch = b;
  p.heads = h;
  p.heads_k = hk;
  p.head_dim = p.head_dim_v = d;
  p.max_seqlen_q = sq;
  p.max_seqlen_k = dc.context;
  for (auto [t, data] : {std::pair{&p.q, q}, std::pair{&p.out, o}}) {
    t->data = data;
    t->batch_stride = std::int64_t(sq) * h * d;
    t->row_stride = std::int64_t(h) * d;
    t->head_stride = d;
  }
  for (auto [t, data] : {std::pair{&p.k, k}, std::pair{&p.v, v}}) {
    t->data = data;
    t->batch_stride = std::int64_t(dc.page > 0 ? dc.page : dc.context) * hk * d;  // a page, or a sequence
    t->row_stride = std::int64_t(hk) * d;
    t->head_stride = d;
  }
  if (dc.page > 0) {
    std::vector<std::int32_t> host(std::size_t(b) * pages_per_seq);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = std::int32_t(i);
    std::shuffle(host.begin(), host.end(), std::mt19937_64(7));
    check(cudaMalloc(reinterpret_cast<void**>(&table), host.size() * sizeof(std::int32_t)), "cudaMalloc");
    check(cudaMemcpy(table, host.data(), host.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
    p.block_table = table;
    p.block_table_batch_stride = pages_per_seq;
    p.page_size = dc.page;
    p.cache_batches = std::int64_t(host.size());  // the pages
  }
  set_lse_and_scale(p, lse, h, sq, d);
  // The index values a KV-cache call of this shape hands the device-side check.
  std::int32_t* cache_seqlens = nullptr;
  {
    const std::vector<std::int32_t> lengths(std::size_t(b), dc.context);
    check(cudaMalloc(reinterpret_cast<void**>(&cache_seqlens), lengths.size() * sizeof(std::int32_t)), "cudaMalloc");
    check(cudaMemcpy(cache_seqlens, lengths.data(), lengths.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
  c::IndexBounds ib;
  ib.batch = b;
  ib.api = c::IndexApi::forward_kvcache;
  ib.cache_seqlens = cache_seqlens;
  ib.block_table = table;
  ib.block_table_batch_stride = pages_per_seq;
  ib.page_size = dc.page;
  ib.cache_rows = dc.page > 0 ? std::int64_t(b) * pages_per_seq : b;
  ib.capacity = dc.page > 0 ? std::int64_t(pages_per_seq) * dc.page : dc.context;
  ib.seqlen_q = sq;
  const int variants = std::max(1, int(args.env_variants.size()));
  bool index_check = false;  // the variant's FLASHATTN_BENCH_INDEX_CHECK, read when it is selected
  auto select = [&](int vi) {
    set_env_variant(args, vi);
    const float mode = env_or("FLASHATTN_BENCH_INDEX_CHECK", 0.0f);
    const bool fold = mode == 2.0f &&
                      (flashattn::cuda::index_check_foldable(ib) || flashattn::cuda::index_check_foldable_paged(ib)) &&
                      flashattn::cuda::choose_forward_family(p).family == flashattn::cuda::Family::sm80;
    p.index_fold = fold ? flashattn::cuda::fold_index_check(ib) : flashattn::common::IndexFold{};
    index_check = mode != 0.0f && !fold;
  };
  // The workspace for every variant (one may choose another kernel family or split count).
  std::size_t ws_bytes = 0;
  for (int vi = 0; vi < variants; ++vi) {
    select(vi);
    ws_bytes = std::max(ws_bytes, flashattn::cuda::forward_workspace_size(p));
  }
  void* ws = nullptr;
  if (ws_bytes > 0) check(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  const L2Flush flush;
  const std::vector<double> medians = medians_ms(
      args.warmup, args.repeats, variants,
      [&] {
        if (index_check) flashattn::cuda::check_indices(ib, nullptr);
        flashattn::cuda::forward(p, nullptr, nullptr, ws, ws_bytes);
      },
      select, flush);
  if (flashattn::cuda::take_device_index_violation()) throw std::runtime_error("the index check failed a valid call");
  check(cudaGetLastError(), "kernel");
  const double bytes = 2.0 * double(b) * dc.context * hk * d * 2 + 2.0 * double(nq) * 2;
  std::ostringstream js;
  for (int vi = 0; vi < variants; ++vi) {
    select(vi);
    const double ms = medians[std::size_t(vi)];
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    const int splits = ws_bytes > 0 ? flashattn::cuda::forward_num_splits(p) : 1;
    const char* family = flashattn::cuda::family_name(flashattn::cuda::choose_forward_family(p).family);
    const std::string variant = args.env_variants.empty() ? "" : args.env_variants[std::size_t(vi)].name;
    std::printf("flashattn%s%s %s decode %s d=%d b=%d sq=%d h=%d hk=%d context=%d page=%d splits=%d: %.4f ms, "
                "%.0f GB/s\n",
                variant.empty() ? "" : " variant ", variant.c_str(), family,
                args.storage == c::Storage::f16 ? "f16" : "bf16", d, b, sq, h, hk, dc.context, dc.page, splits, ms, gbps);
    js << (vi > 0 ? ",\n  " : "") << "{\"impl\": \"flashattn_" << family << "\", \"pass\": \"decode\", \"dtype\": \""
       << (args.storage == c::Storage::f16 ? "f16" : "bf16") << "\", \"d\": " << d << ", \"seqlen\": " << dc.context
       << ", \"batch\": " << b << ", \"sq\": " << sq << ", \"heads\": " << h << ", \"heads_k\": " << hk
       << ", \"page\": " << dc.page << ", \"splits\": " << splits << ", \"causal\": false"
       << (variant.empty() ? "" : ", \"variant\": \"" + variant + "\"") << ", \"ms\": " << ms
       << ", \"gbps\": " << gbps << "}";
  }
  for (void* ptr : {q, k, v, o, static_cast<void*>(lse), static_cast<void*>(table), static_cast<void*>(cache_seqlens), ws}) {
    cudaFree(ptr);
  }
  return js.str();
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  int clock_khz = 0, runtime = 0, driver = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev);
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("# device %s (sm%d%d, %d SMs, peak clock %d MHz), runtime %d, driver %d; kernels: %s\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, clock_khz / 1000, runtime, driver,
              flashattn::cuda::compiled_kernels().c_str());

  std::ostringstream json;
  json << "[";
  bool first = true;
  for (int d : args.dims) {
    for (const Args::Decode& dc : args.decode) {
      json << (first ? "" : ",") << "\n  " << run_decode(args, d, dc);
      first = false;
    }
  }
  const std::unique_ptr<L2Flush> grid_flush = args.l2_flush ? std::make_unique<L2Flush>() : nullptr;
  for (int d : args.decode.empty() ? args.dims : std::vector<int>{}) {
    for (int s : args.seqlens) {
      const int b = std::max(1, args.tokens / s), h = std::max(1, args.width / d);
      if (args.gqa < 1 || h % args.gqa != 0) {
        throw std::runtime_error("--gqa " + std::to_string(args.gqa) + " does not divide the " + std::to_string(h) +
                                 " heads of d " + std::to_string(d));
      }
      const int hk = h / args.gqa;
      const int dv = args.dv > 0 ? args.dv : d;
      const std::size_t n = std::size_t(b) * s * h * d, nk = std::size_t(b) * s * hk * d;
      const std::size_t nv = std::size_t(b) * s * h * dv, nkv = std::size_t(b) * s * hk * dv;  // O, dO; V
      void* q = random_device(n, args.storage, 1);
      void* k = random_device(nk, args.storage, 2);
      void* v = random_device(nkv, args.storage, 3);
      void* dout = random_device(nv, args.storage, 4);
      void* o = nullptr;
      float* lse = nullptr;
      float* softmax_d = nullptr;
      void* grads[3] = {};
      check(cudaMalloc(&o, nv * sizeof(std::uint16_t)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&lse), std::size_t(b) * h * s * sizeof(float)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&softmax_d), std::size_t(b) * h * s * sizeof(float)), "cudaMalloc");
      for (int g = 0; g < 3; ++g) {
        check(cudaMalloc(&grads[g], (g == 0 ? n : g == 1 ? nk : nkv) * sizeof(std::uint16_t)), "cudaMalloc");
      }
      const std::vector<int> lengths = args.varlen.empty() ? std::vector<int>{} : varlen_lengths(args.varlen, b, s);
      std::vector<std::int32_t> cu(1, 0);
      double sum_sq = 0;  // Σ len² over the sequences (b·s² when dense)
      for (int len : lengths) {
        cu.push_back(cu.back() + len);
        sum_sq += double(len) * len;
      }
      if (lengths.empty()) sum_sq = double(b) * s * s;
      std::int32_t* cu_dev = lengths.empty() ? nullptr : device_copy(cu);
      std::vector<float> slopes(static_cast<std::size_t>(h));
      for (int i = 0; i < h; ++i) slopes[std::size_t(i)] = std::exp2(-8.0f * float(i + 1) / float(h));
      float* slopes_dev = device_copy(slopes);
      for (int causal : args.causal) {
        c::AttentionParams p;
        p.storage = args.storage;
        p.batch = b;
        p.heads = h;
        p.heads_k = hk;
        p.head_dim = d;
        p.head_dim_v = dv;
        p.max_seqlen_q = p.max_seqlen_k = s;
        // (b, s, h, d) contiguous; k (b, s, hk, d), v (b, s, hk, dv), out (b, s, h, dv).
        for (auto [t, data, heads, cols] : {std::tuple{&p.q, q, h, d}, std::tuple{&p.k, k, hk, d},
                                            std::tuple{&p.v, v, hk, dv}, std::tuple{&p.out, o, h, dv}}) {
          t->data = data;
          t->batch_stride = std::int64_t(s) * heads * cols;
          t->row_stride = std::int64_t(heads) * cols;
          t->head_stride = cols;
        }
        p.dout = p.out;
        p.dout.data = dout;
        p.dq = p.q;
        p.dk = p.k;
        p.dv = p.v;
        p.dq.data = grads[0];
        p.dk.data = grads[1];
        p.dv.data = grads[2];
        p.softmax_d = softmax_d;
        // The call's features: the command line's, or (set_features, below) a variant's.
        auto set_features = [&](bool deterministic, float softcap, bool alibi, float dropout) {
          p.deterministic = deterministic;
          p.softcap = softcap;
          p.alibi_slopes = alibi ? slopes_dev : nullptr;
          p.dropout_p = dropout;  // as flashattn's validation sets it (src/api/validate.cpp)
          p.dropout.seed = 1234;
          p.dropout.keep_threshold = c::dropout_keep_threshold(dropout);
          p.dropout.keep_scale = dropout > 0.0f ? 1.0f / (1.0f - dropout) : 1.0f;
        };
        set_features(args.deterministic, args.softcap, args.alibi, args.dropout);
        set_lse_and_scale(p, lse, h, s, d);
        if (cu_dev != nullptr) {  // one packed batch: lse (h, b·s), rows from cu_seqlens
          p.batch = int(lengths.size());
          p.cu_seqlens_q = p.cu_seqlens_k = cu_dev;
          p.total_q = p.total_k = std::int64_t(b) * s;
          p.max_seqlen_q = p.max_seqlen_k = *std::max_element(lengths.begin(), lengths.end());
          p.lse_batch_stride = 0;
          p.lse_head_stride = p.total_q;
        }
        p.causal = causal != 0;
        flashattn::cuda::forward(p, nullptr);  // out and lse for the backward
        for (const std::string& pass : args.passes) {
          const bool bwd = pass == "bwd";
          // One timing per variant of the runtime knobs (one unnamed where none are asked for),
          // the variants taking turns call by call.
          const int variants = std::max(1, int(args.env_variants.size()));
          auto select = [&](int vi) {
            if (args.env_variants.empty()) return;
            set_env_variant(args, vi);
            set_features(env_or("FLASHATTN_BENCH_DETERMINISTIC", args.deterministic ? 1.0f : 0.0f) != 0.0f,
                         env_or("FLASHATTN_BENCH_SOFTCAP", args.softcap),
                         env_or("FLASHATTN_BENCH_ALIBI", args.alibi ? 1.0f : 0.0f) != 0.0f,
                         env_or("FLASHATTN_BENCH_DROPOUT", args.dropout));
          };
          // The backward's workspace for every variant (one may choose another kernel family,
          // FLASHATTN_CUDA_FAMILY, whose scratch is laid out and sized differently).
          void* workspace = nullptr;
          if (bwd) {
            std::size_t bytes = 0;
            for (int vi = 0; vi < variants; ++vi) {
              select(vi);
              bytes = std::max(bytes, flashattn::cuda::backward_workspace_size(p, std::int64_t(b) * s));
            }
            check(cudaMalloc(&workspace, bytes), "cudaMalloc");
          }
          auto call = [&] {
            if (bwd) {
              flashattn::cuda::backward(p, std::int64_t(b) * s, workspace, nullptr);
            } else {
              flashattn::cuda::forward(p, nullptr);
            }
          };
          const std::vector<double> times =
              args.l2_flush ? medians_ms(args.warmup, args.repeats, variants, call, select, *grid_flush)
                            : medians_ms(args.warmup, args.repeats, variants, call, select, [] {});
          cudaFree(workspace);
          const double flops = (bwd ? 2.5 : 1.0) * 2.0 * h * sum_sq * (d + dv) / (causal ? 2.0 : 1.0);
          for (int vi = 0; vi < variants; ++vi) {
            // The variant's own settings: its features and the kernel family that ran (cuda/family.h).
            select(vi);
            const std::string variant = args.env_variants.empty() ? "" : args.env_variants[std::size_t(vi)].name;
            const double median = times[std::size_t(vi)];
            const char* family = flashattn::cuda::family_name(bwd ? flashattn::cuda::choose_backward_family(p).family
                                                                  : flashattn::cuda::choose_forward_family(p).family);
            const bool alibi = p.alibi_slopes != nullptr;
            const double tflops = flops / (median * 1e-3) / 1e12;
            std::printf(
                "flashattn%s%s %s %s %s d=%d dv=%d s=%d b=%d h=%d hk=%d causal=%d dropout=%g softcap=%g alibi=%d "
                "deterministic=%d varlen=%s: %.3f ms, %.1f TFLOP/s\n",
                variant.empty() ? "" : " variant ", variant.c_str(), family, pass.c_str(),
                args.storage == c::Storage::f16 ? "f16" : "bf16", d, dv, s, b, h, hk, causal, p.dropout_p, p.softcap,
                int(alibi), int(p.deterministic), args.varlen.empty() ? "no" : args.varlen.c_str(), median, tflops);
            json << (first ? "" : ",") << "\n  {\"impl\": \"flashattn_" << family << "\", \"pass\": \"" << pass
                 << "\", \"dtype\": \"" << (args.storage == c::Storage::f16 ? "f16" : "bf16") << "\", \"d\": " << d
                 << ", \"dv\": " << dv << ", \"seqlen\": " << s << ", \"batch\": " << b << ", \"heads\": " << h << ", \"heads_k\": " << hk
                 << ", \"causal\": " << (causal ? "true" : "false") << ", \"dropout\": " << p.dropout_p
                 << ", \"softcap\": " << p.softcap << ", \"alibi\": " << (alibi ? "true" : "false")
                 << ", \"deterministic\": " << (p.deterministic ? "true" : "false")
                 << ", \"varlen\": \"" << (args.varlen.empty() ? "no" : args.varlen) << "\", \"l2_flush\": " << (args.l2_flush ? "true" : "false")
                 << (variant.empty() ? "" : ", \"variant\": \"" + variant + "\"") << ", \"ms\": " << median
                 << ", \"tflops\": " << tflops << "}";
            first = false;
          }
        }
      }
      check(cudaGetLastError(), "kernel");
      cudaFree(q);
      cudaFree(k);
      cudaFree(v);
      cudaFree(o);
      cudaFree(lse);
      cudaFree(dout);
      cudaFree(softmax_d);
      cudaFree(cu_dev);
      cudaFree(slopes_dev);
      for (void* g : grads) cudaFree(g);
    }
  }
  json << "\n]\n";
  if (!args.json.empty()) std::ofstream(args.json) << json.str();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "cuda_fwd_bench: %s\n", e.what());
  return 1;
}
