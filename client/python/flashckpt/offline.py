"""Offline work on checkpoint directories (no daemon): flashckpt.export."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from . import _flashckpt


def export(checkpoint_dir: Union[str, os.PathLike[str]], out_dir: Union[str, os.PathLike[str]], weights: str = "model",
           dtype: Optional[str] = None, max_shard_size: Union[int, str] = "5GB", strip_prefix: str = "",
           threads: int = 4) -> Dict[str, Any]:
    """Writes a checkpoint's weights as a Hugging Face style safetensors directory.

    checkpoint_dir: a complete checkpoint (<root>/<job>/checkpoint-<step>), in any parallel layout.
    out_dir: created, or an empty directory. It gets model.safetensors, or, when the tensors pass
      max_shard_size, model-0000K-of-0000N.safetensors and model.safetensors.index.json; each file
      appears (atomic rename) only when complete, the index last.
    weights: "model" (the model weights), "ema" (the EMA, under its parameters' names) or "optimizer"
      (the training state: optimizer moments and step counters).
    dtype: None keeps the saved dtypes; "fp32", "bf16" or "fp16" converts the floating-point
      tensors (rounding to nearest even).
    max_shard_size: most tensor bytes per file, an int or a size string ("5GB", "500MiB"; K/M/G are
      powers of 1024); a tensor larger than it gets a file of its own.
    strip_prefix: removed from the start of every tensor name that has it (e.g. "model.").

    Every byte read is verified against the checkpoint's checksums (CorruptionError otherwise); a
    missing directory or incomplete checkpoint is NotFoundError. Returns a dict: tensors, bytes,
    files (the safetensors file names), index (whether the index was written).
    """
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError("dtype must be None, 'fp32', 'bf16' or 'fp16', got %r" % (dtype,))
    if weights not in ("model", "ema", "optimizer"):
        raise ValueError("weights must be 'model', 'ema' or 'optimizer', got %r" % (weights,))
    tensors, nbytes, files, index = _flashckpt.export_checkpoint(
        os.fspath(checkpoint_dir), os.fspath(out_dir), weights, dtype or "", str(max_shard_size), strip_prefix,
        int(threads))
    return {"tensors": tensors, "bytes": nbytes, "files": list(files), "index": index}
