// Sparse MQA attention with sink (kernels_pallas/sparse_attention_ref.py) on CPU.
// Operands: q [T, H, A], sink [H] f32, then n_pools pools [N_i, A] followed by their
// indices [T, M_i] int32 (-1 = unused). Entries are taken in pool order, blocks of 64 over
// the concatenated M; bf16 probabilities relative to the running (exact) or final max.
#include <vector>

#include "common.h"

namespace deepinfer {

static constexpr int64_t kBlock = 64;

static ffi::Error SparseAttentionImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> sink, ffi::RemainingArgs rest,
                                      ffi::Result<ffi::Buffer<ffi::BF16>> out, int64_t n_pools, float scale,
                                      int64_t exact) {
  const std::string op = "sparse_attention";
  if (q.dimensions().size() != 3 || !is_bf16_or_f32(q)) return bad(op, "expected q [T, H, A] bf16 or f32");
  const int64_t T = q.dimensions()[0], H = q.dimensions()[1], A = q.dimensions()[2];
  if (static_cast<int64_t>(rest.size()) != 2 * n_pools) return bad(op, "expected n_pools pools then n_pools index arrays");
  std::vector<ffi::AnyBuffer> pools;
  std::vector<const int32_t*> idx;
  std::vector<int64_t> width, rows;
  for (int64_t i = 0; i < n_pools; ++i) {
    auto p = rest.get<ffi::AnyBuffer>(i);
    auto x = rest.get<ffi::AnyBuffer>(n_pools + i);
    if (p.has_error() || x.has_error()) return bad(op, "bad operand");
    if (p->dimensions().size() != 2 || p->dimensions()[1] != A || !is_bf16_or_f32(*p))
      return bad(op, "expected each pool [N, A] bf16 or f32");
    if (x->element_type() != ffi::DataType::S32 || x->dimensions().size() != 2 || x->dimensions()[0] != T)
      return bad(op, "expected each index array [T, M] int32");
    pools.push_back(*p);
    rows.push_back(p->dimensions()[0]);
    idx.push_back(static_cast<const int32_t*>(x->untyped_data()));
    width.push_back(x->dimensions()[1]);
  }
  int64_t M = 0;
  for (int64_t w : width) M += w;
  const int64_t nb = (M + kBlock - 1) / kBlock;
  std::vector<float> kv(M * A), qh(A), s(M), m_entry(M), acc(A);
  std::vector<char> valid(M);
  const float* sink_h = sink.typed_data();
  uint16_t* o = out->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    // Gather this token's entries (invalid ones as zeros, as the reference masks them).
    int64_t m = 0;
    for (int64_t i = 0; i < n_pools; ++i)
      for (int64_t j = 0; j < width[i]; ++j, ++m) {
        const int32_t e = idx[i][t * width[i] + j];
        valid[m] = e >= 0;
        if (e >= 0) load_f32(pools[i], std::min<int64_t>(e, rows[i] - 1) * A, A, &kv[m * A]);
        else std::fill(&kv[m * A], &kv[m * A] + A, 0.0f);
      }
    for (int64_t h = 0; h < H; ++h) {
      load_f32(q, (t * H + h) * A, A, qh.data());
      for (m = 0; m < M; ++m) s[m] = valid[m] ? dot_f32(qh.data(), &kv[m * A], A) * scale : -INFINITY;
      // Running max per block of 64 (exact) or the final max for all entries.
      float run = -INFINITY;
      for (int64_t b = 0; b < nb; ++b) {
        for (m = b * kBlock; m < std::min(M, (b + 1) * kBlock); ++m) run = std::fmax(run, s[m]);
        const float mb = std::fmax(run, -1e30f);
        for (m = b * kBlock; m < std::min(M, (b + 1) * kBlock); ++m) m_entry[m] = mb;
      }
      const float m_final = std::fmax(run, -1e30f);
      if (!exact) std::fill(m_entry.begin(), m_entry.end(), m_final);
      float denom = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (m = 0; m < M; ++m) {
        const float p = std::exp(s[m] - m_entry[m]);
        const float r = std::exp(m_entry[m] - m_final);
        denom += p * r;
        const float pb = round_bf16(p) * r;
        if (pb != 0.0f)
          for (int64_t a = 0; a < A; ++a) acc[a] += pb * kv[m * A + a];
      }
      denom += std::exp(sink_h[h] - m_final);
      for (int64_t a = 0; a < A; ++a) o[(t * H + h) * A + a] = f32_to_bf16(acc[a] / denom);
    }
  }
  return ffi::Error::Success();
}

}  // namespace deepinfer

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferSparseAttentionCpu, deepinfer::SparseAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()
                                  .Attr<int64_t>("n_pools")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("exact"));
