// Sinkhorn iterations of mHC on f32 [..., C, C] (kernels_pallas/sinkhorn_ref.py): n times,
// rows then columns divided by (sum + eps).
#include <vector>

#include "common.h"

namespace deepinfer {

static ffi::Error SinkhornImpl(ffi::Buffer<ffi::F32> comb, ffi::ResultBuffer<ffi::F32> out, int64_t n, float eps) {
  const auto dims = comb.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 1] != dims[dims.size() - 2])
    return bad("sinkhorn_iterate", "expected comb [..., C, C]");
  const int64_t c = dims[dims.size() - 1];
  const int64_t mats = c ? static_cast<int64_t>(comb.element_count()) / (c * c) : 0;
  const float* src = comb.typed_data();
  float* dst = out->typed_data();
  std::memcpy(dst, src, comb.element_count() * sizeof(float));
  std::vector<float> col(c);
  for (int64_t t = 0; t < mats; ++t) {
    float* m = dst + t * c * c;
    for (int64_t it = 0; it < n; ++it) {
      for (int64_t i = 0; i < c; ++i) {
        float s = 0.0f;
        for (int64_t j = 0; j < c; ++j) s += m[i * c + j];
        const float d = s + eps;
        for (int64_t j = 0; j < c; ++j) m[i * c + j] /= d;
      }
      for (int64_t j = 0; j < c; ++j) col[j] = 0.0f;
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < c; ++j) col[j] += m[i * c + j];
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < c; ++j) m[i * c + j] /= (col[j] + eps);
    }
  }
  return ffi::Error::Success();
}

}  // namespace deepinfer

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferSinkhornCpu, deepinfer::SinkhornImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("n")
                                  .Attr<float>("eps"));
