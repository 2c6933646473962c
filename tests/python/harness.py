"""What the Python tests share: a real flashckptd on a temporary socket and root.

    with Daemon() as d:             # starts build/bin/flashckptd, waits for its socket
        job = d.job("ema")          # a job name unique to this test run
        ...                         # flashckpt.Client(d.socket, job, ...)
    # SIGTERM (SIGKILL if it does not exit), the temp dir and the jobs' /dev/shm EMA segments removed

    w = spawn(__file__, ["worker", ...], log=path)   # a worker process, forked with torch imported

FLASHCKPT_BIN_DIR names the directory of flashckptd (ctest sets it; default build/bin of this
checkout), and FLASHCKPT_TEST_KEEP=1 keeps the temp dir for a look after a failure.
"""

import glob
import importlib.util
import itertools
import json
import multiprocessing
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BIN_DIR = os.environ.get("FLASHCKPT_BIN_DIR", os.path.join(REPO, "build", "bin"))
PYTHON_DIR = os.environ.get("FLASHCKPT_PYTHON_DIR", os.path.join(REPO, "build", "python"))
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# The daemon start/stop of the integration tests (tests/integration/harness.py). Loaded by path under
# another name: `import harness` here would find this module.
_spec = importlib.util.spec_from_file_location(
    "flashckpt_integration_harness", os.path.join(REPO, "tests", "integration", "harness.py"))
integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(integration)


def import_or_skip(*names):
    """The modules `names`, imported in order; where one cannot be imported the test prints why and
    exits 77 (ctest's skip): the venv of scripts/deps.sh has them, another python may not."""
    try:
        return [importlib.import_module(n) for n in names]
    except ImportError as e:
        print("SKIPPED: %s cannot be imported here (%s): run scripts/deps.sh and use its venv's python"
              % (" and ".join(names), e))
        sys.exit(77)


def cuda_skip_reason():
    """Why the CUDA tests cannot run here, or None: torch sees no device, or libflashckpt has no CUDA."""
    import torch
    from flashckpt import _flashckpt
    if not torch.cuda.is_available():
        return "torch %s sees no CUDA device" % torch.__version__
    if not _flashckpt.WITH_CUDA:
        return "libflashckpt was built without CUDA"
    return None


_rendezvous_count = itertools.count()


def rendezvous(tmp):
    """A torch.distributed init_method for one process group: a file under `tmp` that no other
    group uses (a FileStore). A TCP port picked free and then bound by rank 0 could be taken in
    between by a test running beside this one (EADDRINUSE)."""
    return "file://" + os.path.join(tmp, "rendezvous-%d-%d" % (os.getpid(), next(_rendezvous_count)))


def read_loss_log(path):
    """{step: loss} of a trainer's --log file (one JSON line per step: examples/train_mlp.py,
    train_paddle.py); a last line cut by a kill is not a step."""
    losses = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    r = json.loads(line)
                    losses[r["step"]] = r["loss"]
    return losses


def wait_for(pred, timeout, what, poll=0.02):
    return integration.wait_for(pred, timeout, what, poll, error=AssertionError)


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
        binary = integration.binary(BIN_DIR, "flashckptd", error=AssertionError)
        cmd = integration.daemon_command(binary, self.socket, self.root, self.max_host_memory, self.extra_args)
        self.proc = integration.spawn_daemon(cmd, self.log, append=True)
        integration.wait_daemon_ready(self.proc, self.socket, error=AssertionError,
                                      exit_detail=lambda: ":\n%s" % self.log_tail())
        return self

    def stop(self):
        """SIGTERM, then its exit status (None when it had to be SIGKILLed)."""
        return integration.stop_daemon(self.proc)

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


def native_stacks(pid):
    """Every thread's native stack of process `pid` (gdb, when installed), for a test that gives up
    on a process: where C++ code (gloo, the gRPC client) waits, which a Python traceback cannot show."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb to show the native stacks of pid %d)" % pid
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=60)
        return out.stdout.decode(errors="replace")[-20000:]
    except (OSError, subprocess.TimeoutExpired) as e:
        return "(gdb on pid %d failed: %s)" % (pid, e)


def wait_all(procs, deadline):
    """Waits for every process until time.monotonic() reaches `deadline`; if one is still running
    then, prints the native stacks of those still running, kills them all and returns False."""
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    sys.stderr.write("native stacks of pid %d, still running at the deadline:\n%s\n"
                                     % (q.pid, native_stacks(q.pid)))
            for q in procs:
                q.kill()
                q.wait()
            return False
    return True


# Worker processes of the torch.distributed tests are forked from one process that imported torch
# once (multiprocessing's fork server): a fresh interpreter spends seconds importing torch 2 (more
# on a loaded machine), and these tests start a few dozen workers each.
_forkserver = multiprocessing.get_context("forkserver")
_forkserver.set_forkserver_preload(["torch", "torch.distributed"])  # each one skipped if missing


def _run_script(script, args, log, env):
    """In a forked worker: runs `script` as __main__ with sys.argv [script, *args] and os.environ
    `env`, its output to the file `log` (None: where the test's goes); exits with its status."""
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch read it when the fork server imported it
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Worker:
    """A worker process started by spawn(): the part of subprocess.Popen's interface the tests use
    (pid, returncode, poll, wait, kill; a negative returncode is the signal that ended it)."""

    def __init__(self, script, args, log=None, env=None):
        self._process = _forkserver.Process(target=_run_script,
                                            args=(script, [str(a) for a in args], log,
                                                  dict(os.environ if env is None else env)))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["worker %d" % self.pid], timeout)
        return self._process.exitcode

    def kill(self):
        if self._process.exitcode is None:
            self._process.kill()


def spawn(script, args, log=None, env=None):
    """Starts `script` (a test file whose __main__ runs a worker when given these `args`) in a worker
    forked from the fork server, as `python script *args` would run it: its output appended to
    `log` (None: the test's own), os.environ `env` (None: the test's). Returns a Worker."""
    return Worker(script, args, log, env)


def end_worker():
    """Ends a torch.distributed worker process that has written its results, at once: no
    destroy_process_group(), no freeing of the caller's locals, no Python finalization. Call it from
    the function that holds the model, the optimizer and the process groups, after its results are in
    closed files; it does not return.

    Freeing a DistributedDataParallel model or a gloo process group on the main thread runs
    torch 1.13's ~ProcessGroupGloo with the GIL held, and it waits for gloo's worker threads. A
    worker thread that drops the last reference to a finished operation's tensor needs the GIL to
    free its Python object, so the two can wait for each other: the likely cause of pairs of workers
    seen in CI never to finish, their main thread on the line that called the worker function (whose
    locals were being freed). During finalization the same race ends the thread with a forced unwind
    through a noexcept frame ("terminate called without an active exception", SIGABRT from
    ProcessGroupGloo::runLoop). A worker that raised never gets here: it exits 1 with its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DaemonTestCase(unittest.TestCase):
    """A test class sharing one real flashckptd (self.daemon) across its tests."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon().__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.cleanup()
