#!/usr/bin/python3
"""Self-test of the independent reader (flashckpt_reader.py): it must accept a well-formed checkpoint
and reject each kind of damage the integration test relies on it to catch.

The fake checkpoints are written here, by hand, in the on-disk format flashckptd writes (safetensors
images with the header padded to 4 KiB, signals, metadata.json, LATEST) with the values flashckpt-sim
produces, computed element by element in plain Python (not with the reader's numpy code).

Per-chunk checksums are tested on such a fake (format versions 1 and 2) and on a real checkpoint:
flashckptd started with --checksum-chunk 4KiB and four flashckpt-sim ranks, from FLASHCKPT_BIN_DIR
(ctest sets it; default build/bin of this checkout, and the real-checkpoint cases are skipped when
that has no flashckptd). A checkpoint kept as the release before format version 2 wrote it
(tests/data/format_v1) is read, and resumed from by a real daemon.
"""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unittest

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashckpt_reader as reader  # noqa: E402
import harness  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

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


def chunk_hex(data, chunk):
    """The "@xxh3_chunks" string of a tensor's bytes: one xxh3_64 per chunk, each hashed on its own."""
    return "".join("%016x" % reader.xxh3_64(data[k:k + chunk]) for k in range(0, len(data), chunk))


def whole_from_hex(hexes, size):
    """Format version 2: the whole checksum (16 hex digits) of a tensor from its "@xxh3_chunks"."""
    sums = [int(hexes[k:k + 16], 16) for k in range(0, len(hexes), 16)]
    return "%016x" % reader.whole_checksum_from_chunks(sums, size)


def write_fake_checkpoint(job_dir, job, step, T, P, D, L, H, ema=False, checksum_chunk=None, version=1):
    """checksum_chunk: write per-chunk checksums of this many bytes, as flashckptd --checksum-chunk does.
    version: the format version; from 2 on, a chunked tensor's @xxh3 derives from its chunk checksums."""
    W = T * P * D
    ckpt = os.path.join(job_dir, "checkpoint-%d" % step)
    os.makedirs(ckpt)
    files, index = [], {}
    for rank in range(W):
        tp, pp, shard = rank % T, (rank // T) % P, rank // (T * P)
        block = -(-H // T)  # flashckpt-sim's row blocks: ceil(H/T) rows, the last one may be shorter
        rows = min(block, H - tp * block)
        box_offset, box_shape = [tp * block, 0], [rows, H]
        n = rows * H
        chunk = -(-n // D)
        begin, end = min(shard * chunk, n), min((shard + 1) * chunk, n)
        per_file = {"model_state": [], "optimizer": [], "ema": []}
        for layer in range(L):
            if layer % P != pp:
                continue
            name = "layers.%d.weight" % layer
            box = [sim_value(layer, H, step, tp * block + r, c) for r in range(rows) for c in range(H)]
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
            meta = {"format": "flashckpt", "format_version": str(version), "job": job, "rank": str(rank), "file": kind,
                    "world_size": str(W), "tp_rank": str(tp), "tp_degree": str(T), "pp_rank": str(pp),
                    "pp_degree": str(P), "shard_rank": str(shard), "shard_degree": str(D), "step": "%020d" % step}
            if checksum_chunk:
                meta["checksum_chunk"] = str(checksum_chunk)
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
                if checksum_chunk and len(data) > checksum_chunk:
                    meta[name + "@xxh3_chunks"] = chunk_hex(data, checksum_chunk)
                    if version >= 2:
                        meta[name + "@xxh3"] = whole_from_hex(meta[name + "@xxh3_chunks"], len(data))
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
                if name + "@xxh3_chunks" in meta:
                    piece["chunk_bytes"] = checksum_chunk
                    piece["xxh3_chunks"] = meta[name + "@xxh3_chunks"]
                index.setdefault(name, []).append(piece)
        with open(os.path.join(ckpt, "saved_signal_%d" % rank), "w") as f:
            f.write("%d\n" % step)
    metadata = {"format": "flashckpt", "format_version": version, "job": job, "step": step,
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

    def test_uneven_row_blocks_pass(self):
        # tp 3 of H 10: row blocks of 4, 4 and 2 rows, as flashckpt-sim splits them.
        shutil.rmtree(self.job_dir)
        os.makedirs(self.job_dir)
        self.ckpt = write_fake_checkpoint(self.job_dir, "selftest", self.STEP, 3, 1, 2, 2, self.H)
        s = reader.verify_checkpoint(self.ckpt, layers=2, hidden=self.H)
        self.assertEqual(s["elements"], 3 * 2 * self.H * self.H)

    def test_cli_on_job_dir(self):
        self.assertEqual(reader.main([self.job_dir, "--layers", str(self.L), "--hidden", str(self.H)]), 0)

    # --- rejected -------------------------------------------------------------------------------

    def test_unknown_format_version(self):
        self.rewrite_metadata(lambda m: m.__setitem__("format_version", 3))
        self.assertRejected("metadata.json", "format_version '3'")

    def test_format_version_of_a_file_differs_from_metadata_json(self):
        self.rewrite_metadata(lambda m: m.__setitem__("format_version", 2))
        self.assertRejected("format_version 1, metadata.json says 2")

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


# ------------------------------------------------------------------------------------------------
# per-chunk checksums
# ------------------------------------------------------------------------------------------------

def edit_header(path, change):
    """Applies change(__metadata__ dict) to a safetensors file's header in place; the header keeps its
    length (the padding after the JSON absorbs the difference), so the data does not move."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n].decode())
    change(header["__metadata__"])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the edited header no longer fits in %d bytes" % n
    with open(path, "wb") as f:
        f.write(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


def wrong_chunk(hexes, k):
    """`hexes` with chunk k's checksum changed in its last bit."""
    return hexes[:16 * k] + "%016x" % (int(hexes[16 * k:16 * k + 16], 16) ^ 1) + hexes[16 * k + 16:]


class ChunkChecksumCases:
    """Cases run on a checkpoint with 4 KiB checksum chunks (self.ckpt, step 10, L layers of [H, H]):
    FILE holds TENSOR, a 36 x 72 F32 box of 10368 bytes, so 3 chunks, the last of 2176 bytes."""

    L, H, STEP, CHUNK = 2, 72, 10, 4096
    FILE = "model_state.tp01_pp00_shard00.safetensors"
    TENSOR = "layers.1.weight"
    VERSION = 2  # the format version of the checkpoint (2: whole checksums derive from the chunks)

    def verify(self, **kw):
        return reader.verify_checkpoint(self.ckpt, layers=self.L, hidden=self.H, **kw)

    def assertRejected(self, *needles, **kw):
        with self.assertRaises(reader.CheckpointError) as cm:
            self.verify(**kw)
        for needle in needles:
            self.assertIn(needle, str(cm.exception))
        return str(cm.exception)

    def path(self, name=None):
        return os.path.join(self.ckpt, name or self.FILE)

    def header(self, name=None):
        return reader.read_safetensors(self.path(name)).metadata

    def edit_index(self, change, name=None, tensor=None):
        """Applies change(piece dict) to metadata.json's piece of `tensor` in file `name`."""
        meta_path = os.path.join(self.ckpt, "metadata.json")
        with open(meta_path) as f:
            meta = json.load(f)
        pieces = [p for p in meta["tensors"][tensor or self.TENSOR] if p["file"] == (name or self.FILE)]
        self.assertEqual(len(pieces), 1)
        change(pieces[0])
        with open(meta_path, "w") as f:
            json.dump(meta, f)

    def set_chunks(self, hexes, header=True, index=True):
        key = self.TENSOR + "@xxh3_chunks"
        if header:
            edit_header(self.path(), lambda m: m.__setitem__(key, hexes))
        if index:
            self.edit_index(lambda p: p.__setitem__("xxh3_chunks", hexes))

    # --- accepted -------------------------------------------------------------------------------

    def test_chunked_checkpoint_passes(self):
        s = self.verify()
        self.assertEqual(s["elements"], 3 * self.L * self.H * self.H)
        # The checkpoint does carry chunk checksums, in every header and in metadata.json, and the
        # tensor the other cases tamper with has 3 chunks.
        with open(os.path.join(self.ckpt, "metadata.json")) as f:
            index = json.load(f)["tensors"]
        chunked = 0
        for name in sorted(os.listdir(self.ckpt)):
            if not name.endswith(".safetensors"):
                continue
            st = reader.read_safetensors(self.path(name))
            self.assertEqual(st.metadata.get("checksum_chunk"), str(self.CHUNK), name)
            for tname, t in st.tensors.items():
                piece = [p for p in index[tname] if p["file"] == name][0]
                if t.end - t.begin > self.CHUNK:
                    chunked += 1
                    self.assertEqual(piece["chunk_bytes"], self.CHUNK)
                    self.assertEqual(piece["xxh3_chunks"], st.metadata[tname + "@xxh3_chunks"])
                    self.assertEqual(piece["xxh3_chunks"], chunk_hex(st.tensor_bytes(tname), self.CHUNK))
                else:
                    self.assertNotIn(tname + "@xxh3_chunks", st.metadata)
                    self.assertNotIn("xxh3_chunks", piece)
        self.assertGreaterEqual(chunked, 2 * self.L)
        self.assertEqual(len(self.header()[self.TENSOR + "@xxh3_chunks"]), 3 * 16)

    def test_xxh3_chunks_matches_chunk_by_chunk(self):
        data = reader.read_safetensors(self.path()).tensor_bytes(self.TENSOR)
        for chunk in (256, 1024, self.CHUNK, 5000, 1 << 20):
            want = [reader.xxh3_64(data[k:k + chunk]) for k in range(0, len(data), chunk)]
            self.assertEqual(reader.xxh3_chunks(data, chunk), want, "chunk %d" % chunk)

    # --- rejected -------------------------------------------------------------------------------

    def set_whole(self, hexes):
        """Sets the tensor's whole checksum in its header and in metadata.json."""
        edit_header(self.path(), lambda m: m.__setitem__(self.TENSOR + "@xxh3", hexes))
        self.edit_index(lambda p: p.__setitem__("xxh3", hexes))

    def test_whole_checksum_follows_the_format_version(self):
        m, st = self.header(), reader.read_safetensors(self.path())
        self.assertEqual(m["format_version"], str(self.VERSION))
        data = st.tensor_bytes(self.TENSOR)
        want = (whole_from_hex(m[self.TENSOR + "@xxh3_chunks"], len(data)) if self.VERSION >= 2
                else "%016x" % reader.xxh3_64(data))
        self.assertEqual(m[self.TENSOR + "@xxh3"], want)

    def test_wrong_chunk_checksum_in_header_and_metadata_json(self):
        # Header and metadata.json agree on a wrong checksum for chunk 1, and the whole-tensor checksum
        # is consistent with the records: only hashing the chunk finds it.
        wrong = wrong_chunk(self.header()[self.TENSOR + "@xxh3_chunks"], 1)
        self.set_chunks(wrong)
        if self.VERSION >= 2:
            # The whole checksum derives from the chunks': an edited chunk list alone is refused
            # without hashing any data, and with the whole checksum edited to match, hashing finds it.
            self.assertRejected(self.FILE, self.TENSOR, "format version 2", checksums=False)
            self.set_whole(whole_from_hex(wrong, 10368))
        msg = self.assertRejected(self.FILE, self.TENSOR, "chunk 1 of 3", "bytes [4096, 8192)", "checksum")
        self.assertNotIn("chunk 0", msg)
        self.assertEqual(reader.main([self.ckpt]), 1)
        # Not hashing the data, the reader finds nothing wrong: the two records agree.
        self.verify(checksums=False)

    def test_wrong_last_chunk_checksum_in_header_only(self):
        self.set_chunks(wrong_chunk(self.header()[self.TENSOR + "@xxh3_chunks"], 2), index=False)
        if self.VERSION >= 2:
            self.assertRejected(self.FILE, self.TENSOR, "format version 2")
        else:
            self.assertRejected(self.FILE, self.TENSOR, "chunk 2 of 3", "bytes [8192, 10368)", "header says")

    def test_wrong_whole_checksum(self):
        self.set_whole("%016x" % (int(self.header()[self.TENSOR + "@xxh3"], 16) ^ 1))
        self.assertRejected(self.FILE, self.TENSOR, "format version 2" if self.VERSION >= 2 else "checksum mismatch")

    def test_flipped_byte_names_its_chunk(self):
        st = reader.read_safetensors(self.path())
        with open(st.path, "r+b") as f:
            f.seek(st.tensors[self.TENSOR].begin + 9000)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
        self.assertRejected(self.FILE, self.TENSOR, "chunk 2 of 3", "checksum mismatch")

    def test_metadata_json_chunk_checksum_differs_from_header(self):
        self.set_chunks(wrong_chunk(self.header()[self.TENSOR + "@xxh3_chunks"], 0), header=False)
        self.assertRejected(self.FILE, self.TENSOR, "metadata.json", "chunk 0 of 3")
        self.assertRejected(self.FILE, self.TENSOR, "metadata.json", "chunk 0 of 3", checksums=False)

    def test_metadata_json_lacks_chunk_checksums(self):
        def drop(p):
            del p["chunk_bytes"], p["xxh3_chunks"]
        self.edit_index(drop)
        self.assertRejected(self.FILE, self.TENSOR, "metadata.json", "chunk_bytes")

    def test_metadata_json_chunk_count_differs(self):
        self.set_chunks(self.header()[self.TENSOR + "@xxh3_chunks"][:32], header=False)
        self.assertRejected(self.FILE, self.TENSOR, "metadata.json", "xxh3_chunks has 32 characters")

    def test_metadata_json_chunk_bytes_differs(self):
        self.edit_index(lambda p: p.__setitem__("chunk_bytes", 2 * self.CHUNK))
        self.assertRejected(self.FILE, self.TENSOR, "metadata.json", "chunk_bytes")

    def test_header_lacks_chunk_checksums(self):
        edit_header(self.path(), lambda m: m.pop(self.TENSOR + "@xxh3_chunks"))
        self.assertRejected(self.FILE, self.TENSOR, "no @xxh3_chunks")

    def test_header_chunk_checksum_not_hex(self):
        hexes = self.header()[self.TENSOR + "@xxh3_chunks"]
        self.set_chunks(hexes[:16] + hexes[16:32].upper() + hexes[32:])
        self.assertRejected(self.FILE, self.TENSOR, "chunk 1 of 3", "lowercase hex")

    def test_checksum_chunk_not_a_power_of_two(self):
        edit_header(self.path(), lambda m: m.__setitem__("checksum_chunk", "3000"))
        self.assertRejected(self.FILE, "checksum_chunk", "power of two")


class FakeChunkChecksumTest(ChunkChecksumCases, unittest.TestCase):
    """A fake checkpoint with chunk checksums: tp 2 x shard 3, so every optimizer piece (864 floats,
    3456 bytes) fits in one chunk and has none, and every model piece has 3. Format version 1."""

    T, P, D = 2, 1, 3
    VERSION = 1

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fc-reader-chunks-")
        job_dir = os.path.join(self.tmp, "job")
        os.makedirs(job_dir)
        self.ckpt = write_fake_checkpoint(job_dir, "selftest", self.STEP, self.T, self.P, self.D, self.L, self.H,
                                          checksum_chunk=self.CHUNK, version=self.VERSION)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_chunk_checksums_on_a_tensor_within_one_chunk(self):
        name, tensor = "optimizer.tp00_pp00_shard01.safetensors", "layers.0.weight.exp_avg"
        st = reader.read_safetensors(self.path(name))
        self.assertLessEqual(st.tensors[tensor].end - st.tensors[tensor].begin, self.CHUNK)
        hexes = chunk_hex(st.tensor_bytes(tensor), 2048)
        self.edit_index(lambda p: p.update(chunk_bytes=2048, xxh3_chunks=hexes), name=name, tensor=tensor)
        self.assertRejected(name, tensor, "metadata.json", "no chunk checksums")
        edit_header(self.path(name), lambda m: m.__setitem__(tensor + "@xxh3_chunks", hexes))
        self.assertRejected(name, tensor, "fit in one checksum chunk")

    def test_chunk_checksums_without_checksum_chunk(self):
        edit_header(self.path(), lambda m: m.pop("checksum_chunk"))
        self.assertRejected(self.FILE, "no checksum_chunk")


class FakeChunkChecksumV2Test(FakeChunkChecksumTest):
    """The same fake checkpoint in format version 2, written from the documented rule alone."""

    VERSION = 2


def _bin_dir():
    """FLASHCKPT_BIN_DIR, or build/bin of this checkout; None when that is unset and has no flashckptd."""
    bin_dir = os.environ.get("FLASHCKPT_BIN_DIR")
    if bin_dir:
        return bin_dir
    bin_dir = os.path.join(REPO, "build", "bin")
    return bin_dir if os.access(os.path.join(bin_dir, "flashckptd"), os.X_OK) else None


class DaemonChunkChecksumTest(ChunkChecksumCases, unittest.TestCase):
    """A real checkpoint: flashckptd --checksum-chunk 4KiB, four flashckpt-sim ranks (tp 2 x shard 2,
    EMA on) save step 10 once for the class; each case tampers with a copy. Every piece has chunks:
    model and EMA 3 (10368 bytes), optimizer 2 (5184 bytes)."""

    T, D = 2, 2
    SIM_TIMEOUT_S = 30

    @classmethod
    def setUpClass(cls):
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise unittest.SkipTest("no flashckptd in %s/build/bin and FLASHCKPT_BIN_DIR unset" % REPO)
        cls.saved_tmp = tempfile.mkdtemp(prefix="fc-reader-daemon-")
        try:
            cls.saved_job = cls._save(bin_dir, cls.saved_tmp)
        except BaseException:
            shutil.rmtree(cls.saved_tmp, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.saved_tmp, ignore_errors=True)

    @classmethod
    def _save(cls, bin_dir, tmp):
        sock, root = os.path.join(tmp, "flashckptd.sock"), os.path.join(tmp, "root")
        job = "selftest-chunks-%d" % os.getpid()
        daemon_log = os.path.join(tmp, "flashckptd.log")
        cmd = harness.daemon_command(harness.binary(bin_dir, "flashckptd", error=AssertionError), sock, root,
                                     extra_args=["--checksum-chunk", "4KiB"])
        sim = harness.binary(bin_dir, "flashckpt-sim", error=AssertionError)
        world = cls.T * cls.D
        daemon, sims = harness.spawn_daemon(cmd, daemon_log), []
        try:
            harness.wait_daemon_ready(daemon, sock, error=AssertionError,
                                      exit_detail=lambda: ":\n" + harness.tail(daemon_log))
            for rank in range(world):
                out = open(os.path.join(tmp, "sim.rank%d.log" % rank), "wb")
                with out:
                    sims.append(subprocess.Popen(
                        [sim, "--socket", sock, "--job", job, "--rank", str(rank), "--world-size", str(world),
                         "--tp-degree", str(cls.T), "--shard-degree", str(cls.D), "--layers", str(cls.L),
                         "--hidden", str(cls.H), "--steps", str(cls.STEP), "--save-every", str(cls.STEP),
                         "--ema-decay", "0.9", "--run-id", job, "--wait-timeout", str(cls.SIM_TIMEOUT_S)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + cls.SIM_TIMEOUT_S
            for rank, p in enumerate(sims):
                try:
                    rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rc = "still running after %ds" % cls.SIM_TIMEOUT_S
                if rc != 0:
                    raise AssertionError("flashckpt-sim rank %d: %s\n%s\nflashckptd:\n%s" % (
                        rank, rc, harness.tail(os.path.join(tmp, "sim.rank%d.log" % rank)),
                        harness.tail(daemon_log)))
        finally:
            harness.kill_processes(sims)
            code = harness.stop_daemon(daemon)
            for seg in glob.glob("/dev/shm/flashckpt.%s.*" % job):  # the job's EMA segments
                os.unlink(seg)
        if code != 0:
            raise AssertionError("flashckptd exited %s on SIGTERM:\n%s" % (code, harness.tail(daemon_log)))
        return os.path.join(root, job)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fc-reader-daemon-case-")
        job_dir = os.path.join(self.tmp, "job")
        shutil.copytree(self.saved_job, job_dir)
        self.ckpt = os.path.join(job_dir, "checkpoint-%d" % self.STEP)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_ema_pieces_are_chunked_and_checked(self):
        s = self.verify()
        self.assertEqual(s["ema_tensors"], self.L)
        name = "ema.tp00_pp00_shard00.safetensors"
        self.assertEqual(len(self.header(name)["layers.0.weight@xxh3_chunks"]), 3 * 16)
        st = reader.read_safetensors(self.path(name))
        with open(st.path, "r+b") as f:
            f.seek(st.tensors["layers.0.weight"].begin + 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x80]))
        self.assertRejected(name, "layers.0.weight", "chunk 0 of 3")


class FormatV1FixtureTest(unittest.TestCase):
    """tests/data/format_v1: a checkpoint as flashckptd wrote it before format version 2 (whole
    checksums over the bytes). The reader accepts it as version 1 and finds a flipped byte; a real
    flashckptd resumes four flashckpt-sim ranks from it (they check every value) and their next
    checkpoint is version 2, which the reader checks by the documented rule."""

    JOB, STEP, L, H = "format-v1", 10, 2, 48
    SIM_TIMEOUT_S = 30

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="fc-reader-v1-")
        self.root = os.path.join(self.tmp, "root")
        self.job_dir = os.path.join(self.root, self.JOB)
        shutil.copytree(os.path.join(REPO, "tests", "data", "format_v1", self.JOB), self.job_dir)
        self.ckpt = os.path.join(self.job_dir, "checkpoint-%d" % self.STEP)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_reader_accepts_version_1_and_finds_a_flipped_byte(self):
        s = reader.verify_checkpoint(self.ckpt, layers=self.L, hidden=self.H)
        self.assertEqual((s["step"], s["world_size"], s["ema_tensors"]), (self.STEP, 4, self.L))
        name = "model_state.tp01_pp00_shard00.safetensors"
        st = reader.read_safetensors(os.path.join(self.ckpt, name))
        self.assertEqual(st.metadata["format_version"], "1")
        self.assertEqual(len(st.metadata["layers.1.weight@xxh3_chunks"]), 2 * 16)
        with open(st.path, "r+b") as f:
            f.seek(st.tensors["layers.1.weight"].begin + 4097)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x04]))
        with self.assertRaises(reader.CheckpointError) as cm:
            reader.verify_checkpoint(self.ckpt, layers=self.L, hidden=self.H)
        self.assertIn("chunk 1 of 2", str(cm.exception))

    def test_a_daemon_resumes_from_version_1_and_writes_version_2(self):
        bin_dir = _bin_dir()
        if bin_dir is None:
            self.skipTest("no flashckptd in %s/build/bin and FLASHCKPT_BIN_DIR unset" % REPO)
        sock, daemon_log = os.path.join(self.tmp, "flashckptd.sock"), os.path.join(self.tmp, "flashckptd.log")
        cmd = harness.daemon_command(harness.binary(bin_dir, "flashckptd", error=AssertionError), sock, self.root,
                                     extra_args=["--checksum-chunk", "4KiB"])
        sim = harness.binary(bin_dir, "flashckpt-sim", error=AssertionError)
        daemon, sims = harness.spawn_daemon(cmd, daemon_log), []
        try:
            harness.wait_daemon_ready(daemon, sock, error=AssertionError,
                                      exit_detail=lambda: ":\n" + harness.tail(daemon_log))
            for rank in range(4):
                out = open(os.path.join(self.tmp, "sim.rank%d.log" % rank), "wb")
                with out:
                    sims.append(subprocess.Popen(
                        [sim, "--socket", sock, "--job", self.JOB, "--rank", str(rank), "--world-size", "4",
                         "--tp-degree", "2", "--shard-degree", "2", "--layers", str(self.L), "--hidden", str(self.H),
                         "--steps", "20", "--save-every", "10", "--ema-decay", "0.9", "--resume",
                         # One run id on every rank: a rank that starts after another has finished
                         # would otherwise be a run of its own, and step 20 would never complete.
                         "--run-id", "resume-of-v1-%d" % os.getpid(),
                         "--wait-timeout", str(self.SIM_TIMEOUT_S)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + self.SIM_TIMEOUT_S
            for rank, p in enumerate(sims):
                try:
                    rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rc = "still running after %ds" % self.SIM_TIMEOUT_S
                log = harness.tail(os.path.join(self.tmp, "sim.rank%d.log" % rank))
                self.assertEqual(rc, 0, "flashckpt-sim rank %d: %s\n%s\nflashckptd:\n%s" %
                                 (rank, rc, log, harness.tail(daemon_log)))
                self.assertIn("resumed step=%d" % self.STEP, log)
        finally:
            harness.kill_processes(sims)
            code = harness.stop_daemon(daemon)
            for seg in glob.glob("/dev/shm/flashckpt.%s.*" % self.JOB):
                os.unlink(seg)
        self.assertEqual(code, 0, harness.tail(daemon_log))
        self.assertEqual(reader.read_latest(self.job_dir), 20)
        new = os.path.join(self.job_dir, "checkpoint-20")
        s = reader.verify_checkpoint(new, layers=self.L, hidden=self.H)
        self.assertEqual(s["ema_tensors"], self.L)
        st = reader.read_safetensors(os.path.join(new, "model_state.tp00_pp00_shard00.safetensors"))
        self.assertEqual(st.metadata["format_version"], "2")
        hexes = st.metadata["layers.0.weight@xxh3_chunks"]
        size = st.tensors["layers.0.weight"].end - st.tensors["layers.0.weight"].begin
        self.assertEqual(st.metadata["layers.0.weight@xxh3"], whole_from_hex(hexes, size))
        reader.verify_checkpoint(self.ckpt, layers=self.L, hidden=self.H)  # the old one is untouched


if __name__ == "__main__":
    unittest.main(verbosity=2)
