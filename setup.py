# setup.py: builds the one C extension, accelerate_c._C, from csrc/**/*.c.
# Not for: anything torch-related. The build needs only a C11 compiler and the CPython headers;
# torch is found at run time (DLPack), so the same build works with any torch >= 2.4.
#
# abi3 decision: we build against the limited API of CPython 3.10 (Py_LIMITED_API=0x030a0000), so one
# .so serves 3.10 .. 3.13 (the CPU box runs 3.11, the GPU box 3.12). The hot loops work on raw buffers,
# so the limited API costs nothing measurable. Free-threaded (3.13t) builds would need a separate,
# non-abi3 build; not done yet.  Set ACCELERATE_C_DEBUG=1 for -O0 -g, ACCELERATE_C_SANITIZE=1 for ASan/UBSan
# (read through accelerate_c/base/settings.py, loaded by path: the package itself is not importable yet).
import glob
import importlib.util
import os
import sys

from setuptools import Extension, setup

LIMITED_API = 0x030A0000


def _settings():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_c", "base", "settings.py")
    spec = importlib.util.spec_from_file_location("_accelerate_c_build_settings", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the table is built
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


settings = _settings()

sources = sorted(glob.glob("csrc/*.c") + glob.glob("csrc/*/*.c"))
extra_compile_args = ["-std=c11", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
                      "-Wno-missing-field-initializers", "-fno-strict-aliasing", "-pthread"]
extra_link_args = ["-pthread"]
if settings.get("DEBUG"):
    extra_compile_args += ["-O0", "-g", "-UNDEBUG"]
else:
    extra_compile_args += ["-O3"]
if settings.get("SANITIZE"):
    extra_compile_args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    extra_link_args += ["-fsanitize=address,undefined"]

ext = Extension(
    "accelerate_c._C",
    sources=sources,
    include_dirs=["csrc"],
    # headers and per-ISA bodies: editing only them must rebuild the extension
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.inc", recursive=True)),
    define_macros=[("Py_LIMITED_API", hex(LIMITED_API)), ("_GNU_SOURCE", "1")],
    extra_compile_args=extra_compile_args,
    extra_link_args=extra_link_args,
    libraries=["dl", "rt", "m"],
    py_limited_api=True,
)

setup(ext_modules=[ext], options={"bdist_wheel": {"py_limited_api": "cp310"}})
