// Ascend device side of the custom-call targets (built only with the CANN toolkit: setup.py
// defines DEEPINFER_WITH_CANN and links ascendcl / opapi). Never compiled or run here: no CANN
// and no Ascend machine were available. The bindings repeat ../../csrc/*.cc attribute for
// attribute, so the Python wrappers serve both platforms. Each handler gets the plugin's
// stream through the FFI (PlatformStream) and has to launch its kernel there; until a kernel is
// written and checked on hardware it returns Unimplemented, so nothing claims to run.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>

#include "acl/acl.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<aclrtStream>;

namespace {

ffi::Error Todo(const char* op, const char* plan) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    std::string("deepinfer ") + op + " on Ascend: not implemented yet (" + plan +
                        "); see deepinfer_jax/kernels_ascend/README.md");
}

// Sparse MQA attention with sink: an AscendC kernel (gather of the M entries per token into
// the vector core's UB, QK^T on the cube unit, online softmax with the bf16 P rounding).
ffi::Error SparseAttention(aclrtStream, ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::RemainingArgs,
                           ffi::Result<ffi::Buffer<ffi::BF16>>, int64_t, float, int64_t) {
  return Todo("sparse_attention", "AscendC kernel to write");
}

ffi::Error IndexerScores(aclrtStream, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::BF16>) {
  return Todo("indexer_scores", "AscendC kernel: batched bf16 matmul + relu * w reduction");
}

ffi::Error IndexerScoresPool(aclrtStream, ffi::Buffer<ffi::BF16>, ffi::AnyBuffer, ffi::Buffer<ffi::S32>,
                             ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>,
                             ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::BF16>, int64_t) {
  return Todo("indexer_scores_pool", "AscendC kernel reading the paged key pool in place");
}

ffi::Error CandidateBlocks(aclrtStream, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32>,
                           ffi::ResultBuffer<ffi::PRED>, int64_t, int64_t) {
  return Todo("candidate_blocks", "block max + a top-k from CANN's operator library");
}

ffi::Error TopkPositions(aclrtStream, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::S32>, int64_t) {
  return Todo("topk_positions", "CANN top-k (ties to the lowest index to be checked) + sort");
}

ffi::Error MoeExperts(aclrtStream, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                      ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                      ffi::AnyBuffer, ffi::ResultBuffer<ffi::BF16>, int64_t, float, int64_t) {
  return Todo("moe_experts", "routing sort + CANN grouped matmul with fp8 / fp4 weights");
}

ffi::Error Sinkhorn(aclrtStream, ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>, int64_t, float) {
  return Todo("sinkhorn_iterate", "AscendC vector kernel, one C x C matrix per lane group");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferSparseAttentionAscend, SparseAttention,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs().Ret<ffi::Buffer<ffi::BF16>>().Attr<int64_t>("n_pools")
                                  .Attr<float>("scale").Attr<int64_t>("exact"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferIndexerScoresAscend, IndexerScores,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::BF16>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferIndexerScoresPoolAscend, IndexerScoresPool,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("has_scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferCandidateBlocksAscend, CandidateBlocks,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("topk_blocks").Attr<int64_t>("block"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferTopkPositionsAscend, TopkPositions,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>().Attr<int64_t>("k"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferMoeExpertsAscend, MoeExperts,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::BF16>>().Attr<int64_t>("fmt").Attr<float>("limit")
                                  .Attr<int64_t>("n_experts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferSinkhornAscend, Sinkhorn,
                              ffi::Ffi::Bind().Ctx<Stream>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("n").Attr<float>("eps"));

namespace {

PyObject* Targets(PyObject*, PyObject*) {
  const struct { const char* name; void* fn; } kTargets[] = {
      {"deepinfer_sparse_attention", reinterpret_cast<void*>(DeepinferSparseAttentionAscend)},
      {"deepinfer_indexer_scores", reinterpret_cast<void*>(DeepinferIndexerScoresAscend)},
      {"deepinfer_indexer_scores_pool", reinterpret_cast<void*>(DeepinferIndexerScoresPoolAscend)},
      {"deepinfer_candidate_blocks", reinterpret_cast<void*>(DeepinferCandidateBlocksAscend)},
      {"deepinfer_topk_positions", reinterpret_cast<void*>(DeepinferTopkPositionsAscend)},
      {"deepinfer_moe_experts", reinterpret_cast<void*>(DeepinferMoeExpertsAscend)},
      {"deepinfer_sinkhorn_iterate", reinterpret_cast<void*>(DeepinferSinkhornAscend)},
  };
  PyObject* d = PyDict_New();
  for (const auto& t : kTargets) {
    PyObject* cap = PyCapsule_New(t.fn, nullptr, nullptr);
    if (!d || !cap || PyDict_SetItemString(d, t.name, cap) < 0) {
      Py_XDECREF(cap);
      Py_XDECREF(d);
      return nullptr;
    }
    Py_DECREF(cap);
  }
  return d;
}

PyMethodDef kMethods[] = {{"targets", Targets, METH_NOARGS, "FFI target name -> PyCapsule (Ascend)."},
                          {nullptr, nullptr, 0, nullptr}};
PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_ascend_targets", "deepinfer Ascend FFI targets", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__ascend_targets() { return PyModule_Create(&kModule); }
