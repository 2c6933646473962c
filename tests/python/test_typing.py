#!/usr/bin/python3
"""The package's type hints hold, ship, and reach a user's type checker (PEP 561).

- mypy, with the package's own settings (client/python/mypy.ini: every function annotated), finds
  no error in the package's source;
- _flashckpt.pyi describes the extension as built: mypy's stubtest finds the same names in both and
  the module attributes' types, and each function's argument names, defaults and positional-only
  arguments are those pybind11 reports (the py::arg of bindings.cc);
- py.typed and _flashckpt.pyi are in the build tree's package (the list CMake copies and installs)
  and in setup.py's package_data;
- that package, put into a virtual environment's site-packages as pip installs it and checked with
  the environment's interpreter and mypy --strict, as a user's project would: a program using
  Client, export and Checkpointer the documented way passes, and one with deliberate misuses gets
  exactly the errors marked in it, at their lines. Without py.typed mypy does not read an installed
  package (an error, and every name Any); without the stub the extension's names are Any.

The checks that run mypy are skipped when it is not installed (Debian: mypy; scripts/deps.sh
installs it).
"""

import ast
import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SOURCE = os.path.join(harness.REPO, "client", "python")  # setup.py, mypy.ini and flashckpt/
BUILT = os.path.join(harness.PYTHON_DIR, "flashckpt")    # the package as the build makes it
TYPING_FILES = ("py.typed", "_flashckpt.pyi")
HAVE_MYPY = importlib.util.find_spec("mypy") is not None

# Uses the package the way its docstrings and README show; under --strict it must pass.
GOOD = '''
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import flashckpt
from flashckpt.torch import Checkpointer


def client_loop(socket: str) -> None:
    w = np.zeros((1024, 1024), np.float32)
    with flashckpt.Client(socket, job="llama", ema_decay=0.999) as c:
        c.register({"w": w}, specs={"w": {"kind": "model"}})
        step, extra = c.restore({"w": w})
        data: Optional[bytes] = extra
        for s in range(step or 0, 1000):
            snap: flashckpt.Snapshot = c.snapshot(s, {"w": w}, persist=s % 100 == 0, extra={"data_pos": s})
            snap.wait_copied()
        c.wait_persisted(900, timeout=600)
        c.wait_complete(900)
        ema_step, ema = c.ema()
        first: Any = ema["w"]
        names: List[str] = c.ema_names
        status: Dict[str, Any] = c.status()
        run: str = c.run_id
    try:
        flashckpt.Client("/nonexistent.sock", "llama", rank=1, connect_timeout=0.1)
    except flashckpt.DaemonUnavailableError as e:
        code: str = e.code
    report = flashckpt.export("/root/llama/checkpoint-900", "/tmp/hf", weights="ema", dtype="bf16")
    files: List[str] = report["files"]
    version: str = flashckpt.__version__


def torch_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    ck = Checkpointer(model, optimizer, socket="/run/flashckpt/flashckptd.sock", job="mlp",
                      ema_decay=0.999, ema_interval=1)
    start = ck.resume()
    pos = ck.extra["data_pos"] if start is not None else 0
    step = 0
    for step in range((start or 0) + 1, n + 1):
        ck.wait_copied()
        if step % 10 == 0:
            ck.save(step, extra={"data_pos": pos}, loss=0.5)
        else:
            ck.save(step, persist=False)
    ck.wait_persisted(step, timeout=600)
    ema: Dict[str, torch.Tensor] = ck.ema_state_dict()
    states = Checkpointer({"model": model, "optim": optimizer, "data": {"epoch": 0}}, socket="s", job="j",
                          shard_specs={"fc1.weight": (0, 0, 2)})
    loaded: Optional[int] = states.load_pretrained(job="pretrained")
    states.close()
'''

# Each line marked "# E: <text>" must get exactly one mypy error containing <text>; no other line any.
BAD = '''
import flashckpt
from flashckpt.torch import Checkpointer


def misuse(c: flashckpt.Client, ck: Checkpointer) -> None:
    c.wait_persisted(step="x")  # E: Argument "step" to "wait_persisted" of "Client" has incompatible type "str"
    ck.save("7")  # E: Argument 1 to "save" of "Checkpointer" has incompatible type "str"
    step, extra = c.restore({})
    text: str = extra  # E: Incompatible types in assignment
    version: int = flashckpt.__version__  # E: Incompatible types in assignment
    flashckpt.Client("/run/flashckpt/flashckptd.sock", "j", ema_decay="0.999")  # E: Argument "ema_decay" to "Client"
    ck.resume(timout=5.0)  # E: Unexpected keyword argument "timout"
    flashckpt.export("/ckpt", "/out", threads=None)  # E: Argument "threads" to "export"
'''

USER_CONFIG = '''
[mypy]
strict = True

# The environment has neither: their names are Any in the user's program.
[mypy-torch.*,numpy.*]
ignore_missing_imports = True
'''


def run(cmd, cwd, timeout=120, **env_vars):
    """(exit status, stdout and stderr) of `cmd`, in the environment plus `env_vars`."""
    env = dict(os.environ)
    for name in ("MYPYPATH", "PYTHONPATH"):  # only what each check names: ctest puts build/python on PYTHONPATH
        env.pop(name, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(env_vars)
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode, proc.stdout.decode("utf-8", "replace")


def pybind_parameters(doc):
    """[(name, default text or None)] of the first line of a pybind11 docstring, without `self`."""
    text = doc.strip().splitlines()[0]
    inner = text[text.index("(") + 1:text.rindex(") ->")]
    params, depth, start, quote = [], 0, 0, None
    for i, ch in enumerate(inner + ","):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(inner[start:i].strip())
            start = i + 1
    out = []
    for p in params:
        if not p:
            continue
        name = p.split(":", 1)[0].strip()
        default = p.split(" = ", 1)[1] if " = " in p else None
        if name != "self":
            out.append((name, default))
    return out


def stub_parameters(func):
    """[(name, default or None, positional only)] of a function in the stub, without `self`."""
    a = func.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    out = [(p.arg, d, i < len(a.posonlyargs)) for i, (p, d) in enumerate(zip(positional, defaults))]
    return [p for p in out if p[0] != "self"]


class ShippingTest(unittest.TestCase):
    """The build and setup.py ship the hint files (no mypy needed)."""

    def test_the_hint_files_ship(self):
        for f in TYPING_FILES:
            self.assertTrue(os.path.isfile(os.path.join(BUILT, f)),
                            "%s is not in the build's package %s (client/python/CMakeLists.txt)" % (f, BUILT))
            self.assertTrue(filecmp.cmp(os.path.join(BUILT, f), os.path.join(SOURCE, "flashckpt", f), shallow=False),
                            "%s in %s differs from the source" % (f, BUILT))
        with open(os.path.join(SOURCE, "setup.py")) as f:
            setup = ast.parse(f.read())
        calls = [n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
        self.assertEqual(len(calls), 1)
        package_data = next((ast.literal_eval(k.value) for k in calls[0].keywords if k.arg == "package_data"), {})
        self.assertEqual(sorted(package_data.get("flashckpt", [])), sorted(TYPING_FILES),
                         "setup.py's package_data for flashckpt")


@unittest.skipUnless(HAVE_MYPY, "mypy is not installed (Debian: apt-get install mypy; scripts/deps.sh installs it)")
class TypingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fc-typing.")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def mypy(self, args, cwd):
        return run([sys.executable, "-m", "mypy", "--cache-dir", os.path.join(self.tmp, "cache"), *args], cwd)

    def test_the_package_source_has_no_type_error(self):
        rc, out = self.mypy(["--config-file", "mypy.ini", "flashckpt"], SOURCE)
        self.assertEqual(rc, 0, "mypy --config-file mypy.ini flashckpt (in client/python):\n" + out)
        self.assertIn("Success: no issues found", out)

    def test_the_stub_describes_the_extension(self):
        # Names and attribute types. pybind11's classes have a metaclass of their own, which a stub
        # does not state.
        rc, out = run([sys.executable, "-m", "mypy.stubtest", "--concise", "--mypy-config-file",
                       os.path.join(SOURCE, "mypy.ini"), "flashckpt._flashckpt"], self.tmp,
                      PYTHONPATH=harness.PYTHON_DIR, MYPYPATH=harness.PYTHON_DIR)
        errors = [line for line in out.splitlines()
                  if line.startswith("flashckpt.") and "metaclass differs" not in line]
        self.assertIn(rc, (0, 1), "stubtest failed to run:\n" + out)
        self.assertEqual(errors, [], "stubtest: _flashckpt.pyi differs from the extension:\n" + out)

        # Argument names, defaults and positional-only arguments: pybind11 writes each function's
        # signature as the first line of its docstring (arg0, arg1, ... where bindings.cc names none).
        from flashckpt import _flashckpt
        with open(os.path.join(BUILT, "_flashckpt.pyi")) as f:
            stub = ast.parse(f.read())
        functions = {}
        for node in stub.body:
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = (node, getattr(_flashckpt, node.name))
            elif isinstance(node, ast.ClassDef):
                cls = getattr(_flashckpt, node.name)
                for member in node.body:
                    if not isinstance(member, ast.FunctionDef):
                        continue
                    if member.name == "__init__" and not (cls.__init__.__doc__ or "").startswith("__init__("):
                        continue  # no py::init in bindings.cc: pybind11's own, which raises
                    functions["%s.%s" % (node.name, member.name)] = (member, getattr(cls, member.name))
        self.assertIn("Client.restore", functions)
        for name, (node, obj) in functions.items():
            runtime = pybind_parameters(obj.__doc__)
            declared = stub_parameters(node)
            self.assertEqual(len(declared), len(runtime), "%s: the stub has %s, the extension %s"
                             % (name, declared, runtime))
            for (sname, sdefault, posonly), (rname, rdefault) in zip(declared, runtime):
                if re.fullmatch(r"arg\d+", rname):
                    self.assertTrue(posonly, "%s: argument %s is unnamed in bindings.cc, so positional-only"
                                    % (name, sname))
                else:
                    self.assertFalse(posonly, "%s: argument %s has a name in bindings.cc" % (name, sname))
                    self.assertEqual(sname, rname, "%s: the stub names an argument %s, the extension %s"
                                     % (name, sname, rname))
                self.assertEqual(sdefault, None if rdefault is None else ast.literal_eval(rdefault),
                                 "%s: default of %s" % (name, sname))


    def test_a_users_type_checker_reads_the_hints(self):
        # An environment whose site-packages holds the package as pip installs it (the extension
        # itself is left out: its stub is what a type checker reads).
        venv = os.path.join(self.tmp, "venv")
        rc, out = run([sys.executable, "-m", "venv", "--without-pip", venv], self.tmp)
        self.assertEqual(rc, 0, "python3 -m venv:\n" + out)
        python = os.path.join(venv, "bin", "python")
        rc, site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], self.tmp)
        self.assertEqual(rc, 0, site)
        shutil.copytree(BUILT, os.path.join(site.strip(), "flashckpt"),
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        project = os.path.join(self.tmp, "project")
        os.mkdir(project)
        for name, text in (("mypy.ini", USER_CONFIG), ("good.py", GOOD), ("bad.py", BAD)):
            with open(os.path.join(project, name), "w") as f:
                f.write(textwrap.dedent(text).lstrip("\n"))

        def check(program):
            return self.mypy(["--config-file", "mypy.ini", "--python-executable", python, program], project)

        rc, out = check("good.py")
        self.assertEqual(rc, 0, "mypy --strict on a program using the package as documented:\n" + out)

        rc, out = check("bad.py")
        expected = {}
        for number, line in enumerate(textwrap.dedent(BAD).lstrip("\n").splitlines(), 1):
            if "# E: " in line:
                expected[number] = line.split("# E: ", 1)[1]
        reported = {}
        for m in re.finditer(r"^bad\.py:(\d+): error: (.*)$", out, re.M):
            reported.setdefault(int(m.group(1)), []).append(m.group(2))
        self.assertEqual(sorted(reported), sorted(expected), "lines with errors, expected vs mypy:\n" + out)
        for number, text in expected.items():
            self.assertEqual(len(reported[number]), 1, out)
            self.assertIn(text, reported[number][0], "bad.py:%d" % number)


if __name__ == "__main__":
    unittest.main()
