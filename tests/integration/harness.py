"""What the real-process tests share: failures, logging, deadlines, and a flashckptd to start and stop.

Python standard library only. The integration tests (test_save_kill_resume.py, test_ema.py) import it
as a sibling module; tests/python/harness.py loads it by path (it is a module named harness too) and
passes error=AssertionError, so that its failures stay unittest failures.

    h = DaemonHarness(bin_dir, tmp)     # sock and root in tmp; set h.daemon_log before starting
    h.start_daemon()                    # waits (30 s) for the socket file
    rc = h.stop_daemon()                # SIGTERM, 20 s, then SIGKILL: the exit status, or None
"""

import glob
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

START = time.monotonic()


class TestFailure(Exception):
    pass


def check(cond, message):
    if not cond:
        raise TestFailure(message)


def log(message):
    print("[%7.2fs] %s" % (time.monotonic() - START, message), flush=True)


def wait_for(pred, timeout, what, poll=0.02, error=TestFailure):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(poll)


def tail(path, lines=40):
    try:
        with open(path, "r", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return "(cannot read %s: %s)\n" % (path, e)


# ------------------------------------------------------------------------------------------------
# flashckptd
# ------------------------------------------------------------------------------------------------

DAEMON_READY_TIMEOUT_S = 30   # for the socket file to appear
DAEMON_TERM_TIMEOUT_S = 20    # after SIGTERM, before SIGKILL
DAEMON_KILL_TIMEOUT_S = 10    # after SIGKILL


def binary(bin_dir, name, error=TestFailure):
    path = os.path.join(bin_dir, name)
    if not os.access(path, os.X_OK):
        raise error("%s is missing or not executable (build first)" % path)
    return path


def daemon_command(flashckptd, sock, root, max_host_memory="1GiB", extra_args=()):
    return [flashckptd, "--socket", sock, "--root", root, "--max-host-memory", max_host_memory,
            "--log-level", "info"] + list(extra_args)


def spawn_daemon(cmd, log_path, append=False, say=None):
    """Starts cmd with stdout and stderr to log_path (say, if given, logs the command line).

    Keep the Popen before waiting for it (wait_daemon_ready), so that a failed wait can stop it.
    """
    if say:
        say("starting %s" % " ".join(cmd))
    with open(log_path, "ab" if append else "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def socket_accepts(sock):
    """True when a process listens on the UNIX socket sock. The file alone proves nothing: a daemon
    killed with SIGKILL leaves it behind until the next one replaces it."""
    try:
        if not stat.S_ISSOCK(os.stat(sock).st_mode):
            return False
    except FileNotFoundError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(sock)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()


def wait_daemon_ready(proc, sock, error=TestFailure, exit_detail=None, say=None):
    """Waits for the daemon proc to listen on the UNIX socket sock (it adopts what a predecessor
    left before it listens, so then it serves).

    Raises error if it exits first (the message followed by exit_detail(), if given) or it does not
    listen within DAEMON_READY_TIMEOUT_S. say, if given, logs the pid once it is up.
    """
    def ready():
        if proc.poll() is not None:
            raise error("flashckptd exited with %s before listening on its socket%s"
                        % (proc.returncode, exit_detail() if exit_detail else ""))
        return socket_accepts(sock)
    wait_for(ready, DAEMON_READY_TIMEOUT_S, "the daemon socket %s" % sock, error=error)
    if say:
        say("daemon is up (pid %d)" % proc.pid)
    return proc


def stop_daemon(proc):
    """SIGTERM, then the exit status (None if it had to be SIGKILLed, or was never started)."""
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=DAEMON_TERM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=DAEMON_KILL_TIMEOUT_S)
        return None


def kill_processes(procs):
    """SIGKILL every process still running and reap it (10 s each at most)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class DaemonHarness:
    """A temporary socket and root in tmp, the binaries in bin_dir, and one flashckptd at a time.

    Subclasses set self.daemon_log (the daemon's output file) before start_daemon(); every log file
    goes into self.logs, which the tests dump on failure.
    """

    def __init__(self, bin_dir, tmp):
        self.bin_dir = bin_dir
        self.tmp = tmp
        self.sock = os.path.join(tmp, "flashckptd.sock")
        self.root = os.path.join(tmp, "root")
        self.daemon = None
        self.daemon_log = None
        self.logs = []     # every log file, dumped on failure

    def binary(self, name):
        return binary(self.bin_dir, name)

    def start_daemon(self, extra_args=()):
        cmd = daemon_command(self.binary("flashckptd"), self.sock, self.root, extra_args=extra_args)
        self.logs.append(self.daemon_log)
        self.daemon = spawn_daemon(cmd, self.daemon_log, say=log)
        wait_daemon_ready(self.daemon, self.sock, say=log)

    def stop_daemon(self):
        """SIGTERM, then the exit status (None if it had to be SIGKILLed)."""
        return stop_daemon(self.daemon)

    def cli(self, *args, timeout=60):
        """Runs the flashckpt CLI: (exit code, stdout, stderr)."""
        cmd = [self.binary("flashckpt")] + list(args)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


RESUMED = re.compile(r"^resumed step=(\d+) from=(\w+) verified_elements=(\d+)\b", re.M)


class SimPhases(DaemonHarness):
    """A DaemonHarness whose flashckpt-sim ranks run in phases, each rank of a phase writing
    <tmp>/<phase>.rank<r>.log: start them, wait until every rank holds a step and SIGKILL them all,
    read the step each one resumed."""

    timeout_s = 120

    def __init__(self, bin_dir, tmp):
        super().__init__(bin_dir, tmp)
        self.sims = []

    def spawn_sims(self, phase, commands):
        """Starts {rank: command} of `phase`; returns {rank: process}."""
        procs = {}
        for rank, cmd in commands.items():
            path = self.log_path(phase, rank)
            self.logs.append(path)
            with open(path, "wb") as out:
                procs[rank] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.sims.append(procs[rank])
        return procs

    def log_path(self, phase, rank):
        return os.path.join(self.tmp, "%s.rank%d.log" % (phase, rank))

    def output(self, phase, rank):
        with open(self.log_path(phase, rank), "r", errors="replace") as f:
            return f.read()

    def hold_and_kill(self, phase, procs, step):
        """Waits until every rank printed `holding step=<step>`, then SIGKILLs them all."""
        line = "holding step=%d" % step
        for rank, p in procs.items():
            wait_for(lambda: line in self.output(phase, rank) or p.poll() is not None, self.timeout_s,
                     "%s: rank %d to hold at step %d" % (phase, rank, step))
            check(p.poll() is None, "%s: rank %d exited with %s before holding:\n%s" %
                  (phase, rank, p.returncode, self.output(phase, rank)[-3000:]))
        for p in procs.values():
            p.kill()
        for rank, p in procs.items():
            p.wait(timeout=self.timeout_s)
            check(p.returncode == -signal.SIGKILL, "%s: rank %d exit status %s" % (phase, rank, p.returncode))
        log("%s: all %d ranks held at step %d and were SIGKILLed" % (phase, len(procs), step))

    def wait_resumed(self, phase, procs):
        """Every rank's `resumed` line, once all have printed it: {rank: (step, from)}."""
        found = {}
        for rank, p in procs.items():
            wait_for(lambda: RESUMED.search(self.output(phase, rank)) or p.poll() is not None, self.timeout_s,
                     "%s: rank %d to resume" % (phase, rank))
            m = RESUMED.search(self.output(phase, rank))
            check(m is not None, "%s: rank %d exited (%s) without resuming:\n%s" %
                  (phase, rank, p.returncode, self.output(phase, rank)[-3000:]))
            check(int(m.group(3)) > 0, "%s: rank %d verified no element" % (phase, rank))
            found[rank] = (int(m.group(1)), m.group(2))
        return found

    def check_all_resumed(self, phase, procs, step, source):
        """wait_resumed, and every rank resumed `step` from `source`."""
        for rank, got in sorted(self.wait_resumed(phase, procs).items()):
            check(got == (step, source), "%s: rank %d resumed step=%d from=%s, expected step=%d from=%s" %
                  (phase, rank, got[0], got[1], step, source))
        log("%s: all %d ranks resumed step=%d from=%s, every element checked" % (phase, len(procs), step, source))

    def kill_all(self):
        kill_processes(self.sims)


def run_with_daemon_harness(run, prefix, jobs, bin_dir, keep=False, errors=(TestFailure,), harness=None):
    """Runs run(h) in a new temporary folder and returns the exit status: 0, or 1 after printing the
    failure and the tail of every log. `harness(bin_dir, tmp)` builds h (default DaemonHarness);
    `jobs` lists the job names, or is a callable that gives them from h. Whatever happened, it kills
    the harness's processes (h.kill_all, where there is one), stops the daemon, removes the jobs'
    shared-memory segments and the folder (kept with keep, or on failure with FLASHCKPT_KEEP_TMP=1)."""
    # UNIX socket paths are limited to 108 bytes: keep the folder short.
    base = tempfile.gettempdir()
    if len(base) > 40:
        base = "/tmp"
    tmp = tempfile.mkdtemp(prefix=prefix, dir=base)
    h = (harness or DaemonHarness)(os.path.abspath(bin_dir), tmp)
    if h.daemon_log is None:
        h.daemon_log = os.path.join(tmp, "flashckptd.log")
    start = time.monotonic()
    ok = False
    try:
        run(h)
        ok = True
        log("PASSED in %.1fs" % (time.monotonic() - start))
        return 0
    except errors as e:
        print("FAILED: %s" % e, flush=True)
        for path in h.logs:
            if path and os.path.exists(path):
                print("---- %s (last lines)\n%s" % (path, tail(path)), flush=True)
        return 1
    finally:
        if hasattr(h, "kill_all"):
            h.kill_all()
        h.stop_daemon()
        for job in (jobs(h) if callable(jobs) else jobs):  # job names carry the test's pid: unique to this run
            for seg in glob.glob("/dev/shm/flashckpt.%s.*" % job):
                try:
                    os.unlink(seg)
                except OSError:
                    pass
        if keep or (not ok and os.environ.get("FLASHCKPT_KEEP_TMP") == "1"):
            print("kept %s" % tmp, flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def check_flipped_byte_is_caught(h, ckpt_dir, bad_file, tensor):
    """Copies the checkpoint ckpt_dir and flips one bit in the middle of `tensor` in `bad_file`:
    `flashckpt verify` and the independent reader must both refuse the copy and name the file.
    Returns verify's exit status."""
    import flashckpt_reader as reader  # the reader uses nothing of this module
    bad_dir = os.path.join(h.tmp, "corrupt", os.path.basename(os.path.dirname(ckpt_dir)), os.path.basename(ckpt_dir))
    shutil.copytree(ckpt_dir, bad_dir)
    st = reader.read_safetensors(os.path.join(bad_dir, bad_file))
    t = st.tensors[tensor]
    where = t.begin + (t.end - t.begin) // 2
    with open(st.path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x01]))
    rc, out, err = h.cli("verify", bad_dir)
    check(rc != 0, "flashckpt verify accepted a checkpoint with a flipped byte in %s:\n%s%s" % (bad_file, out, err))
    check(bad_file in out + err, "flashckpt verify did not name %s:\n%s%s" % (bad_file, out, err))
    try:
        reader.verify_checkpoint(bad_dir)
        raise TestFailure("the independent reader accepted a flipped byte in %s" % bad_file)
    except reader.CheckpointError as e:
        check(bad_file in str(e), "reader error does not name %s: %s" % (bad_file, e))
    return rc
