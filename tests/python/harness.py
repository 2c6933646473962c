"""What the Python tests share: a real flashckptd on a temporary socket and root.

    with Daemon() as d:             # starts build/bin/flashckptd, waits for its socket
        job = d.job("ema")          # a job name unique to this test run
        ...                         # flashckpt.Client(d.socket, job, ...)
    # SIGTERM (SIGKILL if it does not exit), the temp dir and the jobs' /dev/shm EMA segments removed

FLASHCKPT_BIN_DIR names the directory of flashckptd (ctest sets it; default build/bin of this
checkout), and FLASHCKPT_TEST_KEEP=1 keeps the temp dir for a look after a failure.
"""

import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # keep the source tree clean

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN_DIR = os.environ.get("FLASHCKPT_BIN_DIR", os.path.join(REPO, "build", "bin"))
PYTHON_DIR = os.environ.get("FLASHCKPT_PYTHON_DIR", os.path.join(REPO, "build", "python"))
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


def wait_for(pred, timeout, what, poll=0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(poll)


class Daemon:
    def __init__(self, max_host_memory="1GiB", extra_args=()):
        # /tmp rather than $TMPDIR: a UNIX socket path must stay under 108 bytes.
        self.tmp = tempfile.mkdtemp(prefix="fc-py.", dir="/tmp")
        self.socket = os.path.join(self.tmp, "flashckptd.sock")
        self.root = os.path.join(self.tmp, "root")
        self.log = os.path.join(self.tmp, "flashckptd.log")
        self.max_host_memory = max_host_memory
        self.extra_args = list(extra_args)
        self.jobs = []
        self.proc = None

    def job(self, name):
        job = "pytest-%s-%d-%d" % (name, os.getpid(), len(self.jobs))
        self.jobs.append(job)
        return job

    def job_dir(self, job):
        return os.path.join(self.root, job)

    def start(self):
        binary = os.path.join(BIN_DIR, "flashckptd")
        if not os.access(binary, os.X_OK):
            raise AssertionError("%s is missing or not executable (build first)" % binary)
        cmd = [binary, "--socket", self.socket, "--root", self.root, "--max-host-memory", self.max_host_memory,
               "--log-level", "info"] + self.extra_args
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError("flashckptd exited with %s before creating its socket:\n%s"
                                     % (self.proc.returncode, self.log_tail()))
            return os.path.exists(self.socket) and stat.S_ISSOCK(os.stat(self.socket).st_mode)
        wait_for(ready, 30, "the daemon socket %s" % self.socket)
        return self

    def stop(self):
        """SIGTERM, then its exit status (None when it had to be SIGKILLed)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return None

    def cleanup(self):
        self.stop()
        for job in self.jobs:
            for path in glob.glob("/dev/shm/flashckpt.%s.*" % job):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if os.environ.get("FLASHCKPT_TEST_KEEP") == "1":
            print("kept %s" % self.tmp, file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def log_tail(self, lines=30):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as e:
            return "(no daemon log: %s)" % e

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc):
        self.cleanup()
        return False
