"""Writing the hidden-state cache: `CacheWriter` (the on-disk format and the reader are data/states/cache.py).

    writer = CacheWriter(root, spec, num_records=N, records_per_shard=1024, meta={...})
    for shard in writer.pending_shards():          # any rank, any order; a resumed run redoes only these
        writer.write_shard(shard, records_of(shard))
    manifest = writer.finalize()                   # index.bin, then manifest.json: the cache is complete

Crash safety (see the format's description in data/states/cache.py): a shard is streamed to `shard-XXXXX.bin.tmp`, then
published with its sidecar `shard-XXXXX.idx.json` (the shard's commit marker) in that order, each fsynced, so a kill at
any moment leaves complete shards and pending ones, never a half shard that looks complete. `writer-plan.json` pins
the writer's parameters while the cache is being written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from typing import Any, Iterable, Optional

import numpy as np
import torch

from core.io import atomic_write_bytes, fsync_dir, make_dir, open_new, replace, sync_file, write_failure
from data.states.cache import (ALIGNMENT, FORMAT_VERSION, INDEX_NAME, INDEX_STRUCT, MANIFEST_NAME, CacheCorruptedError,
                        CacheMismatchError, CacheSpec, align, canonical_json, fp8_encode, remove_if_exists, shard_name,
                        sidecar_name)

PLAN_NAME = "writer-plan.json"
_INT32 = np.iinfo(np.int32)
_ZEROS = bytes(ALIGNMENT)
# Temp files and sidecars that only exist while a cache is being written; finalize() removes them.
_SCRATCH_RE = re.compile(
    r"^(shard-\d{5,}\.bin\.tmp|shard-\d{5,}\.idx\.json(\.tmp)?|writer-plan\.json(\.[\w.-]+)?\.tmp"
    r"|writer-plan\.json|index\.bin\.tmp|manifest\.json\.tmp)$"
)


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


def _to_hidden_tensor(value: Any, what: str, spec: CacheSpec) -> torch.Tensor:
    """Hidden states -> contiguous CPU tensor of the cache dtype.

    Floating tensors/arrays are cast to the cache dtype (so an fp32 capture can go into a bf16 cache);
    for a bfloat16 cache, numpy int16/uint16 arrays are taken as raw bf16 bit patterns.
    """
    if isinstance(value, np.ndarray):
        if spec.dtype == "bfloat16" and value.dtype in (np.int16, np.uint16):
            return torch.from_numpy(np.ascontiguousarray(value.view(np.int16))).view(torch.bfloat16)
        if value.dtype.kind != "f":
            raise ValueError(f"{what} must be floating point, got numpy {value.dtype}")
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a torch tensor or numpy array, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {value.dtype}")
    # Cast before moving to CPU: on GPU the cast is free and the transfer gets smaller.
    return value.detach().to(spec.torch_dtype).cpu().contiguous()


def _encoded(states: torch.Tensor, spec: CacheSpec) -> list[np.ndarray]:
    """[T, n*H] states in the cache dtype -> the byte arrays they are stored as, back to back (see cache.py)."""
    if spec.encoding == "fp8":
        values, exponents = fp8_encode(states.view(states.shape[0], -1, spec.hidden_size))
        return [values.view(torch.uint8).numpy(), exponents.numpy()]
    return [(states.view(torch.int16) if states.dtype == torch.bfloat16 else states).numpy()]


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
        n = align(self.pos) - self.pos
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
            self.meta = json.loads(canonical_json(dict(meta or {})))
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta must be a JSON-serialisable dict without NaN/inf: {e}") from None
        self._plan = {
            "format_version": FORMAT_VERSION,
            **spec.to_json(),  # its codec too: resuming with another encoding is refused
            "num_records": self.num_records,
            "records_per_shard": self.records_per_shard,
            "meta": self.meta,
        }
        self._plan_sha = hashlib.sha256(canonical_json(self._plan)).hexdigest()
        make_dir(self.root)
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
        atomic_write_bytes(plan_path, canonical_json(self._plan), tmp_path=f"{plan_path}.{os.getpid()}.tmp")

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
        sidecar = os.path.join(self.root, sidecar_name(shard_id))
        shard = os.path.join(self.root, shard_name(shard_id))
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
        shard_path = os.path.join(self.root, shard_name(shard_id))
        sidecar_path = os.path.join(self.root, sidecar_name(shard_id))
        shard_tmp, sidecar_tmp = shard_path + ".tmp", sidecar_path + ".tmp"

        # Un-commit first: from here until the new sidecar lands, the shard counts as pending.
        if os.path.exists(sidecar_path):
            os.remove(sidecar_path)
            fsync_dir(self.root)

        rows: list[list[int]] = []
        num_tokens = 0
        try:
            with open_new(shard_tmp) as f:  # a stale scratch file or a planted link goes first
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
                sync_file(f)
            sidecar = {
                "plan_sha256": self._plan_sha,
                "shard_id": shard_id,
                "name": shard_name(shard_id),
                "num_records": len(rows),
                "num_tokens": num_tokens,
                "num_bytes": sink.pos,
                "sha256": sink.sha.hexdigest(),
                # [record_id, seq_len, off_ids, off_mask, off_hidden, off_last, num_bytes, crc32]
                "rows": rows,
            }
            with open_new(sidecar_tmp) as f:
                f.write(canonical_json(sidecar))
                sync_file(f)
        except BaseException as err:
            # Leave no temp behind on a clean failure (a kill -9 may leave one; it is never read and
            # finalize() removes it).
            remove_if_exists(shard_tmp)
            remove_if_exists(sidecar_tmp)
            if isinstance(err, OSError):
                raise write_failure(shard_path, err) from err
            raise
        # Publish the data first, then the sidecar that marks it complete.
        replace(shard_tmp, shard_path)
        replace(sidecar_tmp, sidecar_path)

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
            hs = _to_hidden_tensor(rec["hidden_states"], "hidden_states", spec)
            last = _to_hidden_tensor(rec["last_hidden_state"], "last_hidden_state", spec)
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
        for k, arrays in enumerate(([ids], [mask], _encoded(hs, spec), _encoded(last, spec))):
            if k:
                sink.pad()  # inter-array padding is part of the crc'd span
            offsets.append(sink.pos)
            for arr in arrays:
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
                shown = ", ".join(shard_name(s) for s in missing[:20])
                more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
                raise RuntimeError(
                    f"cannot finalize {self.root}: {len(missing)} of {self.num_shards()} shards are missing "
                    f"or incomplete: {shown}{more}. Write them (pending_shards()) and finalize again."
                )
            manifest, index_bytes = self._build_manifest_and_index()
            # index.bin first: a manifest must never point at an index that is not there yet.
            index_path = os.path.join(self.root, INDEX_NAME)
            atomic_write_bytes(index_path, index_bytes, tmp_path=index_path + ".tmp")
            atomic_write_bytes(manifest_path, canonical_json(manifest), tmp_path=manifest_path + ".tmp")
        self._cleanup_scratch()
        with open(manifest_path, "rb") as f:
            return json.load(f)

    def _build_manifest_and_index(self) -> tuple[dict, bytes]:
        index = bytearray()
        shards = []
        num_tokens = 0
        for s in range(self.num_shards()):
            with open(os.path.join(self.root, sidecar_name(s)), "rb") as f:
                info = json.load(f)
            expected = self.shard_range(s)
            ids = [r[0] for r in info["rows"]]
            if info["shard_id"] != s or ids != list(expected):
                raise CacheCorruptedError(f"sidecar {sidecar_name(s)} does not describe records {expected}")
            for rid, T, o_ids, o_mask, o_hs, o_last, nbytes, crc in info["rows"]:
                index += INDEX_STRUCT.pack(rid, s, T, o_ids, o_mask, o_hs, o_last, nbytes, crc, 0)
            shards.append(
                {"name": info["name"], "num_records": info["num_records"], "num_bytes": info["num_bytes"], "sha256": info["sha256"]}
            )
            num_tokens += info["num_tokens"]
        manifest = {
            "format_version": FORMAT_VERSION,
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
                remove_if_exists(os.path.join(self.root, name))
                removed = True
        if removed:
            fsync_dir(self.root)

    @staticmethod
    def is_complete(root: str) -> bool:
        """True once finalize() has published manifest.json."""
        return os.path.isfile(os.path.join(root, MANIFEST_NAME))
