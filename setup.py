"""Builds shmbuffer's optional C extension (``shmbuffer/native/*.c``); the metadata is in
pyproject.toml. Without a working compiler the build of the extension is skipped (``optional``)
and the package runs on its pure-Python path (``shmbuffer.native``)."""

from setuptools import Extension, setup

NATIVE = "shmbuffer/native/"

setup(
    ext_modules=[
        Extension(
            "shmbuffer.native._native",
            sources=[NATIVE + f for f in ("module.c", "common.c", "tree.c", "priorities.c", "gather.c", "sample.c", "copies.c",
                                          "plan.c", "push.c", "method.c", "pool.c", "refresh.c", "learner.c")],
            depends=[NATIVE + "layout.h", NATIVE + "native.h"],
            extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
