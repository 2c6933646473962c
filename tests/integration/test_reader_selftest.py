#!/usr/bin/python3
"""Self-test of the independent reader (flashckpt_reader.py): it must accept a well-formed checkpoint
and reject each kind of damage the integration test relies on it to catch.

The fake checkpoints are written here, by hand, in the on-disk format flashckptd writes (safetensors
images with the header padded to 4 KiB, signals, metadata.json, LATEST) with the values flashckpt-sim
produces, computed element by element in plain Python (not with the reader's numpy code).
"""

import json
import os
import shutil
import struct
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402

# XXH3-64 of bytes((i*131 + 7) % 251 for i in range(n)), computed with libxxhash 0.8.1.
XXH3_VECTORS = {
    0: 0x2d06800538d394c2, 1: 0x4c5cca45d0f4811f, 3: 0xd079cb72d5dc8fe3, 4: 0x142fa07b01613ee8,
    8: 0x9f1975fc585fd927, 9: 0x6bf0116fadb4b711, 16: 0x945d7a2e39182d35, 17: 0xd1539aca118a0247,
    100: 0xceb030fed9a50b8f, 128: 0x2edf21e7a54f582c, 129: 0x8bf7e91c7eb2f2d6, 240: 0x0c9860844b0ad495,
    241: 0x246c5fe4ed1436a3, 1024: 0x0b662daec235d4ca, 1025: 0x13d178f3e2b48e9e, 4100: 0x04c8860c854e43b5,
}


def sim_value(layer, hidden, step, i, j):
    return ((layer * 7919 + i * hidden + j) % 1000) / 1024 + step


def write_safetensors(path, metadata, tensors):
    """tensors: list of (name, dtype, shape, bytes) in data order. Header padded so data is 4 KiB aligned."""
    header = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((-(8 + len(text))) % 4096)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text.encode())
        for _, _, _, data in tensors:
            f.write(data)


def write_fake_checkpoint(job_dir, job, step, T, P, D, L, H, ema=False):
    W = T * P * D
    ckpt = os.path.join(job_dir, "checkpoint-%d" % step)
    os.makedirs(ckpt)
    files, index = [], {}
    for rank in range(W):
        tp, pp, shard = rank % T, (rank // T) % P, rank // (T * P)
        rows = H // T
        box_offset, box_shape = [tp * rows, 0], [rows, H]
        n = rows * H
        chunk = -(-n // D)
        begin, end = min(shard * chunk, n), min((shard + 1) * chunk, n)
        per_file = {"model_state": [], "optimizer": [], "ema": []}
        for layer in range(L):
            if layer % P != pp:
                continue
            name = "layers.%d.weight" % layer
            box = [sim_value(layer, H, step, tp * rows + r, c) for r in range(rows) for c in range(H)]
            if shard == 0:
                per_file["model_state"].append((name, "model", [rows, H], None, box))
                if ema:  # the daemon's average, named after the parameter; any values will do
                    per_file["ema"].append((name, "ema", [rows, H], None, [v * 0.75 for v in box]))
            flat = box[begin:end]
            per_file["optimizer"].append((name + ".exp_avg", "optimizer", [end - begin], [begin, end],
                                          [v / 2 for v in flat]))
            per_file["optimizer"].append((name + ".exp_avg_sq", "optimizer", [end - begin], [begin, end],
                                          [v / 4 for v in flat]))
        for kind, entries in per_file.items():
            if not entries:
                continue
            stem = "%s.tp%02d_pp%02d_shard%02d" % (kind, tp, pp, shard)
            fname = stem + ".safetensors"
            meta = {"format": "flashckpt", "format_version": "1", "job": job, "rank": str(rank), "file": kind,
                    "world_size": str(W), "tp_rank": str(tp), "tp_degree": str(T), "pp_rank": str(pp),
                    "pp_degree": str(P), "shard_rank": str(shard), "shard_degree": str(D), "step": "%020d" % step}
            tensors = []
            for name, tkind, shape, frange, values in sorted(entries, key=lambda e: e[0]):
                data = struct.pack("<%df" % len(values), *values)
                meta[name + "@kind"] = tkind
                meta[name + "@global_shape"] = json.dumps([H, H], separators=(",", ":"))
                meta[name + "@box_offset"] = json.dumps(box_offset, separators=(",", ":"))
                meta[name + "@box_shape"] = json.dumps(box_shape, separators=(",", ":"))
                if frange:
                    meta[name + "@flat_range"] = json.dumps(frange, separators=(",", ":"))
                meta[name + "@xxh3"] = "%016x" % reader.xxh3_64(data)
                tensors.append((name, "F32", shape, data))
            path = os.path.join(ckpt, fname)
            write_safetensors(path, meta, tensors)
            files.append({"name": fname, "rank": rank, "tp_rank": tp, "pp_rank": pp, "shard_rank": shard,
                          "bytes": os.path.getsize(path)})
            st = reader.read_safetensors(path)
            for name, tkind, shape, frange, _ in entries:
                t = st.tensors[name]
                piece = {"file": fname, "kind": tkind, "dtype": "F32", "shape": shape, "global_shape": [H, H],
                         "box_offset": box_offset, "box_shape": box_shape, "offsets": [t.begin, t.end],
                         "xxh3": meta[name + "@xxh3"]}
                if frange:
                    piece["flat_range"] = frange
                index.setdefault(name, []).append(piece)
        with open(os.path.join(ckpt, "saved_signal_%d" % rank), "w") as f:
            f.write("%d\n" % step)
    metadata = {"format": "flashckpt", "format_version": 1, "job": job, "step": step,
                "topology": {"world_size": W, "tp_degree": T, "pp_degree": P, "shard_degree": D},
                "files": files, "tensors": index}
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(metadata, f, indent=1)
    with open(os.path.join(job_dir, "LATEST"), "w") as f:
        f.write("%d\n" % step)
    return ckpt


class ReaderSelfTest(unittest.TestCase):
    T, P, D, L, H, STEP = 2, 2, 3, 4, 10, 7  # uneven: a box of 50 elements in 3 flat ranges of 17, 17, 16

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fc-reader-")
        self.job_dir = os.path.join(self.tmp, "job")
        os.makedirs(self.job_dir)
        self.ckpt = write_fake_checkpoint(self.job_dir, "selftest", self.STEP, self.T, self.P, self.D, self.L, self.H)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def verify(self):
        return reader.verify_checkpoint(self.ckpt, layers=self.L, hidden=self.H)

    def assertRejected(self, *needles):
        with self.assertRaises(reader.CheckpointError) as cm:
            self.verify()
        for needle in needles:
            self.assertIn(needle, str(cm.exception))
        return str(cm.exception)

    def rewrite_metadata(self, change):
        path = os.path.join(self.ckpt, "metadata.json")
        with open(path) as f:
            meta = json.load(f)
        change(meta)
        with open(path, "w") as f:
            json.dump(meta, f)

    # --- accepted -------------------------------------------------------------------------------

    def test_xxh3_matches_libxxhash_vectors(self):
        for n, want in XXH3_VECTORS.items():
            data = bytes((i * 131 + 7) % 251 for i in range(n))
            self.assertEqual(reader.xxh3_64(data), want, "length %d" % n)

    def test_good_checkpoint_passes(self):
        s = self.verify()
        W = self.T * self.P * self.D
        self.assertEqual(s["step"], self.STEP)
        self.assertEqual(s["world_size"], W)
        self.assertEqual(s["tensors"], 3 * self.L)
        # model weights once (shard 0), both optimizer moments: every element of 3 tensors per layer
        self.assertEqual(s["elements"], 3 * self.L * self.H * self.H)
        self.assertEqual(reader.read_latest(self.job_dir), self.STEP)
        self.assertEqual(reader.complete_steps(self.job_dir), [self.STEP])

    def test_ema_files_are_checked_apart(self):
        shutil.rmtree(self.job_dir)
        os.makedirs(self.job_dir)
        self.ckpt = write_fake_checkpoint(self.job_dir, "selftest", self.STEP, self.T, self.P, self.D, self.L,
                                          self.H, ema=True)
        s = self.verify()
        self.assertEqual(s["tensors"], 3 * self.L)
        self.assertEqual(s["ema_tensors"], self.L)
        self.assertEqual(s["ema_elements"], self.L * self.H * self.H)
        self.assertEqual(s["elements"], 3 * self.L * self.H * self.H)

    def test_read_ema_assembles_global_tensors(self):
        self.assertEqual(reader.read_ema(self.ckpt), {})  # a checkpoint without EMA
        shutil.rmtree(self.job_dir)
        os.makedirs(self.job_dir)
        self.ckpt = write_fake_checkpoint(self.job_dir, "selftest", self.STEP, self.T, self.P, self.D, self.L,
                                          self.H, ema=True)
        ema = reader.read_ema(self.ckpt)
        self.assertEqual(sorted(ema), ["layers.%d.weight" % l for l in range(self.L)])
        for layer in range(self.L):
            got = ema["layers.%d.weight" % layer]
            self.assertEqual(got.shape, (self.H, self.H))
            self.assertEqual(str(got.dtype), "float32")
            for i in range(self.H):
                for j in range(self.H):
                    want = struct.unpack("<f", struct.pack("<f", sim_value(layer, self.H, self.STEP, i, j) * 0.75))[0]
                    self.assertEqual(float(got[i, j]), want, "layer %d (%d, %d)" % (layer, i, j))
        self.assertEqual(reader.ema_tensor(self.ckpt, "layers.1.weight").tolist(), ema["layers.1.weight"].tolist())
        with self.assertRaises(reader.CheckpointError):
            reader.ema_tensor(self.ckpt, "layers.9.weight")

    def test_cli_on_job_dir(self):
        self.assertEqual(reader.main([self.job_dir, "--layers", str(self.L), "--hidden", str(self.H)]), 0)

    # --- rejected -------------------------------------------------------------------------------

    def test_flipped_data_byte(self):
        name = "optimizer.tp01_pp01_shard02.safetensors"
        st = reader.read_safetensors(os.path.join(self.ckpt, name))
        t = st.tensors["layers.3.weight.exp_avg_sq"]
        with open(st.path, "r+b") as f:
            f.seek(t.begin + 5)
            b = f.read(1)
            f.seek(t.begin + 5)
            f.write(bytes([b[0] ^ 0x10]))
        self.assertRejected(name, "layers.3.weight.exp_avg_sq", "checksum")
        self.assertEqual(reader.main([self.ckpt]), 1)

    def test_wrong_value_with_matching_checksum(self):
        # The damage a checksum cannot see: a wrong value written consistently.
        name = "model_state.tp00_pp00_shard00.safetensors"
        path = os.path.join(self.ckpt, name)
        st = reader.read_safetensors(path)
        t = st.tensors["layers.2.weight"]
        raw = bytearray(st.raw)
        raw[t.begin:t.begin + 4] = struct.pack("<f", 12345.0)
        old_ck = st.metadata["layers.2.weight@xxh3"]
        new_ck = "%016x" % reader.xxh3_64(bytes(raw[t.begin:t.end]))
        raw = raw.replace(old_ck.encode(), new_ck.encode())
        with open(path, "wb") as f:
            f.write(raw)

        def fix(meta):
            for p in meta["tensors"]["layers.2.weight"]:
                if p["file"] == name:
                    p["xxh3"] = new_ck
        self.rewrite_metadata(fix)
        self.assertRejected(name, "layers.2.weight", "expected")
        # Without the formula the data is self-consistent and passes.
        reader.verify_checkpoint(self.ckpt, formula=False)

    def test_missing_piece_is_a_coverage_hole(self):
        name = "optimizer.tp01_pp00_shard01.safetensors"
        os.remove(os.path.join(self.ckpt, name))

        def drop(meta):
            meta["files"] = [f for f in meta["files"] if f["name"] != name]
            for key in list(meta["tensors"]):
                meta["tensors"][key] = [p for p in meta["tensors"][key] if p["file"] != name]
        self.rewrite_metadata(drop)
        self.assertRejected("in no file")

    def test_file_not_in_metadata(self):
        os.remove(os.path.join(self.ckpt, "optimizer.tp00_pp00_shard00.safetensors"))
        self.assertRejected("optimizer.tp00_pp00_shard00.safetensors")

    def test_incomplete_without_metadata_json(self):
        os.remove(os.path.join(self.ckpt, "metadata.json"))
        self.assertRejected("not complete")
        self.assertEqual(reader.complete_steps(self.job_dir), [])
        self.assertEqual(reader.checkpoint_steps(self.job_dir), [self.STEP])

    def test_missing_signal(self):
        os.remove(os.path.join(self.ckpt, "saved_signal_5"))
        self.assertRejected("saved_signal_5")

    def test_truncated_file(self):
        name = "optimizer.tp00_pp01_shard01.safetensors"
        path = os.path.join(self.ckpt, name)
        os.truncate(path, os.path.getsize(path) - 4)
        self.assertRejected(name)

    def test_header_step_differs(self):
        name = "model_state.tp01_pp00_shard00.safetensors"
        path = os.path.join(self.ckpt, name)
        with open(path, "rb") as f:
            raw = f.read()
        raw = raw.replace(b'"step":"%020d"' % self.STEP, b'"step":"%020d"' % (self.STEP + 1))
        with open(path, "wb") as f:
            f.write(raw)
        self.assertRejected(name, "step")

    def test_overlapping_pieces(self):
        # Shard 1 claims [16, 33) of layer 0's exp_avg instead of [17, 34): element 16 is saved twice and
        # element 33 by nobody. The bytes and checksums stay valid, so only geometry can catch it.
        name = "optimizer.tp00_pp00_shard01.safetensors"
        path = os.path.join(self.ckpt, name)
        with open(path, "rb") as f:
            raw = f.read()
        old = b'"layers.0.weight.exp_avg@flat_range":"[17,34]"'
        self.assertIn(old, raw)
        with open(path, "wb") as f:
            f.write(raw.replace(old, b'"layers.0.weight.exp_avg@flat_range":"[16,33]"'))

        def shift(meta):
            for p in meta["tensors"]["layers.0.weight.exp_avg"]:
                if p["file"] == name:
                    p["flat_range"] = [16, 33]
        self.rewrite_metadata(shift)
        with self.assertRaises(reader.CheckpointError) as cm:
            reader.verify_checkpoint(self.ckpt, formula=False)
        self.assertIn("layers.0.weight.exp_avg", str(cm.exception))
        self.assertRejected(name, "layers.0.weight.exp_avg")

    def test_latest_must_be_decimal(self):
        with open(os.path.join(self.job_dir, "LATEST"), "w") as f:
            f.write("seven")
        with self.assertRaises(reader.CheckpointError):
            reader.read_latest(self.job_dir)


if __name__ == "__main__":
    unittest.main(verbosity=2)
