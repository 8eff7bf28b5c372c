// tests/cpp/test_index_rules.cpp — common::check_sequence_indices, the index-value rules that the
// host validation and the CUDA device check both run (src/common/index_check.h), at the edges:
// each rule accepts its last valid value and refuses the first invalid one, reports the sequence
// and entry, and index_violation_message names the argument as the validation does.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "api/validate.h"
#include "common/index_check.h"
#include "test_util.h"

namespace fa_test {
namespace {

using flashattn::common::check_sequence_indices;
using flashattn::common::IndexBounds;
using flashattn::common::IndexRule;
using flashattn::common::IndexViolation;

// The first violation over all sequences, in sequence order (what the host validation throws).
IndexViolation first_violation(const IndexBounds& ib) {
  for (int b = 0; b < ib.batch; ++b) {
    const IndexViolation v = check_sequence_indices(ib, b);
    if (v) return v;
  }
  return {};
}

// One edge of a rule: a change to valid indices, and the violation it must give (ok: none).
template <class Indices>
struct Edge {
  std::function<void(Indices&)> change;
  IndexRule rule;
  int batch, entry;
  long long value, bound;
};

template <class Indices>
void expect_edges(const std::vector<Edge<Indices>>& edges) {
  EXPECT_FALSE(first_violation(Indices{}.bounds()));
  for (const Edge<Indices>& e : edges) {
    Indices indices;
    e.change(indices);
    const IndexViolation got = first_violation(indices.bounds());
    SCOPED_TRACE(flashattn::detail::index_violation_message("test", got));
    EXPECT_EQ(got.rule, e.rule);
    if (e.rule == IndexRule::ok) continue;
    EXPECT_EQ(got.batch, e.batch);
    EXPECT_EQ(got.entry, e.entry);
    EXPECT_EQ(got.value, e.value);
    EXPECT_EQ(got.bound, e.bound);
  }
}

struct VarlenIndices {
  std::vector<std::int32_t> cu_q = {0, 3, 10}, cu_k = {0, 5, 12}, used;
  IndexBounds bounds() const {
    IndexBounds ib;
    ib.batch = int(cu_q.size()) - 1;
    ib.cu_seqlens_q = cu_q.data();
    ib.cu_seqlens_k = cu_k.data();
    ib.seqused_k = used.empty() ? nullptr : used.data();
    ib.max_seqlen_q = 7;
    ib.max_seqlen_k = 7;
    ib.total_q = 10;
    ib.total_k = 12;
    return ib;
  }
};

TEST(IndexRules, VarlenEdges) {
  expect_edges<VarlenIndices>({
      {[](VarlenIndices& v) { v.cu_q[0] = 1; }, IndexRule::cu_seqlens_start, 0, 0, 1, 0},
      {[](VarlenIndices& v) { v.cu_k = {0, 5, 5}; }, IndexRule::ok, 0, 0, 0, 0},  // an empty second sequence
      {[](VarlenIndices& v) { v.cu_k = {0, 5, 4}; }, IndexRule::cu_seqlens_decreasing, 1, 2, 4, 5},
      {[](VarlenIndices& v) { v.cu_q[2] = 11; }, IndexRule::max_seqlen_too_small, 1, 1, 7, 8},
      {[](VarlenIndices& v) { v.cu_q = {0, 3, 9}; }, IndexRule::ok, 0, 0, 0, 0},  // rows past 9 uncovered
      {[](VarlenIndices& v) { v.cu_k = {0, 6, 13}; }, IndexRule::cu_seqlens_past_total, 1, 2, 13, 12},
      {[](VarlenIndices& v) { v.used = {5, 7}; }, IndexRule::ok, 0, 0, 0, 0},
      {[](VarlenIndices& v) { v.used = {5, 8}; }, IndexRule::seqused_k_range, 1, 1, 8, 7},
      {[](VarlenIndices& v) { v.used = {-1, 0}; }, IndexRule::seqused_k_range, 0, 0, -1, 5},
  });
}

struct CacheIndices {
  std::vector<std::int32_t> seqlens = {3, 14}, batch_idx, table;
  std::int64_t rotary_rows = -1;  // no rotary table
  IndexBounds bounds() const {
    IndexBounds ib;
    ib.batch = 2;
    ib.cache_seqlens = seqlens.data();
    ib.cache_batch_idx = batch_idx.empty() ? nullptr : batch_idx.data();
    ib.capacity = 16;
    ib.cache_rows = table.empty() ? 3 : 5;  // batch rows, or pages of 8 keys
    if (!table.empty()) {
      ib.block_table = table.data();
      ib.block_table_batch_stride = 2;
      ib.page_size = 8;
    }
    ib.seqlen_new = 2;
    ib.seqlen_q = 4;
    ib.rotary_rows = rotary_rows;
    return ib;
  }
};

TEST(IndexRules, KVCacheEdges) {
  expect_edges<CacheIndices>({
      {[](CacheIndices& c) { c.seqlens = {3, 15}; }, IndexRule::cache_seqlens_range, 1, 1, 15, 14},
      {[](CacheIndices& c) { c.seqlens = {-1, 0}; }, IndexRule::cache_seqlens_range, 0, 0, -1, 14},
      {[](CacheIndices& c) { c.rotary_rows = 18; }, IndexRule::ok, 0, 0, 0, 0},  // 14 + max(4, 2)
      {[](CacheIndices& c) { c.rotary_rows = 17; }, IndexRule::rotary_too_short, 1, 1, 17, 18},
      {[](CacheIndices& c) { c.rotary_rows = 0; }, IndexRule::rotary_too_short, 0, 0, 0, 7},  // an empty table
      {[](CacheIndices& c) { c.batch_idx = {2, 0}; }, IndexRule::ok, 0, 0, 0, 0},
      {[](CacheIndices& c) { c.batch_idx = {2, 3}; }, IndexRule::cache_batch_idx_range, 1, 1, 3, 3},
      {[](CacheIndices& c) { c.batch_idx = {-2, 0}; }, IndexRule::cache_batch_idx_range, 0, 0, -2, 3},
      // Sequence 0 uses one page (5 keys), so its unused second entry is not read.
      {[](CacheIndices& c) { c.table = {4, 99, 0, 1}; }, IndexRule::ok, 0, 0, 0, 0},
      {[](CacheIndices& c) { c.table = {4, 99, 0, 5}; }, IndexRule::block_table_range, 1, 1, 5, 5},
      {[](CacheIndices& c) { c.table = {-1, 2, 0, 1}; }, IndexRule::block_table_range, 0, 0, -1, 5},
  });
}

TEST(IndexRules, MessagesNameTheArgument) {
  const std::pair<IndexRule, std::string> names[] = {
      {IndexRule::cu_seqlens_start, "varlen.cu_seqlens_k"},  {IndexRule::cu_seqlens_decreasing, "varlen.cu_seqlens_k"},
      {IndexRule::max_seqlen_too_small, "varlen.max_seqlen_k"}, {IndexRule::cu_seqlens_past_total, "varlen.cu_seqlens_k"},
      {IndexRule::seqused_k_range, "varlen.seqused_k"},       {IndexRule::cache_seqlens_range, "cache_seqlens"},
      {IndexRule::rotary_too_short, "rotary_cos"},           {IndexRule::cache_batch_idx_range, "cache_batch_idx"},
      {IndexRule::block_table_range, "block_table"},
  };
  for (const auto& [rule, name] : names) {
    IndexViolation v;
    v.rule = rule;
    v.side = flashattn::common::IndexSide::k;
    v.value = 42;
    const std::string msg = flashattn::detail::index_violation_message("flashattn::forward", v);
    EXPECT_EQ(msg.rfind("flashattn::forward: " + name + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find("; expected "), std::string::npos) << msg;
    EXPECT_EQ(msg.substr(msg.size() - 8), ", got 42") << msg;
  }
}

}  // namespace
}  // namespace fa_test
