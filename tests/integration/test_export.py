#!/usr/bin/python3
"""flashckpt export: a checkpoint's weights as a Hugging Face safetensors directory.

Eight flashckpt-sim ranks in layout (tp, pp, shard) = (2, 2, 2) with an EMA save steps 2 and 4 through
a real daemon. Then, read back by the independent reader (flashckpt_reader.py: json + numpy, nothing
of flashckpt's):
  1. `--weights model` into one file: model.safetensors, "format": "pt" in __metadata__, tensors in
     name order, every layers.<l>.weight equal to the simulator's formula at step 4 over the whole
     global tensor (its tp boxes and pipeline stages merged), no optimizer or EMA tensor;
  2. `--weights ema --max-shard-size` small enough for several files: model-0000K-of-0000N plus
     model.safetensors.index.json, whose weight_map names every tensor's file and whose total_size
     is the sum of the tensors; the tensors equal the checkpoint's EMA as the reader assembles it;
  3. `--dtype bf16`: every value bit for bit what torch's .to(torch.bfloat16) makes of the fp32 one;
  4. `--strip-prefix layers.`: the names lose it;
  5. flashckpt.export (Python) writes the same bytes as the command;
  6. a flipped byte in a model file: exit 1 naming the file, and the destination is left as it was
     (absent stays absent; an empty one stays empty when the export is sharded and files before the
     bad one were complete), nothing is left beside it, and the retry into it is taken; a non-empty
     destination: exit 3; a destination inside the checkpoint, another checkpoint folder or the root: exit 3.

    test_export.py --bin-dir build/bin [--python-dir build/python] [--keep]
"""

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
import numpy as np  # noqa: E402

from harness import TestFailure, check, log, run_with_daemon_harness  # noqa: E402
import flashckpt_reader as reader  # noqa: E402

JOB = "export-%d" % os.getpid()
LAYERS, HIDDEN, STEPS = 4, 96, 4


def run_ranks(h):
    t, p, d = 2, 2, 2
    world = t * p * d
    procs = []
    for rank in range(world):
        out = os.path.join(h.tmp, "sim-rank%d.log" % rank)
        h.logs.append(out)
        cmd = [h.binary("flashckpt-sim"), "--socket", h.sock, "--job", JOB, "--rank", str(rank),
               "--world-size", str(world), "--tp-degree", str(t), "--pp-degree", str(p), "--shard-degree", str(d),
               "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--steps", str(STEPS), "--save-every", "2",
               "--ema-decay", "0.9", "--run-id", "export-run", "--wait-timeout", "60"]
        procs.append((subprocess.Popen(cmd, stdout=open(out, "wb"), stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL), out))
    deadline = time.monotonic() + 120
    for proc, out in procs:
        try:
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise TestFailure("a simulator rank did not finish within 120 s")
        check(rc == 0, "a simulator rank exited %d:\n%s" % (rc, open(out, errors="replace").read()))


def read_export(out_dir):
    """{name: (dtype, shape, bytes)} of an exported directory, checking the layout rules."""
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    leftovers = [f for f in os.listdir(out_dir) if f not in files and f != "model.safetensors.index.json"]
    check(not leftovers, "%s holds more than the export: %s" % (out_dir, leftovers))
    index = None
    if len(files) == 1:
        check(files == ["model.safetensors"], "one file must be model.safetensors, got %s" % files)
        check(not os.path.exists(index_path), "a one-file export has an index")
    else:
        n = len(files)
        check(files == ["model-%05d-of-%05d.safetensors" % (k + 1, n) for k in range(n)], "shard names: %s" % files)
        with open(index_path) as f:
            index = json.load(f)
    tensors = {}
    for fname in files:
        st = reader.read_safetensors(os.path.join(out_dir, fname))
        check(st.metadata.get("format") == "pt", "%s: __metadata__ format is %r" % (fname, st.metadata.get("format")))
        names = list(st.tensors)  # in data order
        check(names == sorted(names), "%s: tensors not in name order: %s" % (fname, names))
        for name, t in st.tensors.items():
            check(name not in tensors, "tensor %s is in two files" % name)
            tensors[name] = (t.dtype, tuple(t.shape), bytes(st.tensor_bytes(name)), fname)
    order = sorted(tensors)
    check(order == sorted(order, key=lambda n: (tensors[n][3], n)), "tensors are not in name order across the files")
    if index is not None:
        check(index["weight_map"] == {n: v[3] for n, v in tensors.items()},
              "the index's weight_map is not where the tensors are: %s" % index["weight_map"])
        total = sum(len(v[2]) for v in tensors.values())
        check(index["metadata"]["total_size"] == total,
              "index total_size %s, the tensors have %d bytes" % (index["metadata"]["total_size"], total))
    return tensors, files


def export(h, *args):
    rc, out, err = h.cli("export", *args, timeout=120)
    check(rc == 0, "flashckpt export %s exited %d:\n%s%s" % (" ".join(args), rc, out, err))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--python-dir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    def run(h):
        h.start_daemon()
        run_ranks(h)
        ckpt = os.path.join(h.root, JOB, "checkpoint-%d" % STEPS)
        reader.verify_checkpoint(ckpt, layers=LAYERS, hidden=HIDDEN)
        names = ["layers.%d.weight" % l for l in range(LAYERS)]
        expected = {}
        for l, name in enumerate(names):
            flat = np.arange(HIDDEN * HIDDEN, dtype=np.int64)
            expected[name] = reader.sim_expected(l, HIDDEN, STEPS, flat).reshape(HIDDEN, HIDDEN)

        # 1. Model weights, one file.
        model_dir = os.path.join(h.tmp, "model")
        log(export(h, ckpt, model_dir).strip())
        tensors, files = read_export(model_dir)
        check(sorted(tensors) == names, "exported tensors %s, expected %s" % (sorted(tensors), names))
        for name in names:
            dtype, shape, raw, _ = tensors[name]
            check(dtype == "F32" and shape == (HIDDEN, HIDDEN), "%s: %s %s" % (name, dtype, shape))
            got = np.frombuffer(raw, dtype=np.float32).reshape(shape)
            check(np.array_equal(got, expected[name]), "%s differs from the formula at step %d" % (name, STEPS))
        log("--weights model: %s, %d tensors equal to the formula" % (files, len(names)))

        # 2. EMA, several files and the index.
        ema = reader.read_ema(ckpt)
        check(sorted(ema) == names, "the checkpoint's EMA tensors: %s" % sorted(ema))
        ema_dir = os.path.join(h.tmp, "ema")
        log(export(h, ckpt, ema_dir, "--weights", "ema", "--max-shard-size", str(HIDDEN * HIDDEN * 4 * 2)).strip())
        tensors, files = read_export(ema_dir)
        check(len(files) == 2, "--max-shard-size of two tensors made %s" % files)
        for name in names:
            got = np.frombuffer(tensors[name][2], dtype=np.float32).reshape(HIDDEN, HIDDEN)
            check(np.array_equal(got, ema[name]), "%s: the exported EMA differs from the checkpoint's" % name)
        check(not any(np.array_equal(ema[n], expected[n]) for n in names), "the EMA equals the weights: no test")
        log("--weights ema: %s + index, equal to the checkpoint's EMA" % files)

        # 3. bf16, as torch rounds.
        import torch
        bf16_dir = os.path.join(h.tmp, "bf16")
        export(h, ckpt, bf16_dir, "--dtype", "bf16", "--weights", "ema")
        tensors, _ = read_export(bf16_dir)
        for name in names:
            dtype, shape, raw, _ = tensors[name]
            check(dtype == "BF16" and shape == (HIDDEN, HIDDEN), "%s: %s %s" % (name, dtype, shape))
            want = torch.from_numpy(ema[name].copy()).to(torch.bfloat16).view(torch.int16).numpy()
            check(np.array_equal(np.frombuffer(raw, dtype=np.int16).reshape(shape), want),
                  "%s: bf16 differs from torch's .to(torch.bfloat16)" % name)
        log("--dtype bf16: bit for bit torch's rounding")

        # 4. Names without a prefix.
        strip_dir = os.path.join(h.tmp, "strip")
        export(h, ckpt, strip_dir, "--strip-prefix", "layers.")
        tensors, _ = read_export(strip_dir)
        check(sorted(tensors) == ["%d.weight" % l for l in range(LAYERS)], "--strip-prefix: %s" % sorted(tensors))

        # 5. The Python function writes the same files.
        if args.python_dir:
            py_dir = os.path.join(h.tmp, "python-ema")
            code = ("import sys, flashckpt; r = flashckpt.export(sys.argv[1], sys.argv[2], weights='ema', "
                    "max_shard_size=%d); print(r)" % (HIDDEN * HIDDEN * 4 * 2))
            p = subprocess.run([sys.executable, "-c", code, ckpt, py_dir], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=120, env=dict(os.environ, PYTHONPATH=args.python_dir))
            check(p.returncode == 0, "flashckpt.export failed:\n%s" % p.stdout.decode(errors="replace"))
            for fname in sorted(os.listdir(ema_dir)):
                check(filecmp.cmp(os.path.join(ema_dir, fname), os.path.join(py_dir, fname), shallow=False),
                      "flashckpt.export wrote another %s than the command" % fname)
            log("flashckpt.export: %s, the same bytes" % p.stdout.decode().strip())

        # 6. A corrupt checkpoint and a used destination.
        bad = os.path.join(h.tmp, "corrupt", JOB, "checkpoint-%d" % STEPS)
        shutil.copytree(ckpt, bad)
        bad_file = "model_state.tp01_pp01_shard00.safetensors"
        st = reader.read_safetensors(os.path.join(bad, bad_file))
        t = st.tensors[sorted(st.tensors)[0]]
        with open(st.path, "r+b") as f:
            f.seek(t.begin + 5)
            b = f.read(1)[0]
            f.seek(t.begin + 5)
            f.write(bytes([b ^ 0x10]))
        bad_out = os.path.join(h.tmp, "from-corrupt")
        rc, out, err = h.cli("export", bad, bad_out)
        check(rc == 1 and bad_file in err, "export of a corrupt checkpoint: exit %d, expected 1 naming %s:\n%s%s"
              % (rc, bad_file, out, err))
        check(not os.path.exists(bad_out), "an export that failed left its destination %s: %s"
              % (bad_out, os.listdir(bad_out) if os.path.isdir(bad_out) else "a file"))
        # Sharded, one tensor a file: the files before the corrupt tensor's are complete when it fails;
        # the (empty) destination is left as it was, with nothing beside it, and a retry is not refused.
        sharded_out = os.path.join(h.tmp, "sharded-out")
        os.mkdir(sharded_out)
        rc, out, err = h.cli("export", bad, sharded_out, "--max-shard-size", str(HIDDEN * HIDDEN * 4))
        check(rc == 1 and bad_file in err, "sharded export of a corrupt checkpoint: exit %d:\n%s%s" % (rc, out, err))
        check(os.listdir(sharded_out) == [], "a failed sharded export left %s in its destination"
              % sorted(os.listdir(sharded_out)))
        check(not [f for f in os.listdir(h.tmp) if ".export-" in f], "a failed export left its staging folder: %s"
              % sorted(os.listdir(h.tmp)))
        with open(st.path, "r+b") as f:  # repaired: the same destination takes the retry
            f.seek(t.begin + 5)
            f.write(bytes([b]))
        log(export(h, bad, sharded_out, "--max-shard-size", str(HIDDEN * HIDDEN * 4)).strip())
        tensors, files = read_export(sharded_out)
        check(len(files) == LAYERS and sorted(tensors) == names, "the retried export: %s %s" % (files, sorted(tensors)))
        rc, out, err = h.cli("export", ckpt, model_dir)
        check(rc == 3 and "not empty" in err, "export into a non-empty directory: exit %d:\n%s" % (rc, err))
        # Destinations retention would delete (inside the checkpoint, or inside another checkpoint
        # folder) and any inside the checkpoint's root, whose folders the daemon takes for jobs.
        for inside in (os.path.join(ckpt, "inside"), os.path.join(h.root, JOB, "checkpoint-2", "exported"),
                       os.path.join(h.root, "exports", "model"), os.path.join(h.root, JOB, "hf")):
            rc, out, err = h.cli("export", ckpt, inside)
            check(rc == 3 and "is inside" in err, "export into %s: exit %d, expected 3 (is inside):\n%s%s"
                  % (inside, rc, out, err))
            check(not os.path.exists(inside), "a refused export made %s" % inside)
        # A checkpoint folder copied out of the root (no LATEST beside it) has no root: an export next
        # to it is taken.
        copied_ckpt = os.path.join(h.tmp, "copies", os.path.basename(ckpt))
        shutil.copytree(ckpt, copied_ckpt)
        export(h, copied_ckpt, os.path.join(h.tmp, "copies-out"))
        tensors, files = read_export(os.path.join(h.tmp, "copies-out"))
        check(sorted(tensors) == names, "the export of a copied checkpoint: %s" % sorted(tensors))
        log("a flipped byte: exit 1 naming %s, the destination left as it was (also sharded); a used "
            "destination: exit 3; a destination inside a checkpoint folder or the root: exit 3" % bad_file)

    return run_with_daemon_harness(run, "fcexp", [JOB], args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
