// bench/flashattn_bench.cpp — flashattn-bench: times the forward and backward pass of one attention
// configuration (or a fixed suite of them) on a chosen backend, optionally checks the results
// against the fp64 reference backend and times a plain sgemm of the same FLOP count beside it, and
// reports text plus JSON.
//
// FLOP convention (stated in every report): matrix-multiply FLOPs only, 2 per multiply-add,
// counted over exactly the visible (i, j) pairs of the mask (src/common/mask.h decides which):
//   forward  = 2 · pairs · (d + dv)        (S = Q·Kᵀ, O = P·V)
//   backward = 2 · pairs · (3·d + 2·dv)    (S, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q)
// summed over batches and query heads. For d = dv the backward is 2.5× the forward. Softmax,
// exponentials and dropout are not counted.
// Beside it, TFLOP/s by FlashAttention's convention (the one bench/compare.py and published
// numbers use): forward 2·b·h·sq·sk·(d + dv) (= 4·b·h·s²·d), halved when causal, backward 2.5×;
// GB/s of the minimum traffic (every input read once, every output written once), which is the
// figure that matters for decoding shapes (small sq); and the memory the call needs — on a GPU all
// of it is the caller's tensors plus the reported workspace, since the library allocates nothing.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "common/mask.h"
#include "common/numeric.h"
#include "flashattn/flashattn.h"

#ifdef FLASHATTN_BENCH_BLAS
#include <cblas.h>
#endif

// CUDA tensors need the CUDA runtime: present when the library was built with FLASHATTN_CUDA and
// the runtime's headers are on this target's include path.
#if defined(FLASHATTN_WITH_CUDA) && defined(__has_include)
#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define FLASHATTN_BENCH_CUDA 1
#endif
#endif

namespace {

using flashattn::Backend;
using flashattn::DType;
using flashattn::TensorView;

// --- exit codes ---------------------------------------------------------------------------------
constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;

// Timed runs of each measurement in a --suite unless --repeats says otherwise.
constexpr int kSuiteRepeats = 10;

// A single run longer than this gets a progress line on stderr.
constexpr double kProgressAfterSeconds = 1.0;

// --- configuration ------------------------------------------------------------------------------

enum class Direction { fwd, bwd, both };

// How one run of the attention call is timed: the host clock around the call and a device
// synchronisation (wall), or CUDA events around the enqueued kernels (events: device time only,
// the way triton.testing.do_bench and bench/compare.py measure; GPU tensors only).
enum class TimerKind { wall, events };

struct Config {
  int b = 1;
  int sq = 1024;
  int sk = -1;  // −1: same as sq
  int h = 8;
  int hk = -1;  // −1: same as h
  int d = 64;
  int dv = -1;  // −1: same as d
  DType dtype = DType::bf16;
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  float dropout = 0.0f;
  std::uint64_t seed = 0;
  Direction direction = Direction::both;
  Backend backend = Backend::automatic;
  int threads = 0;  // 0: all hardware threads
  int warmup = 1;
  int repeats = 5;
  double min_time = 0.0;  // keep timing past `repeats` until this many seconds were measured
  TimerKind timer = TimerKind::wall;
  bool l2_flush = false;  // GPU: clear a buffer larger than the L2 before every run, untimed
  bool check = false;
  bool gemm = false;
  bool deterministic = false;

  void resolve_defaults() {
    if (sk < 0) sk = sq;
    if (hk < 0) hk = h;
    if (dv < 0) dv = d;
  }
  bool runs_fwd() const { return direction != Direction::bwd; }
  bool runs_bwd() const { return direction != Direction::fwd; }
};

struct Cli {
  Config config;
  std::string json_path;  // "" none, "-" stdout
  std::string suite;      // "" or "cpu-report"
};

const char* timer_name(TimerKind t) { return t == TimerKind::events ? "events" : "wall"; }

const char* direction_name(Direction d) {
  switch (d) {
    case Direction::fwd: return "fwd";
    case Direction::bwd: return "bwd";
    case Direction::both: return "both";
  }
  return "?";
}

void print_help() {
  std::printf(
      "flashattn-bench — time flashattn forward/backward, check it, compare it with sgemm\n"
      "\n"
      "usage: flashattn-bench [flags]\n"
      "       flashattn-bench --suite cpu-report [--json PATH] [--threads N] [--repeats N]\n"
      "\n"
      "shape (q is (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv)):\n"
      "  --b N            batch size                                   (default 1)\n"
      "  --sq N           query length                                 (default 1024)\n"
      "  --sk N           key length                                   (default: sq)\n"
      "  --s N            set sq and sk together\n"
      "  --h N            query heads                                  (default 8)\n"
      "  --hk N           key/value heads, h %% hk == 0 (GQA/MQA)       (default: h)\n"
      "  --d N            head dim of q and k                          (default 64)\n"
      "  --dv N           head dim of v and out                        (default: d)\n"
      "  --dtype T        f16 | bf16 | f32                             (default bf16)\n"
      "semantics:\n"
      "  --causal         bottom-right aligned causal mask\n"
      "  --window L,R     sliding window (−1 = unbounded side)\n"
      "  --softcap X      soft-capping of the scores (0 = off)\n"
      "  --alibi          ALiBi with the usual geometric slopes 2^(−8(i+1)/h)\n"
      "  --dropout P      dropout probability in [0, 1)\n"
      "  --seed N         seed of the random inputs and of the dropout mask (default 0)\n"
      "  --deterministic  bitwise reproducible backward\n"
      "run:\n"
      "  --direction D    fwd | bwd | both                             (default both)\n"
      "  --backend B      auto | cpu | cpu_reference | cuda            (default auto)\n"
      "                   auto puts the tensors on a GPU when one is visible and its backend\n"
      "                   serves the call, else on the host; cuda insists on the GPU\n"
      "  --threads N      CPU worker threads, 0 = all                  (default 0)\n"
      "  --warmup N       untimed runs before timing                   (default 1)\n"
      "  --repeats N      timed runs; the median is reported  (default 5; 10 in a suite)\n"
      "  --min-time S     keep timing past --repeats until S seconds were measured\n"
      "  --timer T        wall | events                                (default wall)\n"
      "                   wall: host clock around the call and a device synchronisation;\n"
      "                   events: CUDA events around the enqueued kernels (GPU tensors only;\n"
      "                   device time without launch latency, as bench/compare.py measures)\n"
      "  --l2-flush       GPU tensors: clear a 256 MiB buffer before every run, untimed, so that\n"
      "                   no run finds its inputs in the L2 (as triton.testing.do_bench does)\n"
      "  --check          compare out, lse, dq, dk, dv, softmax_d with the fp64 reference backend\n"
      "                   (cpu_reference) on the same inputs; exit 1 when over tolerance\n"
      "  --gemm           also time OpenBLAS cblas_sgemm on the attention's matmul shapes, with\n"
      "                   the same FLOP count, in turn with the attention runs, and report the\n"
      "                   ratio of the two GFLOP/s\n"
      "  --json PATH      write the results as JSON to PATH ('-' = stdout)\n"
      "  --suite NAME     run a fixed suite instead of one configuration:\n"
      "                   cpu-report: b=1 h=16 s=2048 d=128, {f32, bf16} x {causal, not} x\n"
      "                   {fwd, bwd}, each beside sgemm (--gemm implied)\n"
      "  --help           this text\n"
      "\n"
      "FLOP convention: matmul FLOPs over exactly the visible (i, j) pairs of the mask;\n"
      "forward 2·pairs·(d+dv), backward 2·pairs·(3d+2dv) (2.5x forward when d = dv).\n"
      "Also reported: TFLOP/s by FlashAttention's convention (4·b·h·sq·sk·d forward, halved when\n"
      "causal, backward 2.5x), GB/s of the minimum traffic (for decoding shapes, e.g. --sq 1), the\n"
      "sum of the fwd and bwd medians, and memory (GPU: tensors + workspace; host: peak RSS).\n"
      "Exit status: 0 ok, 1 a --check exceeded its tolerance, 2 bad usage or unsupported call.\n");
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "flashattn-bench: %s (see --help)\n", message.c_str());
  std::exit(kExitUsage);
}

long long parse_int(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0) usage_error(flag + " wants an integer, got '" + value + "'");
  return v;
}

int parse_int32(const std::string& flag, const std::string& value, long long lo) {
  const long long v = parse_int(flag, value);
  if (v < lo || v > std::numeric_limits<int>::max()) {
    usage_error(flag + " must be in [" + std::to_string(lo) + ", 2^31), got " + value);
  }
  return int(v);
}

double parse_double(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !std::isfinite(v)) usage_error(flag + " wants a number, got '" + value + "'");
  return v;
}

DType parse_dtype(const std::string& value) {
  if (value == "f16" || value == "fp16") return DType::f16;
  if (value == "bf16") return DType::bf16;
  if (value == "f32" || value == "fp32") return DType::f32;
  usage_error("--dtype must be f16, bf16 or f32, got '" + value + "'");
}

Backend parse_backend(const std::string& value) {
  if (value == "auto") return Backend::automatic;
  if (value == "cpu") return Backend::cpu;
  if (value == "cpu_reference") return Backend::cpu_reference;
  if (value == "cuda") return Backend::cuda;
  usage_error("--backend must be auto, cpu, cpu_reference or cuda, got '" + value + "'");
}

TimerKind parse_timer(const std::string& value) {
  if (value == "wall") return TimerKind::wall;
  if (value == "events") return TimerKind::events;
  usage_error("--timer must be wall or events, got '" + value + "'");
}

Direction parse_direction(const std::string& value) {
  if (value == "fwd") return Direction::fwd;
  if (value == "bwd") return Direction::bwd;
  if (value == "both") return Direction::both;
  usage_error("--direction must be fwd, bwd or both, got '" + value + "'");
}

Cli parse_cli(int argc, char** argv) {
  Cli cli;
  Config& c = cli.config;
  bool repeats_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    bool has_inline_value = false;
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline_value = true;
    }
    auto next = [&]() -> std::string {
      if (has_inline_value) return value;
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      return argv[++i];
    };
    auto no_value = [&]() {
      if (has_inline_value) usage_error(flag + " takes no value");
    };
    if (flag == "--help" || flag == "-h") {
      print_help();
      std::exit(kExitOk);
    } else if (flag == "--b") {
      c.b = parse_int32(flag, next(), 1);
    } else if (flag == "--sq") {
      c.sq = parse_int32(flag, next(), 0);
    } else if (flag == "--sk") {
      c.sk = parse_int32(flag, next(), 0);
    } else if (flag == "--s") {
      c.sq = c.sk = parse_int32(flag, next(), 0);
    } else if (flag == "--h") {
      c.h = parse_int32(flag, next(), 1);
    } else if (flag == "--hk") {
      c.hk = parse_int32(flag, next(), 1);
    } else if (flag == "--d") {
      c.d = parse_int32(flag, next(), 1);
    } else if (flag == "--dv") {
      c.dv = parse_int32(flag, next(), 1);
    } else if (flag == "--dtype") {
      c.dtype = parse_dtype(next());
    } else if (flag == "--causal") {
      no_value();
      c.causal = true;
    } else if (flag == "--window") {
      const std::string w = next();
      const auto comma = w.find(',');
      if (comma == std::string::npos) usage_error("--window wants L,R (e.g. 256,0), got '" + w + "'");
      c.window_left = parse_int32(flag, w.substr(0, comma), -1);
      c.window_right = parse_int32(flag, w.substr(comma + 1), -1);
    } else if (flag == "--softcap") {
      c.softcap = float(parse_double(flag, next()));
    } else if (flag == "--alibi") {
      no_value();
      c.alibi = true;
    } else if (flag == "--dropout") {
      c.dropout = float(parse_double(flag, next()));
    } else if (flag == "--seed") {
      c.seed = std::uint64_t(parse_int(flag, next()));
    } else if (flag == "--deterministic") {
      no_value();
      c.deterministic = true;
    } else if (flag == "--direction") {
      c.direction = parse_direction(next());
    } else if (flag == "--backend") {
      c.backend = parse_backend(next());
    } else if (flag == "--threads") {
      c.threads = parse_int32(flag, next(), 0);
    } else if (flag == "--warmup") {
      c.warmup = parse_int32(flag, next(), 0);
    } else if (flag == "--repeats") {
      c.repeats = parse_int32(flag, next(), 1);
      repeats_given = true;
    } else if (flag == "--min-time") {
      c.min_time = parse_double(flag, next());
      if (c.min_time < 0) usage_error("--min-time must be ≥ 0");
    } else if (flag == "--timer") {
      c.timer = parse_timer(next());
    } else if (flag == "--l2-flush") {
      no_value();
      c.l2_flush = true;
    } else if (flag == "--check") {
      no_value();
      c.check = true;
    } else if (flag == "--gemm") {
      no_value();
      c.gemm = true;
    } else if (flag == "--json") {
      cli.json_path = next();
    } else if (flag == "--suite") {
      cli.suite = next();
      if (cli.suite != "cpu-report") usage_error("unknown suite '" + cli.suite + "' (known: cpu-report)");
    } else {
      usage_error("unknown flag '" + std::string(argv[i]) + "'");
    }
  }
  // A suite is run once for a report: more timed runs make its medians steadier.
  if (!cli.suite.empty() && !repeats_given) c.repeats = kSuiteRepeats;
  c.resolve_defaults();
  return cli;
}

// --- the machine --------------------------------------------------------------------------------

struct MachineInfo {
  std::string cpu_model = "unknown CPU";
  int logical_cpus = 0;
  std::string vector_flags;  // the SIMD extensions that matter for this code
  std::string clock_mhz;     // "cpu MHz" of the first CPU as the kernel reports it; "" if absent
};

MachineInfo read_machine_info() {
  MachineInfo info;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::string family, model;
  bool past_first_cpu = false;
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "processor") {
      ++info.logical_cpus;
      past_first_cpu = info.logical_cpus > 1;
    }
    if (past_first_cpu) continue;
    if (key == "model name") info.cpu_model = value;
    if (key == "cpu family") family = value;
    if (key == "model") model = value;
    if (key == "cpu MHz") info.clock_mhz = value;
    if (key == "flags") {
      std::istringstream words(value);
      std::string w;
      static const char* const kInteresting[] = {"avx2", "fma", "avx512f", "avx512_bf16",
                                                 "avx512_fp16", "amx_bf16", "amx_tile"};
      while (words >> w) {
        for (const char* wanted : kInteresting) {
          if (w == wanted) info.vector_flags += (info.vector_flags.empty() ? "" : " ") + w;
        }
      }
    }
  }
  if (!family.empty()) info.cpu_model += " (family " + family + ", model " + model + ")";
  if (info.logical_cpus == 0) info.logical_cpus = int(std::thread::hardware_concurrency());
  return info;
}

// How busy other processes kept the CPUs while the bench ran: the machine's busy CPU time
// (/proc/stat) minus this process's own (getrusage), per second of wall time. Other work on the
// same cores slows every run down, the sgemm baseline alike.
class OtherLoad {
 public:
  OtherLoad() : machine0_(machine_busy_seconds()), self0_(self_cpu_seconds()), wall0_(std::chrono::steady_clock::now()) {}
  // Average number of CPUs other processes kept busy since construction; −1 when unknown.
  double cpus() const {
    const double machine = machine_busy_seconds();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0_).count();
    if (machine0_ < 0 || machine < 0 || wall <= 0) return -1.0;
    return std::max(0.0, (machine - machine0_) - (self_cpu_seconds() - self0_)) / wall;
  }

 private:
  static double machine_busy_seconds() {
    std::ifstream f("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    f >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    const long ticks = sysconf(_SC_CLK_TCK);
    if (!f || cpu != "cpu" || ticks <= 0) return -1.0;
    return (user + nice + system + irq + softirq + steal) / double(ticks);
  }
  static double self_cpu_seconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    auto seconds = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
    return seconds(u.ru_utime) + seconds(u.ru_stime);
  }

  double machine0_;
  double self0_;
  std::chrono::steady_clock::time_point wall0_;
};

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

[[maybe_unused]] bool has_flag(const MachineInfo& m, const std::string& flag) {
  std::istringstream words(m.vector_flags);
  std::string w;
  while (words >> w) {
    if (w == flag) return true;
  }
  return false;
}

// OpenBLAS picks its kernels from the CPU model when it loads; a model newer than the library
// falls back to "Prescott" (SSE3 only), several times too slow for a fair baseline. Then choose the
// kernels from the CPU's vector extensions with OPENBLAS_CORETYPE and run again (the variable is
// read only at load time, hence the exec). A variable already set is left alone.
void configure_openblas(char** argv, const MachineInfo& m) {
#if defined(FLASHATTN_BENCH_BLAS) && defined(OPENBLAS_VERSION)
  bool changed = false;
  std::string core = openblas_get_corename();
  std::transform(core.begin(), core.end(), core.begin(), [](unsigned char ch) { return char(std::tolower(ch)); });
  const char* better = has_flag(m, "avx512_bf16") ? "Cooperlake"
                       : has_flag(m, "avx512f")   ? "SkylakeX"
                       : has_flag(m, "avx2")      ? "Haswell"
                                                  : nullptr;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && core == "prescott" && better != nullptr) {
    std::fprintf(stderr, "flashattn-bench: OpenBLAS does not know this CPU and chose Prescott kernels; "
                         "using OPENBLAS_CORETYPE=%s\n", better);
    setenv("OPENBLAS_CORETYPE", better, 1);
    changed = true;
  }
  if (changed) execv("/proc/self/exe", argv);  // returns only on failure: then go on as we are
#else
  (void)argv;
  (void)m;
#endif
}

std::string compiler_info() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("g++ ") + __VERSION__;
#else
  return "unknown compiler";
#endif
}

std::string blas_info() {
#if defined(FLASHATTN_BENCH_BLAS) && defined(OPENBLAS_VERSION)
  std::string config = openblas_get_config();
  while (!config.empty() && config.back() == ' ') config.pop_back();
  return config;
#elif defined(FLASHATTN_BENCH_BLAS)
  return "a CBLAS library";
#else
  return "";
#endif
}

// --- JSON ---------------------------------------------------------------------------------------

// A minimal JSON writer: values are appended in order; the caller keeps the nesting right.
class Json {
 public:
  Json& begin_object() { return open('{'); }
  Json& end_object() { return close('}'); }
  Json& begin_array() { return open('['); }
  Json& end_array() { return close(']'); }
  Json& key(const std::string& k) {
    separate();
    out_ << quote(k) << ": ";
    after_key_ = true;
    return *this;
  }
  Json& value(const std::string& s) { return raw(quote(s)); }
  Json& value(const char* s) { return raw(quote(s)); }
  Json& value(bool b) { return raw(b ? "true" : "false"); }
  Json& value(int v) { return raw(std::to_string(v)); }
  Json& value(long long v) { return raw(std::to_string(v)); }
  Json& value(std::uint64_t v) { return raw(std::to_string(v)); }
  Json& value(double v) {
    if (!std::isfinite(v)) return raw("null");  // JSON has no NaN or infinity
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return raw(buf);
  }
  template <class T>
  Json& field(const std::string& k, T v) {
    key(k);
    return value(v);
  }
  std::string str() const { return out_.str() + "\n"; }

 private:
  Json& open(char c) {
    separate();
    out_ << c;
    first_.push_back(true);
    return *this;
  }
  Json& close(char c) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) newline();
    out_ << c;
    return *this;
  }
  Json& raw(const std::string& s) {
    separate();
    out_ << s;
    return *this;
  }
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ << ",";
    first_.back() = false;
    newline();
  }
  void newline() { out_ << "\n" << std::string(2 * first_.size(), ' '); }
  static std::string quote(const std::string& s) {
    std::string q = "\"";
    for (const unsigned char ch : s) {
      if (ch == '"' || ch == '\\') {
        q += '\\';
        q += char(ch);
      } else if (ch < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", ch);
        q += buf;
      } else {
        q += char(ch);
      }
    }
    return q + "\"";
  }

  std::ostringstream out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

// --- the GPU ------------------------------------------------------------------------------------

struct GpuInfo {
  bool present = false;
  std::string description;  // name, arch, SMs, clocks, memory, runtime — or why there is none
};

constexpr double kBytesPerGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kKiloPerMega = 1000;

#ifdef FLASHATTN_BENCH_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

GpuInfo read_gpu_info() {
  GpuInfo info;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    info.description = "none visible (this build has the CUDA backend)";
    return info;
  }
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int clock_khz = 0, mem_clock_khz = 0, runtime = 0, driver = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, 0);
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s (sm%d%d, %d SMs, %d MHz, memory %d MHz, %.0f GiB), CUDA runtime %d.%d, driver %d.%d",
                prop.name, prop.major, prop.minor, prop.multiProcessorCount, clock_khz / kKiloPerMega,
                mem_clock_khz / kKiloPerMega, double(prop.totalGlobalMem) / kBytesPerGiB, runtime / 1000,
                (runtime % 1000) / 10, driver / 1000, (driver % 1000) / 10);
  info.present = true;
  info.description = buf;
  return info;
}

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  return p;
}
void device_free(void* p) { cudaFree(p); }
void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
}
// Kernels run asynchronously: a timed call ends when the device is idle again.
void device_sync() { cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
void device_clear(void* p, std::size_t bytes) { cuda_check(cudaMemsetAsync(p, 0, bytes), "cudaMemsetAsync"); }

// Seconds between two CUDA events recorded on the default stream (where the library launches when
// no stream is given) around the kernels that `enqueue` launches: the device's time for them, with
// the host's launch and synchronisation latency left out.
double device_seconds(const std::function<void()>& enqueue) {
  cudaEvent_t start = nullptr, stop = nullptr;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  cuda_check(cudaEventRecord(start, nullptr), "cudaEventRecord");
  enqueue();
  cuda_check(cudaEventRecord(stop, nullptr), "cudaEventRecord");
  cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0.0f;
  cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1e-3 * double(ms);
}
#else
GpuInfo read_gpu_info() {
  GpuInfo info;
#ifdef FLASHATTN_WITH_CUDA
  info.description = "not usable: flashattn-bench was compiled without the CUDA runtime headers";
#else
  info.description = "not used: this build has no CUDA backend (configure with -DFLASHATTN_CUDA=ON)";
#endif
  return info;
}
[[noreturn]] void no_cuda() { throw std::logic_error("flashattn-bench was built without CUDA"); }
void* device_alloc(std::size_t) { no_cuda(); }
void device_free(void*) {}
void copy_to_device(void*, const void*, std::size_t) { no_cuda(); }
void copy_to_host(void*, const void*, std::size_t) { no_cuda(); }
void device_sync() {}
void device_clear(void*, std::size_t) { no_cuda(); }
double device_seconds(const std::function<void()>&) { no_cuda(); }
#endif

// --- tensors ------------------------------------------------------------------------------------

// Caller-owned memory for one tensor: fp32 values, or f16/bf16 bit patterns, on the host, with an
// optional GPU copy. When the copy exists, view() describes it and the host side holds what was
// last uploaded or downloaded.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    numel_ = 1;
    for (const auto n : shape_) numel_ *= n;
    if (dtype_ == DType::f32) {
      f32_.assign(std::size_t(numel_), 0.0f);
    } else {
      half_.assign(std::size_t(numel_), 0);
    }
  }
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  HostTensor(HostTensor&& o) noexcept { *this = std::move(o); }
  HostTensor& operator=(HostTensor&& o) noexcept {
    if (this != &o) {
      device_free(device_data_);
      dtype_ = o.dtype_;
      shape_ = std::move(o.shape_);
      numel_ = o.numel_;
      f32_ = std::move(o.f32_);
      half_ = std::move(o.half_);
      device_data_ = o.device_data_;
      o.device_data_ = nullptr;
    }
    return *this;
  }
  ~HostTensor() { device_free(device_data_); }

  std::int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  bool defined() const { return !shape_.empty(); }
  void* host_data() { return dtype_ == DType::f32 ? static_cast<void*>(f32_.data()) : half_.data(); }
  std::size_t bytes() const { return std::size_t(numel_) * flashattn::dtype_size(dtype_); }

  // Makes the GPU copy (once) and uploads the host values into it.
  void to_device() {
    if (device_data_ == nullptr) device_data_ = device_alloc(bytes());
    upload();
  }
  void upload() {
    if (device_data_ != nullptr) copy_to_device(device_data_, host_data(), bytes());
  }
  void download() {
    if (device_data_ != nullptr) copy_to_host(host_data(), device_data_, bytes());
  }

  TensorView view() {
    const auto& s = shape_;
    const bool gpu = device_data_ != nullptr;
    void* data = gpu ? device_data_ : host_data();
    const flashattn::Device where{gpu ? flashattn::DeviceType::cuda : flashattn::DeviceType::cpu, 0};
    switch (s.size()) {
      case 1: return TensorView::contiguous(data, dtype_, {s[0]}, where);
      case 2: return TensorView::contiguous(data, dtype_, {s[0], s[1]}, where);
      case 3: return TensorView::contiguous(data, dtype_, {s[0], s[1], s[2]}, where);
      case 4: return TensorView::contiguous(data, dtype_, {s[0], s[1], s[2], s[3]}, where);
      default: throw std::logic_error("HostTensor: unsupported rank");
    }
  }

  float get(std::int64_t i) const {
    switch (dtype_) {
      case DType::f32: return f32_[std::size_t(i)];
      case DType::bf16: return flashattn::common::to_float(flashattn::common::bf16_t{half_[std::size_t(i)]});
      case DType::f16: return flashattn::common::to_float(flashattn::common::f16_t{half_[std::size_t(i)]});
      default: return 0.0f;
    }
  }
  void set(std::int64_t i, float v) {
    switch (dtype_) {
      case DType::f32: f32_[std::size_t(i)] = v; break;
      case DType::bf16: half_[std::size_t(i)] = flashattn::common::to_bf16(v).bits; break;
      case DType::f16: half_[std::size_t(i)] = flashattn::common::to_f16(v).bits; break;
      default: break;
    }
  }
  void fill_normal(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::int64_t i = 0; i < numel_; ++i) set(i, normal(rng));
  }
  // NaN everywhere (on the GPU too), so that an element the library forgot to write fails the check.
  void poison() {
    for (std::int64_t i = 0; i < numel_; ++i) set(i, std::numeric_limits<float>::quiet_NaN());
    upload();
  }

 private:
  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 0;
  std::vector<float> f32_;
  std::vector<std::uint16_t> half_;
  void* device_data_ = nullptr;
};

// Element-wise max |a − b|. NaN anywhere gives +∞ (NaN never passes); equal infinities (lse of a
// row with no visible key) count as 0.
double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i);
    const double y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) return std::numeric_limits<double>::infinity();
    if (x == y) continue;
    worst = std::max(worst, std::fabs(x - y));
  }
  return worst;
}

double max_abs_finite(const HostTensor& a) {
  double m = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i);
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

// --- the problem ----------------------------------------------------------------------------------

// Visible (i, j) pairs of one (batch, head) under the mask, by the library's own mask definition.
std::int64_t visible_pairs(const Config& c) {
  const auto mask = flashattn::common::make_mask(c.causal, c.window_left, c.window_right, c.sk, c.sq, c.sk);
  std::int64_t pairs = 0;
  for (int i = 0; i < c.sq; ++i) pairs += std::max(0, mask.col_end(i) - mask.col_begin(i));
  return pairs;
}

double forward_flops(const Config& c, std::int64_t pairs) {
  return 2.0 * double(pairs) * double(c.d + c.dv) * double(c.b) * double(c.h);
}
double backward_flops(const Config& c, std::int64_t pairs) {
  return 2.0 * double(pairs) * double(3 * c.d + 2 * c.dv) * double(c.b) * double(c.h);
}

// FlashAttention's convention: dense sq·sk pairs, halved when causal (a window with right = 0 is
// counted as causal); backward = 2.5 × forward.
constexpr double kFaBackwardFactor = 2.5;
double fa_flops(const Config& c, bool backward) {
  const bool halved = c.causal || c.window_right == 0;
  const double fwd = 2.0 * c.b * c.h * double(c.sq) * c.sk * (c.d + c.dv) * (halved ? 0.5 : 1.0);
  return backward ? kFaBackwardFactor * fwd : fwd;
}

// Bytes a call must move at least: each input read once, each output written once.
double io_bytes(const Config& c, bool backward) {
  const double e = double(flashattn::dtype_size(c.dtype));
  const double q = double(c.b) * c.sq * c.h * c.d * e, out = double(c.b) * c.sq * c.h * c.dv * e;
  const double k = double(c.b) * c.sk * c.hk * c.d * e, v = double(c.b) * c.sk * c.hk * c.dv * e;
  const double rows = double(c.b) * c.h * c.sq * sizeof(float);  // lse or softmax_d
  if (!backward) return q + k + v + out + rows;
  return (out + q + k + v + out + rows) + (q + k + v + rows);  // dout, q, k, v, out, lse → dq, dk, dv, softmax_d
}

// Random inputs (fixed by the seed) and output buffers of one configuration, on the host or, with
// on_device, on the GPU.
struct Problem {
  HostTensor q, k, v, out, lse;
  HostTensor dout, dq, dk, dv, softmax_d;
  HostTensor alibi_slopes;  // (h) fp32
  flashattn::Options opt;
  bool on_device = false;

  Problem(const Config& c, bool gpu) : on_device(gpu) {
    const DType t = c.dtype;
    q = HostTensor(t, {c.b, c.sq, c.h, c.d});
    k = HostTensor(t, {c.b, c.sk, c.hk, c.d});
    v = HostTensor(t, {c.b, c.sk, c.hk, c.dv});
    out = HostTensor(t, {c.b, c.sq, c.h, c.dv});
    lse = HostTensor(DType::f32, {c.b, c.h, c.sq});
    std::mt19937_64 rng(c.seed);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    if (c.runs_bwd() || c.check) {
      dout = HostTensor(t, {c.b, c.sq, c.h, c.dv});
      dq = HostTensor(t, {c.b, c.sq, c.h, c.d});
      dk = HostTensor(t, {c.b, c.sk, c.hk, c.d});
      dv = HostTensor(t, {c.b, c.sk, c.hk, c.dv});
      softmax_d = HostTensor(DType::f32, {c.b, c.h, c.sq});
      dout.fill_normal(rng);
    }
    opt.causal = c.causal;
    opt.window_left = c.window_left;
    opt.window_right = c.window_right;
    opt.softcap = c.softcap;
    opt.dropout_p = c.dropout;
    opt.dropout_seed = c.seed;
    opt.deterministic = c.deterministic;
    opt.backend = c.backend;
    opt.num_threads = c.threads;
    if (c.alibi) {
      // The geometric slopes of the ALiBi paper: 2^(−8(i+1)/h) for head i.
      alibi_slopes = HostTensor(DType::f32, {c.h});
      for (int i = 0; i < c.h; ++i) alibi_slopes.set(i, std::exp2(-8.0f * float(i + 1) / float(c.h)));
    }
    if (on_device) {
      for (HostTensor* t : {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &softmax_d, &alibi_slopes}) {
        if (t->defined()) t->to_device();
      }
    }
    if (c.alibi) opt.alibi_slopes = alibi_slopes.view();
  }
  std::size_t tensor_bytes() const {
    std::size_t n = 0;
    for (const HostTensor* t : {&q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &softmax_d, &alibi_slopes}) {
      if (t->defined()) n += t->bytes();
    }
    return n;
  }
  // The GPU's results into the host buffers (nothing to do for host tensors).
  void download_outputs() {
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv, &softmax_d}) t->download();
  }

  flashattn::ForwardInputs fwd_in() { return {q.view(), k.view(), v.view()}; }
  flashattn::ForwardOutputs fwd_out() { return {out.view(), lse.view()}; }
  flashattn::BackwardInputs bwd_in() { return {dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view()}; }
  flashattn::BackwardOutputs bwd_out() { return {dq.view(), dk.view(), dv.view(), softmax_d.view()}; }
};

// --- timing -------------------------------------------------------------------------------------

struct Timing {
  std::vector<double> seconds;
  double median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    const std::size_t n = s.size();
    if (n == 0) return 0.0;
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
  }
  double min() const { return seconds.empty() ? 0.0 : *std::min_element(seconds.begin(), seconds.end()); }
};

// A one-line progress report on stderr, rewritten in place on a terminal and printed line by line
// otherwise; silent for short runs.
class Progress {
 public:
  explicit Progress(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0) {}
  ~Progress() { finish(); }
  void update(const char* phase, int done, int total, double last_seconds) {
    if (last_seconds < kProgressAfterSeconds && !shown_) return;
    shown_ = true;
    char line[160];
    std::snprintf(line, sizeof line, "%s: %s %d/%d (last %.3f s)", label_.c_str(), phase, done, total,
                  last_seconds);
    if (tty_) {
      std::fprintf(stderr, "\r%-78s", line);
    } else {
      std::fprintf(stderr, "%s\n", line);
    }
    std::fflush(stderr);
  }
  void finish() {
    if (shown_ && tty_) std::fprintf(stderr, "\r%-78s\r", "");
    shown_ = false;
  }

 private:
  std::string label_;
  bool tty_;
  bool shown_ = false;
};

// Times the workloads in turn — a, b, a, b, … — so that a baseline measured beside the attention
// call sees the same machine (other load, clocks, caches) as the call itself. The first workload
// decides when enough was measured (--repeats, --min-time).
// After an sgemm call OpenBLAS's worker threads spin for 2^OPENBLAS_THREAD_TIMEOUT cycles (default
// 2^28, about 0.1 s at 2–3 GHz) before they sleep: an attention run started at once would share
// the cores with them. The pause after every workload but the first lets them settle; it is not
// timed.
constexpr int kOpenblasDefaultSpinLog2 = 28;
constexpr double kSpinPauseMargin = 1.5;

double openblas_settle_seconds(const MachineInfo& m) {
  const char* env = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  const int spin_log2 = env ? std::clamp(std::atoi(env), 4, 30) : kOpenblasDefaultSpinLog2;
  const double mhz = m.clock_mhz.empty() ? 0.0 : std::atof(m.clock_mhz.c_str());
  const double hz = mhz > 0 ? mhz * 1e6 : 1e9;  // a slow clock when unknown: a longer pause
  return kSpinPauseMargin * std::ldexp(1.0, spin_log2) / hz;
}

// Host-clock seconds of one run of a workload that returns when its work is done.
double wall_seconds(const std::function<void()>& run) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  run();
  return std::chrono::duration<double>(clock::now() - t0).count();
}

// Seconds of one run of the first workload (the attention call), by whatever method it needs.
using CallTimer = std::function<double(const std::function<void()>&)>;

std::vector<Timing> time_interleaved(const std::string& label, const Config& c,
                                     const std::vector<std::function<void()>>& workloads,
                                     const CallTimer& time_first, double settle_seconds = 0.0) {
  auto timed = [&](const std::function<void()>& run) {
    const double seconds = &run == &workloads[0] ? time_first(run) : wall_seconds(run);
    if (&run != &workloads[0] && settle_seconds > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(settle_seconds));
    }
    return seconds;
  };
  Progress progress(label);
  for (int i = 0; i < c.warmup; ++i) {
    double first = 0.0;
    for (std::size_t w = 0; w < workloads.size(); ++w) {
      const double s = timed(workloads[w]);
      if (w == 0) first = s;
    }
    progress.update("warmup", i + 1, c.warmup, first);
  }
  std::vector<Timing> timings(workloads.size());
  double total = 0.0;
  while (int(timings[0].seconds.size()) < c.repeats || total < c.min_time) {
    for (std::size_t w = 0; w < workloads.size(); ++w) timings[w].seconds.push_back(timed(workloads[w]));
    total += timings[0].seconds.back();
    const int done = int(timings[0].seconds.size());
    progress.update("repeat", done, std::max(c.repeats, done), timings[0].seconds.back());
  }
  return timings;
}

// --- the sgemm baseline -------------------------------------------------------------------------

struct GemmResult {
  bool available = false;
  std::string note;
  double flops = 0.0;
  Timing timing;
};

// The matmuls attention does for one (batch, head), as dense fp32 sgemm calls on buffers of the
// same shapes (row-major): forward S = Q·Kᵀ (sq×sk×d), O = S·V (sq×dv×sk); backward S = Q·Kᵀ,
// dP = dO·Vᵀ, dV = Sᵀ·dO, dQ = dP·K, dK = dPᵀ·Q. run() loops over as many heads as make the same
// FLOP count as the attention call (fewer than b·h when the mask hides pairs).
class SgemmBaseline {
 public:
  SgemmBaseline(const Config& c, bool backward, double target_flops, int threads)
      : sq_(c.sq), sk_(c.sk), d_(c.d), dv_(c.dv), backward_(backward) {
#ifdef FLASHATTN_BENCH_BLAS
    const double head_flops =
        backward ? 2.0 * sq_ * sk_ * double(3 * d_ + 2 * dv_) : 2.0 * sq_ * sk_ * double(d_ + dv_);
    if (head_flops <= 0.0) {
      note_ = "not run: empty problem";
      return;
    }
    heads_ = std::max(1LL, std::llround(target_flops / head_flops));
    flops_ = double(heads_) * head_flops;
    std::mt19937_64 rng(c.seed + 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto matrix = [&](std::size_t n) {
      std::vector<float> m(n);
      for (auto& x : m) x = normal(rng);
      return m;
    };
    const std::size_t sq = std::size_t(sq_), sk = std::size_t(sk_), d = std::size_t(d_), dv = std::size_t(dv_);
    q_ = matrix(sq * d), k_ = matrix(sk * d), v_ = matrix(sk * dv), dout_ = matrix(sq * dv);
    s_.resize(sq * sk), dp_.resize(sq * sk), out_.resize(sq * dv);
    dq_.resize(sq * d), dk_.resize(sk * d), dv_buf_.resize(sk * dv);
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(threads);
#else
    (void)threads;
#endif
    available_ = true;
    note_ = std::to_string(heads_) + " head(s) of the attention's matmul shapes, fp32, " + blas_info();
#else
    (void)target_flops;
    (void)threads;
    note_ = "not available: flashattn-bench was built without OpenBLAS (install libopenblas-dev and "
            "reconfigure)";
#endif
  }

  bool available() const { return available_; }
  const std::string& note() const { return note_; }
  double flops() const { return flops_; }

  void run() {
#ifdef FLASHATTN_BENCH_BLAS
    for (long long i = 0; i < heads_; ++i) one_head();
#endif
  }

 private:
#ifdef FLASHATTN_BENCH_BLAS
  void one_head() {
    const auto rm = CblasRowMajor;
    const auto N = CblasNoTrans, T = CblasTrans;
    const int sq = sq_, sk = sk_, d = d_, dv = dv_;
    cblas_sgemm(rm, N, T, sq, sk, d, 1.0f, q_.data(), d, k_.data(), d, 0.0f, s_.data(), sk);
    if (!backward_) {
      cblas_sgemm(rm, N, N, sq, dv, sk, 1.0f, s_.data(), sk, v_.data(), dv, 0.0f, out_.data(), dv);
      return;
    }
    cblas_sgemm(rm, N, T, sq, sk, dv, 1.0f, dout_.data(), dv, v_.data(), dv, 0.0f, dp_.data(), sk);
    cblas_sgemm(rm, T, N, sk, dv, sq, 1.0f, s_.data(), sk, dout_.data(), dv, 0.0f, dv_buf_.data(), dv);
    cblas_sgemm(rm, N, N, sq, d, sk, 1.0f, dp_.data(), sk, k_.data(), d, 0.0f, dq_.data(), d);
    cblas_sgemm(rm, T, N, sk, d, sq, 1.0f, dp_.data(), sk, q_.data(), d, 0.0f, dk_.data(), d);
  }
#endif

  int sq_, sk_, d_, dv_;
  bool backward_;
  bool available_ = false;
  std::string note_;
  double flops_ = 0.0;
  long long heads_ = 0;
  std::vector<float> q_, k_, v_, dout_, s_, dp_, out_, dq_, dk_, dv_buf_;  // one head's matrices
};

// --- one configuration --------------------------------------------------------------------------

struct DirectionResult {
  std::string name;
  std::string skipped_reason;  // not measured, and why (e.g. no backward kernel on this backend)
  double flops = 0.0;
  Timing timing;
  GemmResult gemm;
  bool gemm_requested = false;
};

struct CheckResult {
  bool ran = false;
  bool passed = true;
  struct Item {
    std::string tensor;
    double error;
    double tolerance;
  };
  std::vector<Item> items;
};

struct RunResult {
  Config config;
  bool on_device = false;
  std::size_t tensor_bytes = 0;         // the caller's tensors: inputs, outputs, gradients
  std::size_t fwd_workspace_bytes = 0;  // forward_workspace_size
  std::size_t bwd_workspace_bytes = 0;  // backward_workspace_size (0 when no backward ran)
  std::string placement_note;
  std::vector<DirectionResult> skipped;
  std::string backend_served;
  std::int64_t pairs = 0;
  std::vector<DirectionResult> directions;
  CheckResult check;
};

// Unit roundoff of the storage type: half the gap between 1 and the next representable value.
double unit_roundoff(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

// The --check tolerance. SPEC §7 bounds a backend's error by twice that of a naive low-precision
// attention on the same inputs; that naive run is not part of the public API, so the bench uses a
// bound of the same order built from the two error sources every backend has:
//   tolerance = c · (u_store + u_fp32 · √n) · max(1, max|ref|)
// - u_store: unit roundoff of the input dtype, for what is rounded to it — the outputs, P before
//   P·V, dS before dS·K (0 for lse, which never passes through the input dtype);
// - u_fp32 · √n: fp32 accumulation over the longest reduction, n = max(sk, sq·h/hk, d, dv)
//   (a sum of n rounded terms drifts like √n ulps, as random rounding errors do);
// - c = kOutputTolerance for out, lse and softmax_d, kGradientTolerance for dq, dk and dv (their
//   sums mix more rounded operands), ×kSoftcapFactor with softcap (SPEC §7's 3× instead of 2×).
// On a grid of shapes, dtypes and options (GQA, d ≠ dv, windows, ALiBi, softcap, dropout, sq ≪ sk
// and sq ≫ sk) the CPU backend's errors stay at least 5× below these bounds.
enum class CheckedTensor { output, lse, gradient };

constexpr double kOutputTolerance = 8.0;
constexpr double kGradientTolerance = 16.0;
constexpr double kSoftcapFactor = 1.5;
const double kFp32Roundoff = std::ldexp(1.0, -24);

double tolerance(const Config& c, CheckedTensor kind, const HostTensor& ref) {
  const double n = std::max({double(c.sk), double(c.sq) * (c.h / c.hk), double(c.d), double(c.dv), 1.0});
  const double u_store = kind == CheckedTensor::lse ? 0.0 : unit_roundoff(c.dtype);
  const double factor = kind == CheckedTensor::gradient ? kGradientTolerance : kOutputTolerance;
  double t = factor * (u_store + kFp32Roundoff * std::sqrt(n)) * std::max(1.0, max_abs_finite(ref));
  if (c.softcap > 0) t *= kSoftcapFactor;
  return t;
}

void describe_config(const Config& c, Json* json, std::string* text) {
  if (text) {
    char buf[320];
    std::snprintf(buf, sizeof buf,
                  "b=%d sq=%d sk=%d h=%d hk=%d d=%d dv=%d dtype=%s causal=%s window=(%d,%d) "
                  "softcap=%g alibi=%s dropout=%g seed=%llu direction=%s",
                  c.b, c.sq, c.sk, c.h, c.hk, c.d, c.dv, flashattn::dtype_name(c.dtype),
                  c.causal ? "yes" : "no", c.window_left, c.window_right, double(c.softcap),
                  c.alibi ? "yes" : "no", double(c.dropout), (unsigned long long)c.seed,
                  direction_name(c.direction));
    *text = buf;
  }
  if (json) {
    json->key("config").begin_object();
    json->field("b", c.b).field("sq", c.sq).field("sk", c.sk).field("h", c.h).field("hk", c.hk);
    json->field("d", c.d).field("dv", c.dv).field("dtype", flashattn::dtype_name(c.dtype));
    json->field("causal", c.causal).field("window_left", c.window_left).field("window_right", c.window_right);
    json->field("softcap", double(c.softcap)).field("alibi", c.alibi).field("dropout", double(c.dropout));
    json->field("seed", c.seed).field("deterministic", c.deterministic);
    json->field("direction", direction_name(c.direction));
    json->field("backend_requested", flashattn::backend_name(c.backend));
    json->field("warmup", c.warmup).field("repeats", c.repeats).field("min_time_s", c.min_time);
    json->field("timer", timer_name(c.timer)).field("l2_flush", c.l2_flush);
    json->end_object();
  }
}

int resolved_threads(const Config& c) {
  return c.threads > 0 ? c.threads : std::max(1, int(std::thread::hardware_concurrency()));
}

// Runs one configuration; throws flashattn::Error when the library refuses the call.
// Workspace memory where the tensors live.
class Scratch {
 public:
  Scratch(std::size_t bytes, bool on_device) : bytes_(bytes), on_device_(on_device) {
    if (bytes_ == 0) return;
    if (on_device_) {
      device_ = device_alloc(bytes_);
    } else {
      host_.resize(bytes_);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { device_free(device_); }
  flashattn::Workspace workspace() {
    return {on_device_ ? device_ : static_cast<void*>(host_.data()), bytes_};
  }

 private:
  std::size_t bytes_;
  bool on_device_;
  std::vector<unsigned char> host_;
  void* device_ = nullptr;
};

// Larger than the L2 of any GPU this runs on (H200: 50 MB), as triton.testing.do_bench's buffer is.
constexpr std::size_t kL2FlushBytes = std::size_t(256) << 20;

// Times one run of an attention call that only enqueues its work (GPU) or does it (host):
// --timer wall puts the host clock around the call and a device synchronisation, --timer events
// CUDA events around the enqueued kernels. With --l2-flush a 256 MiB buffer is cleared before
// every run, outside the timed interval (events: ahead of the start event on the same stream,
// which also hides the next call's launch behind the clearing).
class CallClock {
 public:
  CallClock(const Config& c, bool on_device)
      : timer_(c.timer), on_device_(on_device), flush_bytes_(c.l2_flush && on_device ? kL2FlushBytes : 0),
        flush_(flush_bytes_, on_device) {
    if (!on_device_ && c.timer == TimerKind::events) throw std::invalid_argument("--timer events needs GPU tensors");
    if (!on_device_ && c.l2_flush) throw std::invalid_argument("--l2-flush needs GPU tensors");
  }
  double operator()(const std::function<void()>& call) {
    if (flush_bytes_ > 0) device_clear(flush_.workspace().data, flush_bytes_);
    if (timer_ == TimerKind::events) return device_seconds(call);
    if (flush_bytes_ > 0) device_sync();
    return wall_seconds([&]() {
      call();
      if (on_device_) device_sync();
    });
  }

 private:
  TimerKind timer_;
  bool on_device_;
  std::size_t flush_bytes_;  // declared before flush_, which is sized by it
  Scratch flush_;
};

// Where the tensors go: a GPU for --backend cuda; for auto, a GPU when one is visible and its
// backend serves the forward pass, else the host (the library picks the backend from the tensors'
// device). Returns the placement and, when auto fell back to the host, why.
bool place_on_device(const Config& c, const GpuInfo& gpu, std::string* note) {
  if (c.backend == Backend::cpu || c.backend == Backend::cpu_reference) return false;
  if (c.backend == Backend::cuda) {
    if (!gpu.present) throw flashattn::Error("--backend cuda: no usable GPU: " + gpu.description);
    return true;
  }
  if (!gpu.present) return false;
  Problem probe(c, true);
  const flashattn::Support s = flashattn::can_implement(probe.fwd_in(), probe.fwd_out(), probe.opt);
  if (s) return true;
  *note = "auto: the GPU backend cannot serve this forward pass (" + s.reason + "); host tensors instead";
  return false;
}

// Runs one configuration; throws flashattn::Error when the library refuses the call.
RunResult run_config(const Config& c, const GpuInfo& gpu, double blas_settle_seconds) {
  RunResult r;
  r.config = c;
  r.pairs = visible_pairs(c);
  const bool on_device = place_on_device(c, gpu, &r.placement_note);
  r.on_device = on_device;
  Problem p(c, on_device);

  const flashattn::Support fwd_support = flashattn::can_implement(p.fwd_in(), p.fwd_out(), p.opt);
  if (!fwd_support) throw flashattn::Error("forward not supported: " + fwd_support.reason);
  r.backend_served = flashattn::backend_name(fwd_support.backend);
  bool run_bwd = c.runs_bwd();
  if (run_bwd) {
    const flashattn::Support bwd_support = flashattn::can_implement(p.bwd_in(), p.bwd_out(), p.opt);
    if (!bwd_support && c.direction == Direction::bwd) {
      throw flashattn::Error("backward not supported: " + bwd_support.reason);
    }
    if (!bwd_support) {
      // --direction both: measure what can be measured, and say why the rest was not.
      DirectionResult skipped;
      skipped.name = "bwd";
      skipped.skipped_reason = bwd_support.reason;
      r.skipped.push_back(std::move(skipped));
      run_bwd = false;
    } else if (bwd_support.backend != fwd_support.backend) {
      r.backend_served += std::string(" (backward: ") + flashattn::backend_name(bwd_support.backend) + ")";
    }
  }
  CallClock clock(c, on_device);
  // Times one direction, with the sgemm baseline interleaved when it was asked for.
  const auto measure = [&](const char* name, double flops, bool backward, const std::function<void()>& call) {
    DirectionResult d;
    d.name = name;
    d.flops = flops;
    d.gemm_requested = c.gemm;
    std::vector<std::function<void()>> workloads{call};
    std::unique_ptr<SgemmBaseline> baseline;
    if (c.gemm && on_device) {
      d.gemm.note = "not run: the sgemm baseline measures the CPU, and this run used the GPU";
    } else if (c.gemm) {
      baseline = std::make_unique<SgemmBaseline>(c, backward, flops, resolved_threads(c));
      d.gemm.available = baseline->available();
      d.gemm.note = baseline->note();
      d.gemm.flops = baseline->flops();
      if (baseline->available()) workloads.push_back([&]() { baseline->run(); });
    }
    std::vector<Timing> timings = time_interleaved(name, c, workloads, std::ref(clock), blas_settle_seconds);
    d.timing = timings[0];
    if (timings.size() > 1) d.gemm.timing = timings[1];
    return d;
  };

  r.tensor_bytes = p.tensor_bytes();
  r.fwd_workspace_bytes = flashattn::forward_workspace_size(p.fwd_in(), p.opt);
  Scratch fwd_ws(r.fwd_workspace_bytes, on_device);
  // The calls only enqueue their kernels on a GPU; the clock waits for them.
  auto forward = [&]() { flashattn::forward(p.fwd_in(), p.fwd_out(), p.opt, fwd_ws.workspace()); };

  p.out.poison();
  p.lse.poison();
  if (c.runs_fwd()) {
    r.directions.push_back(measure("fwd", forward_flops(c, r.pairs), false, forward));
  } else {
    forward();  // the backward pass reads out and lse
    if (on_device) device_sync();
  }

  if (run_bwd) {
    r.bwd_workspace_bytes = flashattn::backward_workspace_size(p.bwd_in(), p.opt);
    Scratch bwd_ws(r.bwd_workspace_bytes, on_device);
    p.dq.poison();
    p.dk.poison();
    p.dv.poison();
    p.softmax_d.poison();
    r.directions.push_back(measure("bwd", backward_flops(c, r.pairs), true, [&]() {
      flashattn::backward(p.bwd_in(), p.bwd_out(), p.opt, bwd_ws.workspace());
    }));
  }
  for (auto& d : r.skipped) r.directions.push_back(d);

  if (c.check) {
    // The fp64 reference on the host, on the same inputs and the same options (the dropout mask is
    // a pure function of seed and position, so the reference drops the same elements).
    r.check.ran = true;
    p.download_outputs();
    Problem ref(c, false);  // same seed: the same q, k, v, dout
    ref.opt.backend = Backend::cpu_reference;
    ref.opt.num_threads = 0;
    ref.out.poison();
    ref.lse.poison();
    std::fprintf(stderr, "check: running the fp64 reference (backend cpu_reference)...\n");
    flashattn::forward(ref.fwd_in(), ref.fwd_out(), ref.opt);
    auto add = [&](const char* name, CheckedTensor kind, const HostTensor& got, const HostTensor& want) {
      const double err = max_abs_diff(got, want);
      const double tol = tolerance(c, kind, want);
      r.check.items.push_back({name, err, tol});
      if (!(err <= tol)) r.check.passed = false;
    };
    add("out", CheckedTensor::output, p.out, ref.out);
    add("lse", CheckedTensor::lse, p.lse, ref.lse);
    if (run_bwd) {
      ref.dq.poison();
      ref.dk.poison();
      ref.dv.poison();
      ref.softmax_d.poison();
      flashattn::backward(ref.bwd_in(), ref.bwd_out(), ref.opt);
      add("dq", CheckedTensor::gradient, p.dq, ref.dq);
      add("dk", CheckedTensor::gradient, p.dk, ref.dk);
      add("dv", CheckedTensor::gradient, p.dv, ref.dv);
      add("softmax_d", CheckedTensor::output, p.softmax_d, ref.softmax_d);
    }
  }
  return r;
}

// --- reporting ----------------------------------------------------------------------------------

const char* kFlopConvention =
    "matmul FLOPs (2 per multiply-add) over exactly the visible (i, j) pairs of the mask: "
    "forward 2*pairs*(d+dv), backward 2*pairs*(3d+2dv), summed over batch and query heads; "
    "softmax and exp not counted";

double gflops(double flops, double seconds) { return seconds > 0 ? flops / seconds * 1e-9 : 0.0; }

const char* kFaFlopConvention =
    "FlashAttention's: forward 2*b*h*sq*sk*(d+dv) (= 4*b*h*s^2*d), halved when causal; backward 2.5x forward";
const char* kBandwidthConvention = "minimum traffic: every input read once, every output written once";

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

// Peak resident memory of this process (host runs: inputs, outputs and the CPU backend's scratch).
double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0 / kBytesPerMiB;  // ru_maxrss is in KiB on Linux
}

bool is_backward(const DirectionResult& d) { return d.name == "bwd"; }

// The forward and backward medians added up, when both ran: what one training step's attention
// costs (FLOPs 3.5× the forward by FlashAttention's convention).
struct Combined {
  bool present = false;
  double seconds = 0.0;
  double flops = 0.0;
  double fa_flops = 0.0;
};

Combined combined(const RunResult& r) {
  Combined sum;
  int measured = 0;
  for (const auto& d : r.directions) {
    if (!d.skipped_reason.empty()) continue;
    ++measured;
    sum.seconds += d.timing.median();
    sum.flops += d.flops;
    sum.fa_flops += fa_flops(r.config, is_backward(d));
  }
  sum.present = measured == 2;
  return sum;
}

void print_run(const RunResult& r) {
  const Config& c = r.config;
  std::string text;
  describe_config(c, nullptr, &text);
  std::printf("config    %s\n", text.c_str());
  std::printf("backend   %s (requested %s), tensors on the %s\n", r.backend_served.c_str(),
              flashattn::backend_name(c.backend), r.on_device ? "GPU" : "host");
  if (!r.placement_note.empty()) std::printf("          %s\n", r.placement_note.c_str());
  const double dense = double(c.sq) * double(c.sk);
  std::printf("pairs     %lld visible (i, j) pairs per head (%.1f%% of sq*sk)\n", (long long)r.pairs,
              dense > 0 ? 100.0 * double(r.pairs) / dense : 0.0);
  std::printf("timing    median of at least %d run(s) after %d warm-up run(s); %s%s\n", c.repeats, c.warmup,
              c.timer == TimerKind::events ? "CUDA events around the enqueued kernels"
              : r.on_device                ? "host clock around the call and a device synchronisation"
                                           : "host clock around the call",
              c.l2_flush ? "; L2 flushed before every run" : "");
  std::printf("%-7s %12s %12s %10s %11s %10s %14s %8s\n", "dir", "median ms", "min ms", "GFLOP/s", "TFLOP/s FA",
              "GB/s", "sgemm GFLOP/s", "ratio");
  std::string gemm_note;
  for (const auto& d : r.directions) {
    if (!d.skipped_reason.empty()) {
      std::printf("%-7s not run: %s\n", d.name.c_str(), d.skipped_reason.c_str());
      continue;
    }
    const double g = gflops(d.flops, d.timing.median());
    std::printf("%-7s %12.3f %12.3f %10.2f %11.3f %10.1f", d.name.c_str(), 1e3 * d.timing.median(),
                1e3 * d.timing.min(), g, 1e-3 * gflops(fa_flops(c, is_backward(d)), d.timing.median()),
                gflops(io_bytes(c, is_backward(d)), d.timing.median()));
    if (d.gemm.available && d.gemm.timing.median() > 0) {
      const double gg = gflops(d.gemm.flops, d.gemm.timing.median());
      std::printf(" %14.2f %8.3f\n", gg, gg > 0 ? g / gg : 0.0);
      gemm_note = d.gemm.note;
    } else {
      std::printf(" %14s %8s\n", "-", "-");
      if (d.gemm_requested) gemm_note = d.gemm.note;
    }
  }
  if (const Combined sum = combined(r); sum.present) {
    std::printf("%-7s %12.3f %12s %10.2f %11.3f   (sum of the two medians)\n", "fwd+bwd", 1e3 * sum.seconds, "",
                gflops(sum.flops, sum.seconds), 1e-3 * gflops(sum.fa_flops, sum.seconds));
  }
  if (!gemm_note.empty()) std::printf("sgemm     %s\n", gemm_note.c_str());
  const double ws_mib = double(std::max(r.fwd_workspace_bytes, r.bwd_workspace_bytes)) / kBytesPerMiB;
  if (r.on_device) {
    std::printf("memory    GPU peak %.1f MiB = tensors %.1f MiB + workspace %.1f MiB (fwd %zu B, bwd %zu B); "
                "the library allocates nothing else\n",
                double(r.tensor_bytes) / kBytesPerMiB + ws_mib, double(r.tensor_bytes) / kBytesPerMiB, ws_mib,
                r.fwd_workspace_bytes, r.bwd_workspace_bytes);
  } else {
    std::printf("memory    tensors %.1f MiB; process peak RSS so far %.1f MiB (host scratch of the CPU backend "
                "included)\n", double(r.tensor_bytes) / kBytesPerMiB, peak_rss_mib());
  }
  if (r.check.ran) {
    std::printf("check     vs cpu_reference (fp64), max abs error (tolerance):\n");
    for (const auto& item : r.check.items) {
      std::printf("          %-10s %.3e (%.3e) %s\n", item.tensor.c_str(), item.error, item.tolerance,
                  item.error <= item.tolerance ? "ok" : "FAIL");
    }
    std::printf("check     %s\n", r.check.passed ? "PASSED" : "FAILED");
  }
}

void json_run(Json& j, const RunResult& r) {
  j.begin_object();
  describe_config(r.config, &j, nullptr);
  j.field("backend", r.backend_served).field("tensors", r.on_device ? "gpu" : "host");
  if (!r.placement_note.empty()) j.field("placement_note", r.placement_note);
  j.field("visible_pairs_per_head", (long long)r.pairs);
  j.key("results").begin_array();
  for (const auto& d : r.directions) {
    j.begin_object();
    j.field("direction", d.name);
    if (!d.skipped_reason.empty()) {
      j.field("skipped", d.skipped_reason).end_object();
      continue;
    }
    j.field("flops", d.flops);
    j.field("median_ms", 1e3 * d.timing.median()).field("min_ms", 1e3 * d.timing.min());
    j.field("gflops", gflops(d.flops, d.timing.median()));
    j.field("fa_flops", fa_flops(r.config, is_backward(d)));
    j.field("tflops_fa", 1e-3 * gflops(fa_flops(r.config, is_backward(d)), d.timing.median()));
    j.field("io_bytes", io_bytes(r.config, is_backward(d)));
    j.field("gbps", gflops(io_bytes(r.config, is_backward(d)), d.timing.median()));
    j.key("times_ms").begin_array();
    for (const double s : d.timing.seconds) j.value(1e3 * s);
    j.end_array();
    if (d.gemm_requested) {
      j.key("sgemm").begin_object();
      j.field("available", d.gemm.available).field("note", d.gemm.note);
      if (d.gemm.available) {
        const double gg = gflops(d.gemm.flops, d.gemm.timing.median());
        j.field("flops", d.gemm.flops).field("median_ms", 1e3 * d.gemm.timing.median());
        j.field("gflops", gg).field("ratio", gg > 0 ? gflops(d.flops, d.timing.median()) / gg : 0.0);
      }
      j.end_object();
    }
    j.end_object();
  }
  j.end_array();
  if (const Combined sum = combined(r); sum.present) {
    j.key("fwd_bwd").begin_object();
    j.field("median_ms_sum", 1e3 * sum.seconds).field("gflops", gflops(sum.flops, sum.seconds));
    j.field("tflops_fa", 1e-3 * gflops(sum.fa_flops, sum.seconds));
    j.end_object();
  }
  j.key("memory").begin_object();
  j.field("tensor_bytes", (long long)r.tensor_bytes);
  j.field("fwd_workspace_bytes", (long long)r.fwd_workspace_bytes);
  j.field("bwd_workspace_bytes", (long long)r.bwd_workspace_bytes);
  if (r.on_device) {
    j.field("gpu_peak_bytes", (long long)(r.tensor_bytes + std::max(r.fwd_workspace_bytes, r.bwd_workspace_bytes)));
  } else {
    j.field("host_peak_rss_mib", peak_rss_mib());
  }
  j.end_object();
  if (r.check.ran) {
    j.key("check").begin_object();
    j.field("reference", "cpu_reference (fp64)").field("passed", r.check.passed);
    j.field("tolerance_rule",
            "c*(u_store + 2^-24*sqrt(n))*max(1, max|ref|); u_store = unit roundoff of the input dtype "
            "(0 for lse), n = max(sk, sq*h/hk, d, dv), c = 8 for out/lse/softmax_d and 16 for "
            "dq/dk/dv, x1.5 with softcap");
    j.key("max_abs_error").begin_object();
    for (const auto& item : r.check.items) j.field(item.tensor, item.error);
    j.end_object();
    j.key("tolerance").begin_object();
    for (const auto& item : r.check.items) j.field(item.tensor, item.tolerance);
    j.end_object();
    j.end_object();
  }
  j.end_object();
}

// With --json - the JSON owns the process's stdout and the text report moves to stderr; this is
// the saved stdout.
FILE* g_json_stdout = nullptr;

void write_json(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  if (path == "-") {
    std::fputs(text.c_str(), g_json_stdout);
    std::fflush(g_json_stdout);
    return;
  }
  std::ofstream f(path);
  f << text;
  if (!f) {
    std::fprintf(stderr, "flashattn-bench: cannot write %s\n", path.c_str());
    std::exit(kExitUsage);
  }
  std::fprintf(stderr, "wrote %s\n", path.c_str());
}

std::vector<Config> suite_configs(const std::string& suite, const Config& base) {
  std::vector<Config> configs;
  if (suite == "cpu-report") {
    for (const DType t : {DType::f32, DType::bf16}) {
      for (const bool causal : {false, true}) {
        Config c = base;
        c.b = 1;
        c.h = c.hk = 16;
        c.sq = c.sk = 2048;
        c.d = c.dv = 128;
        c.dtype = t;
        c.causal = causal;
        c.window_left = c.window_right = -1;
        c.softcap = 0.0f;
        c.alibi = false;
        c.dropout = 0.0f;
        c.direction = Direction::both;
        c.gemm = true;
        configs.push_back(c);
      }
    }
  }
  return configs;
}

}  // namespace

int main(int argc, char** argv) {
  const Cli cli = parse_cli(argc, argv);
  const MachineInfo machine = read_machine_info();
  if (cli.config.gemm || !cli.suite.empty()) configure_openblas(argv, machine);
  // With --json - the JSON owns stdout; the human-readable report goes to stderr.
  if (cli.json_path == "-") {
    std::fflush(stdout);
    const int saved = dup(STDOUT_FILENO);
    g_json_stdout = saved >= 0 ? fdopen(saved, "w") : nullptr;
    if (!g_json_stdout || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) return kExitUsage;
  }

  const OtherLoad other_load;
  const std::string info = flashattn::build_info();
  const int threads = resolved_threads(cli.config);
  std::printf("flashattn-bench  %s\n", info.c_str());
  std::printf("cpu       %s, %d logical CPUs%s%s\n", machine.cpu_model.c_str(), machine.logical_cpus,
              machine.vector_flags.empty() ? "" : "; ", machine.vector_flags.c_str());
  std::printf("clock     %s MHz (/proc/cpuinfo)\n", machine.clock_mhz.empty() ? "?" : machine.clock_mhz.c_str());
  std::printf("compiler  %s\n", compiler_info().c_str());
  std::printf("threads   %d\n", threads);
  const GpuInfo gpu = read_gpu_info();
  std::printf("gpu       %s\n", gpu.description.c_str());
  std::printf("flops     %s\n", kFlopConvention);
  std::printf("          TFLOP/s FA: %s\n", kFaFlopConvention);
  std::printf("          GB/s: %s\n", kBandwidthConvention);
  std::fflush(stdout);

  std::vector<Config> configs =
      cli.suite.empty() ? std::vector<Config>{cli.config} : suite_configs(cli.suite, cli.config);
  std::vector<RunResult> results;
  bool all_passed = true;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    if (configs.size() > 1) std::printf("\n[%zu/%zu]\n", i + 1, configs.size());
    std::fflush(stdout);  // before the progress lines on stderr
    try {
      results.push_back(run_config(configs[i], gpu, openblas_settle_seconds(machine)));
    } catch (const flashattn::Error& e) {
      std::fprintf(stderr, "flashattn-bench: the library refused the call: %s\n", e.what());
      return kExitUsage;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "flashattn-bench: %s\n", e.what());
      return kExitUsage;
    }
    print_run(results.back());
    std::fflush(stdout);
    all_passed = all_passed && results.back().check.passed;
  }

  const double other_cpus = other_load.cpus();
  std::printf("\nload      other processes kept %.2f of %d CPUs busy on average during the runs\n", other_cpus,
              machine.logical_cpus);
  if (!cli.json_path.empty()) {
    Json j;
    j.begin_object();
    j.field("tool", "flashattn-bench").field("build_info", info).field("date", utc_now());
    j.key("device").begin_object();
    j.field("type", "cpu").field("model", machine.cpu_model).field("logical_cpus", machine.logical_cpus);
    j.field("vector_flags", machine.vector_flags).field("clock_mhz", machine.clock_mhz);
    j.field("compiler", compiler_info()).field("blas", blas_info());
    j.end_object();
    j.key("gpu").begin_object();
    j.field("present", gpu.present).field("description", gpu.description);
    j.end_object();
    j.field("threads", threads);
    j.field("other_processes_cpus", other_cpus);
    j.field("flop_convention", kFlopConvention);
    j.field("fa_flop_convention", kFaFlopConvention);
    j.field("bandwidth_convention", kBandwidthConvention);
    if (!cli.suite.empty()) j.field("suite", cli.suite);
    j.key("runs").begin_array();
    for (const auto& r : results) json_run(j, r);
    j.end_array();
    j.end_object();
    std::fflush(stdout);
    write_json(cli.json_path, j.str());
  }
  return all_passed ? kExitOk : kExitCheckFailed;
}
