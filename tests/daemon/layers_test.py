"""The daemon's layers depend one way: edge -> core -> pipeline / parity -> replica -> observe -> common.

Reads every #include of the source tree given as argv[1] and fails, naming the file and the line,
where a layer includes one above it, or where a layer other than the edge, the replica channel and
the parity group on it (whose wire format it is) includes a generated protobuf header. The client's public headers
(flashckpt/...) are the vocabulary every layer may use.
"""
import os
import re
import sys
import unittest

SRC = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")

# What each layer may include, besides itself and flashckpt/ (the public types).
ALLOWED = {
    "daemon/core": ("common/", "daemon/pipeline/", "daemon/parity/", "daemon/replica/", "daemon/observe/"),
    "daemon/parity": ("common/", "daemon/replica/", "daemon/observe/", "proto/"),
    "daemon/pipeline": ("common/", "daemon/observe/"),
    "daemon/replica": ("common/", "daemon/observe/", "proto/"),
    "daemon/observe": ("common/",),
    "common": (),
}
PROTOBUF_ALLOWED = ("daemon/edge", "daemon/replica", "daemon/parity")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def includes(layer):
    root = os.path.join(SRC, layer)
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith((".h", ".cc", ".cu", ".cuh")):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m:
                        yield os.path.relpath(path, SRC), number, m.group(1)


class LayersTest(unittest.TestCase):
    def test_each_layer_includes_only_the_layers_below_it(self):
        wrong = []
        for layer, allowed in ALLOWED.items():
            seen = 0
            for path, number, target in includes(layer):
                seen += 1
                if "/" not in target or target.startswith((layer + "/", "flashckpt/")):
                    continue  # a generated header (checked below), its own layer, or the public types
                if not target.startswith(allowed):
                    wrong.append("%s:%d includes %s" % (path, number, target))
            self.assertGreater(seen, 0, "no source files under %s/%s" % (SRC, layer))
        self.assertEqual(wrong, [], "includes against the layers:\n" + "\n".join(wrong))

    def test_only_the_edge_and_the_replica_channel_include_protobuf(self):
        wrong = []
        for layer in ALLOWED:
            if layer in PROTOBUF_ALLOWED:
                continue
            for path, number, target in includes(layer):
                if target.endswith(".pb.h"):
                    wrong.append("%s:%d includes %s" % (path, number, target))
        self.assertEqual(wrong, [], "generated protobuf headers below the edge:\n" + "\n".join(wrong))


if __name__ == "__main__":
    unittest.main()
