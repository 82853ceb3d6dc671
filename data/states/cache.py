"""Storage layer of the target hidden-state cache (no model code here): the on-disk format and its reader.

Writing is data/states/cache_writer.py (`CacheWriter`); reading is `TargetCache` here.

The cache stage runs the frozen target model once over the training conversations and stores, per
conversation ("record"), what a drafter needs at train time:

    input_ids          int32  [T]
    loss_mask          uint8  [T]
    hidden_states      dtype  [T, K*H]   outputs of the K target layers in ``layer_ids``, concatenated
    last_hidden_state  dtype  [T, H]     the target's final-norm state (the frozen lm_head turns it
                                         into target logits, so full-vocabulary logits are never stored)

``dtype`` is the cache dtype: bfloat16 (default), float16 or float32; hidden states always come back as torch
tensors of that dtype. How they are stored is the cache's encoding (``cache.encoding``, the manifest's ``codec``):

``raw``
    little-endian bytes of the cache dtype, read back as zero-copy views of a memory map. (bfloat16 has no numpy
    dtype, so it travels through numpy as int16 bit patterns.)
``fp8``
    each token's H-vector of each layer (a row: ``[T, K*H]`` is K rows a token, ``[T, H]`` one) as float8 e4m3
    values and one power-of-two scale, ``x ~ value * 2**exponent``, the exponent putting the row's absmax in
    [224, 448] (e4m3's top binade: its relative precision is the same in every binade, so a power of two loses
    nothing to an exact absmax/448 scale, and scaling by it is exact). An array is its ``T*rows*H`` value bytes
    followed directly by its ``T*rows`` int8 exponents: ``H + 1`` bytes a row against bf16's ``2H``. Reads decode
    to a copy (``value * 2**exponent`` in the cache dtype); ``as_stored`` is the same round trip in memory
    (data/states/online.py rounds its states with it).

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
    is never readable). Keys: ``format_version``, ``codec`` (the encoding, "raw" or "fp8"; readers refuse
    codecs they do not know, so a reader older than fp8 refuses an fp8 cache), ``num_records``,
    ``num_tokens``, ``num_shards``, ``records_per_shard``, ``shards`` [{name, num_records, num_bytes,
    sha256}], ``target``, ``layer_ids``, ``hidden_size``, ``dtype``, ``tokenizer_fingerprint``,
    ``index_record_size``, ``index_sha256``, ``alignment`` and a free ``meta`` dict. It holds nothing
    nondeterministic (no timestamps, hosts or paths): two caches written from the same records are
    byte-identical.

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

import json
import os
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from core.io import sha256_file

__all__ = [
    "FORMAT_VERSION",
    "ENCODINGS",
    "ALIGNMENT",
    "INDEX_STRUCT",
    "CacheSpec",
    "TargetCache",
    "CacheMismatchError",
    "CacheFormatError",
    "CacheCorruptedError",
    "CacheIncompleteError",
    "as_stored",
    "bytes_per_token",
    "format_bytes",
]

FORMAT_VERSION = 1
#: how hidden states are stored (the manifest's codec); a new one gets added here together with its reader.
ENCODINGS = ("raw", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
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

# name -> (torch dtype, numpy dtype the raw bytes are viewed as, itemsize)
_DTYPES = {
    "bfloat16": (torch.bfloat16, np.dtype("<i2"), 2),
    "float16": (torch.float16, np.dtype("<f2"), 2),
    "float32": (torch.float32, np.dtype("<f4"), 4),
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


# --------------------------------------------------------------------------------------------- errors
class CacheMismatchError(ValueError):
    """The cache was built for another target / layers / tokenizer / dtype / encoding than the one asked for."""


class CacheFormatError(CacheMismatchError):
    """The cache uses a format version or codec this reader does not know."""


class CacheCorruptedError(RuntimeError):
    """Bytes on disk do not match their checksum, size or index."""


class CacheIncompleteError(RuntimeError):
    """The cache directory was never finalized (no manifest.json)."""


# ----------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds: which target, which layers, what width and dtype, which tokenizer, how it is encoded."""

    target: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str = "bfloat16"
    tokenizer_fingerprint: str = ""
    encoding: str = "raw"

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
        if self.encoding not in ENCODINGS:
            raise ValueError(f"CacheSpec.encoding {self.encoding!r} is not one of {list(ENCODINGS)}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][2]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    @property
    def row_bytes(self) -> int:
        """Bytes one token's H-vector of one layer takes on disk: H values of the dtype, or fp8's H + one exponent."""
        return self.hidden_size + 1 if self.encoding == "fp8" else self.hidden_size * self.itemsize

    def to_json(self) -> dict:
        return {
            "codec": self.encoding,
            "target": self.target,
            "layer_ids": list(self.layer_ids),
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }


def bytes_per_token(spec: CacheSpec) -> int:
    """Bytes one token costs in the cache, alignment padding ignored: int32 id + uint8 mask + K+1 stored rows."""
    return 4 + 1 + (spec.num_layers + 1) * spec.row_bytes


# --------------------------------------------------------------------------------------------- fp8 codec
def fp8_encode(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] floats -> (values [..., H] float8 e4m3, exponents [...] int8), rows ~ values * 2**exponents.

    frexp gives the e with 2**(e-1) <= absmax / 448 < 2**e, so absmax / 2**e is in [224, 448] (448: e4m3's largest
    value; none saturates). Clamped to int8's range, which only rows below 1e-35 reach."""
    rows = rows.float()
    exponents = torch.frexp(rows.abs().amax(-1) / FP8_MAX).exponent.clamp(-127, 127)
    return torch.ldexp(rows, -exponents[..., None]).to(FP8), exponents.to(torch.int8)


def fp8_decode(values: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_encode's inverse, rounded to `dtype`."""
    return torch.ldexp(values.float(), exponents[..., None].int()).to(dtype)


def as_stored(states: torch.Tensor, spec: CacheSpec) -> torch.Tensor:
    """`states` ([T, n*H]: n layers' rows per token) exactly as a cache of `spec` gives them back: in its dtype and
    through its encoding. What data/states/online.py trains on, so online and offline runs see the same numbers."""
    states = states.to(spec.torch_dtype)
    if spec.encoding == "raw":
        return states
    rows = states.reshape(*states.shape[:-1], -1, spec.hidden_size)
    return fp8_decode(*fp8_encode(rows), spec.torch_dtype).reshape(states.shape)


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
def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.bin"


def sidecar_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.idx.json"


def canonical_json(obj: Any) -> bytes:
    # sort_keys + fixed separators => the same dict always serialises to the same bytes.
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()


def remove_if_exists(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# -------------------------------------------------------------------------------------------- reader
_REQUIRED_KEYS = (
    "format_version", "codec", "num_records", "num_tokens", "num_shards", "shards", "target", "layer_ids",
    "hidden_size", "dtype", "tokenizer_fingerprint", "index_record_size",
)


class TargetCache(torch.utils.data.Dataset):
    """Read-only view of a finished cache; ``ds[i]`` -> dict of torch tensors for record i.

    ``hidden_states`` and ``last_hidden_state`` (and ``loss_mask``) are zero-copy views of a
    copy-on-write memory map (an fp8 cache's hidden states are decoded copies): in-place edits never reach the file,
    but they do change what a later read of the same record in this process sees (and then fails its crc) -- clone
    before mutating.
    ``input_ids`` comes back as int64 (a copy), ready for embedding lookups. When ``expect`` names a subset of
    the cache's layers, ``hidden_states`` is a copy of those layers' columns in ``expect``'s order.
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
        if manifest["codec"] not in ENCODINGS:
            raise CacheFormatError(
                f"the cache at {self.root} uses codec {manifest['codec']!r}, which this version of DraftSmith "
                f"cannot read (known codecs: {list(ENCODINGS)}); upgrade DraftSmith or rebuild the cache."
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
        #: indices of the recipe's layers among the cache's, when it reads a subset of them (see _check_expect)
        self.layer_select: list[int] | None = None
        try:
            self.spec = CacheSpec(
                target=manifest["target"],
                layer_ids=tuple(manifest["layer_ids"]),
                hidden_size=manifest["hidden_size"],
                dtype=manifest["dtype"],
                tokenizer_fingerprint=manifest["tokenizer_fingerprint"],
                encoding=manifest["codec"],
            )
        except ValueError as e:
            raise CacheFormatError(f"{manifest_path}: {e}") from None
        if expect is not None:
            self._check_expect(expect)
        self._torch_dtype, self._storage, _ = _DTYPES[self.spec.dtype]
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
        if tuple(expect.layer_ids) != tuple(have.layer_ids) and set(expect.layer_ids) <= set(have.layer_ids):
            # A recipe reading fewer layers than the cache holds (Eagle3's 3 of a block drafter's 5) takes its
            # columns, in its own order: one cache serves every family.
            self.layer_select = [list(have.layer_ids).index(i) for i in expect.layer_ids]
            have = CacheSpec(**{**have.__dict__, "layer_ids": tuple(expect.layer_ids)})
        for field in ("target", "layer_ids", "hidden_size", "tokenizer_fingerprint", "dtype", "encoding"):
            a, b = getattr(have, field), getattr(expect, field)
            if a != b:
                fmt = (lambda v: list(v)) if field == "layer_ids" else (lambda v: v)
                diffs.append(f"  {field}: cache has {fmt(a)!r}, expected {fmt(b)!r}")
        if have.encoding != expect.encoding:  # the one difference a recipe key alone settles
            diffs.append(f"  (a recipe with --set cache.encoding={have.encoding} reads this cache as it is)")
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

    def with_hidden(self, records: list[dict]) -> list[dict]:
        """The records, ready for a forward: cache records carry their hidden states already (data/states/online.py's
        reader computes them here instead)."""
        return records

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
        K, H = spec.num_layers, spec.hidden_size
        parts = (
            ("off_input_ids", T * 4),
            ("off_loss_mask", T),
            ("off_hidden_states", T * K * spec.row_bytes),
            ("off_last_hidden_state", T * spec.row_bytes),
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

        def states(key: str, rows: int) -> torch.Tensor:
            """[T, rows*H] in the cache dtype: views of the raw bytes, or decoded from fp8 values and exponents."""
            count = T * rows * H
            if spec.encoding == "fp8":  # the values, then one exponent per (token, row)
                stored = torch.from_numpy(view(key, np.dtype("u1"), count + T * rows))
                values = stored[:count].view(FP8).view(T, rows, H)
                exponents = stored[count:].view(torch.int8).view(T, rows)
                return fp8_decode(values, exponents, self._torch_dtype).view(T, rows * H)
            raw = torch.from_numpy(view(key, self._storage, count).reshape(T, rows * H))
            return raw.view(torch.bfloat16) if self._torch_dtype == torch.bfloat16 else raw

        input_ids = torch.from_numpy(view("off_input_ids", np.dtype("<i4"), T).astype(np.int64))
        loss_mask = torch.from_numpy(view("off_loss_mask", np.dtype("u1"), T))
        hs, last = states("off_hidden_states", K), states("off_last_hidden_state", 1)
        if self.layer_select is not None:  # a copy of the recipe's layers, in its order
            hs = hs.view(T, K, H)[:, self.layer_select].reshape(T, len(self.layer_select) * H)
        return {"input_ids": input_ids, "loss_mask": loss_mask, "hidden_states": hs, "last_hidden_state": last}

    def verify(self) -> None:
        """sha256 every shard (and the index) against the manifest; CacheCorruptedError names the file."""
        for s in self.manifest["shards"]:
            path = os.path.join(self.root, s["name"])
            digest = sha256_file(path)
            if digest != s["sha256"]:
                raise CacheCorruptedError(
                    f"shard file {path} fails its sha256 check (manifest {s['sha256'][:16]}..., "
                    f"file {digest[:16]}...); rebuild the cache or restore that shard."
                )
        if "index_sha256" in self.manifest:
            path = os.path.join(self.root, INDEX_NAME)
            if sha256_file(path) != self.manifest["index_sha256"]:
                raise CacheCorruptedError(f"index file {path} fails its sha256 check; rebuild the cache.")
        counts = np.bincount(self._index["shard_id"].astype(np.int64), minlength=len(self._shard_names))
        for sid, s in enumerate(self.manifest["shards"]):
            if int(counts[sid]) != s["num_records"]:
                raise CacheCorruptedError(f"index.bin lists {int(counts[sid])} records in {s['name']}, manifest {s['num_records']}")
