#!/usr/bin/python3
"""The installed flashckpt works as users get it: `cmake --install` into a temporary prefix, then

  1. libflashckpt.so exports the public API only: every symbol `nm -D --defined-only` lists is in
     namespace flashckpt (no gRPC, protobuf or absl symbol), and its SONAME is libflashckpt.so.1;
  2. the installed programs find the library through their RPATH ($ORIGIN/../lib), not the build tree;
  3. tests/install/consumer, a program outside the tree, is configured with find_package(flashckpt
     CONFIG) (the default CMake generator) and built against the prefix, and also compiled with the
     flags `pkg-config --cflags --libs flashckpt` gives; each, run against the installed flashckptd,
     saves a tensor and restores it bit for bit;
  4. the systemd unit and the documentation are in place, the unit naming the installed daemon;
  5. `pip install client/python` into a virtual environment builds the Python package against the
     prefix's libflashckpt (FLASHCKPT_PREFIX, offline: --no-index), with its type hints (py.typed
     and the extension's stub _flashckpt.pyi), and that package, loading the prefix's
     libflashckpt.so.1, saves an array through the installed daemon and restores it.

    test_install.py --build-dir build --source-dir . [--keep]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from harness import DaemonHarness, TestFailure, check, log, run_with_daemon_harness  # noqa: E402

JOB = "install%d" % os.getpid()
PYTHON = "/usr/bin/python3"  # Debian's interpreter: setuptools, pybind11 and numpy for the venv

# Run by the venv's interpreter: the installed package saves an array and restores it.
PY_ROUND_TRIP = r"""
import os, sys
import numpy as np
import flashckpt
from flashckpt import _flashckpt
sock, job, venv = sys.argv[1:4]
assert os.path.realpath(flashckpt.__file__).startswith(os.path.realpath(venv)), flashckpt.__file__
print("ext", _flashckpt.__file__)
typing_files = [f for f in ("py.typed", "_flashckpt.pyi")
                if not os.path.isfile(os.path.join(os.path.dirname(flashckpt.__file__), f))]
assert not typing_files, "pip install left out %s" % typing_files
w = np.arange(4096, dtype=np.float32)
c = flashckpt.Client(sock, job, run_id="py-run")
c.register({"w": w})
c.snapshot(3, {"w": w})
c.wait_persisted(3, timeout=60)
c.close()
back = np.zeros_like(w)
r = flashckpt.Client(sock, job, run_id="py-run")
r.register({"w": back})
step, _ = r.restore({"w": back})
r.close()
assert step == 3 and np.array_equal(back, w), (step, back[:4])
print("python restored step %d: %d floats equal, version %s" % (step, back.size, flashckpt.__version__))
"""
COMPONENTS = ("programs", "runtime", "dev", "service")  # not python: it goes to the interpreter's path


def run_cmd(cmd, what, env=None, cwd=None, timeout=300):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    out = p.stdout.decode(errors="replace")
    check(p.returncode == 0, "%s failed (exit %d): %s\n%s" % (what, p.returncode, " ".join(cmd), out[-4000:]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    source = os.path.abspath(args.source_dir)

    def run(h):
        prefix = os.path.join(h.tmp, "prefix")
        for component in COMPONENTS:
            run_cmd(["cmake", "--install", build, "--prefix", prefix, "--component", component],
                    "cmake --install --component " + component)
        lib = os.path.join(prefix, "lib")
        so = os.path.join(lib, "libflashckpt.so")
        for path in ("bin/flashckptd", "bin/flashckpt", "bin/flashckpt-sim", "lib/libflashckpt.so.1",
                     "include/flashckpt/client.h", "include/flashckpt/export.h",
                     "lib/cmake/flashckpt/flashckptConfig.cmake", "lib/pkgconfig/flashckpt.pc",
                     "lib/systemd/system/flashckptd.service", "share/doc/flashckpt/flashckptd.help.txt",
                     "share/doc/flashckpt/flashckpt.help.txt", "share/doc/flashckpt/flashckptd.conf.example"):
            check(os.path.exists(os.path.join(prefix, path)), "not installed: %s" % path)
        log("installed into %s" % prefix)

        # 1. Only the public API is exported.
        out = run_cmd(["nm", "-D", "--defined-only", "-C", so], "nm -D")
        symbols = [line.split(" ", 2)[2] for line in out.splitlines() if line.count(" ") >= 2]
        check(symbols, "nm -D lists no symbol in %s" % so)
        foreign = [s for s in symbols if not s.startswith("flashckpt::")]
        check(not foreign, "libflashckpt.so exports %d symbols outside namespace flashckpt, e.g. %s"
              % (len(foreign), foreign[:10]))
        leaked = [s for s in symbols if re.search(r"grpc|protobuf|absl|google::|flashckpt::v1::", s)]
        check(not leaked, "libflashckpt.so exports gRPC/protobuf symbols: %s" % leaked[:10])
        check(any(s.startswith("flashckpt::Client::Connect") for s in symbols), "Client::Connect is not exported")
        soname = run_cmd(["objdump", "-p", so], "objdump -p")
        check(re.search(r"SONAME\s+libflashckpt\.so\.1\b", soname), "SONAME is not libflashckpt.so.1")
        log("libflashckpt.so exports %d symbols, all in namespace flashckpt; SONAME libflashckpt.so.1"
            % len(symbols))

        # 2. The installed programs load the installed library.
        ldd = run_cmd(["ldd", os.path.join(prefix, "bin", "flashckpt-sim")], "ldd flashckpt-sim")
        found = re.search(r"libflashckpt\.so\.1 => (\S+)", ldd)
        check(found and os.path.realpath(found.group(1)).startswith(os.path.realpath(lib)),
              "flashckpt-sim does not load libflashckpt from the prefix:\n%s" % ldd)
        with open(os.path.join(prefix, "lib/systemd/system/flashckptd.service")) as f:
            unit = f.read()
        check("ExecStart=%s/bin/flashckptd " % prefix in unit or "ExecStart=/usr/local/bin/flashckptd " in unit,
              "the unit's ExecStart does not name an installed daemon")

        # 3. An outside program, built with CMake and with pkg-config.
        cbuild = os.path.join(h.tmp, "consumer-build")
        run_cmd(["cmake", "-S", os.path.join(source, "tests/install/consumer"), "-B", cbuild,
                 "-DCMAKE_PREFIX_PATH=" + prefix], "configuring the consumer")
        run_cmd(["cmake", "--build", cbuild], "building the consumer")
        env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(lib, "pkgconfig"))
        flags = run_cmd(["pkg-config", "--cflags", "--libs", "flashckpt"], "pkg-config", env=env).split()
        check("-lflashckpt" in flags, "pkg-config --libs does not name -lflashckpt: %s" % flags)
        pc_consumer = os.path.join(h.tmp, "consumer-pc")
        run_cmd(["c++", "-std=c++20", "-o", pc_consumer, os.path.join(source, "tests/install/consumer/main.cc")]
                + flags + ["-Wl,-rpath," + lib], "compiling the consumer with pkg-config's flags")
        log("the consumer builds with find_package(flashckpt CONFIG) and with pkg-config")

        h.bin_dir = os.path.join(prefix, "bin")  # the installed daemon
        h.start_daemon()
        for name, program in (("cmake", os.path.join(cbuild, "consumer")), ("pkg-config", pc_consumer)):
            out = run_cmd([program, h.sock, "%s-%s" % (JOB, name)], "the %s consumer" % name, timeout=120)
            check("restored step 7: 4096 floats equal" in out, "the %s consumer said: %s" % (name, out))
            log("%s consumer: %s" % (name, out.strip()))

        # 5. The Python package, built by pip against the prefix. pip builds in the source folder,
        # so it gets a copy of client/python and the checkout stays clean.
        venv = os.path.join(h.tmp, "venv")
        run_cmd([PYTHON, "-m", "venv", "--system-site-packages", venv], "python3 -m venv")
        pysrc = os.path.join(h.tmp, "client-python")
        shutil.copytree(os.path.join(source, "client/python"), pysrc,
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        pip_env = dict(os.environ, FLASHCKPT_PREFIX=prefix, PIP_DISABLE_PIP_VERSION_CHECK="1")
        run_cmd([os.path.join(venv, "bin", "pip"), "install", "--no-index", pysrc], "pip install client/python",
                env=pip_env, timeout=600)
        vpython = os.path.join(venv, "bin", "python")
        out = run_cmd([vpython, "-c", PY_ROUND_TRIP, h.sock, JOB + "-python", venv], "the installed Python package",
                      cwd=h.tmp, timeout=120)
        ext = re.search(r"^ext (\S+)", out, re.M)
        check(ext, "no extension path in: %s" % out)
        ldd = run_cmd(["ldd", ext.group(1)], "ldd _flashckpt")
        found = re.search(r"libflashckpt\.so\.1 => (\S+)", ldd)
        check(found and os.path.realpath(found.group(1)).startswith(os.path.realpath(lib)),
              "the pip-built extension does not load libflashckpt from the prefix:\n%s" % ldd)
        check("python restored step 3: 4096 floats equal" in out, "the Python package said: %s" % out)
        log("pip install client/python: %s" % out.strip().splitlines()[-1])

        rc = h.stop_daemon()
        check(rc == 0, "the installed daemon exited %s" % rc)

    return run_with_daemon_harness(run, "fcinst", ["%s-cmake" % JOB, "%s-pkg-config" % JOB, "%s-python" % JOB], args.build_dir,
                                   keep=args.keep, harness=DaemonHarness)


if __name__ == "__main__":
    sys.exit(main())
