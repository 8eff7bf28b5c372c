// tests/cpp/test_paged_prefill.cpp — paged prefill: flashattn::forward of a varlen batch whose
// keys and values live in a paged cache (block_table, as vLLM calls flash_attn_varlen_func). Each
// check scatters a varlen problem's keys into shuffled pages of a poisoned cache and compares the
// result with the fp64 reference of the packed problem (SPEC §7) — the same keys, gathered back
// in order — so a wrong page, a key past the sequence's count or an unused page read fails.
// Bad block_table / seqused_k values are refused with a message naming the argument, before
// anything is written.
#include <cmath>
#include <string>
#include <vector>

#include "paged_test_util.h"
#include "test_util.h"

namespace fa_test {
namespace {

struct PagedCase {
  AttnConfig cfg;
  int page_size = 16;
  PagedLengths lengths = PagedLengths::seqused_k;
};

// Runs the paged forward on `backend` and checks it against the packed problem's oracle.
void run_paged(const PagedCase& pc, Backend backend) {
  const AttnProblem p = make_problem(pc.cfg);
  const PagedCache cache = make_paged_cache(p, pc.cfg.dtype, pc.page_size, test_seed(11));
  SCOPED_TRACE(describe(p.cfg) + " page_size=" + std::to_string(pc.page_size) + " lengths=" +
               lengths_name(pc.lengths) + " backend=" + flashattn::backend_name(backend));
  ForwardResult res = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = backend;
  opt.num_threads = 2;
  const flashattn::ForwardInputs in = paged_inputs(p, cache, pc.lengths);
  const flashattn::Support s = flashattn::can_implement(in, {res.out.tv(), res.lse.tv()}, opt);
  ASSERT_TRUE(s.ok) << s.reason;
  flashattn::forward(in, {res.out.tv(), res.lse.tv()}, opt);
  EXPECT_TRUE(check_forward(p, res));
}

// Page sizes 1, 16 and 256 over odd lengths (a sequence shorter than a page, one that spans
// many, one that ends exactly on a page boundary), with every source of the key counts.
TEST(PagedPrefill, PageSizesAndLengthSources) {
  for (int page : {1, 16, 256}) {
    for (PagedLengths lengths : {PagedLengths::seqused_k, PagedLengths::cu_seqlens_k}) {
      PagedCase pc;
      pc.cfg = varlen_config(DType::f16, {3, 17, 1, 40}, {5, 33, 256, 41}, 4, 2, 64);
      pc.cfg.opt.causal = true;
      pc.page_size = page;
      pc.lengths = lengths;
      run_paged(pc, Backend::cpu);
    }
  }
}

// seqused_k below the cu_seqlens_k lengths with both given: only the used keys are read (the
// rest of each sequence's keys stay poison in the cache).
TEST(PagedPrefill, SequsedBelowCuSeqlens) {
  PagedCase pc;
  pc.cfg = varlen_config(DType::bf16, {7, 12, 1}, {30, 20, 64}, 2, 2, 32);
  pc.cfg.seqused_k = {13, 20, 1};
  pc.lengths = PagedLengths::both;
  pc.page_size = 16;
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) run_paged(pc, backend);
}

// GQA groups 1, 4 and 8, causal and not, windows, d ≠ dv, fp32 and bf16.
TEST(PagedPrefill, GqaMasksAndHeadDims) {
  struct Variant {
    int h, hk, d, dv;
    bool causal;
    int left, right;
    DType dtype;
  };
  const Variant variants[] = {
      {4, 4, 64, 64, false, -1, -1, DType::f16},  {8, 2, 64, 64, true, -1, -1, DType::bf16},
      {8, 1, 32, 64, true, 7, 0, DType::f32},    {4, 1, 128, 128, false, 5, 3, DType::bf16},
      {6, 3, 40, 24, true, -1, -1, DType::f16},
  };
  for (const Variant& v : variants) {
    PagedCase pc;
    pc.cfg = varlen_config(v.dtype, {9, 1, 33, 20}, {50, 19, 33, 77}, v.h, v.hk, v.d, v.dv);
    pc.cfg.opt.causal = v.causal;
    pc.cfg.opt.window_left = v.left;
    pc.cfg.opt.window_right = v.right;
    pc.page_size = 16;
    run_paged(pc, Backend::cpu);
  }
}

// Sequences without keys (seqused_k = 0: out 0, lse +∞) and without queries, beside full ones;
// softcap and ALiBi read the same per-sequence positions.
TEST(PagedPrefill, EmptySequencesAndScoreMods) {
  PagedCase pc;
  pc.cfg = varlen_config(DType::f16, {4, 0, 6, 3}, {10, 8, 16, 5}, 4, 2, 64);
  pc.cfg.seqused_k = {0, 8, 16, 0};
  pc.cfg.opt.causal = true;
  pc.page_size = 16;
  for (Backend backend : {Backend::cpu, Backend::cpu_reference}) run_paged(pc, backend);

  pc.cfg.seqused_k = {10, 0, 11, 5};
  pc.cfg.opt.softcap = 20.0f;
  pc.cfg.alibi = Alibi::per_head;
  pc.page_size = 1;
  run_paged(pc, Backend::cpu);
}

// The paged call agrees with forward_kvcache over the same pages when each sequence has as many
// queries as the KV-cache call's seqlen_q (one entry point's paged loads against the other's).
TEST(PagedPrefill, MatchesKvcacheEntryPoint) {
  const int b = 3, sq = 5, page = 16;
  AttnConfig cfg = varlen_config(DType::bf16, {sq, sq, sq}, {21, 40, 5}, 4, 2, 64);
  cfg.opt.causal = true;
  const AttnProblem p = make_problem(cfg);
  const PagedCache cache = make_paged_cache(p, cfg.dtype, page, test_seed(3));
  ForwardResult paged = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = Backend::cpu;
  flashattn::forward(paged_inputs(p, cache, PagedLengths::seqused_k), {paged.out.tv(), paged.lse.tv()}, opt);

  flashattn::KVCacheInputs kv;
  const Tensor q = p.q.view(0, {b, sq, cfg.heads, cfg.head_dim},
                            {sq * p.q.stride()[0], p.q.stride()[0], p.q.stride()[1], 1});
  kv.q = q.tv();
  kv.k_cache = cache.k.tv();
  kv.v_cache = cache.v.tv();
  kv.block_table = cache.block_table.tv();
  kv.cache_seqlens = cache.seqused_k.tv();
  Tensor out(cfg.dtype, {b, sq, cfg.heads, cfg.head_dim});
  Tensor lse(DType::f32, {b, cfg.heads, sq});
  flashattn::forward_kvcache(kv, {out.tv(), lse.tv()}, opt);
  const Tensor paged_out = paged.out.view(0, {b, sq, cfg.heads, cfg.head_dim},
                                          {sq * paged.out.stride()[0], paged.out.stride()[0], paged.out.stride()[1], 1});
  EXPECT_TRUE(bitwise_equal(paged_out, out));
}

// --- refusals ----------------------------------------------------------------------------------

struct Refusal {
  AttnProblem p;
  PagedCache cache;
  ForwardResult res;
  flashattn::Options opt;
};

Refusal refusal_setup() {
  AttnConfig cfg = varlen_config(DType::f16, {3, 5}, {20, 9}, 2, 2, 32);
  Refusal r{make_problem(cfg), {}, {}, {}};
  r.cache = make_paged_cache(r.p, cfg.dtype, 8, test_seed(5));
  r.res = make_forward_outputs(r.p);
  r.opt = r.p.opt;
  r.opt.backend = Backend::cpu;
  return r;
}

// The call throws flashattn::Error whose message contains every string of `parts`, and leaves
// out and lse untouched (still poison).
void expect_refused(Refusal& r, const flashattn::ForwardInputs& in, const std::vector<std::string>& parts) {
  try {
    flashattn::forward(in, {r.res.out.tv(), r.res.lse.tv()}, r.opt);
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const flashattn::Error& e) {
    for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
  for (float x : r.res.out.to_vector()) ASSERT_TRUE(std::isnan(x)) << "out was written";
  for (float x : r.res.lse.to_vector()) ASSERT_TRUE(std::isnan(x)) << "lse was written";
  EXPECT_FALSE(flashattn::can_implement(in, {r.res.out.tv(), r.res.lse.tv()}, r.opt).ok);
}

TEST(PagedPrefill, BadBlockTableValues) {
  Refusal r = refusal_setup();
  // Sequence 0 (20 keys, pages of 8) uses table entries 0..2; entry 2 points past the cache.
  const int cols = r.cache.blocks_per_seq;
  const float good = r.cache.block_table.load(2);
  r.cache.block_table.store(2, float(r.cache.num_blocks));
  expect_refused(r, paged_inputs(r.p, r.cache, PagedLengths::seqused_k),
                 {"block_table", "entry (0, 2)", "0 ≤ x < " + std::to_string(r.cache.num_blocks)});
  r.cache.block_table.store(2, good);
  // Sequence 1 (9 keys) uses entries 0..1 of its row: a negative one.
  r.cache.block_table.store(cols + 1, -1.0f);
  expect_refused(r, paged_inputs(r.p, r.cache, PagedLengths::cu_seqlens_k), {"block_table", "entry (1, 1)", "got -1"});
}

TEST(PagedPrefill, BadKeyCounts) {
  Refusal r = refusal_setup();
  // More keys than the row's pages hold (blocks_per_seq · page_size).
  const int capacity = r.cache.blocks_per_seq * r.cache.page_size;
  Tensor too_many = Tensor::from_i32({std::int32_t(capacity + 1), 9});
  flashattn::ForwardInputs in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.varlen.seqused_k = too_many.tv();
  in.varlen.max_seqlen_k = capacity + 1;
  expect_refused(r, in, {"block_table", "row 0", "at most " + std::to_string(capacity) + " keys"});
  // Above max_seqlen_k (the mask and the grid are sized by it).
  Tensor above = Tensor::from_i32({20, 9});
  in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.varlen.seqused_k = above.tv();
  in.varlen.max_seqlen_k = 19;
  expect_refused(r, in, {"varlen.max_seqlen_k", "expected ≥ 20, got 19"});
  // Negative.
  Tensor negative = Tensor::from_i32({20, -2});
  in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.varlen.seqused_k = negative.tv();
  expect_refused(r, in, {"varlen.seqused_k", "entry 1", "got -2"});
  // Above the cu_seqlens_k length when both are given.
  Tensor past_cu = Tensor::from_i32({20, 10});
  in = paged_inputs(r.p, r.cache, PagedLengths::both);
  in.varlen.seqused_k = past_cu.tv();
  expect_refused(r, in, {"varlen.seqused_k", "entry 1", "got 10"});
}

TEST(PagedPrefill, BadShapesAndMissingArguments) {
  Refusal r = refusal_setup();
  flashattn::ForwardInputs in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  // Neither seqused_k nor cu_seqlens_k.
  in.varlen.seqused_k = {};
  expect_refused(r, in, {"varlen.seqused_k", "seqused_k or cu_seqlens_k"});
  // A packed k with block_table.
  in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.k = r.p.k.tv();
  expect_refused(r, in, {"k", "(num_blocks, page_size, heads, head_dim)"});
  // v with another page size.
  const Tensor v_short = r.cache.v.view(0, {r.cache.num_blocks, 4, 2, 32}, r.cache.v.stride());
  in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.v = v_short.tv();
  expect_refused(r, in, {"v", "wrong shape"});
  // block_table of another dtype, another batch, a strided last dimension.
  Tensor as_f32(DType::f32, {2, r.cache.blocks_per_seq});
  in = paged_inputs(r.p, r.cache, PagedLengths::seqused_k);
  in.block_table = as_f32.tv();
  expect_refused(r, in, {"block_table", "int32"});
  Tensor three_rows(DType::i32, {3, r.cache.blocks_per_seq});
  in.block_table = three_rows.tv();
  expect_refused(r, in, {"block_table", "wrong shape", "(2, max_blocks_per_seq)"});
  Tensor wide(DType::i32, {2, 2 * r.cache.blocks_per_seq});
  const Tensor strided = wide.view(0, {2, r.cache.blocks_per_seq}, {2 * r.cache.blocks_per_seq, 2});
  in.block_table = strided.tv();
  expect_refused(r, in, {"block_table", "last dimension must be contiguous"});
}

TEST(PagedPrefill, BatchModeQueriesRefused) {
  const AttnProblem p = make_problem(dense_config(DType::f16, 2, 4, 16, 2, 2, 32));
  const Tensor table = Tensor::from_i32({0, 1}).view(0, {2, 1}, {1, 1});
  flashattn::ForwardInputs in = p.forward_inputs();
  in.block_table = table.tv();
  ForwardResult res = make_forward_outputs(p);
  flashattn::Options opt = p.opt;
  opt.backend = Backend::cpu;
  try {
    flashattn::forward(in, {res.out.tv(), res.lse.tv()}, opt);
    ADD_FAILURE() << "expected flashattn::Error";
  } catch (const flashattn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_table: a paged K/V in forward needs a varlen call"), std::string::npos)
        << e.what();
  }
  for (float x : res.out.to_vector()) ASSERT_TRUE(std::isnan(x)) << "out was written";
}

}  // namespace
}  // namespace fa_test
