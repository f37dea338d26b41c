// CSA2 indexer on CPU (kernels_pallas/indexer_topk_ref.py): bf16 scores against gathered or
// in-place pool keys, candidate blocks and top-k positions (ties to the lowest position).
#include <algorithm>
#include <numeric>
#include <vector>

#include "common.h"

namespace deepinfer {

// score[t, n] = bf16(sum_i bf16(relu(bf16(q[t,i] . k[n])) * w[t,i])); -inf for n >= n_visible[t].
// key(t, n, out) writes the bf16-valued f32 key of token t's position n.
template <typename KeyFn>
static void Scores(const uint16_t* q, const float* w, const int32_t* n_vis, int64_t T, int64_t I, int64_t N,
                   int64_t J, KeyFn key, uint16_t* out) {
  std::vector<float> qf(I * J), kf(J);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t x = 0; x < I * J; ++x) qf[x] = bf16_to_f32(q[t * I * J + x]);
    for (int64_t n = 0; n < N; ++n) {
      if (n >= n_vis[t]) { out[t * N + n] = f32_to_bf16(-INFINITY); continue; }
      key(t, n, kf.data());
      float sum = 0.0f;
      for (int64_t i = 0; i < I; ++i) {
        const float s = std::fmax(round_bf16(dot_f32(&qf[i * J], kf.data(), J)), 0.0f);
        sum += round_bf16(s * w[t * I + i]);
      }
      out[t * N + n] = f32_to_bf16(sum);
    }
  }
}

static ffi::Error ScoresImpl(ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> n_vis, ffi::ResultBuffer<ffi::BF16> out) {
  if (q.dimensions().size() != 3 || k.dimensions().size() != 3) return bad("indexer_scores", "expected q [T, I, J], k [T, N, J]");
  const int64_t T = q.dimensions()[0], I = q.dimensions()[1], J = q.dimensions()[2], N = k.dimensions()[1];
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.typed_data());
  auto key = [&](int64_t t, int64_t n, float* kf) {
    for (int64_t j = 0; j < J; ++j) kf[j] = bf16_to_f32(kp[(t * N + n) * J + j]);
  };
  Scores(reinterpret_cast<const uint16_t*>(q.typed_data()), w.typed_data(), n_vis.typed_data(), T, I, N, J, key,
         reinterpret_cast<uint16_t*>(out->typed_data()));
  return ffi::Error::Success();
}

// Keys pool[entry[token_row[t], n]] read in place; with has_scale the pool holds e5m2 codes and
// the key is bf16(code * scale[p]) (quant.unpack_index_keys). Indices are clamped as jnp's are.
static ffi::Error ScoresPoolImpl(ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> entry,
                                 ffi::Buffer<ffi::S32> token_row, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> n_vis,
                                 ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::BF16> out, int64_t has_scale) {
  const std::string op = "indexer_scores_pool";
  if (q.dimensions().size() != 3 || pool.dimensions().size() != 2 || entry.dimensions().size() != 2)
    return bad(op, "expected q [T, I, J], pool [P, J], entry [R, N]");
  const bool codes = pool.element_type() == ffi::DataType::F8E5M2;
  if (!codes && pool.element_type() != ffi::DataType::BF16) return bad(op, "pool must be bf16 or float8_e5m2 codes");
  const int64_t T = q.dimensions()[0], I = q.dimensions()[1], J = q.dimensions()[2];
  const int64_t P = pool.dimensions()[0], R = entry.dimensions()[0], N = entry.dimensions()[1];
  const int32_t* ent = entry.typed_data();
  const int32_t* row = token_row.typed_data();
  const float* sc = scale.typed_data();
  const uint8_t* p8 = static_cast<const uint8_t*>(pool.untyped_data());
  const uint16_t* p16 = static_cast<const uint16_t*>(pool.untyped_data());
  auto key = [&](int64_t t, int64_t n, float* kf) {
    int64_t r = row[t];
    if (r < 0) r += R;
    r = std::clamp<int64_t>(r, 0, R - 1);
    const int64_t p = std::clamp<int64_t>(ent[r * N + n], 0, P - 1);
    if (codes) {
      const float s = has_scale ? sc[p] : 1.0f;
      for (int64_t j = 0; j < J; ++j) kf[j] = round_bf16(e5m2_to_f32(p8[p * J + j]) * s);
    } else if (has_scale) {
      for (int64_t j = 0; j < J; ++j) kf[j] = round_bf16(bf16_to_f32(p16[p * J + j]) * sc[p]);
    } else {
      for (int64_t j = 0; j < J; ++j) kf[j] = bf16_to_f32(p16[p * J + j]);
    }
  };
  Scores(reinterpret_cast<const uint16_t*>(q.typed_data()), w.typed_data(), n_vis.typed_data(), T, I, N, J, key,
         reinterpret_cast<uint16_t*>(out->typed_data()));
  return ffi::Error::Success();
}

// lax.top_k's order: larger first, NaN above everything, ties to the lower index.
static bool Before(const float* v, int32_t a, int32_t b) {
  const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
  if (na != nb) return na;
  if (!na && v[a] != v[b]) return v[a] > v[b];
  return a < b;
}

// The first k indices of v[0:n] in top_k order, into ids (k <= n).
static void TopK(const float* v, int64_t n, int64_t k, std::vector<int32_t>& ids) {
  ids.resize(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [v](int32_t a, int32_t b) { return Before(v, a, b); });
  ids.resize(k);
}

static ffi::Error CandidateBlocksImpl(ffi::Buffer<ffi::F32> score, ffi::Buffer<ffi::S32> n_vis,
                                      ffi::ResultBuffer<ffi::PRED> out, int64_t topk_blocks, int64_t block) {
  if (score.dimensions().size() != 2 || block <= 0) return bad("candidate_blocks", "expected score [T, N] and block > 0");
  const int64_t T = score.dimensions()[0], N = score.dimensions()[1], nb = (N + block - 1) / block;
  const int64_t k = std::min(topk_blocks, nb);
  std::vector<float> bs(nb);
  std::vector<int32_t> ids;
  std::vector<char> keep(nb);
  bool* o = out->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const float* s = score.typed_data() + t * N;
    for (int64_t b = 0; b < nb; ++b) {
      float m = -INFINITY;
      for (int64_t n = b * block; n < std::min(N, (b + 1) * block); ++n) m = std::isnan(s[n]) || std::isnan(m) ? NAN : std::fmax(m, s[n]);
      bs[b] = m;
    }
    const int64_t nv = n_vis.typed_data()[t];
    const int64_t last = nv - 1 >= 0 ? (nv - 1) / block : -1;  // floor division as jnp's
    if (last >= 0 && last < nb) bs[last] = INFINITY;
    std::fill(keep.begin(), keep.end(), 0);
    TopK(bs.data(), nb, k, ids);
    for (int32_t b : ids) keep[b] = bs[b] > -INFINITY;
    for (int64_t n = 0; n < N; ++n) o[t * N + n] = keep[n / block];
  }
  return ffi::Error::Success();
}

static ffi::Error TopkPositionsImpl(ffi::Buffer<ffi::F32> score, ffi::ResultBuffer<ffi::S32> out, int64_t k) {
  if (score.dimensions().size() != 2) return bad("topk_positions", "expected score [T, N]");
  const int64_t T = score.dimensions()[0], N = score.dimensions()[1];
  std::vector<int32_t> ids;
  int32_t* o = out->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    const float* s = score.typed_data() + t * N;
    TopK(s, N, std::min(k, N), ids);
    std::vector<int32_t> kept;
    for (int32_t i : ids)
      if (s[i] > -INFINITY) kept.push_back(i);
    std::sort(kept.begin(), kept.end());
    for (int64_t j = 0; j < k; ++j) o[t * k + j] = j < static_cast<int64_t>(kept.size()) ? kept[j] : -1;
  }
  return ffi::Error::Success();
}

}  // namespace deepinfer

namespace xf = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferIndexerScoresCpu, deepinfer::ScoresImpl,
                              xf::Ffi::Bind()
                                  .Arg<xf::Buffer<xf::BF16>>()
                                  .Arg<xf::Buffer<xf::BF16>>()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Ret<xf::Buffer<xf::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferIndexerScoresPoolCpu, deepinfer::ScoresPoolImpl,
                              xf::Ffi::Bind()
                                  .Arg<xf::Buffer<xf::BF16>>()
                                  .Arg<xf::AnyBuffer>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Ret<xf::Buffer<xf::BF16>>()
                                  .Attr<int64_t>("has_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferCandidateBlocksCpu, deepinfer::CandidateBlocksImpl,
                              xf::Ffi::Bind()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Arg<xf::Buffer<xf::S32>>()
                                  .Ret<xf::Buffer<xf::PRED>>()
                                  .Attr<int64_t>("topk_blocks")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferTopkPositionsCpu, deepinfer::TopkPositionsImpl,
                              xf::Ffi::Bind()
                                  .Arg<xf::Buffer<xf::F32>>()
                                  .Ret<xf::Buffer<xf::S32>>()
                                  .Attr<int64_t>("k"));
