"""XLA FFI custom-call targets for the hot ops of ``kernels_pallas/ops.py`` (see README.md).

The same target names serve two platforms: a C++ CPU implementation of each op (``csrc/``,
built at install time as ``_cpu_targets``: the test build) and the Ascend device launches
(``ascend/``, built only where the CANN toolkit is found). ``ops.py`` routes the ops here with
``DEEPINFER_KERNELS=ffi`` / ``LLM(kernels="ffi")``. Nothing here imports the rooms above.
"""
