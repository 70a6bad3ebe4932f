"""Builds the optional compiled module, `kvferry.executors._native`, where a C compiler works.

Everything else is in pyproject.toml. The module only makes the GPU executors' per-job host work
cheaper (docs/executors.md, "The compiled module"); kvferry imports, and every executor runs,
without it. So the build is tried first: where no C compiler works, or where `KVFERRY_NO_NATIVE=1`,
there is no extension and the wheel is pure Python (`py3-none-any`).
"""

from __future__ import annotations

import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Extension(
    "kvferry.executors._native",
    sources=["executors/_native.c"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
    optional=True,  # a build that fails after the probe still installs, without it
)


def compiler_works() -> bool:
    """Return True where a C compiler builds and links a Python extension here."""
    from setuptools import Distribution

    command = build_ext(Distribution({"name": "probe", "ext_modules": [NATIVE]}))
    command.finalize_options()
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "probe.c")
        with open(source, "w") as out:
            out.write("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        try:
            from setuptools._distutils.ccompiler import new_compiler
            from setuptools._distutils.sysconfig import customize_compiler

            compiler = new_compiler()
            customize_compiler(compiler)
            objects = compiler.compile(
                [source], output_dir=folder, include_dirs=command.include_dirs
            )
            compiler.link_shared_object(objects, os.path.join(folder, "probe.so"))
        except Exception as error:  # any failure means: build without the module
            print(f"kvferry: no working C compiler ({error}); building without _native")
            return False
    return True


def ext_modules() -> list[Extension]:
    """Return the compiled module where it can and may be built, else nothing."""
    if os.environ.get("KVFERRY_NO_NATIVE", "") == "1":
        print("kvferry: KVFERRY_NO_NATIVE=1; building without _native")
        return []
    if sys.platform == "win32":  # the module uses POSIX threads
        return []
    return [NATIVE] if compiler_works() else []


setup(ext_modules=ext_modules())
