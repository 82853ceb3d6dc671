"""Storage layer of the target hidden-state cache (no model code here).

The cache stage runs the frozen target model once over the training conversations and stores, per
conversation ("record"), what a drafter needs at train time:

    input_ids          int32  [T]
    loss_mask          uint8  [T]
    hidden_states      dtype  [T, K*H]   outputs of the K target layers in ``layer_ids``, concatenated
    last_hidden_state  dtype  [T, H]     the target's final-norm state (the frozen lm_head turns it
                                         into target logits, so full-vocabulary logits are never stored)

``dtype`` is the cache dtype: bfloat16 (default), float16 or float32. Hidden states are stored as raw
little-endian bytes of that dtype and come back as torch tensors of that dtype, as zero-copy views of a
memory map. (bfloat16 has no numpy dtype, so it travels through numpy as int16 bit patterns.)

On-disk layout of a cache directory
-----------------------------------
``shard-00000.bin``, ``shard-00001.bin``, ...
    Records back to back, in record order. Every array starts at a multiple of 64 bytes (zero padding
    between arrays and after each record), so a record is::

        input_ids | pad | loss_mask | pad | hidden_states | pad | last_hidden_state | pad

    Shard ``s`` holds records ``[s*records_per_shard, min((s+1)*records_per_shard, num_records))``.

``index.bin``
    One fixed-size little-endian record per cache record, in record order (``INDEX_STRUCT``,
    ``struct`` format ``"<QIIQQQQQII"``, 64 bytes)::

        u64 record_id            equals the record's position in the cache (0..num_records-1)
        u32 shard_id
        u32 seq_len              T
        u64 off_input_ids        byte offsets inside the shard file; off_input_ids is also where the
        u64 off_loss_mask        record starts
        u64 off_hidden_states
        u64 off_last_hidden_state
        u64 num_bytes            length of the record's byte span [off_input_ids, end of
                                 last_hidden_state), inter-array padding included
        u32 crc32                zlib.crc32 of that span, checked on every read
        u32 reserved             0

``manifest.json``
    Written last and atomically; its presence is what makes a cache complete (a directory without it
    is never readable). Keys: ``format_version``, ``codec`` ("raw"; a compressed codec may come later
    and readers refuse codecs they do not know), ``num_records``, ``num_tokens``, ``num_shards``,
    ``records_per_shard``, ``shards`` [{name, num_records, num_bytes, sha256}], ``target``,
    ``layer_ids``, ``hidden_size``, ``dtype``, ``tokenizer_fingerprint``, ``index_record_size``,
    ``index_sha256``, ``alignment`` and a free ``meta`` dict. It holds nothing nondeterministic (no
    timestamps, hosts or paths): two caches written from the same records are byte-identical.

Writing and crash safety
------------------------
Shard composition is fixed up front by ``(num_records, records_per_shard)``, so any number of ranks can
write disjoint shards independently, and a resumed run rebuilds exactly the same bytes. While a cache
is being written the directory also holds:

``writer-plan.json``
    The writer's parameters (spec, num_records, records_per_shard, meta). A writer reopening the
    directory with different parameters is refused instead of silently mixing two caches.
``shard-XXXXX.bin.tmp`` / ``shard-XXXXX.idx.json.tmp``
    A shard and its sidecar (the shard's index rows, byte count and sha256) being streamed.
``shard-XXXXX.idx.json``
    The published sidecar. It is the shard's commit marker: it is published (fsync + os.replace)
    only after the shard file itself, so ``kill -9`` at any moment leaves either a complete shard or
    a pending one, never a half shard that looks complete.

``finalize()`` merges the sidecars into ``index.bin``, writes ``manifest.json`` and removes the
sidecars, temp files and plan. After it, the directory holds only shards, index and manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import torch

__all__ = [
    "FORMAT_VERSION",
    "CODEC",
    "ALIGNMENT",
    "INDEX_STRUCT",
    "CacheSpec",
    "CacheWriter",
    "TargetCache",
    "CacheMismatchError",
    "CacheFormatError",
    "CacheCorruptedError",
    "CacheIncompleteError",
    "bytes_per_token",
    "format_bytes",
]

FORMAT_VERSION = 1
CODEC = "raw"
#: codecs this reader can decode; a future compressed codec gets added here together with its reader.
SUPPORTED_CODECS = ("raw",)
ALIGNMENT = 64

INDEX_STRUCT = struct.Struct("<QIIQQQQQII")
#: the same layout as a numpy structured dtype, to read millions of index rows without a Python loop.
INDEX_DTYPE = np.dtype(
    [
        ("record_id", "<u8"),
        ("shard_id", "<u4"),
        ("seq_len", "<u4"),
        ("off_input_ids", "<u8"),
        ("off_loss_mask", "<u8"),
        ("off_hidden_states", "<u8"),
        ("off_last_hidden_state", "<u8"),
        ("num_bytes", "<u8"),
        ("crc32", "<u4"),
        ("reserved", "<u4"),
    ]
)
assert INDEX_STRUCT.size == INDEX_DTYPE.itemsize == 64

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.bin"
PLAN_NAME = "writer-plan.json"

# name -> (torch dtype, numpy dtype the raw bytes are viewed as, itemsize)
_DTYPES = {
    "bfloat16": (torch.bfloat16, np.dtype("<i2"), 2),
    "float16": (torch.float16, np.dtype("<f2"), 2),
    "float32": (torch.float32, np.dtype("<f4"), 4),
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

_INT32 = np.iinfo(np.int32)
_ZEROS = bytes(ALIGNMENT)
# Temp files and sidecars that only exist while a cache is being written; finalize() removes them.
_SCRATCH_RE = re.compile(
    r"^(shard-\d{5,}\.bin\.tmp|shard-\d{5,}\.idx\.json(\.tmp)?|writer-plan\.json(\.[\w.-]+)?\.tmp"
    r"|writer-plan\.json|index\.bin\.tmp|manifest\.json\.tmp)$"
)


# --------------------------------------------------------------------------------------------- errors
class CacheMismatchError(ValueError):
    """The cache was built for another target / layers / tokenizer / dtype than the one asked for."""


class CacheFormatError(CacheMismatchError):
    """The cache uses a format version or codec this reader does not know."""


class CacheCorruptedError(RuntimeError):
    """Bytes on disk do not match their checksum, size or index."""


class CacheIncompleteError(RuntimeError):
    """The cache directory was never finalized (no manifest.json)."""


# ----------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds: which target, which layers, what width and dtype, which tokenizer."""

    target: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    tokenizer_fingerprint: str = ""

    def __post_init__(self):
        # Normalise here so that specs built from YAML lists or "bf16" compare equal to manifest specs.
        layer_ids = tuple(int(i) for i in self.layer_ids)
        if not layer_ids:
            raise ValueError("CacheSpec.layer_ids must name at least one target layer")
        object.__setattr__(self, "layer_ids", layer_ids)
        dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if dtype not in _DTYPES:
            raise ValueError(f"CacheSpec.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        if int(self.hidden_size) <= 0:
            raise ValueError(f"CacheSpec.hidden_size must be positive, got {self.hidden_size}")
        object.__setattr__(self, "hidden_size", int(self.hidden_size))
        object.__setattr__(self, "target", str(self.target))
        object.__setattr__(self, "tokenizer_fingerprint", str(self.tokenizer_fingerprint))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][2]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "layer_ids": list(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }


def bytes_per_token(spec: CacheSpec) -> int:
    """Bytes one token costs in the cache, alignment padding ignored: int32 id + uint8 mask + (K+1)*H values."""
    return 4 + 1 + (spec.num_layers + 1) * spec.hidden_size * spec.itemsize


def format_bytes(n: float) -> str:
    """Human-readable binary size: 512 B, 1.50 KiB, 1.23 GiB, ..."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------- helpers
def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.bin"


def _sidecar_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.idx.json"


def _canonical_json(obj: Any) -> bytes:
    # sort_keys + fixed separators => the same dict always serialises to the same bytes.
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()


def _fsync_dir(path: str) -> None:
    # os.replace is only durable once the directory entry itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes, tmp_suffix: str = ".tmp") -> None:
    tmp = path + tmp_suffix
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _remove_if_exists(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _sha256_file(path: str, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            buf = f.read(chunk)
            if not buf:
                break
            h.update(buf)
    return h.hexdigest()


def _to_int_array(value: Any, what: str, np_dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    """input_ids / loss_mask -> contiguous little-endian numpy array of np_dtype, range-checked."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"{what} must be an integer or bool tensor, got {value.dtype}")
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biu":
            raise ValueError(f"{what} must be an integer or bool array, got {arr.dtype}")
    if arr.size and arr.dtype != np.bool_ and (int(arr.min()) < lo or int(arr.max()) > hi):
        # A silent wrap-around would corrupt token ids; refuse instead.
        raise ValueError(f"{what} has values outside [{lo}, {hi}] (min {arr.min()}, max {arr.max()})")
    return np.ascontiguousarray(arr.astype(np_dtype, copy=False))


def _to_hidden_array(value: Any, what: str, spec: CacheSpec) -> np.ndarray:
    """Hidden states -> contiguous numpy array holding the raw bytes of the cache dtype.

    Floating tensors/arrays are cast to the cache dtype (so an fp32 capture can go into a bf16 cache);
    for a bfloat16 cache, numpy int16/uint16 arrays are taken as raw bf16 bit patterns.
    """
    torch_dtype, storage, _ = _DTYPES[spec.dtype]
    if isinstance(value, np.ndarray):
        if spec.dtype == "bfloat16" and value.dtype in (np.int16, np.uint16):
            return np.ascontiguousarray(value.view(np.int16).astype(storage, copy=False))
        if value.dtype.kind != "f":
            raise ValueError(f"{what} must be floating point, got numpy {value.dtype}")
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a torch tensor or numpy array, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {value.dtype}")
    # Cast before moving to CPU: on GPU the cast is free and the transfer gets smaller.
    t = value.detach().to(torch_dtype).cpu().contiguous()
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


# -------------------------------------------------------------------------------------------- writer
class _ShardSink:
    """Append-only file that tracks position, the file's sha256 and a per-record crc32."""

    def __init__(self, f):
        self.f = f
        self.pos = 0
        self.sha = hashlib.sha256()
        self.crc = 0

    def write(self, buf) -> None:
        if isinstance(buf, np.ndarray):
            # Byte view first: memoryview.cast refuses numpy's non-native format strings (e.g. "<e").
            buf = buf.reshape(-1).view(np.uint8)
        mv = memoryview(buf).cast("B")
        self.f.write(mv)
        self.sha.update(mv)
        self.crc = zlib.crc32(mv, self.crc)
        self.pos += mv.nbytes

    def pad(self) -> None:
        n = _align(self.pos) - self.pos
        if n:
            self.write(_ZEROS[:n])


class CacheWriter:
    """Writes a cache directory shard by shard; resumable, multi-rank friendly, crash safe.

    Typical use (each rank takes ``shards_for_rank(rank, world)``; one rank finalizes after a barrier)::

        w = CacheWriter(root, spec, num_records=N, records_per_shard=1024)
        for s in w.pending_shards():
            w.write_shard(s, make_records(w.shard_range(s)))
        manifest = w.finalize()
    """

    def __init__(
        self,
        root: str,
        spec: CacheSpec,
        num_records: int,
        records_per_shard: int,
        meta: Optional[dict] = None,
    ):
        if num_records < 0:
            raise ValueError(f"num_records must be >= 0, got {num_records}")
        if records_per_shard < 1:
            raise ValueError(f"records_per_shard must be >= 1, got {records_per_shard}")
        self.root = os.path.abspath(root)
        self.spec = spec
        self.num_records = int(num_records)
        self.records_per_shard = int(records_per_shard)
        try:
            # Round trip through JSON so tuples become lists etc. and the manifest matches what we compare.
            self.meta = json.loads(_canonical_json(dict(meta or {})))
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta must be a JSON-serialisable dict without NaN/inf: {e}") from None
        self._plan = {
            "format_version": FORMAT_VERSION,
            "codec": CODEC,
            **spec.to_json(),
            "num_records": self.num_records,
            "records_per_shard": self.records_per_shard,
            "meta": self.meta,
        }
        self._plan_sha = hashlib.sha256(_canonical_json(self._plan)).hexdigest()
        os.makedirs(self.root, exist_ok=True)
        self._check_or_write_plan()

    # -- plan ------------------------------------------------------------------------------------
    def _check_or_write_plan(self) -> None:
        manifest_path = os.path.join(self.root, MANIFEST_NAME)
        if os.path.exists(manifest_path):
            with open(manifest_path, "rb") as f:
                m = json.load(f)
            existing = {k: m.get(k) for k in self._plan}
            self._raise_if_plan_differs(existing, "the finished cache's manifest.json")
            return
        plan_path = os.path.join(self.root, PLAN_NAME)
        if os.path.exists(plan_path):
            with open(plan_path, "rb") as f:
                existing = json.load(f)
            self._raise_if_plan_differs(existing, PLAN_NAME)
            return
        # Several ranks may get here at once: each writes its own temp and renames; same content wins.
        _atomic_write(plan_path, _canonical_json(self._plan), tmp_suffix=f".{os.getpid()}.tmp")

    def _raise_if_plan_differs(self, existing: dict, where: str) -> None:
        diffs = [
            f"  {k}: directory has {existing.get(k)!r}, this writer has {v!r}"
            for k, v in self._plan.items()
            if existing.get(k) != v
        ]
        if diffs:
            raise CacheMismatchError(
                f"{self.root} already holds a cache written with other settings ({where}):\n"
                + "\n".join(diffs)
                + "\nUse the same settings to resume, or delete the directory to start a new cache."
            )

    # -- shard bookkeeping ---------------------------------------------------------------------------
    def num_shards(self) -> int:
        return (self.num_records + self.records_per_shard - 1) // self.records_per_shard

    def shard_range(self, shard_id: int) -> range:
        """Record ids shard ``shard_id`` must hold."""
        if not 0 <= shard_id < self.num_shards():
            raise ValueError(f"shard_id {shard_id} out of range [0, {self.num_shards()})")
        start = shard_id * self.records_per_shard
        return range(start, min(start + self.records_per_shard, self.num_records))

    def _shard_done(self, shard_id: int) -> bool:
        sidecar = os.path.join(self.root, _sidecar_name(shard_id))
        shard = os.path.join(self.root, _shard_name(shard_id))
        if not (os.path.exists(sidecar) and os.path.exists(shard)):
            return False
        try:
            with open(sidecar, "rb") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return False
        # A shard file whose size disagrees with its sidecar was damaged after publishing: redo it.
        return info.get("plan_sha256") == self._plan_sha and info.get("num_bytes") == os.path.getsize(shard)

    def pending_shards(self) -> list[int]:
        """Shards not yet completely written (a half-written shard counts as pending)."""
        if self.is_complete(self.root):
            return []
        return [s for s in range(self.num_shards()) if not self._shard_done(s)]

    def shards_for_rank(self, rank: int, world_size: int) -> list[int]:
        """Pending shards of ``rank`` under a fixed round-robin split (stable however far others got)."""
        return [s for s in self.pending_shards() if s % world_size == rank]

    # -- writing -----------------------------------------------------------------------------------
    def write_shard(self, shard_id: int, records: Iterable[dict]) -> None:
        """Stream ``records`` (dicts with record_id, input_ids, loss_mask, hidden_states,
        last_hidden_state; torch tensors or numpy arrays; in record order) into shard ``shard_id``.

        Raises ValueError naming the record when ids are not exactly ``shard_range(shard_id)`` or a shape
        does not match the spec; nothing is published then.
        """
        if self.is_complete(self.root):
            raise RuntimeError(f"{self.root} is already finalized; a finished cache is never modified")
        expected = self.shard_range(shard_id)
        shard_path = os.path.join(self.root, _shard_name(shard_id))
        sidecar_path = os.path.join(self.root, _sidecar_name(shard_id))
        shard_tmp, sidecar_tmp = shard_path + ".tmp", sidecar_path + ".tmp"

        # Un-commit first: from here until the new sidecar lands, the shard counts as pending.
        if os.path.exists(sidecar_path):
            os.remove(sidecar_path)
            _fsync_dir(self.root)

        rows: list[list[int]] = []
        num_tokens = 0
        try:
            with open(shard_tmp, "wb") as f:
                sink = _ShardSink(f)
                it = iter(records)
                for k, record_id in enumerate(expected):
                    try:
                        rec = next(it)
                    except StopIteration:
                        raise ValueError(
                            f"shard {shard_id}: records ended after {k} of {len(expected)}; "
                            f"record {record_id} is missing (shard holds records "
                            f"{expected.start}..{expected.stop - 1})"
                        ) from None
                    row = self._write_record(sink, shard_id, record_id, rec)
                    rows.append(row)
                    num_tokens += row[1]
                extra = next(it, None)
                if extra is not None:
                    rid = extra.get("record_id") if isinstance(extra, dict) else extra
                    raise ValueError(
                        f"shard {shard_id}: got an extra record (record_id {rid!r}); the shard holds "
                        f"exactly records {expected.start}..{expected.stop - 1}"
                    )
                f.flush()
                os.fsync(f.fileno())
            sidecar = {
                "plan_sha256": self._plan_sha,
                "shard_id": shard_id,
                "name": _shard_name(shard_id),
                "num_records": len(rows),
                "num_tokens": num_tokens,
                "num_bytes": sink.pos,
                "sha256": sink.sha.hexdigest(),
                # [record_id, seq_len, off_ids, off_mask, off_hidden, off_last, num_bytes, crc32]
                "rows": rows,
            }
            with open(sidecar_tmp, "wb") as f:
                f.write(_canonical_json(sidecar))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            # Leave no temp behind on a clean failure (a kill -9 may leave one; it is never read and
            # finalize() removes it).
            _remove_if_exists(shard_tmp)
            _remove_if_exists(sidecar_tmp)
            raise
        # Publish the data first, then the sidecar that marks it complete.
        os.replace(shard_tmp, shard_path)
        _fsync_dir(self.root)
        os.replace(sidecar_tmp, sidecar_path)
        _fsync_dir(self.root)

    def _write_record(self, sink: _ShardSink, shard_id: int, record_id: int, rec: dict) -> list[int]:
        spec = self.spec
        if not isinstance(rec, dict):
            raise ValueError(f"shard {shard_id}: record {record_id} is a {type(rec).__name__}, expected a dict")
        got_id = rec.get("record_id")
        if isinstance(got_id, torch.Tensor):
            got_id = got_id.item()
        if got_id is None or int(got_id) != record_id:
            raise ValueError(
                f"shard {shard_id}: expected record_id {record_id}, got {got_id!r} (records must come in "
                f"order and cover exactly ids {self.shard_range(shard_id).start}.."
                f"{self.shard_range(shard_id).stop - 1})"
            )
        where = f"record {record_id} (shard {shard_id})"
        missing = [k for k in ("input_ids", "loss_mask", "hidden_states", "last_hidden_state") if k not in rec]
        if missing:
            raise ValueError(f"{where} lacks {missing}")
        try:
            ids = _to_int_array(rec["input_ids"], "input_ids", np.dtype("<i4"), _INT32.min, _INT32.max)
            mask = _to_int_array(rec["loss_mask"], "loss_mask", np.dtype("u1"), 0, 255)
            hs = _to_hidden_array(rec["hidden_states"], "hidden_states", spec)
            last = _to_hidden_array(rec["last_hidden_state"], "last_hidden_state", spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if ids.ndim != 1 or ids.shape[0] < 1:
            raise ValueError(f"{where}: input_ids must have shape [T] with T >= 1, got {list(ids.shape)}")
        T = ids.shape[0]
        if T > np.iinfo(np.uint32).max:
            raise ValueError(f"{where}: sequence of {T} tokens is too long for the index")
        width = spec.num_layers * spec.hidden_size
        checks = [
            ("loss_mask", mask.shape, (T,)),
            ("hidden_states", hs.shape, (T, width)),
            ("last_hidden_state", last.shape, (T, spec.hidden_size)),
        ]
        for name, shape, want in checks:
            if tuple(shape) != want:
                hint = f" = {spec.num_layers} layers x hidden_size {spec.hidden_size}" if name == "hidden_states" else ""
                raise ValueError(f"{where}: {name} has shape {list(shape)}, expected {list(want)}{hint}")

        sink.pad()  # records start aligned (a no-op after the previous record's trailing pad)
        sink.crc = 0
        offsets = []
        for k, arr in enumerate((ids, mask, hs, last)):
            if k:
                sink.pad()  # inter-array padding is part of the crc'd span
            offsets.append(sink.pos)
            sink.write(arr.reshape(-1))
        num_bytes = sink.pos - offsets[0]
        crc = sink.crc
        sink.pad()
        return [record_id, T, *offsets, num_bytes, crc]

    # -- finalize ------------------------------------------------------------------------------------
    def finalize(self) -> dict:
        """Merge the shard sidecars into index.bin, write manifest.json (atomically, last) and remove
        the writer's scratch files. Idempotent; safe to re-run after a kill at any point."""
        manifest_path = os.path.join(self.root, MANIFEST_NAME)
        if not os.path.exists(manifest_path):
            missing = [s for s in range(self.num_shards()) if not self._shard_done(s)]
            if missing:
                shown = ", ".join(_shard_name(s) for s in missing[:20])
                more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
                raise RuntimeError(
                    f"cannot finalize {self.root}: {len(missing)} of {self.num_shards()} shards are missing "
                    f"or incomplete: {shown}{more}. Write them (pending_shards()) and finalize again."
                )
            manifest, index_bytes = self._build_manifest_and_index()
            # index.bin first: a manifest must never point at an index that is not there yet.
            _atomic_write(os.path.join(self.root, INDEX_NAME), index_bytes)
            _atomic_write(manifest_path, _canonical_json(manifest))
        self._cleanup_scratch()
        with open(manifest_path, "rb") as f:
            return json.load(f)

    def _build_manifest_and_index(self) -> tuple[dict, bytes]:
        index = bytearray()
        shards = []
        num_tokens = 0
        for s in range(self.num_shards()):
            with open(os.path.join(self.root, _sidecar_name(s)), "rb") as f:
                info = json.load(f)
            expected = self.shard_range(s)
            ids = [r[0] for r in info["rows"]]
            if info["shard_id"] != s or ids != list(expected):
                raise CacheCorruptedError(f"sidecar {_sidecar_name(s)} does not describe records {expected}")
            for rid, T, o_ids, o_mask, o_hs, o_last, nbytes, crc in info["rows"]:
                index += INDEX_STRUCT.pack(rid, s, T, o_ids, o_mask, o_hs, o_last, nbytes, crc, 0)
            shards.append(
                {"name": info["name"], "num_records": info["num_records"], "num_bytes": info["num_bytes"], "sha256": info["sha256"]}
            )
            num_tokens += info["num_tokens"]
        manifest = {
            "format_version": FORMAT_VERSION,
            "codec": CODEC,
            "num_records": self.num_records,
            "num_tokens": num_tokens,
            "num_shards": self.num_shards(),
            "records_per_shard": self.records_per_shard,
            "shards": shards,
            **self.spec.to_json(),
            "index_record_size": INDEX_STRUCT.size,
            "index_sha256": hashlib.sha256(index).hexdigest(),
            "alignment": ALIGNMENT,
            "meta": self.meta,
        }
        return manifest, bytes(index)

    def _cleanup_scratch(self) -> None:
        removed = False
        for name in os.listdir(self.root):
            if _SCRATCH_RE.match(name):
                _remove_if_exists(os.path.join(self.root, name))
                removed = True
        if removed:
            _fsync_dir(self.root)

    @staticmethod
    def is_complete(root: str) -> bool:
        """True once finalize() has published manifest.json."""
        return os.path.isfile(os.path.join(root, MANIFEST_NAME))


# -------------------------------------------------------------------------------------------- reader
_REQUIRED_KEYS = (
    "format_version", "codec", "num_records", "num_tokens", "num_shards", "shards", "target", "layer_ids",
    "hidden_size", "dtype", "tokenizer_fingerprint", "index_record_size",
)


class TargetCache(torch.utils.data.Dataset):
    """Read-only view of a finished cache; ``ds[i]`` -> dict of torch tensors for record i.

    ``hidden_states`` and ``last_hidden_state`` (and ``loss_mask``) are zero-copy views of a
    copy-on-write memory map: in-place edits never reach the file, but they do change what a later
    read of the same record in this process sees (and then fails its crc) -- clone before mutating.
    ``input_ids`` comes back as int64 (a copy), ready for embedding lookups.
    """

    def __init__(
        self,
        root: str,
        expect: Optional[CacheSpec] = None,
        verify: bool = False,
        max_open_shards: int = 16,
    ):
        self.root = os.path.abspath(root)
        self.max_open_shards = max(1, int(max_open_shards))
        manifest_path = os.path.join(self.root, MANIFEST_NAME)
        if not os.path.isfile(manifest_path):
            if not os.path.isdir(self.root):
                raise CacheIncompleteError(f"no cache at {self.root}; run the cache stage to build it")
            raise CacheIncompleteError(
                f"the cache at {self.root} was not finished (no {MANIFEST_NAME}); re-run the cache stage "
                f"to resume it. A partial cache is never read."
            )
        try:
            with open(manifest_path, "rb") as f:
                manifest = json.load(f)
        except ValueError as e:
            raise CacheCorruptedError(f"{manifest_path} is not valid JSON: {e}") from None
        missing = [k for k in _REQUIRED_KEYS if k not in manifest]
        if missing:
            raise CacheCorruptedError(f"{manifest_path} lacks keys {missing}")
        if manifest["codec"] not in SUPPORTED_CODECS:
            raise CacheFormatError(
                f"the cache at {self.root} uses codec {manifest['codec']!r}, which this version of DraftSmith "
                f"cannot read (known codecs: {list(SUPPORTED_CODECS)}); upgrade DraftSmith or rebuild the cache."
            )
        if manifest["format_version"] != FORMAT_VERSION:
            raise CacheFormatError(
                f"the cache at {self.root} has format_version {manifest['format_version']}, this reader "
                f"reads version {FORMAT_VERSION}; rebuild the cache or use a matching DraftSmith."
            )
        if manifest["index_record_size"] != INDEX_STRUCT.size:
            raise CacheFormatError(
                f"{manifest_path}: index_record_size {manifest['index_record_size']} != {INDEX_STRUCT.size}"
            )
        self.manifest: dict = manifest
        try:
            self.spec = CacheSpec(
                target=manifest["target"],
                layer_ids=tuple(manifest["layer_ids"]),
                hidden_size=manifest["hidden_size"],
                dtype=manifest["dtype"],
                tokenizer_fingerprint=manifest["tokenizer_fingerprint"],
            )
        except ValueError as e:
            raise CacheFormatError(f"{manifest_path}: {e}") from None
        if expect is not None:
            self._check_expect(expect)
        self._torch_dtype, self._storage, self._itemsize = _DTYPES[self.spec.dtype]
        self._shard_names = [s["name"] for s in manifest["shards"]]
        if len(self._shard_names) != manifest["num_shards"]:
            raise CacheCorruptedError(f"{manifest_path}: num_shards disagrees with the shards list")
        # Cheap structural checks on every open (sizes only; content is checked by crc/sha256).
        for s in manifest["shards"]:
            path = os.path.join(self.root, s["name"])
            if not os.path.isfile(path):
                raise CacheCorruptedError(f"shard file {path} is missing")
            size = os.path.getsize(path)
            if size != s["num_bytes"]:
                raise CacheCorruptedError(
                    f"shard file {path} has {size} bytes, the manifest says {s['num_bytes']} (truncated or replaced)"
                )
        self._index = self._load_index()
        self._state_init()
        if verify:
            self.verify()

    # -- state that is per process (rebuilt after pickling, e.g. in DataLoader workers) ------------------
    def _state_init(self) -> None:
        self._open: "OrderedDict[int, np.memmap]" = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self):
        # Never pickle memory maps: spawn-started workers would copy the data. They reopen lazily.
        state = self.__dict__.copy()
        for k in ("_open", "_lock", "_index"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._index = self._load_index(check=False)
        self._state_init()

    def _load_index(self, check: bool = True) -> np.ndarray:
        path = os.path.join(self.root, INDEX_NAME)
        n = self.manifest["num_records"]
        if not os.path.isfile(path):
            raise CacheCorruptedError(f"index file {path} is missing")
        size = os.path.getsize(path)
        if size != n * INDEX_STRUCT.size:
            raise CacheCorruptedError(f"index file {path} has {size} bytes, expected {n} x {INDEX_STRUCT.size}")
        index = np.zeros(0, INDEX_DTYPE) if n == 0 else np.memmap(path, dtype=INDEX_DTYPE, mode="r", shape=(n,))
        if check and n:
            if not np.array_equal(index["record_id"], np.arange(n, dtype=np.uint64)):
                raise CacheCorruptedError(f"index file {path}: record ids are not 0..{n - 1} in order")
            if int(index["shard_id"].max()) >= len(self._shard_names):
                raise CacheCorruptedError(f"index file {path} names a shard the manifest does not list")
            if int(index["seq_len"].sum(dtype=np.uint64)) != self.manifest["num_tokens"]:
                raise CacheCorruptedError(f"index file {path}: token count disagrees with the manifest")
        return index

    def _check_expect(self, expect: CacheSpec) -> None:
        have = self.spec
        diffs = []
        for field in ("target", "layer_ids", "hidden_size", "tokenizer_fingerprint", "dtype"):
            a, b = getattr(have, field), getattr(expect, field)
            if a != b:
                fmt = (lambda v: list(v)) if field == "layer_ids" else (lambda v: v)
                diffs.append(f"  {field}: cache has {fmt(a)!r}, expected {fmt(b)!r}")
        if diffs:
            raise CacheMismatchError(
                f"the cache at {self.root} does not match this recipe:\n" + "\n".join(diffs) + "\n"
                "Rebuild the cache for this recipe (re-run the cache stage into a new directory), "
                "or use a recipe that matches the cache."
            )

    # -- access ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["num_records"])

    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def seq_lens(self) -> np.ndarray:
        """Per-record token counts (int64 copy), e.g. for length-bucketed batching."""
        return np.asarray(self._index["seq_len"], dtype=np.int64)

    def _shard(self, shard_id: int) -> np.memmap:
        with self._lock:
            mm = self._open.get(shard_id)
            if mm is not None:
                self._open.move_to_end(shard_id)
                return mm
            path = os.path.join(self.root, self._shard_names[shard_id])
            # mode "c" (copy-on-write): torch.from_numpy needs a writable array, and a private mapping
            # keeps any in-place edit out of the file. Pages stay shared with the page cache until written.
            mm = np.memmap(path, dtype=np.uint8, mode="c")
            self._open[shard_id] = mm
            # Bound open mappings (each holds a file descriptor). Tensors already handed out keep their
            # own reference to the mapping, so evicting here never invalidates them.
            while len(self._open) > self.max_open_shards:
                self._open.popitem(last=False)
            return mm

    def __getitem__(self, i) -> dict[str, torch.Tensor]:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range for a cache of {n} records")
        row = self._index[i]
        shard_id, T = int(row["shard_id"]), int(row["seq_len"])
        start, nbytes = int(row["off_input_ids"]), int(row["num_bytes"])
        name = self._shard_names[shard_id]
        mm = self._shard(shard_id)
        spec = self.spec
        H, KH = spec.hidden_size, spec.num_layers * spec.hidden_size
        parts = (
            ("off_input_ids", T * 4),
            ("off_loss_mask", T),
            ("off_hidden_states", T * KH * self._itemsize),
            ("off_last_hidden_state", T * H * self._itemsize),
        )
        for key, size in parts:
            off = int(row[key])
            if off < start or off + size > start + nbytes or start + nbytes > mm.shape[0]:
                raise CacheCorruptedError(
                    f"{os.path.join(self.root, name)}: record {i} index entry points outside the record "
                    f"or the file (index.bin or the shard is corrupted)"
                )
        span = mm[start : start + nbytes]
        crc = zlib.crc32(span)
        if crc != int(row["crc32"]):
            raise CacheCorruptedError(
                f"{os.path.join(self.root, name)}: record {i} fails its crc32 check "
                f"(stored {int(row['crc32']):#010x}, read {crc:#010x}); the shard file is corrupted. "
                f"Rebuild the cache or restore that shard."
            )

        def view(key: str, np_dtype: np.dtype, count: int) -> np.ndarray:
            off = int(row[key])
            return mm[off : off + count * np_dtype.itemsize].view(np_dtype)

        input_ids = torch.from_numpy(view("off_input_ids", np.dtype("<i4"), T).astype(np.int64))
        loss_mask = torch.from_numpy(view("off_loss_mask", np.dtype("u1"), T))
        hs = torch.from_numpy(view("off_hidden_states", self._storage, T * KH).reshape(T, KH))
        last = torch.from_numpy(view("off_last_hidden_state", self._storage, T * H).reshape(T, H))
        if self._torch_dtype == torch.bfloat16:
            hs, last = hs.view(torch.bfloat16), last.view(torch.bfloat16)
        return {"input_ids": input_ids, "loss_mask": loss_mask, "hidden_states": hs, "last_hidden_state": last}

    def verify(self) -> None:
        """sha256 every shard (and the index) against the manifest; CacheCorruptedError names the file."""
        for s in self.manifest["shards"]:
            path = os.path.join(self.root, s["name"])
            digest = _sha256_file(path)
            if digest != s["sha256"]:
                raise CacheCorruptedError(
                    f"shard file {path} fails its sha256 check (manifest {s['sha256'][:16]}..., "
                    f"file {digest[:16]}...); rebuild the cache or restore that shard."
                )
        if "index_sha256" in self.manifest:
            path = os.path.join(self.root, INDEX_NAME)
            if _sha256_file(path) != self.manifest["index_sha256"]:
                raise CacheCorruptedError(f"index file {path} fails its sha256 check; rebuild the cache.")
        counts = np.bincount(self._index["shard_id"].astype(np.int64), minlength=len(self._shard_names))
        for sid, s in enumerate(self.manifest["shards"]):
            if int(counts[sid]) != s["num_records"]:
                raise CacheCorruptedError(f"index.bin lists {int(counts[sid])} records in {s['name']}, manifest {s['num_records']}")
