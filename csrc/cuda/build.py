# csrc/cuda/build.py: how accelerate_c._C_cuda is built, in one place for setup.py (which builds it only when nvcc is
# found: a plain CPU install never needs it), tests/test_cuda_ext.py (builds it in a temporary directory) and
# benchmarks/gpu_check.py (builds it on the GPU machine). The kernels (*.cu, CUDA C) are compiled by nvcc, the
# binding (csrc/bind_cuda*.c, through tensor.c's DLPack borrow) by the C compiler setuptools uses, and both are linked
# with the static CUDA runtime, so the module needs no libcudart at run time and works beside torch's.
# Flags: -O3; -fmad=false with IEEE division and square root and no flush-to-zero, so the optimizer and cast math
# gives the CPU kernels' bits (they run with fp-contract off); machine code for sm_80 (A100) and sm_90 (H100/H200)
# plus compute_90 PTX for later GPUs.
# Not for: the CPU extension _C (setup.py), or deciding at run time whether to load it (accelerate_c/optim/cuda.py).
# Loaded by path (no package around it): keep it free of imports beyond the standard library and setuptools.
from __future__ import annotations

import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.dirname(HERE)
ROOT = os.path.dirname(CSRC)
NAME = "accelerate_c._C_cuda"
C_SOURCES = ["bind_cuda.c", "bind_cuda_ops.c", "tensor.c", "bind_util.c", "acc_error.c"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false",
              "-Xcompiler", "-fPIC,-fvisibility=hidden,-fno-strict-aliasing",
              "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"]


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else in /usr/local/cuda/bin; None when there is none (the CPU-only build)."""
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def cuda_lib_dir(nvcc: str) -> str:
    """The toolkit's library folder holding libcudart_static.a (nvcc may be a wrapper script elsewhere)."""
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True).stderr  # its environment lines name the toolkit: "#$ TOP=<cuda>/bin/.."
    roots = [os.path.normpath(line.split("=", 1)[1].strip()) for line in out.splitlines() if line.startswith("#$ TOP=")]
    roots += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if os.path.exists(os.path.join(root, sub, "libcudart_static.a")):
                return os.path.join(root, sub)
    raise RuntimeError(f"no libcudart_static.a next to {nvcc} (looked under {roots}): the CUDA toolkit is incomplete")


def cu_sources() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "*.cu")))


def depends() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "*.h")) + glob.glob(os.path.join(HERE, "*.cu")))


def compile_cu(nvcc: str, out_dir: str, extra: Optional[list[str]] = None) -> list[str]:
    """Each .cu file into an object in out_dir, in parallel; returns the objects. Raises with nvcc's output."""
    os.makedirs(out_dir, exist_ok=True)

    def one(src: str) -> str:
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        cmd = [nvcc, "-c", src, "-o", obj, "-I", CSRC] + NVCC_FLAGS + list(extra or [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed on {src} ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
        return obj

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(one, cu_sources()))


def extension(limited_api: int, extra_compile_args: list[str]):
    """The setuptools Extension of _C_cuda, its C sources and link flags; the .cu objects are added by
    build_extension (below) just before the link."""
    from setuptools import Extension
    return Extension(NAME, sources=[os.path.relpath(os.path.join(CSRC, s), ROOT) for s in C_SOURCES],
                     include_dirs=[os.path.relpath(CSRC, ROOT)], depends=depends(),
                     define_macros=[("Py_LIMITED_API", hex(limited_api)), ("_GNU_SOURCE", "1")],
                     extra_compile_args=extra_compile_args, libraries=["dl", "rt", "m", "pthread"],
                     py_limited_api=True)


def build_extension(build_ext_cmd, ext, nvcc: str) -> None:
    """setuptools' build_extension for _C_cuda: nvcc first, then the usual compile and link with the objects and
    the static CUDA runtime added."""
    objects = compile_cu(nvcc, os.path.join(build_ext_cmd.build_temp, "cuda"))
    ext.extra_objects = objects
    ext.library_dirs = [cuda_lib_dir(nvcc)]
    ext.extra_link_args = list(ext.extra_link_args or []) + ["-Wl,--no-as-needed", "-lcudart_static", "-lstdc++"]
