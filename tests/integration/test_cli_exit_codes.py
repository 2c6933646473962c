#!/usr/bin/python3
"""The exit statuses of the offline `flashckpt` commands, run as the real binary (no daemon).

One rule for every offline command (those whose help says "offline": verify, inspect, reshard, export, import), as
`flashckpt --help` and docs/reference.md state it:
  - the directory it reads is missing, or is not a directory: exit 3, and stderr says which;
  - the directory exists but holds an incomplete checkpoint (no metadata.json): exit 1.
A new offline command fails this test until it is added to COMMANDS below.

    test_cli_exit_codes.py --bin-dir build/bin
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

EXIT_VERIFY_FAILED = 1  # the checkpoint is incomplete or failed verification
EXIT_FAILED = 3         # an offline command failed otherwise (a missing directory included)

# How to run each offline command on the directory `d`, with `tmp` for anything it writes.
COMMANDS = {
    "verify": lambda d, tmp: ["verify", d],
    "inspect": lambda d, tmp: ["inspect", d],
    "export": lambda d, tmp: ["export", d, os.path.join(tmp, "exported")],
    "import": lambda d, tmp: ["import", d, "--root", tmp, "--job", "imported"],
    "reshard": lambda d, tmp: ["reshard", d, os.path.join(tmp, "resharded"), "--tp-degree", "1",
                               "--pp-degree", "1", "--shard-degree", "1"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    args = ap.parse_args()
    cli = os.path.join(os.path.abspath(args.bin_dir), "flashckpt")
    failures = []

    def run(argv):
        p = subprocess.run([cli] + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL, timeout=60)
        return p.returncode, p.stderr.decode(errors="replace")

    def expect(command, case, argv, code, words):
        rc, err = run(argv)
        ok = rc == code and words in err
        print("%s %s: flashckpt %s -> exit %d%s" % ("ok  " if ok else "FAIL", case, " ".join(argv), rc,
                                                     "" if ok else ", expected %d and %r in: %r" % (code, words, err)),
              flush=True)
        if not ok:
            failures.append("%s %s" % (command, case))

    help_text = subprocess.run([cli, "--help"], stdout=subprocess.PIPE, timeout=60).stdout.decode()
    offline = set(re.findall(r"^\s+(\S+)\s+.*\(offline\)", help_text, re.M))
    if offline != set(COMMANDS):
        failures.append("the offline commands in --help are %s, this test knows %s" % (sorted(offline),
                                                                                         sorted(COMMANDS)))
    if not re.search(r"3 an offline command failed otherwise \(a DIR or SRC that is missing", help_text):
        failures.append("--help does not document exit 3 for a missing directory:\n" + help_text)

    tmp = tempfile.mkdtemp(prefix="flashckpt-exit-")
    try:
        missing = os.path.join(tmp, "checkpoint-12345")
        a_file = os.path.join(tmp, "a-file")
        with open(a_file, "w") as f:
            f.write("not a checkpoint\n")
        incomplete = os.path.join(tmp, "checkpoint-7")
        os.makedirs(incomplete)
        with open(os.path.join(incomplete, "saved_signal_0"), "w") as f:
            f.write("{}")
        for command, argv in sorted(COMMANDS.items()):
            expect(command, "missing directory", argv(missing, tmp), EXIT_FAILED, "no such directory")
            expect(command, "not a directory", argv(a_file, tmp), EXIT_FAILED, "not a directory")
            expect(command, "incomplete checkpoint", argv(incomplete, tmp), EXIT_VERIFY_FAILED, "")
            if os.path.exists(os.path.join(tmp, "resharded")):
                failures.append("%s created its destination for a source it refused" % command)
                shutil.rmtree(os.path.join(tmp, "resharded"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print("FAILED: " + "; ".join(failures), flush=True)
        return 1
    print("PASSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
