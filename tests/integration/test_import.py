#!/usr/bin/python3
"""flashckpt import: a Hugging Face safetensors directory as the first checkpoint of a job.

The test writes the input itself with numpy, as Hugging Face's writer lays it out (JSON header padded
to 8 bytes, "format": "pt", data packed in name order): five tensors (fp32, bf16, int64, a 1-D bias)
in two files plus model.safetensors.index.json. Then:
  1. `flashckpt import HF --root R --job J`: checkpoint-0 and LATEST; `flashckpt verify` and the
     independent reader (flashckpt_reader.py) accept it;
  2. the round trip: `flashckpt export` of it gives back every tensor byte for byte (name, dtype,
     shape, data); with `--add-prefix model.` and `export --strip-prefix model.` too;
  3. a real daemon restores it, model weights only (kinds=["model"]), into four ranks of (tp, shard) =
     (2, 2) that also hold Adam moments (flat ranges): every weight bit for bit, the moments left as
     they were; a full restore is NOT_FOUND naming a moment, asking for optimizer tensors is
     FAILED_PRECONDITION; and flashckpt.torch.Checkpointer.load_pretrained(job=...) loads an import
     made with --add-prefix model. into a torch model with a fresh optimizer, which then saves
     its own step 1;
  4. malformed input is refused with exit 1 naming the file and tensor, and leaves nothing behind:
     a header that is not JSON, offsets past the end of the data, an index naming a missing file, a
     tensor in a file the index does not place it in, an unknown dtype; a FIFO in place of the file or
     of the index is refused at once (only regular files are opened, never blocking); importing into
     a job that has checkpoints is exit 3.

    test_import.py --bin-dir build/bin [--python-dir build/python] [--keep]
"""

import argparse
import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
import numpy as np  # noqa: E402

from harness import check, log, run_with_daemon_harness  # noqa: E402
import flashckpt_reader as reader  # noqa: E402

JOB = "import-%d" % os.getpid()
NP = {"F32": np.float32, "BF16": np.uint16, "I64": np.int64}


def make_tensors():
    rng = np.random.default_rng(7)
    return {
        "embed.weight": ("F32", rng.standard_normal((64, 32)).astype(np.float32)),
        "layers.0.bias": ("F32", rng.standard_normal(32).astype(np.float32)),
        "layers.0.weight": ("F32", rng.standard_normal((32, 32)).astype(np.float32)),
        "norm.weight": ("BF16", rng.integers(0, 1 << 16, size=32, dtype=np.uint64).astype(np.uint16)),
        "step_count": ("I64", np.array([12345], dtype=np.int64)),
    }


def write_safetensors(path, tensors, header_override=None):
    """Writes `tensors` {name: (dtype, array)} as Hugging Face's writer does."""
    header = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dtype, array = tensors[name]
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if header_override:
        header_override(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def write_hf_dir(path, tensors, split=("embed.weight", "layers.0.bias")):
    """Two files (the names in `split` in the first) and the index."""
    os.makedirs(path)
    first = {n: v for n, v in tensors.items() if n in split}
    second = {n: v for n, v in tensors.items() if n not in split}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for fname, part in files.items():
        write_safetensors(os.path.join(path, fname), part)
        weight_map.update({n: fname for n in part})
    total = sum(v[1].nbytes for v in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def read_dir_tensors(path):
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            st = reader.read_safetensors(os.path.join(path, fname))
            for name, t in st.tensors.items():
                out[name] = (t.dtype, tuple(t.shape), bytes(st.tensor_bytes(name)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--python-dir")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    tensors = make_tensors()
    original = {n: (d, tuple(a.shape), a.tobytes()) for n, (d, a) in tensors.items()}

    def run(h):
        os.makedirs(h.root)
        hf = os.path.join(h.tmp, "hf")
        write_hf_dir(hf, tensors)

        # 1. Import.
        rc, out, err = h.cli("import", hf, "--root", h.root, "--job", JOB, "--checksum-chunk", "4KiB")
        check(rc == 0, "flashckpt import exited %d:\n%s%s" % (rc, out, err))
        log(out.strip())
        ckpt = os.path.join(h.root, JOB, "checkpoint-0")
        with open(os.path.join(h.root, JOB, "LATEST")) as f:
            check(f.read().strip() == "0", "LATEST does not name step 0")
        rc, out, err = h.cli("verify", ckpt)
        check(rc == 0, "flashckpt verify of the import: %s%s" % (out, err))
        reader.verify_checkpoint(ckpt, formula=False)
        log("verify and the independent reader accept it: %s" % out.strip())

        # 2. Round trips.
        back = os.path.join(h.tmp, "back")
        rc, out, err = h.cli("export", ckpt, back)
        check(rc == 0, "export of the import: %s%s" % (out, err))
        check(read_dir_tensors(back) == original, "export(import(x)) differs from x")
        rc, out, err = h.cli("import", hf, "--root", h.root, "--job", JOB + "-prefixed", "--add-prefix", "model.")
        check(rc == 0, "import --add-prefix: %s%s" % (out, err))
        prefixed = os.path.join(h.root, JOB + "-prefixed", "checkpoint-0")
        names = sorted(read_dir_tensors(prefixed))
        check(names == sorted("model." + n for n in tensors), "--add-prefix gave %s" % names)
        back2 = os.path.join(h.tmp, "back2")
        rc, out, err = h.cli("export", prefixed, back2, "--strip-prefix", "model.")
        check(rc == 0 and read_dir_tensors(back2) == original, "export --strip-prefix of the prefixed import differs")
        log("export(import(x)) == x byte for byte, with and without a prefix")

        # 3. Restored by a daemon into tensor parallelism 2.
        if args.python_dir:
            h.start_daemon()
            code = r"""
import sys, numpy as np, torch, flashckpt
from flashckpt.errors import FailedPreconditionError, NotFoundError
sock, job, path = sys.argv[1:4]
src = {n: np.load(path + "/" + n + ".npy") for n in ("embed.weight", "layers.0.weight", "layers.0.bias",
                                                   "norm.weight", "step_count")}
def empty(shape, name):  # norm.weight is bf16 (its bits in the .npy as uint16)
    if name == "norm.weight":
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.zeros(shape, dtype=torch.from_numpy(src[name]).dtype)
def raw(t):
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
# Four ranks: tp 2 x shard 2. The matrices' rows are cut by tp (the shard-1 ranks hold replicas of
# the model), their Adam moments are flat ranges of the tp box cut by shard; the vectors are whole.
clients, mine_of = [], {}
for rank in range(4):
    tp, shard = rank % 2, rank // 2
    c = flashckpt.Client(sock, job, rank=rank, world_size=4, tp_rank=tp, tp_degree=2, shard_rank=shard,
                         shard_degree=2, run_id="imported-run")
    mine, specs = {}, {}
    for name, full in src.items():
        if full.ndim == 2:
            rows = full.shape[0] // 2
            box = {"global_shape": full.shape, "box_offset": (tp * rows, 0), "box_shape": (rows, full.shape[1])}
            mine[name] = empty((rows, full.shape[1]), name)
            specs[name] = dict(box, replica=shard == 1)
            n = rows * full.shape[1]
            mine[name + ".exp_avg"] = torch.full((n // 2,), 7.0)
            specs[name + ".exp_avg"] = dict(box, kind="optimizer", flat_range=(shard * n // 2, (shard + 1) * n // 2))
        else:
            mine[name] = empty(full.shape, name)
            specs[name] = {"replica": rank != 0}
    c.register(mine, specs)
    if rank == 0:
        try:
            c.restore(mine)
            raise SystemExit("a full restore of a weights-only checkpoint succeeded")
        except NotFoundError as e:
            assert "exp_avg" in e.message, e.message
        try:
            c.restore(mine, kinds=["model", "optimizer"])
            raise SystemExit("a restore asking for optimizer tensors succeeded")
        except FailedPreconditionError as e:
            assert "holds no optimizer tensors" in e.message, e.message
    step, _ = c.restore(mine, kinds=["model"])
    assert step == 0, step
    for name, full in src.items():
        want = full[tp * (full.shape[0] // 2):(tp + 1) * (full.shape[0] // 2)] if full.ndim == 2 else full
        assert raw(mine[name]) == np.ascontiguousarray(want).tobytes(), (rank, name)
        if full.ndim == 2:
            assert bool((mine[name + ".exp_avg"] == 7.0).all()), (rank, name, "optimizer state was overwritten")
    clients.append(c)
for c in clients:
    c.close()
print("restored step 0 into (tp, shard) = (2, 2), model only: every weight bit for bit, the optimizer untouched")

# A PyTorch job of its own loads them with Checkpointer.load_pretrained (job=the imported one), with
# a fresh optimizer, trains a step and saves as a fresh run of its own job.
from flashckpt.torch import Checkpointer
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32)])
net = Net()
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
ck = Checkpointer(net, opt, socket=sock, job=job + "-ft", run_id="ft-run")
step = ck.load_pretrained(job=job + "-torch")
assert step == 0, step
for key, value in net.state_dict().items():
    assert value.numpy().tobytes() == src[key].tobytes(), key
assert len(opt.state) == 0, "the optimizer was touched"
loss = net.layers[0](net.embed(torch.arange(4))).pow(2).mean()
loss.backward()
opt.step()
ck.save(1)
ck.wait_persisted(1, timeout=60)
ck.close() if hasattr(ck, "close") else None
print("Checkpointer.load_pretrained: weights bit for bit, fresh optimizer; its own job saved step 1")
"""
            torch_hf = os.path.join(h.tmp, "hf-torch")
            os.makedirs(torch_hf)
            write_safetensors(os.path.join(torch_hf, "model.safetensors"),
                              {"embed.weight": tensors["embed.weight"], "layers.0.weight": tensors["layers.0.weight"],
                               "layers.0.bias": tensors["layers.0.bias"]})
            rc, out, err = h.cli("import", torch_hf, "--root", h.root, "--job", JOB + "-torch", "--add-prefix", "model.")
            check(rc == 0, "import for the Checkpointer: %s%s" % (out, err))
            npy = os.path.join(h.tmp, "npy")
            os.makedirs(npy)
            for n, (_, a) in tensors.items():
                np.save(os.path.join(npy, n + ".npy"), a)
            p = subprocess.run([sys.executable, "-c", code, h.sock, JOB, npy], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=120, env=dict(os.environ, PYTHONPATH=args.python_dir))
            out = p.stdout.decode(errors="replace")
            check(p.returncode == 0, "restoring the import into tp 2 failed:\n%s" % out)
            for line in out.strip().splitlines()[-2:]:
                log(line)

        # 4. Malformed input.
        def refused(case, build, words):
            d = os.path.join(h.tmp, "bad-" + case)
            build(d)
            job = "bad-%s-%d" % (case, os.getpid())
            rc, out, err = h.cli("import", d, "--root", h.root, "--job", job)
            check(rc == 1, "%s: exit %d, expected 1:\n%s%s" % (case, rc, out, err))
            for w in words:
                check(w in err, "%s: the error does not name %r: %s" % (case, w, err))
            check(not os.path.exists(os.path.join(h.root, job, "checkpoint-0")), "%s: left a checkpoint" % case)
            log("%s: refused: %s" % (case, err.strip()))

        def not_json(d):
            write_hf_dir(d, tensors)
            path = os.path.join(d, "model-00002-of-00002.safetensors")
            raw = bytearray(open(path, "rb").read())
            raw[8] = ord("[")  # the header's first byte
            open(path, "wb").write(bytes(raw))

        def past_end(d):
            os.makedirs(d)
            write_safetensors(os.path.join(d, "model.safetensors"), tensors,
                              lambda hd: hd["step_count"].update(data_offsets=[hd["step_count"]["data_offsets"][0],
                                                                               10 ** 9]))

        def missing_file(d):
            write_hf_dir(d, tensors)
            os.unlink(os.path.join(d, "model-00001-of-00002.safetensors"))

        def misplaced(d):
            write_hf_dir(d, tensors)
            index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
            index["weight_map"]["norm.weight"] = "model-00001-of-00002.safetensors"
            json.dump(index, open(os.path.join(d, "model.safetensors.index.json"), "w"))

        def unknown_dtype(d):
            os.makedirs(d)
            write_safetensors(os.path.join(d, "model.safetensors"), tensors,
                              lambda hd: hd["norm.weight"].update(dtype="F8_E4M3"))

        refused("not-json", not_json, ["model-00002-of-00002.safetensors"])
        refused("past-end", past_end, ["model.safetensors", "step_count"])
        refused("missing-file", missing_file, ["model-00001-of-00002.safetensors", "embed.weight"])
        refused("misplaced", misplaced, ["model-00002-of-00002.safetensors", "norm.weight"])
        refused("unknown-dtype", unknown_dtype, ["model.safetensors", "norm.weight"])
        # Only regular files are read, and nothing blocks: a FIFO in place of a file (an open for
        # reading would wait for a writer forever) is refused at once, by name.
        for fifo_name in ("model.safetensors", "model.safetensors.index.json"):
            d = os.path.join(h.tmp, "fifo-" + fifo_name.replace(".", "-"))
            os.makedirs(d)
            os.mkfifo(os.path.join(d, fifo_name))
            job = "bad-fifo-%d-%d" % (len(fifo_name), os.getpid())
            rc, out, err = h.cli("import", d, "--root", h.root, "--job", job, timeout=30)
            check(rc != 0 and "a FIFO, not a regular file" in err and fifo_name in err,
                  "a FIFO as %s: exit %d: %s%s" % (fifo_name, rc, out, err))
            check(not os.path.exists(os.path.join(h.root, job, "checkpoint-0")), "a FIFO import left a checkpoint")
            log("a FIFO as %s: refused at once (exit %d)" % (fifo_name, rc))
        rc, out, err = h.cli("import", hf, "--root", h.root, "--job", JOB)
        check(rc == 3 and "already has checkpoints" in err, "import into a used job: exit %d: %s" % (rc, err))
        log("a used job: exit 3")

    return run_with_daemon_harness(run, "fcimp", [JOB, JOB + "-ft"], args.bin_dir, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
