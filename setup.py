"""Hooks skippy's native build into the standard setuptools build.

`pip wheel .` / `pip install .` run native/build.py (cached under
~/.cache/skippy/) and ship libllama, ggml and the cffi extension inside the
package as skippyd/_native/. An editable install puts them into the source tree.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def _native_build():
    spec = importlib.util.spec_from_file_location("skippy_native_build", ROOT / "native" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithNative(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            dest = ROOT / "skippyd" / "_native"
        else:
            dest = Path(self.build_lib) / "skippyd" / "_native"
        _native_build().install_into(dest)


class BinaryDistribution(Distribution):
    """The wheel carries shared objects, so it is platform-specific."""

    def has_ext_modules(self):
        return True

    def has_data(self):
        # setuptools' editable build asks for has_data(), which Distribution lacks:
        # without this, an editable install silently skips the man pages
        return self.has_data_files()


setup(cmdclass={"build_py": BuildPyWithNative}, distclass=BinaryDistribution)
