"""TEST-ONLY shim: an import-only stand-in for SGLang's native kernel package `sgl_kernel`.

SGLang 0.5.23's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports a CPU build of `sgl_kernel` at module level, and no
PyPI wheel ships one (the `sglang-kernel` wheels are CUDA-only). The export tests only build SGLang's draft model
classes and call their `load_weights`, which never runs a kernel. So this module registers a fake `sgl_kernel`
(and `sgl_kernel.common_ops`) whose every attribute is a function that raises NotImplementedError: imports succeed,
and any kernel that is actually called fails loudly instead of passing silently.

Never install or use this outside the tests: it provides no kernels at all.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types


def _missing_kernel(qualname: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is a test-only stub (tests/sglang_cpu_stub.py): no sgl_kernel CPU build")

    kernel.__name__ = qualname.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualname
    return kernel


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # a package, so `from sgl_kernel.x import y` resolves through sys.modules

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _missing_kernel(f"{name}.{attr}")

    module.__getattr__ = __getattr__
    return module


def install() -> None:
    """Register the stand-in modules (idempotent). Call before importing anything from sglang."""
    if "sgl_kernel" in sys.modules and getattr(sys.modules["sgl_kernel"], "_draftsmith_stub", False):
        return
    root = _stub_module("sgl_kernel")
    root._draftsmith_stub = True
    common = _stub_module("sgl_kernel.common_ops")
    root.common_ops = common
    sys.modules["sgl_kernel"] = root
    sys.modules["sgl_kernel.common_ops"] = common


def init_single_process_dist() -> None:
    """SGLang's one-process groups (its layers want them even at tp=1) on a port found free now: SGLang's helper keeps
    an inherited MASTER_PORT, which a caller's own still-open group (a test process that trained) may hold."""
    import os

    from core.server import free_port
    from sglang.test.layer_ut_utils import init_single_process_dist as sglang_init

    os.environ["MASTER_PORT"] = str(free_port())
    sglang_init()
