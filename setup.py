"""The wheel carries the native kernels built for every instruction-set level
(qworker/model/kernels/native_build.py); QWORKER_BUILD_KERNELS=0 builds a wheel without them,
which then builds them on first use where a compiler is, and reports them missing where none is."""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("QWORKER_BUILD_KERNELS", "1") == "0" or self.editable_mode:
            return  # an editable install's kernels: `make install` builds them in the tree
        source = Path(__file__).parent / "qworker" / "model" / "kernels" / "native_build.py"
        spec = importlib.util.spec_from_file_location("native_build", source)
        assert spec is not None and spec.loader is not None
        native_build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native_build)  # stdlib only: no torch at build time
        kernels = Path(self.build_lib) / "qworker" / "model" / "kernels"
        native_build.build_all(kernels / "native_lib")


setup(cmdclass={"build_py": BuildPyWithKernels})
