#!/usr/bin/python3
"""flashckptd as a service: its config check, systemd notifications, health service and stop timeout,
through real flashckptd, flashckpt-sim and flashckpt processes and real signals.

  1. Config: `flashckptd --check-config --config FILE` prints "config ok" and the effective settings,
     which read back as a config file give the same output; an unknown key, and bad values, exit 2
     naming the key; nothing is started (no socket, no root).
  2. systemd notify (NOTIFY_SOCKET: a datagram socket bound here): READY=1 with a STATUS= line once
     the daemon's socket is connectable; WATCHDOG=1 every half WATCHDOG_USEC when WATCHDOG_PID is
     the daemon's pid (started through `sh -c 'WATCHDOG_PID=$$ exec ...'`), none when it names
     another process (that run logs with --log-file: the file gets the log, stderr does not).
  3. Health: `flashckpt health` prints SERVING (exit 0) over the socket and over a read-only TCP
     listener. A large save (flashckpt-sim, 1.5 GiB) is in flight when SIGTERM arrives with
     --stop-timeout 60: STOPPING=1 arrives, health says NOT_SERVING (exit 2) while the write
     finishes, the daemon exits 0, the checkpoint is complete and passes `flashckpt verify`, and
     health fails (exit 2) once the daemon is gone.
  4. Stop timeout: the same save with --stop-timeout 2 and SIGTERM as soon as its temporaries
     appear: the daemon exits 0 within the timeout (plus 0.5 s for the process to go), logs the step
     as abandoned, leaves no temporary, no signal and no metadata.json for it, and keeps its segment
     and commit record; a restarted daemon adopts it (before READY=1) and completes the checkpoint,
     which passes `flashckpt verify`.

    test_service.py --bin-dir build/bin [--keep]
"""

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True  # keep the source tree clean
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (DaemonHarness, TestFailure, check, kill_processes, log, run_with_daemon_harness,  # noqa: E402
                     tail, wait_for)

JOB = "svc%d" % os.getpid()          # the graceful stop
JOB2 = "svc%dabandon" % os.getpid()  # the stop timeout
# 2 layers of 8192 x 8192 fp32 weights with two Adam moments: 1.5 GiB per snapshot, so that its write
# (O_DIRECT, a few hundred MB/s to a few GB/s) is still running when SIGTERM arrives.
LAYERS, HIDDEN = 2, 8192
SNAPSHOT_BYTES = 3 * LAYERS * HIDDEN * HIDDEN * 4
WATCHDOG_USEC = 400000
SHORT_STOP_S = 2
EXIT_SLACK_S = 0.5
# The abandon case throttles the daemon's writes to this (a blkio cgroup), so that the write is
# still running at the stop timeout on any disk: 1.5 GiB at 200 MB/s takes about 8 s.
ABANDON_WRITE_BPS = 200 * 1000 * 1000
BLKIO = "/sys/fs/cgroup/blkio"


class WriteThrottle:
    """A cgroup-v1 blkio group whose O_DIRECT writes to the disk holding `path` are limited to `bps`.

    `wrap(cmd)` runs cmd inside it. Where the blkio controller cannot be used (not root, no cgroup v1),
    `ok` is False and wrap leaves the command alone: the disk's own speed decides then."""

    def __init__(self, path, bps):
        self.dir = None
        self.ok = False
        dev = os.stat(path).st_dev
        node = "/sys/dev/block/%d:%d" % (os.major(dev), os.minor(dev))
        if os.path.exists(os.path.join(node, "partition")):  # throttling applies to whole disks
            with open(os.path.join(os.path.realpath(node), "..", "dev")) as f:
                disk = f.read().strip()
        else:
            disk = "%d:%d" % (os.major(dev), os.minor(dev))
        try:
            self.dir = os.path.join(BLKIO, "flashckpt-test-%d" % os.getpid())
            os.mkdir(self.dir)
            with open(os.path.join(self.dir, "blkio.throttle.write_bps_device"), "w") as f:
                f.write("%s %d\n" % (disk, bps))
            self.ok = True
            log("writes to disk %s throttled to %.0f MB/s in %s" % (disk, bps / 1e6, self.dir))
        except OSError as e:
            log("no write throttle (%s): the abandon case relies on the disk being slow enough" % e)
            self.remove()

    def wrap(self, cmd):
        if not self.ok:
            return cmd
        return ["/bin/sh", "-c", 'echo $$ > "%s/cgroup.procs" && exec "$@"' % self.dir, "sh"] + cmd

    def remove(self):
        if self.dir and os.path.isdir(self.dir):
            wait_for(lambda: _try_rmdir(self.dir), 10, "the throttle cgroup %s to empty" % self.dir)
        self.dir = None


def _try_rmdir(path):
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


class Notifications:
    """A bound AF_UNIX datagram socket, as systemd's NOTIFY_SOCKET, and what arrives on it."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages = []   # (monotonic time, {key: value})
        self.lock = threading.Lock()
        self.on_message = None   # called on the receiving thread with each message
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = {}
            for line in data.decode(errors="replace").split("\n"):
                if "=" in line:
                    k, v = line.split("=", 1)
                    fields[k] = v
            if self.on_message:
                self.on_message(fields)
            with self.lock:
                self.messages.append((time.monotonic(), fields))

    def with_key(self, key, since=0.0):
        with self.lock:
            return [(t, m) for t, m in self.messages if key in m and t >= since]

    def close(self):
        self.stop = True
        self.thread.join(timeout=2)
        self.sock.close()


class Harness(DaemonHarness):
    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.procs = []
        self.notify = None

    def kill_all(self):
        kill_processes(self.procs)
        if self.notify:
            self.notify.close()

    def start(self, name, args=(), env=None, watchdog_pid=None, wrap=None):
        """Starts flashckptd (through sh when watchdog_pid is given: "self" is the daemon's own pid;
        `wrap` may put the command inside another, as WriteThrottle.wrap)."""
        self.daemon_log = os.path.join(self.tmp, name + ".log")
        self.logs.append(self.daemon_log)
        cmd = [self.binary("flashckptd"), "--socket", self.sock, "--root", self.root, "--max-host-memory", "6GiB",
               "--slots", "1", "--log-level", "info"] + list(args)
        full_env = dict(os.environ)
        full_env.update(env or {})
        if watchdog_pid == "self":
            cmd = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh"] + cmd
        elif watchdog_pid is not None:
            full_env["WATCHDOG_PID"] = str(watchdog_pid)
        if wrap is not None:
            cmd = wrap(cmd)
        log("starting %s" % " ".join(cmd))
        with open(self.daemon_log, "wb") as out:
            self.daemon = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=full_env)
        self.procs.append(self.daemon)
        return self.daemon

    def wait_socket(self):
        def up():
            if self.daemon.poll() is not None:
                raise TestFailure("flashckptd exited with %s:\n%s" % (self.daemon.returncode, tail(self.daemon_log)))
            return connectable(self.sock)
        wait_for(up, 30, "the daemon's socket")

    def sim(self, name, job=JOB):
        out = os.path.join(self.tmp, name + ".log")
        self.logs.append(out)
        cmd = [self.binary("flashckpt-sim"), "--socket", self.sock, "--job", job, "--rank", "0", "--world-size", "1",
               "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--steps", "1", "--save-every", "1",
               "--wait-timeout", "600"]
        with open(out, "wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def ckpt(self, step, job=JOB):
        return os.path.join(self.root, job, "checkpoint-%d" % step)

    def log_text(self):
        with open(self.daemon_log, errors="replace") as f:
            return f.read()


def connectable(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def temporaries(root):
    return glob.glob(os.path.join(root, "**", "*.tmp.*"), recursive=True)


def wait_for_write_in_flight(h, step, job=JOB):
    """Waits until the writer has created its temporaries for `step` (the commit is acknowledged)."""
    return wait_for(lambda: glob.glob(os.path.join(h.ckpt(step, job), "*.tmp.*")), 120,
                    "the writer's temporaries in %s" % h.ckpt(step, job), poll=0.005)


# ------------------------------------------------------------------------------------------------
# 1. --check-config
# ------------------------------------------------------------------------------------------------

def check_config(h, text, name):
    path = os.path.join(h.tmp, name)
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([h.binary("flashckptd"), "--check-config", "--config", path], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=30, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def test_config(h):
    sock = os.path.join(h.tmp, "cfg", "flashckptd.sock")
    root = os.path.join(h.tmp, "cfg-root")
    good = ("# a comment\nsocket = %s\nroot = %s\nslots = 3\nmax-host-memory = 512MiB\nkeep = 2\n"
            "stop-timeout = 7\nlog-level = debug\nlog-file = %s\nallow-uid = %d\nlisten = 127.0.0.1:0\n"
            "checksum-chunk = 64KiB\n" % (sock, root, os.path.join(h.tmp, "cfg.log"), os.getuid()))
    rc, out, err = check_config(h, good, "good.conf")
    check(rc == 0, "--check-config of a good file exited %d:\n%s%s" % (rc, out, err))
    lines = out.splitlines()
    check(lines and lines[0] == "config ok", "--check-config did not print 'config ok' first:\n%s" % out)
    for want in ("socket = %s" % sock, "root = %s" % root, "state-dir = %s.state" % sock, "slots = 3",
                 "max-host-memory = 512MiB", "keep = 2", "stop-timeout = 7", "log-level = debug",
                 "allow-uid = [%d]" % os.getuid(), "listen = 127.0.0.1:0", "checksum-chunk = 64KiB",
                 "writer-threads = 2", "tcp-allow-writes = false"):
        check(want in lines, "--check-config output lacks %r:\n%s" % (want, out))
    # Fed back as a config file, the printed settings give the same settings.
    rc2, out2, err2 = check_config(h, "\n".join(lines[1:]) + "\n", "printed.conf")
    check(rc2 == 0, "the printed settings as a config file exited %d:\n%s%s" % (rc2, out2, err2))
    check(out2 == out, "the printed settings read back differ:\n--- first\n%s--- second\n%s" % (out, out2))
    check(not os.path.exists(sock) and not os.path.exists(root) and not os.path.exists(os.path.join(h.tmp, "cfg.log")),
          "--check-config created the socket, the root or the log file")
    log("--check-config: ok, %d settings, round trip identical" % (len(lines) - 1))

    base = "socket = %s\nroot = %s\n" % (sock, root)
    for bad, key in (("slotz = 3\n", "slotz"), ("slots = 100\n", "slots"), ("max-host-memory = lots\n",
                     "max-host-memory"), ("stop-timeout = 0\n", "stop-timeout"), ("log-level = chatty\n",
                     "log-level"), ("checksum-chunk = 3000\n", "checksum-chunk"),
                     ("log-file = /nonexistent-dir/x.log\n", "log-file")):
        rc, out, err = check_config(h, base + bad, "bad.conf")
        check(rc == 2, "--check-config with %r exited %d, not 2:\n%s%s" % (bad.strip(), rc, out, err))
        check("config ok" not in out, "--check-config with %r printed 'config ok'" % bad.strip())
        check(key in err, "--check-config with %r: the message does not name %r:\n%s" % (bad.strip(), key, err))
        log("refused %-40r -> %s" % (bad.strip(), err.strip().splitlines()[0][:120]))
    check(not os.path.exists(sock), "a refused --check-config created the socket")


# ------------------------------------------------------------------------------------------------
# 2, 3. notify, watchdog, health, a stop that finishes its write
# ------------------------------------------------------------------------------------------------

def health(h, *args):
    rc, out, err = h.cli("--socket", h.sock, *args, "health", timeout=30)
    return rc, out.strip(), err.strip()


def test_watchdog_other_pid(h):
    h.notify.messages.clear()
    log_file = os.path.join(h.tmp, "log-file.log")
    h.logs.append(log_file)
    d = h.start("watchdog-other", ["--log-file", log_file],
                env={"NOTIFY_SOCKET": h.notify.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}, watchdog_pid=1)
    wait_for(lambda: h.notify.with_key("READY"), 30, "READY=1")
    time.sleep(1.2)
    pings = h.notify.with_key("WATCHDOG")
    check(not pings, "WATCHDOG=1 pings arrived although WATCHDOG_PID named another process: %s" % pings)
    d.send_signal(signal.SIGTERM)
    rc = d.wait(timeout=30)
    check(rc == 0, "flashckptd exited %d after SIGTERM" % rc)
    check(not connectable(h.sock), "the socket still answers after the daemon exited")
    with open(log_file, errors="replace") as f:
        logged = f.read()
    for want in ("[rpc] listening socket=%s" % h.sock, "[rpc] systemd notify socket=", "[rpc] stopped"):
        check(want in logged, "--log-file %s lacks %r:\n%s" % (log_file, want, logged[-2000:]))
    check("listening socket=" not in h.log_text(), "with --log-file the log still went to stderr:\n%s"
          % tail(h.daemon_log))
    log("WATCHDOG_PID=1: READY=1, no pings in 1.2 s; --log-file got the log, stderr did not")


def test_notify_health_and_graceful_stop(h):
    h.notify.messages.clear()
    ready_connectable = []

    def on_message(fields):
        if "READY" in fields:
            ready_connectable.append(connectable(h.sock))
    h.notify.on_message = on_message
    d = h.start("serve", ["--listen", "127.0.0.1:0", "--stop-timeout", "60"],
                env={"NOTIFY_SOCKET": h.notify.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}, watchdog_pid="self")
    ready = wait_for(lambda: h.notify.with_key("READY"), 30, "READY=1 on NOTIFY_SOCKET")
    check(ready[0][1]["READY"] == "1", "READY=%s" % ready[0][1]["READY"])
    check(ready_connectable == [True], "READY=1 arrived before the daemon's socket was connectable")
    check(ready[0][1].get("STATUS", "").startswith("serving"), "READY=1 without a STATUS=serving line: %s"
          % ready[0][1])
    t0 = time.monotonic()
    wait_for(lambda: len(h.notify.with_key("WATCHDOG", since=t0)) >= 3, 5, "three WATCHDOG=1 pings")
    pings = [t for t, m in h.notify.with_key("WATCHDOG", since=t0)]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    check(all(0.1 < g < 0.4 for g in gaps), "WATCHDOG=1 gaps %s are not about half of %d us" % (gaps, WATCHDOG_USEC))
    log("READY=1 (socket connectable), STATUS=%r, WATCHDOG=1 every %s s" % (ready[0][1]["STATUS"],
                                                                            ["%.2f" % g for g in gaps]))

    rc, out, err = health(h)
    check(rc == 0 and out == "SERVING", "flashckpt health: exit %d, %r %r" % (rc, out, err))
    port = wait_for(lambda: _tcp_port(h), 30, "the 'listening tcp=' line")
    rc, out, err = h.cli("--address", "127.0.0.1:%d" % port, "health", timeout=30)
    check(rc == 0 and out.strip() == "SERVING", "flashckpt --address health (read-only listener): exit %d, %r %r"
          % (rc, out, err))
    log("flashckpt health: SERVING over the socket and over TCP (read-only)")

    sim = h.sim("sim-graceful")
    wait_for_write_in_flight(h, 1)
    sent = time.monotonic()
    d.send_signal(signal.SIGTERM)
    log("SIGTERM with the write of %.1f GiB in flight (--stop-timeout 60)" % (SNAPSHOT_BYTES / 2**30))
    during = []
    while d.poll() is None and time.monotonic() - sent < 60:
        rc, out, err = health(h)
        if d.poll() is None:
            during.append((rc, out))
        time.sleep(0.05)
    rc = d.wait(timeout=70)
    took = time.monotonic() - sent
    check(rc == 0, "flashckptd exited %d after SIGTERM:\n%s" % (rc, tail(h.daemon_log)))
    stopping = h.notify.with_key("STOPPING", since=sent)
    check(stopping and stopping[0][1]["STOPPING"] == "1", "no STOPPING=1 after SIGTERM")
    check(any(r == (2, "NOT_SERVING") for r in during),
          "flashckpt health never said NOT_SERVING (exit 2) while the daemon stopped: %s" % during[:5])
    text = h.log_text()
    check("persisted job=%s step=1 " % JOB in text, "the write in flight was not finished:\n%s" % tail(h.daemon_log))
    check("stopped finished=1 abandoned=0" in text, "no 'stopped finished=1 abandoned=0' line:\n%s"
          % tail(h.daemon_log))
    check(os.path.exists(os.path.join(h.ckpt(1), "metadata.json")), "checkpoint-1 is not complete")
    rc, out, err = h.cli("verify", h.ckpt(1), timeout=300)
    check(rc == 0, "flashckpt verify checkpoint-1: exit %d\n%s%s" % (rc, out, err))
    check(not temporaries(h.root), "temporaries left: %s" % temporaries(h.root))
    rc, out, err = health(h)
    check(rc == 2, "flashckpt health after the daemon exited: exit %d, %r" % (rc, out))
    kill_processes([sim])
    log("graceful stop in %.1f s: STOPPING=1, NOT_SERVING %d times, checkpoint-1 complete and verified"
        % (took, sum(1 for r in during if r == (2, "NOT_SERVING"))))


def _tcp_port(h):
    for line in h.log_text().splitlines():
        if "listening tcp=" in line:
            return int(line.split("listening tcp=")[1].split()[0].rsplit(":", 1)[1])
    return None


# ------------------------------------------------------------------------------------------------
# 4. the stop timeout runs out: abandoned, then adopted
# ------------------------------------------------------------------------------------------------

def test_abandon_and_adopt(h):
    job = JOB2
    state_dir = h.sock + ".state"
    throttle = WriteThrottle(h.root, ABANDON_WRITE_BPS)
    try:
        d = h.start("abandon", ["--stop-timeout", str(SHORT_STOP_S), "--io-threads", "1"], wrap=throttle.wrap)
        h.wait_socket()
        sim = h.sim("sim-abandon", job)
        wait_for_write_in_flight(h, 1, job)
        sent = time.monotonic()
        d.send_signal(signal.SIGTERM)
        rc = d.wait(timeout=60)
        took = time.monotonic() - sent
        kill_processes([sim])
    finally:
        if h.daemon is not None and h.daemon.poll() is None:
            h.daemon.kill()
            h.daemon.wait()
        throttle.remove()
    text = h.log_text()
    check(rc == 0, "flashckptd exited %d after SIGTERM:\n%s" % (rc, tail(h.daemon_log)))
    check(took <= SHORT_STOP_S + EXIT_SLACK_S, "flashckptd took %.2f s to exit, --stop-timeout is %d s"
          % (took, SHORT_STOP_S))
    check("abandoned job=%s step=1 rank=0" % job in text,
          "the write was not abandoned (finished within %d s? a disk faster than %.1f GB/s needs a larger state):\n%s"
          % (SHORT_STOP_S, SNAPSHOT_BYTES / 1e9 / (SHORT_STOP_S / 2), tail(h.daemon_log)))
    check("stopped finished=0 abandoned=1" in text, "no 'stopped finished=0 abandoned=1' line:\n%s"
          % tail(h.daemon_log))
    check(not temporaries(h.root), "temporaries left after the abandoned write: %s" % temporaries(h.root))
    left = sorted(os.listdir(h.ckpt(1, job))) if os.path.isdir(h.ckpt(1, job)) else []
    check(not [n for n in left if n.startswith("saved_signal") or n == "metadata.json"],
          "the abandoned write left a signal or metadata.json: %s" % left)
    check(not [n for n in left if n.endswith(".safetensors")], "the abandoned write left files: %s" % left)
    records = sorted(os.listdir(state_dir))
    check(any(r.endswith(".reg") for r in records) and any(".slot" in r for r in records),
          "the state directory lacks the segment's or the commit's record: %s" % records)
    segments = glob.glob("/dev/shm/flashckpt.%s.0.*" % job)
    check([s for s in segments if not s.endswith(".ema")], "the abandoned snapshot's segment was unlinked")
    log("stop timeout: exit 0 in %.2f s, step 1 abandoned, nothing of it on disk, records %s kept" % (took, records))
    for ckpt in glob.glob(os.path.join(h.root, "*", "checkpoint-*")):
        if os.path.exists(os.path.join(ckpt, "metadata.json")):
            rc, out, err = h.cli("verify", ckpt, timeout=300)
            check(rc == 0, "flashckpt verify %s: exit %d\n%s%s" % (ckpt, rc, out, err))

    # The next daemon adopts the snapshot before it says READY=1, and writes it.
    h.notify.messages.clear()
    log_at_ready = []
    h.notify.on_message = lambda fields: log_at_ready.append(h.log_text()) if "READY" in fields else None
    d = h.start("adopt", ["--stop-timeout", "60"], env={"NOTIFY_SOCKET": h.notify.path})
    wait_for(lambda: h.notify.with_key("READY"), 60, "READY=1 of the restarted daemon")
    check(log_at_ready and "recovered job=%s rank=0 step=1" % job in log_at_ready[0],
          "READY=1 came before the daemon adopted the abandoned snapshot:\n%s" % (log_at_ready or [""])[0][-2000:])
    wait_for(lambda: os.path.exists(os.path.join(h.ckpt(1, job), "metadata.json")), 120,
             "the adopted step's metadata.json")
    rc, out, err = h.cli("verify", h.ckpt(1, job), timeout=300)
    check(rc == 0, "flashckpt verify of the adopted checkpoint-1: exit %d\n%s%s" % (rc, out, err))
    d.send_signal(signal.SIGTERM)
    rc = d.wait(timeout=30)
    check(rc == 0, "the restarted daemon exited %d after SIGTERM" % rc)
    left = [r for r in os.listdir(state_dir) if r != "daemon.lock"]  # the lock file stays, unlocked
    check(not left, "records left after a clean stop: %s" % left)
    check(not temporaries(h.root), "temporaries left: %s" % temporaries(h.root))
    log("restarted daemon adopted step 1 before READY=1 and completed it; verify ok")


def run(h):
    test_config(h)
    h.notify = Notifications(os.path.join(h.tmp, "notify.sock"))
    test_watchdog_other_pid(h)
    test_notify_health_and_graceful_stop(h)
    test_abandon_and_adopt(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    return run_with_daemon_harness(run, "fcsvc", [JOB, JOB2], args.bin_dir, keep=args.keep,
                                   harness=Harness)


if __name__ == "__main__":
    sys.exit(main())
