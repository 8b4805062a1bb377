// The rCache simulator: counts gathers and evictions of chunks through a cache of `blocks` full-size
// blocks, for one training step's chunk-access trace, under Belady's rule (evict the chunk whose next
// use is furthest away: the runtime's policy with a traced order) or LRU (without one).
//
// Trace: steps t = 0..n_steps-1; step t touches chunks[offsets[t] .. offsets[t+1]) (all must be
// resident together; duplicates inside a step count once). The cache starts empty (the runtime
// resets it at the end of backward). Ties: Belady evicts the largest (next use, chunk id); LRU the
// smallest (last use, chunk id). elixir/search/simulator.py holds a Python twin with identical results.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "registry.h"

namespace py = pybind11;

namespace elixir {
namespace {

using Entry = std::pair<int64_t, int64_t>;  // (key, chunk)

struct Result {
  int64_t gathers = 0;
  int64_t evictions = 0;
};

Result simulate(const int64_t* offsets, int64_t n_steps, const int32_t* chunks, int64_t n_chunks,
                int64_t blocks, bool belady, int64_t* per_chunk) {
  const int64_t n_acc = offsets[n_steps];
  std::vector<int64_t> seen(n_chunks, -1);
  // Working-set check and next-use table (Belady): next_occ[i] for the first occurrence of a chunk
  // in its step is the next step that touches it, or n_steps (never again).
  std::vector<int64_t> next_occ(belady ? n_acc : 0, n_steps);
  int64_t max_ws = 0;
  for (int64_t t = 0; t < n_steps; ++t) {
    int64_t ws = 0;
    for (int64_t i = offsets[t]; i < offsets[t + 1]; ++i) {
      int32_t c = chunks[i];
      if (c < 0 || c >= n_chunks) throw std::invalid_argument("chunk id out of range in trace");
      if (seen[c] != t) {
        seen[c] = t;
        ++ws;
      }
    }
    if (ws > max_ws) max_ws = ws;
  }
  if (blocks < max_ws) {
    throw std::invalid_argument("cache has " + std::to_string(blocks) + " blocks but one step needs " +
                                std::to_string(max_ws) + " chunks at once");
  }
  if (belady) {
    std::vector<int64_t> last(n_chunks, n_steps);
    std::fill(seen.begin(), seen.end(), -1);
    for (int64_t t = n_steps - 1; t >= 0; --t) {
      for (int64_t i = offsets[t]; i < offsets[t + 1]; ++i) {
        int32_t c = chunks[i];
        if (seen[c] == t) continue;
        seen[c] = t;
        next_occ[i] = last[c];
      }
      for (int64_t i = offsets[t]; i < offsets[t + 1]; ++i) last[chunks[i]] = t;
    }
  }

  std::vector<char> resident(n_chunks, 0);
  std::vector<int64_t> key(n_chunks, 0);
  std::priority_queue<Entry> maxq;                                     // Belady
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> minq;  // LRU
  std::fill(seen.begin(), seen.end(), -1);
  std::vector<int64_t> stamp(n_chunks, -1);
  int64_t used = 0;
  Result r;
  for (int64_t t = 0; t < n_steps; ++t) {
    const int64_t b = offsets[t], e = offsets[t + 1];
    // Pass 1: hits are protected for this step.
    for (int64_t i = b; i < e; ++i) {
      int32_t c = chunks[i];
      if (stamp[c] == t) continue;
      if (resident[c]) {
        stamp[c] = t;
        if (!belady) {
          key[c] = t;
          minq.emplace(t, c);
        }
      }
    }
    // Pass 2: misses gather, evicting when the cache is full.
    for (int64_t i = b; i < e; ++i) {
      int32_t c = chunks[i];
      if (stamp[c] == t) continue;
      stamp[c] = t;
      if (used == blocks) {
        while (true) {
          if (belady ? maxq.empty() : minq.empty()) throw std::logic_error("cache simulator: no block to evict");
          Entry top;
          if (belady) {
            top = maxq.top();
            maxq.pop();
          } else {
            top = minq.top();
            minq.pop();
          }
          int64_t v = top.second;
          if (resident[v] && key[v] == top.first && stamp[v] != t) {
            resident[v] = 0;
            --used;
            ++r.evictions;
            break;
          }
        }
      }
      resident[c] = 1;
      ++used;
      ++r.gathers;
      if (per_chunk) ++per_chunk[c];
      key[c] = t;
      if (!belady) minq.emplace(t, c);
    }
    // Pass 3 (Belady): re-key this step's chunks by their next use.
    if (belady) {
      for (int64_t i = b; i < e; ++i) {
        int32_t c = chunks[i];
        if (seen[c] == t) continue;
        seen[c] = t;
        key[c] = next_occ[i];
        maxq.emplace(key[c], c);
      }
    }
  }
  return r;
}

py::tuple simulate_cache(py::array_t<int64_t, py::array::c_style | py::array::forcecast> offsets,
                         py::array_t<int32_t, py::array::c_style | py::array::forcecast> chunks,
                         int64_t n_chunks, int64_t blocks, const std::string& policy,
                         py::object per_chunk_out) {
  if (policy != "belady" && policy != "lru") throw std::invalid_argument("policy must be 'belady' or 'lru'");
  if (offsets.ndim() != 1 || offsets.shape(0) < 1) throw std::invalid_argument("offsets must be 1-D, length n_steps + 1");
  const int64_t n_steps = offsets.shape(0) - 1;
  const int64_t* off = offsets.data();
  if (off[0] != 0 || off[n_steps] != chunks.shape(0)) throw std::invalid_argument("offsets must run from 0 to len(chunks)");
  for (int64_t t = 0; t < n_steps; ++t)
    if (off[t + 1] < off[t]) throw std::invalid_argument("offsets must be non-decreasing");
  int64_t* pc = nullptr;
  if (!per_chunk_out.is_none()) {
    py::array arr = per_chunk_out.cast<py::array>();
    if (!arr.dtype().is(py::dtype::of<int64_t>()) || arr.ndim() != 1 || arr.shape(0) != n_chunks ||
        !(arr.flags() & py::array::c_style) || !arr.writeable())
      throw std::invalid_argument("per_chunk_out must be a writable, contiguous int64[n_chunks] array");
    pc = static_cast<int64_t*>(arr.mutable_data());
  }
  Result r;
  {
    py::gil_scoped_release release;
    r = simulate(off, n_steps, chunks.data(), n_chunks, blocks, policy == "belady", pc);
  }
  return py::make_tuple(r.gathers, r.evictions);
}

}  // namespace

void register_cache_sim(py::module_& m) {
  m.def("simulate_cache", &simulate_cache, py::arg("offsets"), py::arg("chunks"), py::arg("n_chunks"),
        py::arg("blocks"), py::arg("policy") = "belady", py::arg("per_chunk_out") = py::none(),
        "Count (gathers, evictions) of a chunk-access trace through a cache of `blocks` blocks, under "
        "'belady' or 'lru'; optionally add per-chunk gather counts into per_chunk_out (int64[n_chunks]).");
}

}  // namespace elixir
