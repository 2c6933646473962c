#!/usr/bin/python3
"""An independent reader of flashckpt checkpoints, for tests.

It shares no code with flashckpt: it parses the safetensors files itself (8-byte little-endian header
length, JSON header, data), computes XXH3-64 itself, and checks a checkpoint directory against the
on-disk contract:

  * metadata.json exists (the checkpoint is complete) and agrees with every file's own header;
  * every rank left its saved_signal_<rank>;
  * every file's __metadata__ and metadata.json record the same "format_version", 1 or 2;
  * per-chunk checksums, where a file has them: its __metadata__ "checksum_chunk" C (decimal, a power
    of two) and, for every tensor of more than C bytes and only for those, "<name>@xxh3_chunks": 16
    lowercase hex digits per chunk k = tensor bytes [k*C, min((k+1)*C, size)) (the last may be
    shorter). Each chunk must hash to its digits, and metadata.json's piece must repeat them as
    "chunk_bytes": C and "xxh3_chunks" (pieces without chunk checksums have neither);
  * every tensor's "<name>@xxh3" in its file's __metadata__: the XXH3-64 of its bytes, except, in
    format version 2, for a tensor with chunk checksums c_0 .. c_(n-1): the XXH3-64 of the 8(n+1)
    bytes c_0, ..., c_(n-1), size, each an unsigned 64-bit little-endian integer (docs/format.md,
    "Checksums");
  * the pieces of each global tensor cover every global element exactly once;
  * with `formula=True`, every element equals what flashckpt-sim writes at the checkpoint's step:
        v = ((l*7919 + i*H + j) % 1000) / 1024 + step   for layers.<l>.weight at global (i, j)
        exp_avg = v / 2,  exp_avg_sq = v / 4              (exact in fp32)
    and the pieces sit where the simulator's layout puts them. EMA files (ema.*) get every check but
    the values, which depend on the average's history; read_ema() assembles them into global arrays
    so that a test can compare them with an average it computes itself.

Only the Python standard library and numpy are used. As a command:

    flashckpt_reader.py <checkpoint-dir | job-dir> [--layers L --hidden H] [--no-formula]

A job directory (one that holds LATEST) means its LATEST checkpoint. Exit status 0 when every check
passes, 1 otherwise, with a message that names the file and tensor at fault.
"""

import argparse
import json
import os
import re
import struct
import sys

import numpy as np

__all__ = [
    "CheckpointError", "xxh3_64", "xxh3_chunks", "read_safetensors", "verify_checkpoint", "sim_expected",
    "read_latest", "complete_steps", "checkpoint_steps", "read_ema", "ema_tensor", "whole_checksum_from_chunks",
]


class CheckpointError(Exception):
    """A checkpoint breaks the on-disk contract; the message names the file and tensor."""


# ------------------------------------------------------------------------------------------------
# XXH3-64 (seed 0, default secret), written from the xxHash specification. Short inputs in Python
# integers; long inputs (> 240 bytes) vectorised over stripes with numpy's wrapping uint64 arithmetic.
# ------------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_STRIPE = 64
_STRIPES_PER_BLOCK = (len(_SECRET) - _STRIPE) // 8  # 16
_BLOCK = _STRIPE * _STRIPES_PER_BLOCK                # 1024 bytes


def _r64(b, off):
    return int.from_bytes(b[off:off + 8], "little")


def _r32(b, off):
    return int.from_bytes(b[off:off + 4], "little")


def _rotl64(x, r):
    return ((x << r) | (x >> (64 - r))) & _M64


def _mul128_fold64(a, b):
    p = a * b
    return (p & _M64) ^ (p >> 64)


def _xxh64_avalanche(h):
    h ^= h >> 33
    h = (h * _P64_2) & _M64
    h ^= h >> 29
    h = (h * _P64_3) & _M64
    return h ^ (h >> 32)


def _xxh3_avalanche(h):
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _M64
    return h ^ (h >> 32)


def _rrmxmx(h, length):
    h ^= _rotl64(h, 49) ^ _rotl64(h, 24)
    h = (h * 0x9FB21C651E98DF25) & _M64
    h ^= (h >> 35) + length
    h = (h * 0x9FB21C651E98DF25) & _M64
    return h ^ (h >> 28)


def _mix16(b, off, soff):
    return _mul128_fold64(_r64(b, off) ^ _r64(_SECRET, soff), _r64(b, off + 8) ^ _r64(_SECRET, soff + 8))


# Secret words per stripe: _STRIPE_KEYS[n] are the 8 little-endian u64 at secret offset 8*n.
_STRIPE_KEYS = np.array([[_r64(_SECRET, 8 * n + 8 * i) for i in range(8)]
                         for n in range(_STRIPES_PER_BLOCK)], dtype=np.uint64)
_SCRAMBLE_KEY = np.array([_r64(_SECRET, len(_SECRET) - _STRIPE + 8 * i) for i in range(8)], dtype=np.uint64)
_SCRAMBLE_INTS = _SCRAMBLE_KEY.tolist()
_LAST_KEY = np.array([_r64(_SECRET, len(_SECRET) - _STRIPE - 7 + 8 * i) for i in range(8)], dtype=np.uint64)
_SWAP = np.array([1, 0, 3, 2, 5, 4, 7, 6])
_LOW32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)


_INIT_ACC = np.array([_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1], dtype=np.uint64)
_SLAB_BYTES = 16 << 20  # input bytes turned into u64 words at a time, to bound temporary memory


def _words(rows, begin, end):
    """Bytes [begin, end) of each row of a (k, n) uint8 array as (k, (end-begin)/8) native uint64."""
    return np.ascontiguousarray(rows[:, begin:end]).view("<u8").astype(np.uint64, copy=False)


def _stripe_sums(stripes, keys):
    """Per-lane contribution of stripes (..., s, 8) under keys (s, 8), summed over the s stripes."""
    data_key = stripes ^ keys
    return (stripes.sum(axis=-2, dtype=np.uint64)[..., _SWAP] +
            ((data_key & _LOW32) * (data_key >> _U32)).sum(axis=-2, dtype=np.uint64))


def _hash_long_rows(rows):
    """XXH3-64 of every row of `rows`, a (k, n) uint8 array with n > 240: a list of k ints.

    The rows are hashed side by side: the stripe arithmetic is vectorised over rows and stripes, and
    only the scramble between 1 KiB blocks (sequential by definition) is a Python loop, once per block
    of a row whatever the number of rows. Hashing a tensor's checksum chunks together this way costs
    about what hashing the tensor whole does.
    """
    k, n = rows.shape
    acc = np.tile(_INIT_ACC, (k, 1))
    nb_blocks = (n - 1) // _BLOCK
    slab = max(1, _SLAB_BYTES // (k * _BLOCK))
    with np.errstate(over="ignore"):
        for b0 in range(0, nb_blocks, slab):
            b1 = min(nb_blocks, b0 + slab)
            words = _words(rows, b0 * _BLOCK, b1 * _BLOCK).reshape(k, b1 - b0, _STRIPES_PER_BLOCK, 8)
            contrib = _stripe_sums(words, _STRIPE_KEYS)  # (k, blocks, 8)
            del words
            if k == 1:  # one row: Python integers beat numpy calls on 8-element arrays
                lanes = acc[0].tolist()
                for c in contrib[0].tolist():
                    lanes = [(((a + x) & _M64) ^ (((a + x) & _M64) >> 47) ^ key) * _P32_1 & _M64
                             for a, x, key in zip(lanes, c, _SCRAMBLE_INTS)]
                acc[0] = np.array(lanes, dtype=np.uint64)
            else:
                for blk in range(b1 - b0):
                    acc += contrib[:, blk]
                    acc ^= acc >> np.uint64(47)
                    acc ^= _SCRAMBLE_KEY
                    acc *= np.uint64(_P32_1)
        start = nb_blocks * _BLOCK
        nb_stripes = ((n - 1) - start) // _STRIPE
        if nb_stripes:
            stripes = _words(rows, start, start + nb_stripes * _STRIPE).reshape(k, nb_stripes, 8)
            acc += _stripe_sums(stripes, _STRIPE_KEYS[:nb_stripes])
        acc += _stripe_sums(_words(rows, n - _STRIPE, n).reshape(k, 1, 8), _LAST_KEY.reshape(1, 8))
    out = []
    for lanes in acc.tolist():
        result = (n * _P64_1) & _M64
        for i in range(4):
            result = (result + _mul128_fold64(lanes[2 * i] ^ _r64(_SECRET, 11 + 16 * i),
                                              lanes[2 * i + 1] ^ _r64(_SECRET, 11 + 16 * i + 8))) & _M64
        out.append(_xxh3_avalanche(result))
    return out


def _hash_long(b):
    return _hash_long_rows(np.frombuffer(b, dtype=np.uint8).reshape(1, -1))[0]


def xxh3_64(data):
    """XXH3-64 of `data` (bytes-like) with seed 0 and the default secret."""
    b = bytes(data)
    n = len(b)
    if n == 0:
        return _xxh64_avalanche(_r64(_SECRET, 56) ^ _r64(_SECRET, 64))
    if n <= 3:
        combined = (b[0] << 16) | (b[n >> 1] << 24) | b[n - 1] | (n << 8)
        return _xxh64_avalanche(combined ^ (_r32(_SECRET, 0) ^ _r32(_SECRET, 4)))
    if n <= 8:
        bitflip = _r64(_SECRET, 8) ^ _r64(_SECRET, 16)
        input64 = (_r32(b, n - 4) + (_r32(b, 0) << 32)) & _M64
        return _rrmxmx(input64 ^ bitflip, n)
    if n <= 16:
        lo = _r64(b, 0) ^ (_r64(_SECRET, 24) ^ _r64(_SECRET, 32))
        hi = _r64(b, n - 8) ^ (_r64(_SECRET, 40) ^ _r64(_SECRET, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _xxh3_avalanche((n + swapped + hi + _mul128_fold64(lo, hi)) & _M64)
    if n <= 128:
        acc = (n * _P64_1) & _M64
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(b, 48, 96) + _mix16(b, n - 64, 112)
                acc += _mix16(b, 32, 64) + _mix16(b, n - 48, 80)
            acc += _mix16(b, 16, 32) + _mix16(b, n - 32, 48)
        acc += _mix16(b, 0, 0) + _mix16(b, n - 16, 16)
        return _xxh3_avalanche(acc & _M64)
    if n <= 240:
        acc = (n * _P64_1) & _M64
        for i in range(8):
            acc += _mix16(b, 16 * i, 16 * i)
        acc = _xxh3_avalanche(acc & _M64)
        for i in range(8, n // 16):
            acc += _mix16(b, 16 * i, 16 * (i - 8) + 3)
        acc += _mix16(b, n - 16, 136 - 17)
        return _xxh3_avalanche(acc & _M64)
    return _hash_long(b)


def xxh3_chunks(data, chunk):
    """XXH3-64 of each `chunk`-byte piece of `data` (the last one may be shorter), as a list of ints.

    Equal to [xxh3_64(data[k:k + chunk]) for k in range(0, len(data), chunk)], but the full chunks
    are hashed side by side (see _hash_long_rows), so that many small chunks cost little more than
    one hash of the whole.
    """
    if chunk < 1:
        raise ValueError("chunk must be positive")
    view = memoryview(data).cast("B")
    n = len(view)
    full = n // chunk
    if chunk <= 240 or full < 2:
        return [xxh3_64(view[k:k + chunk]) for k in range(0, n, chunk)]
    rows = np.frombuffer(view, dtype=np.uint8, count=full * chunk)
    out = []
    group = max(1, _SLAB_BYTES // chunk)  # chunks per batch, to bound temporary memory
    for g in range(0, full, group):
        out += _hash_long_rows(rows[g * chunk:min(full, g + group) * chunk].reshape(-1, chunk))
    if n > full * chunk:
        out.append(xxh3_64(view[full * chunk:]))
    return out


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------

# dtype name -> (element size, numpy dtype or None where numpy has none)
DTYPES = {
    "F64": (8, "<f8"), "F32": (4, "<f4"), "F16": (2, "<f2"), "BF16": (2, None),
    "I64": (8, "<i8"), "I32": (4, "<i4"), "I16": (2, "<i2"), "I8": (1, "i1"), "U8": (1, "u1"),
    "BOOL": (1, "?"),
}
MAX_HEADER_BYTES = 100 << 20
PAGE = 4096


def _is_uint(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class Tensor:
    """One entry of a safetensors file. `begin`/`end` are absolute offsets in the file."""

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


class SafetensorsFile:
    def __init__(self, path, raw, data_start, metadata, tensors):
        self.path = path
        self.name = os.path.basename(path)
        self.raw = raw                  # the whole file
        self.data_start = data_start    # 8 + header length
        self.metadata = metadata        # the __metadata__ object (str -> str)
        self.tensors = tensors          # name -> Tensor, in data order

    def tensor_bytes(self, name):
        t = self.tensors[name]
        return memoryview(self.raw)[t.begin:t.end]

    def array(self, name):
        t = self.tensors[name]
        np_dtype = DTYPES[t.dtype][1]
        if np_dtype is None:
            raise CheckpointError("%s: tensor '%s': dtype %s has no numpy equivalent" % (self.name, name, t.dtype))
        return np.frombuffer(self.raw, dtype=np_dtype, count=_numel(t.shape), offset=t.begin).reshape(t.shape)


def read_safetensors(path):
    """Parses and validates a safetensors file; raises CheckpointError naming the file."""
    name = os.path.basename(path)

    def fail(why):
        raise CheckpointError("%s: %s" % (name, why))

    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        fail("%d bytes: too short for a safetensors header" % len(raw))
    n = int.from_bytes(raw[:8], "little")
    if n == 0 or n > MAX_HEADER_BYTES or n > len(raw) - 8:
        fail("header length %d is impossible for a %d-byte file" % (n, len(raw)))
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        fail("header is not JSON: %s" % e)
    if not isinstance(header, dict):
        fail("header is not a JSON object")
    data_start = 8 + n
    data_bytes = len(raw) - data_start
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        fail("__metadata__ is not an object of strings")
    entries = []
    for tname, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            fail("tensor '%s': entry must have exactly dtype, shape and data_offsets" % tname)
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPES:
            fail("tensor '%s': unknown dtype %r" % (tname, dtype))
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            fail("tensor '%s': shape %r is not a list of unsigned integers" % (tname, shape))
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_uint(o) for o in offs):
            fail("tensor '%s': data_offsets %r is not [begin, end]" % (tname, offs))
        begin, end = offs
        if begin > end or end > data_bytes:
            fail("tensor '%s': data_offsets [%d, %d] outside the %d-byte data region" % (tname, begin, end, data_bytes))
        size = DTYPES[dtype][0]
        if end - begin != _numel(shape) * size:
            fail("tensor '%s': %d bytes but shape %s of %s needs %d" % (tname, end - begin, shape, dtype,
                                                                       _numel(shape) * size))
        if begin % size:
            fail("tensor '%s': data offset %d is not aligned to its element size %d" % (tname, begin, size))
        entries.append(Tensor(tname, dtype, shape, data_start + begin, data_start + end))
    entries.sort(key=lambda t: t.begin)
    expected = data_start
    for t in entries:
        if t.begin != expected:
            fail("tensor '%s': %s before it in the data region" % (t.name, "gap" if t.begin > expected else "overlap"))
        expected = t.end
    if expected != len(raw):
        fail("tensors end at byte %d but the file has %d bytes (truncated or trailing data)" % (expected, len(raw)))
    return SafetensorsFile(path, raw, data_start, metadata, {t.name: t for t in entries})


# ------------------------------------------------------------------------------------------------
# checkpoint directories
# ------------------------------------------------------------------------------------------------

_CKPT_DIR = re.compile(r"^checkpoint-(0|[1-9][0-9]*)$")
_FILE_NAME = re.compile(r"^(model_state|optimizer|ema)\.tp(\d{2,})_pp(\d{2,})_shard(\d{2,})\.safetensors$")
# The file each tensor kind belongs in.
_FILE_OF_KIND = {"model": "model_state", "optimizer": "optimizer", "master_weight": "optimizer", "ema": "ema"}
_SIM_TENSOR = re.compile(r"^layers\.(0|[1-9][0-9]*)\.weight(\.exp_avg|\.exp_avg_sq)?$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def checkpoint_steps(job_dir):
    """Steps of every checkpoint-<step> directory under `job_dir`, complete or not, ascending."""
    steps = []
    for entry in os.listdir(job_dir):
        m = _CKPT_DIR.match(entry)
        if m and os.path.isdir(os.path.join(job_dir, entry)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def complete_steps(job_dir):
    """Steps of the checkpoints that have metadata.json, ascending."""
    return [s for s in checkpoint_steps(job_dir)
            if os.path.isfile(os.path.join(job_dir, "checkpoint-%d" % s, "metadata.json"))]


def read_latest(job_dir):
    """The step in <job_dir>/LATEST (decimal, optional trailing newline)."""
    with open(os.path.join(job_dir, "LATEST"), "r", encoding="ascii") as f:
        text = f.read()
    if not re.fullmatch(r"(0|[1-9][0-9]*)\n?", text):
        raise CheckpointError("LATEST holds %r, not a decimal step" % text)
    return int(text)


def sim_expected(layer, hidden, step, flat_index):
    """flashckpt-sim's value of layers.<layer>.weight at the global row-major indices `flat_index`."""
    base = ((layer * 7919 + flat_index.astype(np.int64)) % 1000).astype(np.float64) / 1024.0 + float(step)
    return base.astype(np.float32)


def _global_flat_indices(global_shape, box_offset, box_shape, flat_range):
    """Row-major indices in the global tensor of each local element, in local order."""
    if flat_range:
        local = np.arange(flat_range[0], flat_range[1], dtype=np.int64)
    else:
        local = np.arange(_numel(box_shape), dtype=np.int64)
    if local.size == 0 or not global_shape:
        return local
    coords = np.unravel_index(local, box_shape)
    return np.ravel_multi_index(tuple(c + o for c, o in zip(coords, box_offset)), global_shape)


def _json_uint_list(text, what):
    try:
        v = json.loads(text)
    except ValueError:
        raise CheckpointError("%s is not JSON: %r" % (what, text))
    if not isinstance(v, list) or not all(_is_uint(x) for x in v):
        raise CheckpointError("%s is not a list of unsigned integers: %r" % (what, text))
    return v


def _uint_meta(meta, key, where):
    v = meta.get(key)
    if v is None or not re.fullmatch(r"[0-9]+", v):
        raise CheckpointError("%s: __metadata__ '%s' missing or not a decimal integer: %r" % (where, key, v))
    return int(v)


class _Topology:
    def __init__(self, world_size, tp_degree, pp_degree, shard_degree):
        self.W, self.T, self.P, self.D = world_size, tp_degree, pp_degree, shard_degree


class _Piece:
    """One tensor of one file, as its own header describes it."""

    def __init__(self, file, name, tensor, kind, gshape, boff, bshape, frange, xxh3, chunk_bytes, xxh3_chunks):
        self.file, self.name, self.tensor, self.kind = file, name, tensor, kind
        self.gshape, self.boff, self.bshape, self.frange, self.xxh3 = gshape, boff, bshape, frange, xxh3
        # Per-chunk checksums (the concatenated hex string) and their chunk size; None for a tensor
        # that is not larger than its file's checksum_chunk.
        self.chunk_bytes, self.xxh3_chunks = chunk_bytes, xxh3_chunks
        # EMA tensors are named after the parameter they average: they are covered separately.
        self.family = "ema" if kind == "ema" else "state"


def _load_metadata(ckpt_dir):
    """Parses metadata.json and checks it against the directory: signals and the file list."""
    meta_path = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError("%s: no metadata.json: the checkpoint is not complete" % ckpt_dir)
    try:
        with open(meta_path, "r", encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:
        raise CheckpointError("%s: not JSON: %s" % (meta_path, e))
    if not isinstance(meta, dict):
        raise CheckpointError("metadata.json is not an object")
    for key in ("job", "step", "topology", "files", "tensors"):
        if key not in meta:
            raise CheckpointError("metadata.json: no '%s'" % key)
    job, step, topo = meta["job"], meta["step"], meta["topology"]
    if not isinstance(job, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", job) or job in (".", ".."):
        raise CheckpointError("metadata.json: bad job name %r" % (job,))
    if not _is_uint(step):
        raise CheckpointError("metadata.json: step %r is not an unsigned integer" % (step,))
    if os.path.basename(ckpt_dir) != "checkpoint-%d" % step:
        raise CheckpointError("metadata.json: step %d does not match directory %s" % (step, ckpt_dir))
    if not isinstance(topo, dict):
        raise CheckpointError("metadata.json: topology is not an object")
    for key in ("world_size", "tp_degree", "pp_degree", "shard_degree"):
        if not _is_uint(topo.get(key)) or topo[key] < 1:
            raise CheckpointError("metadata.json: topology.%s = %r" % (key, topo.get(key)))
    t = _Topology(topo["world_size"], topo["tp_degree"], topo["pp_degree"], topo["shard_degree"])
    if t.W != t.T * t.P * t.D:
        raise CheckpointError("metadata.json: world_size %d != %d*%d*%d" % (t.W, t.T, t.P, t.D))
    for r in range(t.W):
        if not os.path.isfile(os.path.join(ckpt_dir, "saved_signal_%d" % r)):
            raise CheckpointError("%s: metadata.json exists but saved_signal_%d does not" % (ckpt_dir, r))

    listed = {}  # file name -> files entry
    if not isinstance(meta["files"], list):
        raise CheckpointError("metadata.json: files is not a list")
    for fe in meta["files"]:
        if not isinstance(fe, dict) or not isinstance(fe.get("name"), str):
            raise CheckpointError("metadata.json: bad files entry %r" % (fe,))
        for key in ("rank", "tp_rank", "pp_rank", "shard_rank", "bytes"):
            if not _is_uint(fe.get(key)):
                raise CheckpointError("metadata.json: file %s: %s = %r" % (fe["name"], key, fe.get(key)))
        if fe["name"] in listed:
            raise CheckpointError("metadata.json: file %s listed twice" % fe["name"])
        listed[fe["name"]] = fe
    present = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".safetensors"))
    if sorted(listed) != present:
        raise CheckpointError("%s: metadata.json and the directory disagree: listed but absent %s, present but "
                              "unlisted %s" % (ckpt_dir, sorted(set(listed) - set(present)),
                                               sorted(set(present) - set(listed))))
    if not present:
        raise CheckpointError("%s: no .safetensors files" % ckpt_dir)

    if not isinstance(meta["tensors"], dict):
        raise CheckpointError("metadata.json: tensors is not an object")
    indexed = {}  # (file, tensor name) -> piece entry
    for key, pieces in meta["tensors"].items():
        if not isinstance(pieces, list) or not pieces:
            raise CheckpointError("metadata.json: tensor '%s' has no pieces" % key)
        for p in pieces:
            if not isinstance(p, dict) or p.get("file") not in listed:
                raise CheckpointError("metadata.json: tensor '%s' has a piece in unknown file %r" %
                                      (key, p.get("file") if isinstance(p, dict) else p))
            if (p["file"], key) in indexed:
                raise CheckpointError("metadata.json: tensor '%s' has two pieces in %s" % (key, p["file"]))
            indexed[(p["file"], key)] = p
    return job, step, t, listed, indexed


def _check_file_header(st, fe, job, step, topo, formula):
    """Checks a file's name and __metadata__ against metadata.json; returns (kind, tp, pp, shard)."""
    fname, m = st.name, st.metadata
    if fe["bytes"] != len(st.raw):
        raise CheckpointError("%s: metadata.json says %d bytes, the file has %d" % (fname, fe["bytes"], len(st.raw)))
    if st.data_start % PAGE:
        raise CheckpointError("%s: data starts at byte %d, not on a 4 KiB boundary" % (fname, st.data_start))
    fm = _FILE_NAME.match(fname)
    if not fm:
        raise CheckpointError("%s: name is not <model_state|optimizer|ema>.tpXX_ppYY_shardZZ.safetensors" % fname)
    kind_of_file = fm.group(1)
    tp, pp, shard = int(fm.group(2)), int(fm.group(3)), int(fm.group(4))
    if m.get("job") != job:
        raise CheckpointError("%s: __metadata__ job %r, metadata.json says %r" % (fname, m.get("job"), job))
    step_text = m.get("step", "")
    if not re.fullmatch(r"[0-9]{20}", step_text) or int(step_text) != step:
        raise CheckpointError("%s: __metadata__ step %r is not step %d as 20 digits" % (fname, step_text, step))
    if m.get("file") != kind_of_file:
        raise CheckpointError("%s: __metadata__ file %r does not match the name" % (fname, m.get("file")))
    for key, want in (("world_size", topo.W), ("tp_degree", topo.T), ("pp_degree", topo.P),
                      ("shard_degree", topo.D), ("rank", fe["rank"]), ("tp_rank", tp), ("pp_rank", pp),
                      ("shard_rank", shard)):
        got = _uint_meta(m, key, fname)
        if got != want:
            raise CheckpointError("%s: __metadata__ %s = %d, expected %d" % (fname, key, got, want))
    if (fe["tp_rank"], fe["pp_rank"], fe["shard_rank"]) != (tp, pp, shard):
        raise CheckpointError("%s: metadata.json coordinates differ from the file name" % fname)
    if tp >= topo.T or pp >= topo.P or shard >= topo.D or fe["rank"] >= topo.W:
        raise CheckpointError("%s: coordinates outside the topology" % fname)
    if formula and fe["rank"] != tp + topo.T * (pp + topo.P * shard):
        raise CheckpointError("%s: rank %d is not tp + T*(pp + P*shard) = %d as flashckpt-sim maps it" %
                              (fname, fe["rank"], tp + topo.T * (pp + topo.P * shard)))
    if not st.tensors:
        raise CheckpointError("%s: holds no tensors" % fname)
    return kind_of_file, tp, pp, shard


def _checksum_chunk(st):
    """The file's "checksum_chunk" (a power of two), or None when its header has none."""
    text = st.metadata.get("checksum_chunk")
    if text is None:
        return None
    if not re.fullmatch(r"[1-9][0-9]*", text) or int(text) & (int(text) - 1):
        raise CheckpointError("%s: __metadata__ checksum_chunk %r is not a power of two in decimal" %
                              (st.name, text))
    return int(text)


def _chunk_span(k, chunk, size):
    return "chunk %d of %d (bytes [%d, %d) of the tensor)" % (k, -(-size // chunk), k * chunk,
                                                              min((k + 1) * chunk, size))


def _read_chunk_checksums(st, tname, chunk, where):
    """A tensor's "@xxh3_chunks" from its file's header, checked against the file's checksum_chunk:
    present exactly when the tensor is larger than one chunk, 16 lowercase hex digits per chunk."""
    t = st.tensors[tname]
    size = t.end - t.begin
    hexes = st.metadata.get(tname + "@xxh3_chunks")
    if chunk is None:
        if hexes is not None:
            raise CheckpointError("%s: has @xxh3_chunks but the file's __metadata__ has no checksum_chunk" % where)
        return None
    if size <= chunk:
        if hexes is not None:
            raise CheckpointError("%s: has @xxh3_chunks but its %d bytes fit in one checksum chunk of %d" %
                                  (where, size, chunk))
        return None
    count = -(-size // chunk)
    if hexes is None:
        raise CheckpointError("%s: %d bytes, more than the file's checksum_chunk %d, but no @xxh3_chunks" %
                              (where, size, chunk))
    if len(hexes) != 16 * count:
        raise CheckpointError("%s: @xxh3_chunks has %d characters; %d chunks of %d bytes need %d" %
                              (where, len(hexes), count, chunk, 16 * count))
    for k in range(count):
        if not _HEX16.match(hexes[16 * k:16 * k + 16]):
            raise CheckpointError("%s: @xxh3_chunks %s is %r, not 16 lowercase hex digits" %
                                  (where, _chunk_span(k, chunk, size), hexes[16 * k:16 * k + 16]))
    return hexes


def _format_version(text, where):
    """A format_version this reader knows (1 or 2), from its decimal text."""
    if text not in ("1", "2"):
        raise CheckpointError("%s: format_version %r is not 1 or 2" % (where, text))
    return int(text)


def whole_checksum_from_chunks(chunk_sums, size):
    """Format version 2: a chunked tensor's whole checksum from its chunk checksums and byte size."""
    return xxh3_64(struct.pack("<%dQ" % (len(chunk_sums) + 1), *chunk_sums, size))


def _read_piece(st, tname, kind_of_file, checksums, chunk=None, version=1):
    """A tensor's geometry and checksum from its file's __metadata__, checked for consistency."""
    t, m = st.tensors[tname], st.metadata
    where = "%s: tensor '%s'" % (st.name, tname)
    kind = m.get(tname + "@kind")
    if kind not in _FILE_OF_KIND:
        raise CheckpointError("%s: @kind %r" % (where, kind))
    if _FILE_OF_KIND[kind] != kind_of_file:
        raise CheckpointError("%s: kind %s does not belong in a %s file" % (where, kind, kind_of_file))
    gshape = _json_uint_list(m.get(tname + "@global_shape", "null"), where + " @global_shape")
    boff = _json_uint_list(m.get(tname + "@box_offset", "null"), where + " @box_offset")
    bshape = _json_uint_list(m.get(tname + "@box_shape", "null"), where + " @box_shape")
    if not (len(gshape) == len(boff) == len(bshape)):
        raise CheckpointError("%s: global_shape, box_offset, box_shape differ in rank" % where)
    for d in range(len(gshape)):
        if boff[d] + bshape[d] > gshape[d]:
            raise CheckpointError("%s: box leaves the global tensor in dimension %d" % (where, d))
    frange = None
    if tname + "@flat_range" in m:
        frange = _json_uint_list(m[tname + "@flat_range"], where + " @flat_range")
        if len(frange) != 2 or frange[0] > frange[1] or frange[1] > _numel(bshape):
            raise CheckpointError("%s: flat_range %s not inside the box" % (where, frange))
        if frange[1] - frange[0] != _numel(t.shape):
            raise CheckpointError("%s: flat_range has %d elements, shape %s has %d" %
                                  (where, frange[1] - frange[0], t.shape, _numel(t.shape)))
    elif t.shape != bshape:
        raise CheckpointError("%s: shape %s differs from box_shape %s without a flat_range" % (where, t.shape, bshape))
    ck = m.get(tname + "@xxh3", "")
    if not _HEX16.match(ck):
        raise CheckpointError("%s: @xxh3 %r is not 16 lowercase hex digits" % (where, ck))
    chunks = _read_chunk_checksums(st, tname, chunk, where)
    size = t.end - t.begin
    from_chunks = version >= 2 and chunks is not None
    if from_chunks:  # a function of the recorded chunk checksums: checked even without hashing data
        sums = [int(chunks[16 * k:16 * k + 16], 16) for k in range(len(chunks) // 16)]
        want = "%016x" % whole_checksum_from_chunks(sums, size)
        if want != ck:
            raise CheckpointError("%s: @xxh3 %s is not %s, the format version 2 checksum of its chunk checksums" %
                                  (where, ck, want))
    if checksums:
        if chunks is not None:  # first, so that damage is located to a chunk
            for k, h in enumerate(xxh3_chunks(st.tensor_bytes(tname), chunk)):
                got, want = "%016x" % h, chunks[16 * k:16 * k + 16]
                if got != want:
                    raise CheckpointError("%s: %s: chunk checksum mismatch: header says %s, bytes hash to %s" %
                                          (where, _chunk_span(k, chunk, size), want, got))
        if not from_chunks:
            got = "%016x" % xxh3_64(st.tensor_bytes(tname))
            if got != ck:
                raise CheckpointError("%s: checksum mismatch: header says %s, bytes hash to %s" % (where, ck, got))
    return _Piece(st.name, tname, t, kind, gshape, boff, bshape, frange, ck,
                  chunk if chunks is not None else None, chunks)


def _check_index_entry(piece, entry):
    """metadata.json's entry for a piece must repeat what the file's header says."""
    where = "%s: tensor '%s'" % (piece.file, piece.name)
    if entry is None:
        raise CheckpointError("%s: missing from metadata.json's tensor index" % where)
    t = piece.tensor
    size = t.end - t.begin
    if piece.xxh3_chunks is None:
        for key in ("chunk_bytes", "xxh3_chunks"):
            if key in entry:
                raise CheckpointError("%s: metadata.json has %s, the file's header has no chunk checksums" %
                                      (where, key))
    else:
        if not _is_uint(entry.get("chunk_bytes")) or entry["chunk_bytes"] != piece.chunk_bytes:
            raise CheckpointError("%s: metadata.json has chunk_bytes = %r, the file's checksum_chunk is %d" %
                                  (where, entry.get("chunk_bytes"), piece.chunk_bytes))
        hexes = entry.get("xxh3_chunks")
        if not isinstance(hexes, str) or len(hexes) != len(piece.xxh3_chunks):
            got = "is not a string" if not isinstance(hexes, str) else "has %d characters" % len(hexes)
            raise CheckpointError("%s: metadata.json xxh3_chunks %s; the file's header has %d chunk checksums "
                                  "(%d characters)" % (where, got, len(piece.xxh3_chunks) // 16,
                                                       len(piece.xxh3_chunks)))
        for k in range(len(piece.xxh3_chunks) // 16):
            if hexes[16 * k:16 * k + 16] != piece.xxh3_chunks[16 * k:16 * k + 16]:
                raise CheckpointError("%s: %s: metadata.json has chunk checksum %r, the file's header has %s" %
                                      (where, _chunk_span(k, piece.chunk_bytes, size), hexes[16 * k:16 * k + 16],
                                       piece.xxh3_chunks[16 * k:16 * k + 16]))
    want = {"kind": piece.kind, "dtype": t.dtype, "shape": t.shape, "global_shape": piece.gshape,
            "box_offset": piece.boff, "box_shape": piece.bshape, "offsets": [t.begin, t.end], "xxh3": piece.xxh3,
            "flat_range": piece.frange}
    for key, value in want.items():
        if entry.get(key) != value:
            raise CheckpointError("%s: metadata.json has %s = %r, the file has %r" % (where, key, entry.get(key), value))


def _check_sim_values(st, piece, coords, topo, step, gidx):
    """The piece sits where flashckpt-sim puts it and holds exactly its values at `step`."""
    where = "%s: tensor '%s'" % (piece.file, piece.name)
    tp, pp, shard = coords
    sm = _SIM_TENSOR.match(piece.name)
    if not sm:
        raise CheckpointError("%s: not a tensor flashckpt-sim writes" % where)
    layer, suffix = int(sm.group(1)), sm.group(2) or ""
    gshape, boff, bshape, frange = piece.gshape, piece.boff, piece.bshape, piece.frange
    if piece.tensor.dtype != "F32" or len(gshape) != 2 or gshape[0] != gshape[1]:
        raise CheckpointError("%s: expected F32 [H, H], found %s %s" % (where, piece.tensor.dtype, gshape))
    H = gshape[0]
    if layer % topo.P != pp:
        raise CheckpointError("%s: layer %d belongs to pp rank %d, file is pp %d" % (where, layer, layer % topo.P, pp))
    # Row blocks of ceil(H/T) rows, the last one shorter when T does not divide H (as flashckpt-sim).
    block = -(-H // topo.T)
    rows = min(block, H - tp * block)
    if rows <= 0 or boff != [tp * block, 0] or bshape != [rows, H]:
        raise CheckpointError("%s: box %s+%s is not row block %d of %d (rows of %d)" %
                              (where, boff, bshape, tp, topo.T, block))
    if suffix == "":
        if piece.kind != "model" or shard != 0 or frange is not None:
            raise CheckpointError("%s: the model weight is written by shard 0 only, as a box" % where)
        scale = 1.0
    else:
        n = _numel(bshape)
        chunk = -(-n // topo.D)
        want_range = [min(shard * chunk, n), min((shard + 1) * chunk, n)]
        if piece.kind != "optimizer" or frange != want_range:
            raise CheckpointError("%s: expected optimizer flat range %s, found %s %s" %
                                  (where, want_range, piece.kind, frange))
        scale = 0.5 if suffix == ".exp_avg" else 0.25
    expected = (sim_expected(layer, H, step, gidx) * np.float32(scale)).astype(np.float32)
    actual = st.array(piece.name).reshape(-1)
    if not np.array_equal(actual, expected):
        bad = int(np.flatnonzero(actual != expected)[0])
        raise CheckpointError("%s: element %d (global flat index %d) is %r, expected %r at step %d" %
                              (where, bad, int(gidx[bad]), float(actual[bad]), float(expected[bad]), step))


def _check_coverage(coverage):
    """Every global element of every tensor is saved exactly once."""
    for (_, key), (gshape, _, kind, cov) in sorted(coverage.items()):
        if cov.size and cov.min() == 0:
            first = int(np.flatnonzero(cov == 0)[0])
            raise CheckpointError("tensor '%s' (%s): %d of %d global elements are in no file (first: flat index %d)" %
                                  (key, kind, int((cov == 0).sum()), cov.size, first))
        if cov.size and cov.max() > 1:
            first = int(np.flatnonzero(cov > 1)[0])
            raise CheckpointError("tensor '%s' (%s): %d global elements are saved more than once (first: flat "
                                  "index %d)" % (key, kind, int((cov > 1).sum()), first))


def verify_checkpoint(ckpt_dir, layers=None, hidden=None, formula=True, checksums=True):
    """Checks one checkpoint directory; returns a summary dict or raises CheckpointError.

    layers/hidden: when given, the exact set of simulator tensors and their global shape [H, H].
    formula: check every model/optimizer element against flashckpt-sim's values and layout (else only
    structure, coverage and checksums). EMA files (ema.*) are checked for structure, checksums and
    coverage only: their values depend on the average's history.
    checksums: hash the data and compare it with the whole-tensor and per-chunk checksums (without it
    the checksums are still checked for form and for agreement between headers and metadata.json).
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    job, step, topo, listed, indexed = _load_metadata(ckpt_dir)
    with open(os.path.join(ckpt_dir, "metadata.json"), "r", encoding="utf-8") as f:
        version = _format_version(str(json.load(f).get("format_version")), "metadata.json")
    coverage = {}  # (family, tensor name) -> (global_shape, dtype, kind, uint8 count per global element)
    summary = {"job": job, "step": step, "world_size": topo.W, "files": len(listed), "pieces": 0,
               "elements": 0, "ema_elements": 0, "bytes": 0}
    for fname in sorted(listed):
        st = read_safetensors(os.path.join(ckpt_dir, fname))
        summary["bytes"] += len(st.raw)
        kind_of_file, tp, pp, shard = _check_file_header(st, listed[fname], job, step, topo, formula)
        chunk = _checksum_chunk(st)
        file_version = _format_version(st.metadata.get("format_version"), fname + ": __metadata__")
        if file_version != version:
            raise CheckpointError("%s: format_version %d, metadata.json says %d" % (fname, file_version, version))
        for tname in st.tensors:
            piece = _read_piece(st, tname, kind_of_file, checksums, chunk, version)
            _check_index_entry(piece, indexed.pop((fname, tname), None))
            summary["pieces"] += 1

            gidx = _global_flat_indices(piece.gshape, piece.boff, piece.bshape, piece.frange)
            signature = (piece.gshape, piece.tensor.dtype, piece.kind)
            cov = coverage.setdefault((piece.family, tname),
                                      signature + (np.zeros(_numel(piece.gshape), dtype=np.uint8),))
            if cov[:3] != signature:
                raise CheckpointError("%s: tensor '%s': global shape/dtype/kind %s differ from another piece's %s" %
                                      (fname, tname, signature, cov[:3]))
            np.add.at(cov[3], gidx, 1)

            if piece.family == "ema":
                summary["ema_elements"] += int(gidx.size)
                continue
            if formula:
                _check_sim_values(st, piece, (tp, pp, shard), topo, step, gidx)
            summary["elements"] += int(gidx.size)
    if indexed:
        (fname, key), _ = next(iter(indexed.items()))
        raise CheckpointError("metadata.json: tensor '%s' in %s is not in the file" % (key, fname))
    _check_coverage(coverage)

    state = {key: v for (family, key), v in coverage.items() if family == "state"}
    if layers is not None:
        want = set()
        for layer in range(layers):
            want |= {"layers.%d.weight" % layer, "layers.%d.weight.exp_avg" % layer,
                     "layers.%d.weight.exp_avg_sq" % layer}
        if set(state) != want:
            raise CheckpointError("tensors %s differ from the expected %s (missing %s, extra %s)" %
                                  (sorted(state), sorted(want), sorted(want - set(state)), sorted(set(state) - want)))
    if hidden is not None:
        for key, (gshape, _, _, _) in state.items():
            if gshape != [hidden, hidden]:
                raise CheckpointError("tensor '%s': global shape %s, expected [%d, %d]" % (key, gshape, hidden, hidden))
    summary["tensors"] = len(state)
    summary["ema_tensors"] = len(coverage) - len(state)
    return summary


def read_ema(ckpt_dir):
    """The EMA tensors of a complete checkpoint, assembled from its ema.* files.

    Returns {tensor name: float32 numpy array of the tensor's global shape}; an empty dict when the
    checkpoint has no EMA. Each piece is placed by its own header (@global_shape, @box_offset,
    @box_shape, optional @flat_range); every piece must be F32 with @kind "ema", and every global
    element of every EMA tensor must be in exactly one piece. Checksums are not checked here
    (verify_checkpoint does that).
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    _, _, _, listed, _ = _load_metadata(ckpt_dir)
    assembled = {}  # name -> (global shape, values, count per global element)
    for fname in sorted(listed):
        fm = _FILE_NAME.match(fname)
        if not fm or fm.group(1) != "ema":
            continue
        st = read_safetensors(os.path.join(ckpt_dir, fname))
        for tname, t in st.tensors.items():
            where = "%s: tensor '%s'" % (fname, tname)
            m = st.metadata
            if m.get(tname + "@kind") != "ema":
                raise CheckpointError("%s: @kind %r in an ema file" % (where, m.get(tname + "@kind")))
            if t.dtype != "F32":
                raise CheckpointError("%s: EMA dtype %s, expected F32" % (where, t.dtype))
            gshape = _json_uint_list(m.get(tname + "@global_shape", "null"), where + " @global_shape")
            boff = _json_uint_list(m.get(tname + "@box_offset", "null"), where + " @box_offset")
            bshape = _json_uint_list(m.get(tname + "@box_shape", "null"), where + " @box_shape")
            if not (len(gshape) == len(boff) == len(bshape)) or any(
                    o + n > g for o, n, g in zip(boff, bshape, gshape)):
                raise CheckpointError("%s: box %s+%s does not fit the global shape %s" % (where, boff, bshape, gshape))
            frange = None
            if tname + "@flat_range" in m:
                frange = _json_uint_list(m[tname + "@flat_range"], where + " @flat_range")
                if len(frange) != 2 or frange[0] > frange[1] or frange[1] > _numel(bshape):
                    raise CheckpointError("%s: flat_range %s not inside the box" % (where, frange))
            gidx = _global_flat_indices(gshape, boff, bshape, frange)
            if gidx.size != _numel(t.shape):
                raise CheckpointError("%s: %d elements, its box/flat_range places %d" % (where, _numel(t.shape),
                                                                                         gidx.size))
            entry = assembled.setdefault(tname, (gshape, np.zeros(_numel(gshape), dtype=np.float32),
                                                 np.zeros(_numel(gshape), dtype=np.uint8)))
            if entry[0] != gshape:
                raise CheckpointError("%s: global shape %s, another piece says %s" % (where, gshape, entry[0]))
            entry[1][gidx] = st.array(tname).reshape(-1)
            np.add.at(entry[2], gidx, 1)
    out = {}
    for tname, (gshape, values, count) in sorted(assembled.items()):
        if count.size and (count.min() != 1 or count.max() != 1):
            raise CheckpointError("EMA tensor '%s': %d global elements in no piece, %d in more than one" %
                                  (tname, int((count == 0).sum()), int((count > 1).sum())))
        out[tname] = values.reshape(gshape)
    return out


def ema_tensor(ckpt_dir, name):
    """The EMA of parameter `name` in a complete checkpoint (float32, global shape); see read_ema."""
    tensors = read_ema(ckpt_dir)
    if name not in tensors:
        raise CheckpointError("%s: no EMA tensor '%s' (EMA tensors: %s)" % (ckpt_dir, name, sorted(tensors)))
    return tensors[name]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a checkpoint-<step> directory, or a job directory (its LATEST is checked)")
    ap.add_argument("--layers", type=int, help="expect exactly the simulator tensors of this many layers")
    ap.add_argument("--hidden", type=int, help="expect global shape [H, H]")
    ap.add_argument("--no-formula", action="store_true", help="skip flashckpt-sim's values and layout")
    ap.add_argument("--no-checksums", action="store_true",
                    help="skip hashing the data (the whole-tensor and per-chunk xxh3)")
    args = ap.parse_args(argv)
    path = args.path
    try:
        if os.path.isfile(os.path.join(path, "LATEST")):
            path = os.path.join(path, "checkpoint-%d" % read_latest(path))
        s = verify_checkpoint(path, layers=args.layers, hidden=args.hidden, formula=not args.no_formula,
                              checksums=not args.no_checksums)
    except (CheckpointError, OSError) as e:
        print("FAIL %s: %s" % (path, e), file=sys.stderr)
        return 1
    print("ok job=%s step=%d world_size=%d files=%d tensors=%d pieces=%d elements=%d bytes=%d" %
          (s["job"], s["step"], s["world_size"], s["files"], s["tensors"], s["pieces"], s["elements"], s["bytes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
