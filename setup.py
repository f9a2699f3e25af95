# setup.py: builds the C extension, accelerate_c._C, from csrc/**/*.c, and where nvcc is found the CUDA one,
# accelerate_c._C_cuda (csrc/cuda/*.cu and csrc/bind_cuda*.c; csrc/cuda/build.py says how).
# Not for: anything torch-related. The build needs only a C11 compiler and the CPython headers;
# torch is found at run time (DLPack), so the same build works with any torch >= 2.4.
#
# abi3 decision: we build against the limited API of CPython 3.10 (Py_LIMITED_API=0x030a0000), so one
# .so serves 3.10 .. 3.13 (the CPU box runs 3.11, the GPU box 3.12). The hot loops work on raw buffers,
# so the limited API costs nothing measurable. Free-threaded (3.13t) builds would need a separate,
# non-abi3 build; not done yet.  Set ACCELERATE_C_DEBUG=1 for -O0 -g, ACCELERATE_C_SANITIZE=1 for ASan/UBSan
# (read through accelerate_c/base/settings.py, loaded by path: the package itself is not importable yet).
# It also puts accelerate_c_as_accelerate.pth at the top of site-packages, in the wheel (build_py) and in the
# editable install (editable_wheel): the start-up hook of ACCELERATE_C_AS_ACCELERATE (accelerate_c/as_accelerate.py).
import glob
import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs to extend
    editable_wheel = None

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


def _cuda_build():
    """csrc/cuda/build.py (the CUDA extension's build, shared with the tests and benchmarks/gpu_check.py)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cuda", "build.py")
    spec = importlib.util.spec_from_file_location("_accelerate_c_cuda_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cuda_build = _cuda_build()
NVCC = cuda_build.find_nvcc() if settings.get("CUDA_BUILD") else None  # ACCELERATE_C_CUDA_BUILD=0: CPU only

# the CPU extension: every C file but the CUDA module's binding (csrc/bind_cuda*.c) and csrc/cuda/
sources = sorted(f for f in glob.glob("csrc/*.c") + glob.glob("csrc/*/*.c")
                 if not os.path.basename(f).startswith("bind_cuda") and not f.startswith(os.path.join("csrc", "cuda")))
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

# accelerate_c._C_cuda: CUDA C kernels, built only where nvcc is found (csrc/cuda/build.py); without it the package is
# complete and CUDA tensors take torch's kernels.
extensions = [ext]
if NVCC:
    extensions.append(cuda_build.extension(LIMITED_API, extra_compile_args))


def _compile_files_in_parallel(compiler, jobs: int) -> None:
    """Makes compiler.compile run `jobs` compiler processes at once (distutils runs one file after another, which
    left all but one core idle: the SIMD variants make ~60 files)."""
    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = [obj for obj in objects if obj in build]
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # a failed file raises here (CompileError)
            list(pool.map(lambda obj: compiler._compile(obj, *build[obj], cc_args, extra_postargs, pp_opts), todo))
        return objects
    compiler.compile = compile


class BuildExt(build_ext):
    """build_ext, with nvcc run for _C_cuda before its link and the C files compiled one per core."""

    def build_extension(self, ext: Extension) -> None:
        if getattr(self.compiler, "_setup_compile", None) is not None and (os.cpu_count() or 1) > 1:
            _compile_files_in_parallel(self.compiler, os.cpu_count())
        if ext.name == cuda_build.NAME:
            cuda_build.build_extension(self, ext, NVCC)
        super().build_extension(ext)


PTH = "accelerate_c_as_accelerate.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPy(build_py):
    """The package's modules plus the start-up hook at the top of build_lib (the wheel's purelib root)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        extra = [] if getattr(self, "editable_mode", False) else [os.path.join(self.build_lib, PTH)]
        return super().get_outputs(include_bytecode) + extra


class _WithPth:
    """An editable-install strategy of setuptools, plus the start-up hook written at the wheel's root."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __enter__(self) -> "_WithPth":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> object:
        return self.inner.__exit__(*exc)

    def __call__(self, wheel: object, files: list, mapping: dict) -> None:
        self.inner(wheel, files, mapping)
        with open(os.path.join(HERE, PTH), "rb") as fh:
            wheel.writestr(PTH, fh.read())


commands = {"build_py": BuildPy, "build_ext": BuildExt}
if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    class EditableWheel(editable_wheel):
        def _select_strategy(self, *args: object, **kwargs: object) -> _WithPth:
            return _WithPth(super()._select_strategy(*args, **kwargs))

    commands["editable_wheel"] = EditableWheel

setup(ext_modules=extensions, cmdclass=commands, options={"bdist_wheel": {"py_limited_api": "cp310"}})
