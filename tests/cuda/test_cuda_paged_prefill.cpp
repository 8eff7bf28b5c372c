// tests/cuda/test_cuda_paged_prefill.cpp — paged prefill on CUDA tensors: flashattn::forward of a
// varlen batch whose K/V live in a paged cache (block_table with shuffled pages, seqused_k or
// cu_seqlens_k giving the key counts), the call vLLM makes per batch. out and lse pass SPEC §7
// against the fp64 reference of the packed problem (tests/cpp/paged_test_util.h: the cache holds
// poison wherever no key was copied, so a wrong page read shows as NaN); split-KV and the GQA-packed
// kernel run too, under the ordered family choice and each family forced. Bad block_table / seqused_k values in device memory are found by the device-side
// index check and thrown naming the argument, with out and lse untouched. Without a GPU every test
// skips and says it was not run.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "paged_test_util.h"

namespace fa_test::cuda {
namespace {

namespace fa = flashattn;

struct DeviceCall {
  DeviceArena dev;
  fa::ForwardInputs in;
  ForwardResult res;
  void* d_out = nullptr;
  void* d_lse = nullptr;
};

// The paged inputs of p (host) with every tensor mirrored to the device; poisoned outputs there.
void upload(DeviceCall& call, const AttnProblem& p, const PagedCache& cache, PagedLengths lengths) {
  const fa::ForwardInputs host = paged_inputs(p, cache, lengths);
  call.res = make_forward_outputs(p);
  call.in = host;
  call.in.q = call.dev.mirror_view(p.q);
  call.in.k = call.dev.mirror_view(cache.k);
  call.in.v = call.dev.mirror_view(cache.v);
  call.in.block_table = call.dev.mirror_view(cache.block_table);
  call.in.varlen.cu_seqlens_q = call.dev.mirror_view(p.cu_seqlens_q);
  call.in.varlen.cu_seqlens_k = host.varlen.cu_seqlens_k.defined() ? call.dev.mirror_view(p.cu_seqlens_k) : fa::TensorView{};
  call.in.varlen.seqused_k = host.varlen.seqused_k.defined() ? call.dev.mirror_view(cache.seqused_k) : fa::TensorView{};
}

// Runs the call (check_indices: a bad value throws at once) with a workspace of the reported size
// and copies out and lse back.
void run(DeviceCall& call, const AttnProblem& p, int num_splits) {
  fa::TensorView out = call.dev.mirror_view(call.res.out), lse = call.dev.mirror_view(call.res.lse);
  call.d_out = out.data;
  call.d_lse = lse.data;
  fa::Options opt = p.opt;
  opt.check_indices = true;
  opt.num_splits = num_splits;
  if (p.alibi_slopes.defined()) opt.alibi_slopes = call.dev.mirror_view(p.alibi_slopes);
  const std::size_t bytes = fa::forward_workspace_size(call.in, opt);
  try {
    fa::forward(call.in, {out, lse}, opt, {call.dev.alloc(bytes), bytes});
  } catch (...) {
    DeviceArena::download(call.res.out, call.d_out);
    DeviceArena::download(call.res.lse, call.d_lse);
    throw;
  }
  DeviceArena::download(call.res.out, call.d_out);
  DeviceArena::download(call.res.lse, call.d_lse);
}

struct PagedGpuCase {
  DType dtype;
  int h, hk, d;
  int page;
  bool causal;
  int window_left;
  PagedLengths lengths;
  int num_splits;  // 0: heuristic, 1: unsplit, n: forced split-KV
  int dv = 0;      // 0: d
  bool score_mod = false;  // softcap and ALiBi (the kernels' softcap/ALiBi/dropout variants)
};

class CudaPagedPrefill : public testing::TestWithParam<PagedGpuCase> {};

TEST_P(CudaPagedPrefill, MatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const PagedGpuCase& g = GetParam();
  const fa::common::Storage storage = storage_of(g.dtype);
  if (!kernel_built(fa::cuda::sm80::Family::fwd, storage, g.d, g.dv > 0 ? g.dv : g.d)) return;
  // Decoding rows (1 query) beside prefill chunks, a sequence without keys, odd key counts.
  AttnConfig cfg = varlen_config(g.dtype, {1, 37, 1, 130, 5}, {300, 37, 1, 700, 64}, g.h, g.hk, g.d, g.dv);
  if (g.lengths != PagedLengths::cu_seqlens_k) cfg.seqused_k = {300, 20, 0, 699, 64};
  cfg.opt.causal = g.causal;
  cfg.opt.window_left = g.window_left;
  if (g.score_mod) {
    cfg.opt.softcap = 20.0f;
    cfg.alibi = Alibi::per_head;
  }
  const AttnProblem p = make_problem(cfg);
  const PagedCache cache = make_paged_cache(p, g.dtype, g.page, test_seed(17));
  // The ordered choice, then each family this GPU runs forced (sm90: where built with
  // -DFLASHATTN_SM90_FWD_PAGED=1; it does not split, so num_splits is moot there).
  std::vector<const char*> families = {""};
  for (const char* family : families_here()) {
    // (CudaPagedPrefillRefusal checks the sm90 family's reason for other page sizes.)
    if (std::string(family) == "sm90" && !sm90_takes_pages(g.page)) continue;
    families.push_back(family);
  }
  for (const char* family : families) {
    // sm90 with pages of a multiple of 64 rows: its 64-row boxes (the default), then the 16-row ones
    // as well.
    const bool wide = std::string(family) == "sm90" && g.page % 64 == 0;
    for (const char* box : {"", "16"}) {
      if (*box != '\0' && !wide) continue;
      SCOPED_TRACE(std::string("FLASHATTN_CUDA_FAMILY=") + family + " FLASHATTN_SM90_FWD_PAGE_BOX=" + box);
      const FamilyOverride forced(family);
      const EnvOverride boxes("FLASHATTN_SM90_FWD_PAGE_BOX", box);
      DeviceCall call;
      upload(call, p, cache, g.lengths);
      run(call, p, g.num_splits);
      EXPECT_TRUE(check_forward(p, call.res));
    }
  }
}

std::string paged_case_name(const testing::TestParamInfo<PagedGpuCase>& info) {
  const PagedGpuCase& g = info.param;
  return std::string(fa::dtype_name(g.dtype)) + "_h" + std::to_string(g.h) + "hk" + std::to_string(g.hk) + "_d" +
         std::to_string(g.d) + (g.dv > 0 ? "_dv" + std::to_string(g.dv) : "") + (g.score_mod ? "_softcap_alibi" : "") +
         "_page" + std::to_string(g.page) + (g.causal ? "_causal" : "") +
         (g.window_left >= 0 ? "_window" + std::to_string(g.window_left) : "") + "_" + lengths_name(g.lengths) +
         "_splits" + std::to_string(g.num_splits);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CudaPagedPrefill,
    testing::Values(PagedGpuCase{DType::bf16, 8, 2, 128, 16, true, -1, PagedLengths::seqused_k, 0},
                    PagedGpuCase{DType::bf16, 8, 2, 128, 16, true, -1, PagedLengths::seqused_k, 3},
                    PagedGpuCase{DType::bf16, 4, 4, 128, 256, false, -1, PagedLengths::cu_seqlens_k, 1},
                    PagedGpuCase{DType::bf16, 8, 1, 128, 32, true, 63, PagedLengths::both, 0},
                    PagedGpuCase{DType::f16, 8, 2, 64, 16, true, -1, PagedLengths::seqused_k, 0},
                    PagedGpuCase{DType::bf16, 4, 2, 256, 64, true, -1, PagedLengths::seqused_k, 2},
                    // The softcap/ALiBi kernels; DeepSeek's 192 / 128 (the sm90 192 kernel where built).
                    PagedGpuCase{DType::bf16, 8, 2, 128, 16, true, -1, PagedLengths::seqused_k, 0, 0, true},
                    PagedGpuCase{DType::f16, 4, 1, 64, 48, false, 40, PagedLengths::both, 1, 0, true},
                    PagedGpuCase{DType::bf16, 4, 4, 192, 32, true, -1, PagedLengths::seqused_k, 1, 128},
                    PagedGpuCase{DType::bf16, 4, 2, 192, 16, false, -1, PagedLengths::cu_seqlens_k, 1, 128, true},
                    // Pages of any size (sm80: fewer than 16 rows read their entries row by row):
                    // one row (SGLang's caches), 5, 24 and 100 (not multiples of 16), split and
                    // packed, the softcap/ALiBi kernel, a window.
                    PagedGpuCase{DType::bf16, 8, 2, 128, 1, true, -1, PagedLengths::seqused_k, 0},
                    PagedGpuCase{DType::f16, 8, 8, 64, 5, false, -1, PagedLengths::cu_seqlens_k, 3},
                    PagedGpuCase{DType::bf16, 8, 2, 128, 24, true, 63, PagedLengths::both, 0, 0, true},
                    PagedGpuCase{DType::bf16, 4, 1, 256, 100, true, -1, PagedLengths::seqused_k, 1},
                    PagedGpuCase{DType::f16, 8, 4, 128, 7, true, -1, PagedLengths::seqused_k, 1, 0, true},
                    // d 96 (the sm90 96 kernel's 32-column boxes where built), pages of 16 and 64.
                    PagedGpuCase{DType::bf16, 4, 2, 96, 16, true, -1, PagedLengths::seqused_k, 0},
                    PagedGpuCase{DType::f16, 4, 4, 96, 64, false, -1, PagedLengths::cu_seqlens_k, 1, 0, true}),
    paged_case_name);

// A page size that is not a multiple of 16: the sm90 family declines it with the reason (a forced
// call is refused and writes nothing), and the ordered choice serves it in the sm80 family.
TEST(CudaPagedPrefillRefusal, PageSizeNotMultipleOf16) {
  FA_SKIP_WITHOUT_SM90();
  DType dtype;
  if (!built_dtype(flashattn::cuda::sm80::Family::fwd, 128, &dtype)) return;
  const AttnProblem p = make_problem(varlen_config(dtype, {3, 5}, {20, 9}, 2, 2, 128));
  const PagedCache cache = make_paged_cache(p, dtype, 8, test_seed(2));
  DeviceCall call;
  upload(call, p, cache, PagedLengths::seqused_k);
  const fa::TensorView out = call.dev.mirror_view(call.res.out), lse = call.dev.mirror_view(call.res.lse);
  {
    const FamilyOverride forced("sm90");
    const fa::Support s = fa::can_implement(call.in, {out, lse}, p.opt);
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.reason.find("multiples of 16"), std::string::npos) << s.reason;
  }
  const FamilyOverride ordered("");
  const fa::Support s = fa::can_implement(call.in, {out, lse}, p.opt);
  EXPECT_TRUE(s.ok) << s.reason;
  run(call, p, 0);
  EXPECT_TRUE(check_forward(p, call.res));
}

// Bad values in device memory: the index check finds them before any kernel reads a page.
TEST(CudaPagedPrefillRefusal, BadIndexValuesThrowAndWriteNothing) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::fwd, fa::common::Storage::bf16, 128, 128)) return;
  AttnConfig cfg = varlen_config(DType::bf16, {3, 5}, {40, 17}, 2, 2, 128);
  cfg.seqused_k = {40, 17};
  const AttnProblem p = make_problem(cfg);
  struct Fault {
    const char* name;
    int entry;          // block_table element to overwrite (-1: none)
    float value;
    int seqused_first;  // seqused_k[0] (-1: keep)
    int max_seqlen_k;   // 0: keep
    const char* expect;
  };
  const Fault faults[] = {
      {"page_past_the_cache", 1, 1000.0f, -1, 0, "block_table: entry (0, 1)"},
      {"negative_page", 0, -3.0f, -1, 0, "block_table: entry (0, 0)"},
      {"keys_past_the_row", -1, 0.0f, 1000, 1000, "block_table: row 0"},
      {"keys_past_max_seqlen_k", -1, 0.0f, 41, 40, "varlen.max_seqlen_k: "},
      {"negative_seqused_k", -1, 0.0f, -1000, 0, "varlen.seqused_k: entry 0"},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(f.name);
    PagedCache cache = make_paged_cache(p, DType::bf16, 16, test_seed(4));
    if (f.entry >= 0) cache.block_table.store(f.entry, f.value);
    if (f.seqused_first != -1) cache.seqused_k.store(0, float(f.seqused_first));
    DeviceCall call;
    upload(call, p, cache, PagedLengths::seqused_k);
    if (f.max_seqlen_k > 0) call.in.varlen.max_seqlen_k = f.max_seqlen_k;
    try {
      run(call, p, 0);
      ADD_FAILURE() << "expected flashattn::Error";
    } catch (const fa::Error& e) {
      EXPECT_NE(std::string(e.what()).find(f.expect), std::string::npos) << e.what();
    }
    for (float x : call.res.out.to_vector()) ASSERT_TRUE(std::isnan(x)) << "out was written";
    for (float x : call.res.lse.to_vector()) ASSERT_TRUE(std::isnan(x)) << "lse was written";
  }
  // The device is usable afterwards: a good call passes.
  const PagedCache cache = make_paged_cache(p, DType::bf16, 16, test_seed(4));
  DeviceCall call;
  upload(call, p, cache, PagedLengths::seqused_k);
  run(call, p, 0);
  EXPECT_TRUE(check_forward(p, call.res));
}

}  // namespace
}  // namespace fa_test::cuda
