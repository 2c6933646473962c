#!/usr/bin/python3
"""How `flashckpt watch` ends, against a real flashckptd: it tells a daemon that went away from one
it never reached.

  1. No daemon on the socket: exit 2, "is flashckptd running, and is --socket right?", and no
     "watching events" line (it never subscribed).
  2. A watch subscribed to a daemon that is stopped with SIGTERM: exit 2, "the daemon at <socket>
     stopped" with the daemon's reason ("the daemon is stopping"), and no hint about --socket.
  3. The same with a daemon killed with SIGKILL (the stream breaks): exit 2, "stopped", no hint.

    test_watch_end.py --bin-dir build/bin [--keep]
"""

import argparse
import os
import signal
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import check, log, run_with_daemon_harness, wait_for  # noqa: E402

SOCKET_HINT = "is flashckptd running, and is --socket right?"
SUBSCRIBE_TIMEOUT_S = 30
END_TIMEOUT_S = 30


def start_watch(h, name):
    """`flashckpt watch` in the background, once it says it is subscribed: (process, stderr path)."""
    err_path = os.path.join(h.tmp, name + ".err")
    h.logs.append(err_path)
    proc = subprocess.Popen([h.binary("flashckpt"), "--socket", h.sock, "watch"], stdout=subprocess.DEVNULL,
                            stderr=open(err_path, "w"), stdin=subprocess.DEVNULL)
    wait_for(lambda: "watching events" in open(err_path).read() or proc.poll() is not None,
             SUBSCRIBE_TIMEOUT_S, "%s to subscribe" % name)
    check(proc.poll() is None, "%s exited at once:\n%s" % (name, open(err_path).read()))
    return proc, err_path


def check_ends_saying_stopped(name, proc, err_path, reason=""):
    rc = proc.wait(timeout=END_TIMEOUT_S)
    err = open(err_path).read()
    check(rc == 2, "%s: exit %d, expected 2:\n%s" % (name, rc, err))
    check("stopped" in err and reason in err, "%s does not say the daemon stopped (%r):\n%s" % (name, reason, err))
    check(SOCKET_HINT not in err and "not reachable" not in err,
          "%s blames the socket of a daemon it was connected to:\n%s" % (name, err))
    log("%s: %s" % (name, err.strip().splitlines()[-1]))


def run(h):
    rc, out, err = h.cli("--socket", h.sock, "watch", "--seconds", "5")
    check(rc == 2 and SOCKET_HINT in err, "watch without a daemon: exit %d:\n%s" % (rc, err))
    check("watching events" not in err, "watch without a daemon says it is watching:\n%s" % err)
    log("no daemon: %s" % err.strip())

    h.start_daemon()
    proc, err_path = start_watch(h, "watch-sigterm")
    check(h.stop_daemon() == 0, "flashckptd did not exit 0 on SIGTERM")
    check_ends_saying_stopped("watch-sigterm", proc, err_path, reason="the daemon is stopping")

    h.start_daemon()
    proc, err_path = start_watch(h, "watch-sigkill")
    h.daemon.send_signal(signal.SIGKILL)
    h.daemon.wait(timeout=10)
    check_ends_saying_stopped("watch-sigkill", proc, err_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fcwatch", [], args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
