// The CPython module `_cpu_targets`: targets() -> {name: PyCapsule of an XLA FFI handler},
// registered by kernels_ascend/library.py with jax.ffi.register_ffi_target(platform="cpu").
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* DeepinferSparseAttentionCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferIndexerScoresCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferIndexerScoresPoolCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferCandidateBlocksCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferTopkPositionsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferMoeExpertsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* DeepinferSinkhornCpu(XLA_FFI_CallFrame*);
}

namespace {

struct Target {
  const char* name;
  void* fn;
};

const Target kTargets[] = {
    {"deepinfer_sparse_attention", reinterpret_cast<void*>(DeepinferSparseAttentionCpu)},
    {"deepinfer_indexer_scores", reinterpret_cast<void*>(DeepinferIndexerScoresCpu)},
    {"deepinfer_indexer_scores_pool", reinterpret_cast<void*>(DeepinferIndexerScoresPoolCpu)},
    {"deepinfer_candidate_blocks", reinterpret_cast<void*>(DeepinferCandidateBlocksCpu)},
    {"deepinfer_topk_positions", reinterpret_cast<void*>(DeepinferTopkPositionsCpu)},
    {"deepinfer_moe_experts", reinterpret_cast<void*>(DeepinferMoeExpertsCpu)},
    {"deepinfer_sinkhorn_iterate", reinterpret_cast<void*>(DeepinferSinkhornCpu)},
};

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (!d) return nullptr;
  for (const Target& t : kTargets) {
    PyObject* cap = PyCapsule_New(t.fn, nullptr, nullptr);  // unnamed, as jax.ffi expects
    if (!cap || PyDict_SetItemString(d, t.name, cap) < 0) {
      Py_XDECREF(cap);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(cap);
  }
  return d;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "FFI target name -> PyCapsule of its CPU handler."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu_targets", "deepinfer CPU FFI targets", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_targets() { return PyModule_Create(&kModule); }
