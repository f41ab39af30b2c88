// The host side of a forward pass in one call: `batch_plan.py`'s checks of a `Forward`, its pass
// layout (`plan_arrays`) and an attention family's keys (`family_arrays`), in C++ over the
// request's numpy arrays. They give the same arrays, the same dtypes and the same rejections, in
// the same order, as the numpy code beside them in batch_plan.py (which runs where the kernels are
// not built, and for the tests, which compare the two). The numpy code makes ~60 small array
// operations a decode step, ~250 us on a 2-core Zen 5 with the caches cold from the model's
// graph; this is one call.
//
// A Python module (the build's one PYBIND11_MODULE), not a torch op: the arrays decoded from a
// bridge frame are read-only, and torch.from_numpy takes those only with a warning (an error
// under the tests' warning filter); pybind11 reads them in place.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using U32 = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Bool = py::array_t<bool, py::array::c_style | py::array::forcecast>;

// A CSR indptr over `segments` segments of `data` entries: starts at 0, never decreases, ends at
// `data`. Anything else is left to the numpy code (the bridge's checks refuse it before here).
bool sound_indptr(const U32& indptr, int64_t segments, int64_t data) {
  if (indptr.ndim() != 1 || indptr.size() != segments + 1) return false;
  const uint32_t* p = indptr.data();
  if (p[0] != 0 || p[segments] != data) return false;
  for (int64_t i = 0; i < segments; ++i) {
    if (p[i + 1] < p[i]) return false;
  }
  return true;
}

uint32_t max_of(const U32& a) {
  const uint32_t* p = a.data();
  return a.size() ? *std::max_element(p, p + a.size()) : 0;
}

py::tuple reject(const std::string& message, const char* field) { return py::make_tuple(message, field); }

// `batch_plan._check` and the arrays `build_plan` makes from a Forward's arrays: None where they
// do not fit together (left to the numpy code), a (message, field) pair for a rejected request
// (the first failing check in `_check`'s order), or the tuple (num_tokens, kv_len, token_request,
// q_slot, slots, q_valid, q_index, page_table, out_tokens, q_start, tokens, positions).
py::object plan_arrays(const U32& token_indptr, const U32& tokens, const U32& positions, const U32& page_indptr,
                       const U32& pages, const U32& last_page_len, const U32& out_indptr, const U32& out_rows,
                       const U32& probe_k, int64_t page_size, int64_t num_pages_total, int64_t vocab_size,
                       int64_t max_context, int64_t max_probe_k) {
  const int64_t R = token_indptr.size() - 1, T = tokens.size(), P = pages.size(), O = out_rows.size();
  if (R < 0 || positions.size() != T || last_page_len.size() != R || !sound_indptr(token_indptr, R, T) ||
      !sound_indptr(page_indptr, R, P) || !sound_indptr(out_indptr, R, O) || page_size <= 0) {
    return py::none();
  }
  const uint32_t *tp = token_indptr.data(), *pp = page_indptr.data(), *op = out_indptr.data();
  const uint32_t* last = last_page_len.data();
  const std::string ps = std::to_string(page_size);
  if (T && max_of(tokens) >= vocab_size) return reject("token id >= vocab size " + std::to_string(vocab_size), "tokens");
  if (T && max_of(positions) >= max_context)
    return reject("position >= max_context " + std::to_string(max_context), "positions");
  if (P && max_of(pages) >= num_pages_total)
    return reject("page id >= num_pages " + std::to_string(num_pages_total), "pages");
  for (int64_t r = 0; r < R; ++r) {
    if (tp[r + 1] > tp[r] && pp[r + 1] == pp[r]) return reject("a request with tokens has no pages", "page_indptr");
  }
  for (int64_t r = 0; r < R; ++r) {
    if (pp[r + 1] > pp[r] && (last[r] < 1 || last[r] > page_size))
      return reject("last_page_len must be in 1.." + ps, "last_page_len");
  }
  I64 num_tokens(R), kv_len(R), q_start(R);
  int64_t *nt = num_tokens.mutable_data(), *kv = kv_len.mutable_data(), *qs = q_start.mutable_data();
  int64_t tq = 1, max_pages = 1;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t np = pp[r + 1] - pp[r];
    nt[r] = tp[r + 1] - tp[r];
    qs[r] = tp[r];
    kv[r] = np > 0 ? (np - 1) * page_size + last[r] : 0;
    tq = std::max(tq, nt[r]);
    max_pages = std::max(max_pages, np);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (kv[r] < nt[r]) return reject("a request has more new tokens than kv slots", "last_page_len");
  }
  for (int64_t r = 0; r < R; ++r) {
    if (kv[r] > max_context) return reject("kv_len exceeds max_context " + std::to_string(max_context), "page_indptr");
  }
  const uint32_t* rows = out_rows.data();
  for (int64_t r = 0; r < R; ++r) {
    for (uint32_t o = op[r]; o < op[r + 1]; ++o) {
      if (rows[o] >= nt[r]) return reject("an output row is past its request's tokens", "out_rows");
    }
  }
  if (probe_k.size() && max_of(probe_k) > max_probe_k)
    return reject("probe_k exceeds " + std::to_string(max_probe_k), "probe_k");

  I64 token_request(T), q_slot(T), slots(T), out_tokens(O), tokens64(T), positions64(T);
  Bool q_valid({R, tq});
  I64 q_index({R, tq});
  I32 page_table({R, max_pages});
  int64_t *treq = token_request.mutable_data(), *qsl = q_slot.mutable_data(), *sl = slots.mutable_data();
  int64_t *qi = q_index.mutable_data(), *ot = out_tokens.mutable_data();
  bool* qv = q_valid.mutable_data();
  int32_t* pt = page_table.mutable_data();
  const uint32_t *pg = pages.data(), *tok = tokens.data(), *pos = positions.data();
  for (int64_t r = 0; r < R; ++r) {
    // A request's new tokens take the last num_tokens of its kv_len slots, in order.
    for (int64_t j = 0; j < nt[r]; ++j) {
      const int64_t t = tp[r] + j, s = kv[r] - nt[r] + j;
      treq[t] = r;
      qsl[t] = s;
      sl[t] = static_cast<int64_t>(pg[pp[r] + s / page_size]) * page_size + s % page_size;
    }
    for (int64_t j = 0; j < tq; ++j) {
      qv[r * tq + j] = j < nt[r];
      qi[r * tq + j] = j < nt[r] ? tp[r] + j : 0;
    }
    const int64_t np = pp[r + 1] - pp[r];
    for (int64_t c = 0; c < max_pages; ++c) pt[r * max_pages + c] = c < np ? static_cast<int32_t>(pg[pp[r] + c]) : 0;
    for (uint32_t o = op[r]; o < op[r + 1]; ++o) ot[o] = tp[r] + rows[o];
  }
  int64_t *t64 = tokens64.mutable_data(), *p64 = positions64.mutable_data();
  for (int64_t t = 0; t < T; ++t) {
    t64[t] = tok[t];
    p64[t] = pos[t];
  }
  return py::make_tuple(num_tokens, kv_len, token_request, q_slot, slots, q_valid, q_index, page_table, out_tokens,
                        q_start, tokens64, positions64);
}

// `batch_plan.family_keys`'s arrays for a family with `window` (0: full attention), without a
// user mask: (index, slot, allowed, empty, safe) over `plan_arrays`' outputs.
py::tuple family_arrays(const I64& kv_len, const I64& num_q, const I32& page_table, const I64& q_slot,
                        const I64& q_index, const Bool& q_valid, int64_t window, int64_t num_sinks,
                        int64_t page_size) {
  const int64_t R = kv_len.size(), tq = q_index.ndim() == 2 ? q_index.shape(1) : 1;
  const int64_t max_pages = page_table.ndim() == 2 ? page_table.shape(1) : 1;
  TORCH_CHECK(num_q.size() == R && q_index.size() == R * tq && q_valid.size() == R * tq &&
                  page_table.size() == R * max_pages && page_size > 0,
              "family_arrays: the plan's arrays do not fit together");
  const int64_t *kv = kv_len.data(), *nq = num_q.data(), *qsl = q_slot.data(), *qi = q_index.data();
  const bool* qv = q_valid.data();
  for (int64_t i = 0; i < R * tq; ++i) {
    TORCH_CHECK(!qv[i] || (qi[i] >= 0 && qi[i] < q_slot.size()), "family_arrays: a query past the pass's tokens");
  }
  const int32_t* pt = page_table.data();
  // Request r reads its first sinks[r] slots, then slots start[r] .. kv[r] - 1.
  std::vector<int64_t> start(R), sinks(R), count(R);
  int64_t width = 1;
  for (int64_t r = 0; r < R; ++r) {
    start[r] = window ? std::max<int64_t>(kv[r] - nq[r] - window + 1, 0) : 0;
    sinks[r] = std::min(num_sinks, start[r]);
    count[r] = sinks[r] + kv[r] - start[r];
    width = std::max(width, count[r]);
  }
  I64 index({R, width}), slot({R, width});
  Bool allowed({R, tq, width}), empty({R, tq}), safe({R, tq, width});
  int64_t *ix = index.mutable_data(), *sl = slot.mutable_data();
  bool *al = allowed.mutable_data(), *em = empty.mutable_data(), *sf = safe.mutable_data();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      int64_t s = c < sinks[r] ? c : start[r] + c - sinks[r];
      if (c >= count[r]) s = -1;
      const int64_t at = std::max<int64_t>(s, 0);
      TORCH_CHECK(at / page_size < max_pages, "family_arrays: a key slot past the request's pages");
      sl[r * width + c] = s;
      ix[r * width + c] = s >= 0 ? static_cast<int64_t>(pt[r * max_pages + at / page_size]) * page_size + at % page_size : 0;
    }
    for (int64_t j = 0; j < tq; ++j) {
      const int64_t q = qv[r * tq + j] ? qsl[qi[r * tq + j]] : -1;
      bool any = false;
      bool* row = al + (r * tq + j) * width;
      for (int64_t c = 0; c < width; ++c) {
        const int64_t k = sl[r * width + c];
        bool ok = k >= 0 && k <= q;
        if (window) ok = ok && (k > q - window || k < num_sinks);
        row[c] = ok;
        any = any || ok;
      }
      em[r * tq + j] = !any;
      bool* out = sf + (r * tq + j) * width;
      for (int64_t c = 0; c < width; ++c) out[c] = row[c] || !any;
    }
  }
  return py::make_tuple(index, slot, allowed, empty, safe);
}

}  // namespace

namespace wafer {
void register_decode_step(py::module_& m);  // decode_step.cpp
}  // namespace wafer

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "wafer's pass planning in C++ (batch_plan.py)";
  m.def("plan_arrays", &plan_arrays);
  m.def("family_arrays", &family_arrays);
  wafer::register_decode_step(m);
}
