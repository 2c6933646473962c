#!/usr/bin/python3
"""scripts/package.sh builds the Debian packages, and they hold what they should:

  1. flashckptd, libflashckpt1 and libflashckpt-dev are built (a build of their own, for /usr);
  2. `dpkg-deb -c` and `dpkg-deb -f`: each file in its place (the daemon, CLI and simulator in
     /usr/bin, libflashckpt.so.1 in the multiarch library directory, headers, the CMake package and
     flashckpt.pc in -dev, the unit in /usr/lib/systemd/system naming /usr/bin/flashckptd, the
     postinst that creates the system user, the prerm that stops the service, the postrm that cleans
     up on purge), and dependencies from dpkg-shlibdeps;
  3. unpacked into a scratch root, the simulator finds libflashckpt.so.1 there through its RPATH.

    test_package.py --source-dir . [--keep]
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from harness import TestFailure, check, log  # noqa: E402


def run_cmd(cmd, what, cwd=None, env=None):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=1800,
                       stdin=subprocess.DEVNULL)
    out = p.stdout.decode(errors="replace")
    check(p.returncode == 0, "%s failed (exit %d):\n%s" % (what, p.returncode, out[-4000:]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    source = os.path.abspath(args.source_dir)
    scratch = tempfile.mkdtemp(prefix="fcpkg")
    try:
        # Configured with the warnings-as-errors of scripts/test.sh's builds: with the compiler cache that
        # script sets up, every object of the package is then one compiled already.
        env = dict(os.environ, FLASHCKPT_PACKAGE_CMAKE_ARGS="-DFLASHCKPT_WERROR=ON")
        out = run_cmd([os.path.join(source, "scripts/package.sh")], "scripts/package.sh", cwd=source, env=env)
        debs = {re.sub(r"_.*", "", os.path.basename(p)): p for p in out.split() if p.endswith(".deb")}
        check(set(debs) == {"flashckptd", "libflashckpt1", "libflashckpt-dev"}, "packages built: %s" % sorted(debs))
        log("built %s" % ", ".join(os.path.basename(p) for p in sorted(debs.values())))
        multiarch = run_cmd(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], "dpkg-architecture").strip()
        want = {
            "flashckptd": ["./usr/bin/flashckptd", "./usr/bin/flashckpt", "./usr/bin/flashckpt-sim",
                           "./usr/lib/systemd/system/flashckptd.service",
                           "./usr/share/doc/flashckpt/flashckptd.conf.example",
                           "./usr/share/doc/flashckpt/flashckptd.help.txt"],
            "libflashckpt1": ["./usr/lib/%s/libflashckpt.so.1" % multiarch],
            "libflashckpt-dev": ["./usr/lib/%s/libflashckpt.so" % multiarch, "./usr/include/flashckpt/client.h",
                                 "./usr/lib/%s/cmake/flashckpt/flashckptConfig.cmake" % multiarch,
                                 "./usr/lib/%s/pkgconfig/flashckpt.pc" % multiarch],
        }
        for name, paths in want.items():
            listing = run_cmd(["dpkg-deb", "-c", debs[name]], "dpkg-deb -c " + name)
            for path in paths:
                check(re.search(r" %s( |$)" % re.escape(path), listing, re.M), "%s lacks %s:\n%s" % (name, path, listing))
        depends = run_cmd(["dpkg-deb", "-f", debs["flashckptd"], "Depends"], "dpkg-deb -f")
        check("libflashckpt1 (= " in depends and "libc6" in depends and "libgrpc++" in depends,
              "flashckptd's Depends lacks libflashckpt1, libc6 or libgrpc++: %s" % depends.strip())
        control = os.path.join(scratch, "control")
        run_cmd(["dpkg-deb", "-e", debs["flashckptd"], control], "dpkg-deb -e")
        with open(os.path.join(control, "postinst")) as f:
            check("useradd --system" in f.read(), "flashckptd's postinst does not create the system user")
        with open(os.path.join(control, "prerm")) as f:
            check("systemctl stop flashckptd" in f.read(), "flashckptd's prerm does not stop the service")
        with open(os.path.join(control, "postrm")) as f:
            check('"purge"' in f.read(), "flashckptd's postrm does nothing on purge")
        log("every file in its place; flashckptd depends on %s" % depends.strip())

        root = os.path.join(scratch, "root")
        for p in debs.values():
            run_cmd(["dpkg-deb", "-x", p, root], "dpkg-deb -x")
        with open(os.path.join(root, "usr/lib/systemd/system/flashckptd.service")) as f:
            check("ExecStart=/usr/bin/flashckptd " in f.read(), "the packaged unit does not start /usr/bin/flashckptd")
        ldd = run_cmd(["ldd", os.path.join(root, "usr/bin/flashckpt-sim")], "ldd")
        found = re.search(r"libflashckpt\.so\.1 => (\S+)", ldd)
        check(found and os.path.realpath(found.group(1)).startswith(os.path.realpath(root)),
              "the unpacked simulator does not load the unpacked libflashckpt.so.1:\n%s" % ldd)
        log("unpacked into a scratch root, flashckpt-sim loads %s" % found.group(1))
        log("PASSED")
        return 0
    except TestFailure as e:
        print("FAILED: %s" % e, flush=True)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
