"""Builds the one compiled module, `kvferry.executors._native`; the rest is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvferry.executors._native",
            sources=["executors/_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
        )
    ]
)
