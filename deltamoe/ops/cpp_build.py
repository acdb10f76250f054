"""Building our C++ CPU kernels (`ops/csrc/`) on first use with `torch.utils.cpp_extension`.

g++ and ninja (the `ninja` package's executable) compile a kernel once per source and flags,
cached under torch's extensions folder. The kernels' `at::parallel_for` is a header template, so
they are built with -fopenmp: without it an extension's copy runs serially whatever torch's thread
count (the soname matches torch's bundled libgomp: one OpenMP runtime in the process).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU capability names


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in VECTOR_CAPABILITIES


def load_cpp_extension(name: str, source: Path, cflags: list[str], ldflags: list[str] | None = None) -> str | None:
    """Compile and load `source` as the torch library `name`; None when it loaded, else why not."""
    try:
        import ninja  # noqa: F401  (torch's builder runs the `ninja` executable this package ships)
        from torch.utils import cpp_extension
    except ImportError as e:
        return f"cannot build: {e}"
    ninja_dir = getattr(ninja, "BIN_DIR", None)
    if ninja_dir and ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=[*cflags, "-fopenmp"],
                           extra_ldflags=[*(ldflags or []), "-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler surfaces as several exception types
        return f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None
