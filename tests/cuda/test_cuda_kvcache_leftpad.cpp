// tests/cuda/test_cuda_kvcache_leftpad.cpp — forward_kvcache with cache_leftpad on CUDA tensors
// (tests/cpp/leftpad_test_util.h): sequence i attends to cache rows [cache_leftpad[i],
// cache_seqlens[i] + sk_new), checked against the fp64 reference of the varlen problem of exactly
// those rows (the rows before the padding hold poison), split-KV included; k_new lands at the
// absolute rows cache_seqlens[i] + t; a bad cache_leftpad in device memory is thrown by the
// device-side index check with out untouched. Without a GPU every test skips and says it was not
// run.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "cuda_test_util.h"
#include "leftpad_test_util.h"

namespace fa_test::cuda {
namespace {

namespace fa = flashattn;

// The call of c on the device (every tensor mirrored; check_indices), results copied back into c.
void run_on_device(LeftpadCall& c, int num_splits) {
  DeviceArena dev;
  const fa::KVCacheInputs host = c.inputs();
  fa::KVCacheInputs in = host;
  in.q = dev.mirror_view(c.q);
  in.k_cache = dev.mirror_view(c.k_cache);
  in.v_cache = dev.mirror_view(c.v_cache);
  in.cache_seqlens = dev.mirror_view(c.seqlens);
  in.cache_leftpad = dev.mirror_view(c.leftpad);
  if (host.k_new.defined()) {
    in.k_new = dev.mirror_view(c.k_new);
    in.v_new = dev.mirror_view(c.v_new);
  }
  const fa::TensorView out = dev.mirror_view(c.out), lse = dev.mirror_view(c.lse);
  fa::Options opt = c.p.opt;
  opt.check_indices = true;
  opt.num_splits = num_splits;
  if (c.p.alibi_slopes.defined()) opt.alibi_slopes = dev.mirror_view(c.p.alibi_slopes);
  const std::size_t bytes = fa::forward_kvcache_workspace_size(in, opt);
  auto copy_back = [&] {
    DeviceArena::download(c.out, out.data);
    DeviceArena::download(c.lse, lse.data);
    DeviceArena::download(c.k_cache, in.k_cache.data);
    DeviceArena::download(c.v_cache, in.v_cache.data);
  };
  try {
    fa::forward_kvcache(in, {out, lse}, opt, {dev.alloc(bytes), bytes});
  } catch (...) {
    copy_back();
    throw;
  }
  copy_back();
}

struct LeftpadGpuCase {
  DType dtype;
  int heads, heads_k, d, sq, sk_new;
  bool causal;
  int num_splits;
};

class CudaKvcacheLeftpad : public testing::TestWithParam<LeftpadGpuCase> {};

TEST_P(CudaKvcacheLeftpad, MatchesReference) {
  FA_SKIP_WITHOUT_GPU();
  const LeftpadGpuCase& g = GetParam();
  const fa::common::Storage storage = storage_of(g.dtype);
  if (!kernel_built(fa::cuda::sm80::Family::fwd, storage, g.d, g.d)) return;
  LeftpadCase lc;
  lc.dtype = g.dtype;
  lc.heads = g.heads;
  lc.heads_k = g.heads_k;
  lc.d = g.d;
  lc.sq = g.sq;
  lc.sk_new = g.sk_new;
  lc.causal = g.causal;
  lc.capacity = 600;
  lc.seqlens = {300, 7, 33, 512};
  lc.leftpad = {45, 0, 33, 1};
  LeftpadCall c = make_leftpad_call(lc);
  run_on_device(c, g.num_splits);
  EXPECT_TRUE(check_forward(c.p, c.varlen_result()));
  EXPECT_TRUE(c.appended_at_cache_seqlens());
}

std::string leftpad_case_name(const testing::TestParamInfo<LeftpadGpuCase>& info) {
  const LeftpadGpuCase& g = info.param;
  return std::string(fa::dtype_name(g.dtype)) + "_h" + std::to_string(g.heads) + "hk" + std::to_string(g.heads_k) +
         "_d" + std::to_string(g.d) + "_sq" + std::to_string(g.sq) + "_new" + std::to_string(g.sk_new) +
         (g.causal ? "_causal" : "") + "_splits" + std::to_string(g.num_splits);
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaKvcacheLeftpad,
                         testing::Values(LeftpadGpuCase{DType::bf16, 8, 2, 128, 1, 1, true, 0},
                                         LeftpadGpuCase{DType::bf16, 8, 2, 128, 1, 1, true, 4},
                                         LeftpadGpuCase{DType::bf16, 4, 4, 128, 17, 0, false, 1},
                                         LeftpadGpuCase{DType::f16, 8, 1, 64, 5, 3, true, 0}),
                         leftpad_case_name);

TEST(CudaKvcacheLeftpadRefusal, PastCacheSeqlensThrowsAndWritesNothing) {
  FA_SKIP_WITHOUT_GPU();
  if (!kernel_built(fa::cuda::sm80::Family::fwd, fa::common::Storage::bf16, 128, 128)) return;
  LeftpadCase lc;
  lc.d = 128;
  LeftpadCall c = make_leftpad_call(lc);
  c.leftpad.store(1, 8.0f);  // cache_seqlens[1] = 7
  try {
    run_on_device(c, 0);
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const fa::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cache_leftpad: entry 1"), std::string::npos) << e.what();
  }
  for (float x : c.out.to_vector()) ASSERT_TRUE(std::isnan(x)) << "out was written";
}

}  // namespace
}  // namespace fa_test::cuda
