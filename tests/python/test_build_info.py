#!/usr/bin/python3
"""The extension module says what the build has, as `flashckpt --version` does.

- `_flashckpt.__version__` and `_flashckpt.cuda_info()` are the version and the CUDA text that
  `flashckpt --version` prints ("flashckpt <version> (<cuda>)"): one source of truth, no copy;
- `_flashckpt.WITH_CUDA` is true exactly when that text says "CUDA compiled in";
- the error for a tensor on a GPU says "built without CUDA" only in a build without it.
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

    def test_a_gpu_tensor_is_refused_naming_the_real_build(self):
        message = str(_tensors._not_host("w", "cuda:0"))
        self.assertIn("tensor 'w' is on cuda:0", message)
        self.assertIn("copies host memory only", message)
        self.assertEqual("built without CUDA" in message, not _flashckpt.WITH_CUDA, message)


if __name__ == "__main__":
    unittest.main()
