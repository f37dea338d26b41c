"""The error ``kernels="ffi"`` raises when its targets are not built or cannot register."""


class FfiUnavailable(RuntimeError):
    """The custom-call library for a platform is not built or cannot register."""
