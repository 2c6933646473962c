"""Builds the flashckpt Python package against an installed libflashckpt.

    pip install ./client/python                               # libflashckpt found by pkg-config
    FLASHCKPT_PREFIX=/opt/flashckpt pip install ./client/python   # installed with cmake --install --prefix

The package is the pure-Python flashckpt/ plus the extension _flashckpt (bindings.cc), which uses
only the public API of libflashckpt (include/flashckpt/) and links libflashckpt.so. The library is
found through its pkg-config file, flashckpt.pc: under FLASHCKPT_PREFIX when that is set, else
wherever pkg-config looks (PKG_CONFIG_PATH, /usr, /usr/local). The extension records the library's
directory as its RPATH when that is not a system directory, so it loads without LD_LIBRARY_PATH.

Builds need setuptools and pybind11 in the interpreter (Debian: python3-setuptools,
python3-pybind11); no download happens, so it works offline.
"""

import glob
import os
import shlex
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

SYSTEM_LIB_DIRS = {"/lib", "/usr/lib", "/lib64", "/usr/lib64"}


def fail(message):
    sys.exit("flashckpt setup.py: " + message)


def pkg_config_env():
    env = dict(os.environ)
    prefix = os.environ.get("FLASHCKPT_PREFIX")
    if not prefix:
        return env
    if not os.path.isdir(prefix):
        fail(f"FLASHCKPT_PREFIX={prefix} is not a directory")
    found = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(prefix, "lib*", "**", "flashckpt.pc"),
                                                           recursive=True)})
    if not found:
        fail(f"no flashckpt.pc under {prefix}/lib*: is libflashckpt installed there (cmake --install build "
             f"--prefix {prefix})?")
    # Only the prefix's own directories: a flashckpt.pc elsewhere must not win over the one asked for.
    env["PKG_CONFIG_PATH"] = os.pathsep.join(found)
    env["PKG_CONFIG_LIBDIR"] = os.pathsep.join(found)
    return env


def pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config", *args, "flashckpt"], env=pkg_config_env(), check=True,
                             capture_output=True, text=True)
    except FileNotFoundError:
        fail("pkg-config is not installed (Debian: apt-get install pkg-config)")
    except subprocess.CalledProcessError as e:
        fail("pkg-config finds no flashckpt: install libflashckpt (the libflashckpt-dev package, or "
             "cmake --install build --prefix P and FLASHCKPT_PREFIX=P)\n" + e.stderr.strip())
    return out.stdout.strip()


version = pkg_config("--modversion")
include_dirs = [a[2:] for a in shlex.split(pkg_config("--cflags-only-I"))]
library_dirs = [a[2:] for a in shlex.split(pkg_config("--libs-only-L"))]
libraries = [a[2:] for a in shlex.split(pkg_config("--libs-only-l"))]
rpath = [d for d in library_dirs if os.path.realpath(d) not in SYSTEM_LIB_DIRS
         and not d.startswith("/usr/lib/")]

setup(
    name="flashckpt",
    version=version,
    description="Python client and PyTorch Checkpointer of flashckpt, the per-node asynchronous checkpoint daemon",
    packages=["flashckpt"],
    package_dir={"flashckpt": "flashckpt"},
    # The type stub of the extension and the PEP 561 marker: type checkers read the package's hints.
    package_data={"flashckpt": ["py.typed", "_flashckpt.pyi"]},
    ext_modules=[
        Pybind11Extension(
            "flashckpt._flashckpt",
            ["bindings.cc"],
            include_dirs=include_dirs,
            library_dirs=library_dirs,
            libraries=libraries,
            runtime_library_dirs=rpath,
            cxx_std=20,
        )
    ],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.9",
    zip_safe=False,
)
