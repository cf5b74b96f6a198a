"""Build zeroinfer._C with CMake + ninja from setuptools.

Environment switches (all optional):
  ZEROINFER_CUDA        AUTO (default: CUDA kernels iff nvcc is found) | ON (missing nvcc is an error) | OFF
  ZEROINFER_CUDA_ARCHS  CMAKE_CUDA_ARCHITECTURES, default "90a" (Hopper; wgmma/setmaxnreg need the "a")
  ZEROINFER_NATIVE      ON (default: -march=native for the CPU kernels) | OFF (portable binary)
  ZEROINFER_BUILD_TYPE  Release (default) | RelWithDebInfo | Debug
  CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (2 on the CI box: CUDA TUs take up to ~4 GB each)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        cfg = os.environ.get("ZEROINFER_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DZEROINFER_OUTPUT_DIR={out_dir}",
            f"-DZEROINFER_CUDA={os.environ.get('ZEROINFER_CUDA', 'AUTO')}",
            f"-DZEROINFER_CUDA_ARCHS={os.environ.get('ZEROINFER_CUDA_ARCHS', '90a')}",
            f"-DZEROINFER_NATIVE={os.environ.get('ZEROINFER_NATIVE', 'ON')}",
        ]
        # pip builds in a fresh isolated environment each time, with its own ninja; the build
        # folder's CMakeCache would keep the first one's path (gone after that install), and a
        # second `pip install` would fail to configure. So name this build's ninja every time.
        ninja = shutil.which("ninja")
        if ninja:
            args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", *args],
                       check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(max(1, os.cpu_count() or 1)))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)


setup(ext_modules=[CMakeExtension("zeroinfer._C")], cmdclass={"build_ext": CMakeBuild})
