#!/usr/bin/python3
"""deploy/systemd/flashckptd.service passes `systemd-analyze verify` and agrees with the daemon.

  1. A copy of the unit whose ExecStart= names the built flashckptd (the installed path does not
     exist here) is verified: exit 0 and no output at all, so any warning fails the test. The same
     copy with one bad value (Type=notifyy) must draw output, which shows the check can fail.
  2. The unit is Type=notify with NotifyAccess=main and WatchdogSec=30s, and its TimeoutStopSec= is
     above the daemon's default --stop-timeout (as `flashckptd --check-config` prints it), so systemd
     does not SIGKILL a stop the daemon would end cleanly.
  3. The example config passes `flashckptd --check-config` (with its root and socket moved to a
     temporary folder).

Skipped (exit 0, with a message) when /usr/bin/systemd-analyze is absent.

    test_systemd_unit.py --bin-dir build/bin
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UNIT = os.path.join(REPO, "deploy", "systemd", "flashckptd.service")
EXAMPLE = os.path.join(REPO, "deploy", "flashckptd.conf.example")
ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def fail(message):
    print("FAILED: %s" % message, flush=True)
    sys.exit(1)


def verify(text, tmp):
    path = os.path.join(tmp, "flashckptd.service")
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([ANALYZE, "verify", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                       stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout.decode(errors="replace")


def unit_value(text, key):
    values = re.findall(r"^%s=(.*)$" % re.escape(key), text, re.M)
    if len(values) != 1:
        fail("the unit has %d %s= lines, expected 1" % (len(values), key))
    return values[0].strip()


def check_config(flashckptd, text, tmp):
    path = os.path.join(tmp, "check.conf")
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([flashckptd, "--check-config", "--config", path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=30, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    args = ap.parse_args()
    if not os.access(ANALYZE, os.X_OK):
        print("SKIPPED: %s is not installed" % ANALYZE, flush=True)
        return 0
    flashckptd = os.path.join(os.path.abspath(args.bin_dir), "flashckptd")
    if not os.access(flashckptd, os.X_OK):
        fail("%s is missing (build first)" % flashckptd)
    with open(UNIT) as f:
        unit = f.read()
    exec_start = unit_value(unit, "ExecStart")
    if not exec_start.startswith("/usr/local/bin/flashckptd "):
        fail("ExecStart= does not run /usr/local/bin/flashckptd: %s" % exec_start)
    local = unit.replace("ExecStart=/usr/local/bin/flashckptd ", "ExecStart=%s " % flashckptd)

    tmp = tempfile.mkdtemp(prefix="fcunit")
    try:
        rc, out = verify(local, tmp)
        if rc != 0 or out.strip():
            fail("systemd-analyze verify of the unit (ExecStart=%s): exit %d\n%s" % (flashckptd, rc, out))
        print("systemd-analyze verify: exit 0, no warnings", flush=True)
        rc, out = verify(local.replace("Type=notify", "Type=notifyy"), tmp)
        if rc == 0 and not out.strip():
            fail("systemd-analyze verify said nothing about Type=notifyy: this check cannot fail")
        print("a bad value is reported: %s" % out.strip().splitlines()[-1], flush=True)

        for key, want in (("Type", "notify"), ("NotifyAccess", "main"), ("WatchdogSec", "30s"),
                          ("KillSignal", "SIGTERM"), ("LimitMEMLOCK", "infinity"), ("PrivateTmp", "no"),
                          ("ProtectSystem", "strict"), ("NoNewPrivileges", "yes"),
                          ("RuntimeDirectoryPreserve", "yes")):
            if unit_value(unit, key) != want:
                fail("%s=%s in the unit, expected %s" % (key, unit_value(unit, key), want))
        stop = re.fullmatch(r"(\d+)s", unit_value(unit, "TimeoutStopSec"))
        if not stop:
            fail("TimeoutStopSec=%s is not in seconds" % unit_value(unit, "TimeoutStopSec"))
        rc, out, err = check_config(flashckptd, "socket = %s/s.sock\nroot = %s/root\n" % (tmp, tmp), tmp)
        m = re.search(r"^stop-timeout = (\d+)$", out, re.M)
        if rc != 0 or not m:
            fail("flashckptd --check-config: exit %d, no stop-timeout line:\n%s%s" % (rc, out, err))
        if not int(m.group(1)) < int(stop.group(1)) <= int(m.group(1)) + 60:
            fail("TimeoutStopSec=%ss is not a little above the daemon's stop-timeout %s s" % (stop.group(1),
                                                                                           m.group(1)))
        print("Type=notify, WatchdogSec=30s, TimeoutStopSec=%ss above stop-timeout %s s" % (stop.group(1),
                                                                                         m.group(1)), flush=True)

        with open(EXAMPLE) as f:
            example = f.read()
        example = re.sub(r"^socket = .*$", "socket = %s/run/flashckptd.sock" % tmp, example, flags=re.M)
        example = re.sub(r"^root = .*$", "root = %s/root" % tmp, example, flags=re.M)
        rc, out, err = check_config(flashckptd, example, tmp)
        if rc != 0 or not out.startswith("config ok\n"):
            fail("the example config fails --check-config: exit %d\n%s%s" % (rc, out, err))
        print("deploy/flashckptd.conf.example passes --check-config", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
