#!/usr/bin/python3
"""The extension module says what the build has, as `flashckpt --version` does.

- `_flashckpt.__version__` and `_flashckpt.cuda_info()` are the version and the CUDA text that
  `flashckpt --version` prints ("flashckpt <version> (<cuda>)"): one source of truth, no copy;
- `_flashckpt.WITH_CUDA` is true exactly when that text says "CUDA compiled in";
- a tensor on a GPU is taken (as device memory) exactly in a build with CUDA, and refused saying
  "built without CUDA" in a build without it; a tensor on another device is refused in both;
- in a process that sees no CUDA device, a buffer marked as device memory is refused by the
  library with the runtime's reason, before a slot is taken, and the next snapshot of host memory
  is saved as usual.
"""

import os
import re
import subprocess
import sys
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from flashckpt import _flashckpt, _tensors  # noqa: E402


def cli_version():
    out = subprocess.run([os.path.join(harness.BIN_DIR, "flashckpt"), "--version"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60, check=True).stdout.decode().strip()
    m = re.fullmatch(r"flashckpt (\S+) \((.*)\)", out)
    if not m:
        raise AssertionError("flashckpt --version printed %r" % out)
    return m.group(1), m.group(2)


class BuildInfoTest(unittest.TestCase):
    def test_version_and_cuda_text_are_the_clis(self):
        version, cuda = cli_version()
        self.assertEqual(_flashckpt.__version__, version)
        self.assertEqual(_flashckpt.cuda_info(), cuda)

    def test_with_cuda_is_the_compile_time_fact(self):
        _, cuda = cli_version()
        self.assertIn(cuda.split(",")[0], ("CUDA compiled in", "CUDA not compiled in"))
        self.assertEqual(_flashckpt.WITH_CUDA, cuda.startswith("CUDA compiled in"),
                         "flashckpt --version says %r" % cuda)
        if _flashckpt.WITH_CUDA and not re.fullmatch(r"CUDA compiled in, \d+ devices?", cuda):
            # A machine without a GPU: said as such, with the runtime's own words in parentheses.
            self.assertRegex(cuda, r"^CUDA compiled in, no CUDA device or driver \(cudaGetDeviceCount: .+\)$")

    def test_a_gpu_tensor_is_taken_exactly_with_cuda(self):
        if _flashckpt.WITH_CUDA:
            self.assertEqual(_tensors._device_of("w", "cuda:1", 1), 1)
        else:
            with self.assertRaisesRegex(ValueError, r"tensor 'w' is on cuda:1, but libflashckpt was built without "
                                                    r"CUDA"):
                _tensors._device_of("w", "cuda:1", 1)
        with self.assertRaisesRegex(ValueError, r"tensor 'w' is on mps:0; flashckpt copies host memory and CUDA "
                                                r"device memory only"):
            _tensors._device_of("w", "mps:0", None)
        self.assertEqual(_tensors._device_of("w", "cpu", None), -1)

    def test_device_memory_without_a_device_is_refused_before_a_slot_is_taken(self):
        if re.fullmatch(r"CUDA compiled in, \d+ devices?", _flashckpt.cuda_info()):
            self.skipTest("this process sees a CUDA device: %s" % _flashckpt.cuda_info())
        import numpy as np
        import flashckpt
        with harness.Daemon() as d:
            w = np.arange(1024, dtype=np.float32)
            with flashckpt.Client(d.socket, job=d.job("nodevice")) as c:
                c.register({"w": w})
                # The bindings' own form of a CUDA tensor: (name, address, bytes, on_device).
                with self.assertRaises(flashckpt.errors.FailedPreconditionError) as e:
                    c._live().snapshot(1, [("w", w.ctypes.data, w.nbytes, True)], True, None, b"", "disk", 0)
                expected = ("no usable CUDA device" if _flashckpt.WITH_CUDA else "built without CUDA")
                self.assertIn("tensor 'w' is marked as CUDA device memory", str(e.exception))
                self.assertIn(expected, str(e.exception))
                snap = c.snapshot(1, {"w": w})
                self.assertFalse(snap.on_device)
                snap.wait_copied()
                snap.wait_committed()
                c.wait_persisted(1, timeout=60)


if __name__ == "__main__":
    unittest.main()
