// Decode attention on the CPU: one query token per row against a long key/value cache, grouped-query heads, any
// boolean key mask (repertory.models.decode builds this file on first use and dispatches to it). The cache is
// either one tensor [B, Hkv, T, D] or pages [N, Hkv, P, D] that each row reads through its own block table.
//
// PyTorch's scaled_dot_product_attention reads a decode step's cache at well under the memory bandwidth. Here
// each task takes one (row, key/value head, split of the columns): it reads that head's keys and values once for
// all the query heads of its group, never reads a masked column, and keeps a streaming softmax per query head.
// A second pass merges the splits of each (row, query head) by log-sum-exp. Keys and values are read through
// their strides: the cache is a view of a larger buffer, and copying it would cost what the kernel saves.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();
// Columns scored before their values are summed: a block's keys and values are still in L1 or L2 for the
// group's other query heads. 128 measured faster than 64 or 256 (12 rows x 2,400 tokens, 2 cores).
constexpr int64_t kBlock = 128;
// How far ahead (in columns) the register-resident loops ask for key and value rows: the hardware prefetcher
// alone left a core at about 18 GB/s where a plain sum streams 40. Prefetching never faults, so rows past the
// end of the cache are harmless.
constexpr int64_t kAhead = 64;
constexpr int64_t kMinSplit = 256;  // fewest columns worth a task of their own (merging costs a pass)
// Tasks per thread when rows are split: enough that uneven rows (padding, holes) still balance.
constexpr int64_t kTasksPerThread = 4;
constexpr float kNone = -std::numeric_limits<float>::infinity();

inline Vec load(const float* p) { return Vec::loadu(p); }

inline Vec load(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

// Keys and values of one key/value head over a run of columns that lie `stride` elements apart: a row's whole
// cache, or one page. `next_*` is where the following run starts (a row's next page; null when none or when the
// run is the row's cache), so that reading ahead crosses into it instead of into the memory after the run.
template <typename scalar_t>
struct Run {
  const scalar_t* keys;
  const scalar_t* values;
  int64_t k_stride, v_stride;
  int64_t length = std::numeric_limits<int64_t>::max();  // columns in the run
  const scalar_t* next_keys = nullptr;
  const scalar_t* next_values = nullptr;
};

// Asks for the row kAhead columns after column `col` of a run (`base`, rows `stride` elements apart), in the next
// run when that is where it lies; the address is computed as an integer because it may lie past the end of the
// cache (prefetching never faults).
template <typename scalar_t>
inline void prefetch_ahead(const scalar_t* base, const scalar_t* next, int64_t length, int64_t col, int64_t stride,
                           int64_t dim) {
  const int64_t target = col + kAhead;
  if (target >= length && !next) return;
  const scalar_t* row = target < length ? base : next;
  const auto start = reinterpret_cast<uintptr_t>(row) + (target < length ? target : target - length) * stride *
                                                            sizeof(scalar_t);
  for (uintptr_t line = 0; line < dim * sizeof(scalar_t); line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(start + line));
  }
}

// Where everything is, in elements: the query [B, Hq, 1, D], keys and values [B, Hkv, T, D] with unit stride
// along D, and the boolean mask [B or 1, 1, 1, T] (null when every column is attended). Paged: keys and values
// are pages [N, Hkv, P, D]; column t of row b lies in page table[b][t / P] at t % P, and the row attends to its
// first lengths[b] columns (k_row and v_row are then the page strides).
template <typename scalar_t>
struct Problem {
  const float* query;
  const scalar_t* key;
  const scalar_t* value;
  const bool* mask;
  const int64_t* table = nullptr;
  const int64_t* lengths = nullptr;
  int64_t rows, heads, kv_heads, group, tokens, dim;
  int64_t q_row, q_head, q_dim;
  int64_t k_row, k_head, k_token;
  int64_t v_row, v_head, v_token;
  int64_t m_row, m_token;
  int64_t t_row = 0, page = 0;
  int64_t splits, split_len;
  float scale;

  // the first column after t that lies elsewhere (the next page's first; else the end)
  int64_t run_end(int64_t t) const { return table ? (t / page + 1) * page : tokens; }

  // the run of key/value head h of row b that holds column t (of `tokens` the row attends to), from t on
  Run<scalar_t> run_at(int64_t b, int64_t h, int64_t t, int64_t tokens) const {
    if (!table) {
      return {key + b * k_row + h * k_head + t * k_token, value + b * v_row + h * v_head + t * v_token, k_token,
              v_token};
    }
    const int64_t index = t / page, offset = t % page;
    Run<scalar_t> run{key + table[b * t_row + index] * k_row + h * k_head + offset * k_token,
                      value + table[b * t_row + index] * v_row + h * v_head + offset * v_token, k_token, v_token,
                      page - offset};
    if ((index + 1) * page < tokens) {
      run.next_keys = key + table[b * t_row + index + 1] * k_row + h * k_head;
      run.next_values = value + table[b * t_row + index + 1] * v_row + h * v_head;
    }
    return run;
  }

  // one task's partial result: accumulated values [group, dim], then running maxima [group] and sums [group]
  int64_t partial_size() const { return group * (dim + 2); }
};

template <typename scalar_t>
float dot(const float* q, const scalar_t* k, int64_t dim) {
  Vec a0(0.f), a1(0.f);
  int64_t d = 0;
  for (; d + 2 * kWidth <= dim; d += 2 * kWidth) {
    a0 = at::vec::fmadd(Vec::loadu(q + d), load(k + d), a0);
    a1 = at::vec::fmadd(Vec::loadu(q + d + kWidth), load(k + d + kWidth), a1);
  }
  for (; d + kWidth <= dim; d += kWidth) a0 = at::vec::fmadd(Vec::loadu(q + d), load(k + d), a0);
  float sum = (a0 + a1).reduce_add();
  for (; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// scores[g * kBlock + i] = q_g . k_{cols[i]} for the block's n attended columns
template <typename scalar_t>
void score_block(const float* q, const scalar_t* keys, int64_t stride, const int64_t* cols, int64_t n,
                 int64_t group, int64_t dim, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* k = keys + cols[i] * stride;
    for (int64_t g = 0; g < group; ++g) scores[g * kBlock + i] = dot(q + g * dim, k, dim);
  }
}

// Turns one query head's block of scores into weights exp(score - running max), rescaling what it accumulated
// so far when the block raises the max. Lanes past n hold -inf so that whole vectors can be used.
inline void weigh_block(float* row, int64_t n, float& max, float& sum, float* acc, int64_t dim) {
  const int64_t padded = (n + kWidth - 1) / kWidth * kWidth;
  std::fill(row + n, row + padded, kNone);
  Vec top(kNone);
  for (int64_t i = 0; i < padded; i += kWidth) top = at::vec::maximum(top, Vec::loadu(row + i));
  const float fresh = std::max(max, top.reduce_max());
  if (fresh > max) {
    const float shrink = std::exp(max - fresh);  // 0 for the first attended block (max = -inf)
    sum *= shrink;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= shrink;
    max = fresh;
  }
  Vec total(0.f);
  const Vec shift(fresh);
  for (int64_t i = 0; i < padded; i += kWidth) {
    const Vec w = (Vec::loadu(row + i) - shift).exp();
    w.store(row + i);
    total = total + w;
  }
  sum += total.reduce_add();
}

// acc_g += sum_i weights[g * kBlock + i] * v_{cols[i]}, four vectors of a head's accumulator held in registers
// while the block's value rows stream past
template <typename scalar_t>
void accumulate_block(const float* weights, const scalar_t* values, int64_t stride, const int64_t* cols, int64_t n,
                      int64_t group, int64_t dim, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    const float* w = weights + g * kBlock;
    float* out = acc + g * dim;
    int64_t d = 0;
    for (; d + 4 * kWidth <= dim; d += 4 * kWidth) {
      Vec a0 = Vec::loadu(out + d), a1 = Vec::loadu(out + d + kWidth);
      Vec a2 = Vec::loadu(out + d + 2 * kWidth), a3 = Vec::loadu(out + d + 3 * kWidth);
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t* v = values + cols[i] * stride + d;
        const Vec wi(w[i]);
        a0 = at::vec::fmadd(wi, load(v), a0);
        a1 = at::vec::fmadd(wi, load(v + kWidth), a1);
        a2 = at::vec::fmadd(wi, load(v + 2 * kWidth), a2);
        a3 = at::vec::fmadd(wi, load(v + 3 * kWidth), a3);
      }
      a0.store(out + d);
      a1.store(out + d + kWidth);
      a2.store(out + d + 2 * kWidth);
      a3.store(out + d + 3 * kWidth);
    }
    for (; d + kWidth <= dim; d += kWidth) {
      Vec a = Vec::loadu(out + d);
      for (int64_t i = 0; i < n; ++i) a = at::vec::fmadd(Vec(w[i]), load(values + cols[i] * stride + d), a);
      a.store(out + d);
    }
    for (; d < dim; ++d) {
      float a = out[d];
      for (int64_t i = 0; i < n; ++i) a += w[i] * static_cast<float>(values[cols[i] * stride + d]);
      out[d] = a;
    }
  }
}

// The same two steps for the common head sizes (dim = V vectors, V of 4 or 8: 64 or 128 floats with AVX-512),
// H query heads at a time with their queries and accumulators held in registers across the block: a block's key
// and value rows are then loaded once per H heads, not once per head and vector of the queries. Twice the
// generic loops' speed on cached data (one core, 9 over 3 heads of 64), and a core streams 24 GB/s from memory
// instead of 18: what lets two cores reach the memory bandwidth.
template <int H, int V, typename scalar_t>
void score_heads(const float* q, const Run<scalar_t>& run, const int64_t* cols, int64_t n, float* scores) {
  const scalar_t* keys = run.keys;
  const int64_t stride = run.k_stride;
  Vec qv[H][V];
  for (int g = 0; g < H; ++g)
    for (int v = 0; v < V; ++v) qv[g][v] = Vec::loadu(q + (g * V + v) * kWidth);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* k = keys + cols[i] * stride;
    prefetch_ahead(keys, run.next_keys, run.length, cols[i], stride, V * kWidth);
    Vec kv[V];
    for (int v = 0; v < V; ++v) kv[v] = load(k + v * kWidth);
    for (int g = 0; g < H; ++g) {
      Vec sum = qv[g][0] * kv[0];
      for (int v = 1; v < V; ++v) sum = at::vec::fmadd(qv[g][v], kv[v], sum);
      scores[g * kBlock + i] = sum.reduce_add();
    }
  }
}

template <int H, int V, typename scalar_t>
void accumulate_heads(const float* weights, const Run<scalar_t>& run, const int64_t* cols, int64_t n, float* acc) {
  const scalar_t* values = run.values;
  const int64_t stride = run.v_stride;
  Vec av[H][V];
  for (int g = 0; g < H; ++g)
    for (int v = 0; v < V; ++v) av[g][v] = Vec::loadu(acc + (g * V + v) * kWidth);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* row = values + cols[i] * stride;
    prefetch_ahead(values, run.next_values, run.length, cols[i], stride, V * kWidth);
    Vec vv[V];
    for (int v = 0; v < V; ++v) vv[v] = load(row + v * kWidth);
    for (int g = 0; g < H; ++g) {
      const Vec w(weights[g * kBlock + i]);
      for (int v = 0; v < V; ++v) av[g][v] = at::vec::fmadd(w, vv[v], av[g][v]);
    }
  }
  for (int g = 0; g < H; ++g)
    for (int v = 0; v < V; ++v) av[g][v].store(acc + (g * V + v) * kWidth);
}

// Both steps for the last `heads` (< H) heads of a group: the instance for exactly that many.
template <int H, int V, typename scalar_t>
void rest_of_group(int64_t heads, const float* q, const float* weights, const Run<scalar_t>& run, const int64_t* cols,
                   int64_t n, float* scores, float* acc, bool scoring) {
  if constexpr (H > 0) {
    if (heads != H) {
      rest_of_group<H - 1, V>(heads, q, weights, run, cols, n, scores, acc, scoring);
    } else if (scoring) {
      score_heads<H, V>(q, run, cols, n, scores);
    } else {
      accumulate_heads<H, V>(weights, run, cols, n, acc);
    }
  }
}

// One step (scoring, or summing values) of a block for a whole group, H heads at a time; the registers hold 16
// vectors of queries or accumulators.
template <int V, typename scalar_t>
void group_step(const float* q, const float* weights, const Run<scalar_t>& run, const int64_t* cols, int64_t n,
                int64_t group, float* scores, float* acc, bool scoring) {
  constexpr int H = 16 / V;
  constexpr int64_t dim = V * kWidth;
  int64_t g = 0;
  for (; g + H <= group; g += H) {
    if (scoring) {
      score_heads<H, V>(q + g * dim, run, cols, n, scores + g * kBlock);
    } else {
      accumulate_heads<H, V>(weights + g * kBlock, run, cols, n, acc + g * dim);
    }
  }
  if (g < group) {
    rest_of_group<H - 1, V>(group - g, q + g * dim, weights + g * kBlock, run, cols, n, scores + g * kBlock,
                            acc + g * dim, scoring);
  }
}

// Scores or sums one block, through the register-resident instances where the head size has one.
template <typename scalar_t>
void block_step(const float* q, const float* weights, const Run<scalar_t>& run, const int64_t* cols, int64_t n,
                int64_t group, int64_t dim, float* scores, float* acc, bool scoring) {
  if (dim == 4 * kWidth) {
    group_step<4>(q, weights, run, cols, n, group, scores, acc, scoring);
  } else if (dim == 8 * kWidth) {
    group_step<8>(q, weights, run, cols, n, group, scores, acc, scoring);
  } else if (scoring) {
    score_block(q, run.keys, run.k_stride, cols, n, group, dim, scores);
  } else {
    accumulate_block(weights, run.values, run.v_stride, cols, n, group, dim, acc);
  }
}

// Per-thread room: the group's scaled queries, one block's scores and the block's attended columns.
struct Scratch {
  std::vector<float> query, scores;
  std::vector<int64_t> cols;
  Scratch(int64_t group, int64_t dim) : query(group * dim), scores(group * kBlock), cols(kBlock) {}
};

// One task: the columns of split s of key/value head h of row b, for every query head of the group.
template <typename scalar_t>
void attend_split(const Problem<scalar_t>& p, int64_t task, Scratch& scratch, float* partial) {
  const int64_t s = task % p.splits, b = task / p.splits / p.kv_heads, h = task / p.splits % p.kv_heads;
  const int64_t group = p.group, dim = p.dim;
  float* q = scratch.query.data();
  for (int64_t g = 0; g < group; ++g) {
    const float* src = p.query + b * p.q_row + (h * group + g) * p.q_head;
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = src[d * p.q_dim] * p.scale;
  }
  float* acc = partial;
  float* maxes = partial + group * dim;
  float* sums = maxes + group;
  std::fill(acc, acc + group * dim, 0.f);
  std::fill(maxes, maxes + group, kNone);
  std::fill(sums, sums + group, 0.f);
  const bool* mask = p.mask ? p.mask + b * p.m_row : nullptr;
  const int64_t tokens = p.lengths ? std::min(p.lengths[b], p.tokens) : p.tokens;
  const int64_t begin = std::min(s * p.split_len, tokens), end = std::min(begin + p.split_len, tokens);
  int64_t* cols = scratch.cols.data();
  float* scores = scratch.scores.data();
  for (int64_t start = begin, stop; start < end; start = stop) {
    stop = std::min({start + kBlock, end, p.run_end(start)});
    int64_t n = 0;
    for (int64_t t = start; t < stop; ++t) {
      if (!mask || mask[t * p.m_token]) cols[n++] = t - start;
    }
    if (n == 0) continue;
    const Run<scalar_t> run = p.run_at(b, h, start, tokens);
    block_step(q, scores, run, cols, n, group, dim, scores, acc, true);
    for (int64_t g = 0; g < group; ++g) weigh_block(scores + g * kBlock, n, maxes[g], sums[g], acc + g * dim, dim);
    block_step(q, scores, run, cols, n, group, dim, scores, acc, false);
  }
}

// Output row of query head g of pair (b, h): the splits' accumulators weighted by exp(their max - the overall
// max), over the same weighting of their sums. A row with no attended column gets zeros, as SDPA gives.
void merge_splits(const float* partials, int64_t splits, int64_t group, int64_t dim, int64_t g, float* out) {
  const int64_t size = group * (dim + 2);
  float top = kNone;
  for (int64_t s = 0; s < splits; ++s) top = std::max(top, partials[s * size + group * dim + g]);
  std::fill(out, out + dim, 0.f);
  if (top == kNone) return;
  float total = 0.f;
  for (int64_t s = 0; s < splits; ++s) {
    const float* part = partials + s * size;
    const float max = part[group * dim + g];
    if (max == kNone) continue;
    const float weight = std::exp(max - top);
    total += weight * part[group * dim + group + g];
    for (int64_t d = 0; d < dim; ++d) out[d] += weight * part[g * dim + d];
  }
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

int64_t split_count(int64_t pairs, int64_t tokens, int64_t requested) {
  if (requested > 0) return std::max<int64_t>(1, std::min(requested, tokens));
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = (kTasksPerThread * threads + pairs - 1) / pairs;
  return std::max<int64_t>(1, std::min(wanted, tokens / kMinSplit));
}

template <typename scalar_t>
void run(const Problem<scalar_t>& p, float* out) {
  const int64_t tasks = p.rows * p.kv_heads * p.splits;
  std::vector<float> partials(tasks * p.partial_size());
  // tasks are taken from a shared counter, not handed out in equal ranges: rows differ in attended columns
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(p.group, p.dim);
    for (int64_t task = next++; task < tasks; task = next++) {
      attend_split(p, task, scratch, partials.data() + task * p.partial_size());
    }
  });
  const int64_t outputs = p.rows * p.heads;
  at::parallel_for(0, outputs, 64, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      const int64_t b = o / p.heads, h = o % p.heads / p.group, g = o % p.group;
      const float* pair = partials.data() + (b * p.kv_heads + h) * p.splits * p.partial_size();
      merge_splits(pair, p.splits, p.group, p.dim, g, out + o * p.dim);
    }
  });
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& mask, bool paged = false) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "decode_attention: query must be [B, Hq, 1, D]");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "decode_attention: query must be float32");
  TORCH_CHECK(key.dim() == 4 && key.sizes() == value.sizes(), "decode_attention: key and value must be [B, Hkv, T, D]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "decode_attention: key and value dtypes differ");
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16,
              "decode_attention: key and value must be float32 or bfloat16");
  TORCH_CHECK((paged || key.size(0) == query.size(0)) && key.size(3) == query.size(3),
              "decode_attention: shapes differ");
  TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0,
              "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "decode_attention: key and value need unit stride on D");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "decode_attention: CPU tensors only");
  if (!mask) return;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->device().is_cpu(), "decode_attention: mask must be bool");
  TORCH_CHECK(mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == 1 && mask->size(3) == key.size(2) &&
                  (mask->size(0) == 1 || mask->size(0) == key.size(0)),
              "decode_attention: mask must be [B or 1, 1, 1, T]");
}

template <typename scalar_t>
Problem<scalar_t> describe(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& mask, double scale, int64_t splits) {
  Problem<scalar_t> p;
  p.query = query.data_ptr<float>();
  p.key = key.data_ptr<scalar_t>();
  p.value = value.data_ptr<scalar_t>();
  p.mask = mask ? mask->data_ptr<bool>() : nullptr;
  p.rows = query.size(0), p.heads = query.size(1), p.kv_heads = key.size(1);
  p.group = p.heads / p.kv_heads, p.tokens = key.size(2), p.dim = query.size(3);
  p.q_row = query.stride(0), p.q_head = query.stride(1), p.q_dim = query.stride(3);
  p.k_row = key.stride(0), p.k_head = key.stride(1), p.k_token = key.stride(2);
  p.v_row = value.stride(0), p.v_head = value.stride(1), p.v_token = value.stride(2);
  p.m_row = mask && mask->size(0) > 1 ? mask->stride(0) : 0;
  p.m_token = mask ? mask->stride(3) : 0;
  p.splits = split_count(p.rows * p.kv_heads, p.tokens, splits);
  p.split_len = (p.tokens + p.splits - 1) / p.splits;
  p.scale = static_cast<float>(scale);
  return p;
}

// query [B, Hq, 1, D] float32; key, value [B, Hkv, T, D] float32 or bfloat16; mask [B or 1, 1, 1, T] bool (True:
// attend) or None; splits: pieces each row's columns are cut into (0: chosen from the threads and the length).
// Returns [B, 1, Hq, D] float32.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale, int64_t splits) {
  check_inputs(query, key, value, mask);
  at::Tensor out = at::empty({query.size(0), 1, query.size(1), query.size(3)}, query.options());
  if (out.numel() == 0) return out;
  if (key.scalar_type() == at::kBFloat16) {
    run(describe<c10::BFloat16>(query, key, value, mask, scale, splits), out.data_ptr<float>());
  } else {
    run(describe<float>(query, key, value, mask, scale, splits), out.data_ptr<float>());
  }
  return out;
}

void check_pages(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
                 const at::Tensor& lengths) {
  check_inputs(query, key, value, std::nullopt, true);
  TORCH_CHECK(table.dim() == 2 && table.size(0) == query.size(0) && table.scalar_type() == at::kLong &&
                  table.is_contiguous() && table.device().is_cpu(),
              "paged_decode_attention: table must be contiguous int64 [B, pages]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == query.size(0) && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous() && lengths.device().is_cpu(),
              "paged_decode_attention: lengths must be contiguous int64 [B]");
  // plain loops: the table is small, and a tensor reduction per layer cost more than the check
  const int64_t* pages = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.numel(); ++i) {
    TORCH_CHECK(pages[i] >= 0 && pages[i] < key.size(0), "paged_decode_attention: a page index lies outside the pages");
  }
  const int64_t* rows = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < lengths.numel(); ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] <= table.size(1) * key.size(2),
                "paged_decode_attention: a length exceeds its row's pages");
  }
}

template <typename scalar_t>
Problem<scalar_t> describe_pages(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& table, const at::Tensor& lengths, double scale, int64_t splits) {
  Problem<scalar_t> p;
  p.query = query.data_ptr<float>();
  p.key = key.data_ptr<scalar_t>();
  p.value = value.data_ptr<scalar_t>();
  p.mask = nullptr;
  p.table = table.data_ptr<int64_t>();
  p.lengths = lengths.data_ptr<int64_t>();
  p.rows = query.size(0), p.heads = query.size(1), p.kv_heads = key.size(1);
  p.group = p.heads / p.kv_heads, p.dim = query.size(3), p.page = key.size(2);
  const int64_t* rows = lengths.data_ptr<int64_t>();
  p.tokens = lengths.numel() ? *std::max_element(rows, rows + lengths.numel()) : 0;
  p.q_row = query.stride(0), p.q_head = query.stride(1), p.q_dim = query.stride(3);
  p.k_row = key.stride(0), p.k_head = key.stride(1), p.k_token = key.stride(2);
  p.v_row = value.stride(0), p.v_head = value.stride(1), p.v_token = value.stride(2);
  p.m_row = 0, p.m_token = 0, p.t_row = table.size(1);
  p.splits = split_count(p.rows * p.kv_heads, p.tokens, splits);
  p.split_len = (p.tokens + p.splits - 1) / p.splits;
  p.scale = static_cast<float>(scale);
  return p;
}

// query [B, Hq, 1, D] float32; key, value pages [N, Hkv, P, D] float32 or bfloat16; table [B, pages] int64 (row
// b's columns t lie in page table[b][t / P]); lengths [B] int64 (row b attends to its first lengths[b] columns).
// Returns [B, 1, Hq, D] float32. Unused table entries must still name a page (0 will do).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& table, const at::Tensor& lengths, double scale, int64_t splits) {
  check_pages(query, key, value, table, lengths);
  at::Tensor out = at::empty({query.size(0), 1, query.size(1), query.size(3)}, query.options());
  if (out.numel() == 0) return out;
  if (key.scalar_type() == at::kBFloat16) {
    run(describe_pages<c10::BFloat16>(query, key, value, table, lengths, scale, splits), out.data_ptr<float>());
  } else {
    run(describe_pages<float>(query, key, value, table, lengths, scale, splits), out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(repertory, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, int splits=0) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor query, Tensor key, Tensor value, Tensor table, Tensor lengths, float scale, "
      "int splits=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(repertory, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
