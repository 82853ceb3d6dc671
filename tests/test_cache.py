"""Tests for data/states/cache.py: round trips, crash-safe resume, refusal of partial / mismatched / corrupted
caches."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from data.states.cache import (
    ALIGNMENT,
    INDEX_STRUCT,
    CacheCorruptedError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheSpec,
    TargetCache,
    as_stored,
    bytes_per_token,
    format_bytes,
)
from data.states.cache_writer import CacheWriter

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SPEC = CacheSpec(target="toy/target", layer_ids=(1, 3, 5), hidden_size=8, tokenizer_fingerprint="tok-abc")
FP8_SPEC = CacheSpec(**{**SPEC.__dict__, "encoding": "fp8"})
#: a cache of 3 records, 2 a shard, written by the writer of commit 9acbcd3, before cache.encoding existed
OLD_RAW_CACHE = os.path.join(TESTS_DIR, "fixtures", "cache-raw-v1")
NUM_RECORDS, PER_SHARD = 10, 3  # 4 shards, the last one holding a single record


def make_record(record_id: int, spec: CacheSpec = SPEC) -> dict:
    """Deterministic toy record: same id -> same tensors, in any process."""
    g = torch.Generator().manual_seed(1000 + record_id)
    T = 3 + (record_id * 7) % 11
    K, H = len(spec.layer_ids), spec.hidden_size
    return {
        "record_id": record_id,
        "input_ids": torch.randint(0, 150_000, (T,), generator=g),
        "loss_mask": (torch.rand(T, generator=g) > 0.3).to(torch.uint8),
        "hidden_states": torch.randn(T, K * H, generator=g).to(spec.torch_dtype),
        "last_hidden_state": torch.randn(T, H, generator=g).to(spec.torch_dtype),
    }


def write_cache(root, spec=SPEC, num_records=NUM_RECORDS, per_shard=PER_SHARD, meta=None) -> dict:
    w = CacheWriter(str(root), spec, num_records, per_shard, meta=meta if meta is not None else {"source": "unit"})
    for s in w.pending_shards():
        w.write_shard(s, (make_record(r, spec) for r in w.shard_range(s)))
    return w.finalize()


def dir_digest(root) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, for bit-exact comparison."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_round_trip_bit_identical(tmp_path, dtype):
    spec = CacheSpec(target="toy/target", layer_ids=(1, 3, 5), hidden_size=8, dtype=dtype)
    manifest = write_cache(tmp_path, spec)
    assert manifest["num_shards"] == 4 and [s["num_records"] for s in manifest["shards"]] == [3, 3, 3, 1]
    assert manifest["codec"] == "raw" and manifest["dtype"] == dtype
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        ds = TargetCache(str(tmp_path), expect=spec, verify=True)
        assert len(ds) == NUM_RECORDS
        total = 0
        for r in range(NUM_RECORDS):
            want, got = make_record(r, spec), ds[r]
            assert got["hidden_states"].dtype == spec.torch_dtype
            assert got["last_hidden_state"].dtype == spec.torch_dtype
            assert torch.equal(got["input_ids"], want["input_ids"].to(torch.int64))
            assert torch.equal(got["loss_mask"], want["loss_mask"])
            assert torch.equal(bits(got["hidden_states"]), bits(want["hidden_states"]))
            assert torch.equal(bits(got["last_hidden_state"]), bits(want["last_hidden_state"]))
            total += want["input_ids"].numel()
    assert ds.num_tokens() == total == manifest["num_tokens"]
    assert ds.seq_lens.sum() == total
    assert ds[-1]["input_ids"].shape == ds[NUM_RECORDS - 1]["input_ids"].shape
    with pytest.raises(IndexError):
        ds[NUM_RECORDS]


def test_layout_alignment_and_zero_copy(tmp_path):
    write_cache(tmp_path)
    raw = (tmp_path / "index.bin").read_bytes()
    assert len(raw) == NUM_RECORDS * INDEX_STRUCT.size
    rows = [INDEX_STRUCT.unpack_from(raw, k * INDEX_STRUCT.size) for k in range(NUM_RECORDS)]
    assert [r[0] for r in rows] == list(range(NUM_RECORDS))
    assert [r[1] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    for r in rows:
        assert all(off % ALIGNMENT == 0 for off in r[3:7])
    ds = TargetCache(str(tmp_path))
    sample = ds[4]
    mm = ds._shard(1)
    lo, hi = mm.ctypes.data, mm.ctypes.data + mm.shape[0]
    for key in ("hidden_states", "last_hidden_state"):
        assert lo <= sample[key].data_ptr() < hi, f"{key} was copied instead of mapped"
    # Survives pickling (DataLoader workers) without carrying the memory maps along.
    ds2 = pickle.loads(pickle.dumps(ds))
    assert torch.equal(bits(ds2[4]["hidden_states"]), bits(sample["hidden_states"]))


def test_numpy_inputs_and_fp32_into_bf16(tmp_path):
    w = CacheWriter(str(tmp_path), SPEC, 2, 2)
    recs = []
    for r in range(2):
        rec = make_record(r)
        hs32 = rec["hidden_states"].float()
        recs.append(
            {
                "record_id": np.int64(r),
                "input_ids": rec["input_ids"].numpy(),
                "loss_mask": rec["loss_mask"].numpy().astype(bool),
                "hidden_states": hs32.numpy(),  # float32 numpy, cast to bf16 by the writer
                "last_hidden_state": rec["last_hidden_state"].view(torch.int16).numpy(),  # raw bf16 bits
            }
        )
    w.write_shard(0, recs)
    w.finalize()
    ds = TargetCache(str(tmp_path))
    for r in range(2):
        want = make_record(r)
        assert torch.equal(bits(ds[r]["hidden_states"]), bits(want["hidden_states"]))
        assert torch.equal(bits(ds[r]["last_hidden_state"]), bits(want["last_hidden_state"]))


def test_a_cache_of_the_writer_before_encodings_reads_and_raw_bytes_are_unchanged(tmp_path):
    ds = TargetCache(OLD_RAW_CACHE, expect=SPEC, verify=True)
    assert "encoding" not in ds.manifest and ds.spec.encoding == "raw"
    for r in range(len(ds)):
        want = make_record(r)
        assert torch.equal(bits(ds[r]["hidden_states"]), bits(want["hidden_states"]))
        assert torch.equal(bits(ds[r]["last_hidden_state"]), bits(want["last_hidden_state"]))
    write_cache(tmp_path, num_records=3, per_shard=2)  # today's raw cache of the same records: the same bytes
    assert dir_digest(tmp_path) == dir_digest(OLD_RAW_CACHE)


def fp8_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each element: 1/16 of it (3 mantissa bits), or, below e4m3's normal range, half its
    subnormal step, 2**-10 of a power-of-two scale at most absmax/224."""
    x = x.float()
    return torch.maximum(x.abs() / 16, x.abs().amax(-1, keepdim=True) / 224 / 1024)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_round_trip_is_the_in_memory_round_trip_within_half_a_step(tmp_path, dtype):
    spec = CacheSpec(**{**FP8_SPEC.__dict__, "dtype": dtype})
    manifest = write_cache(tmp_path, spec)
    assert manifest["codec"] == "fp8" and manifest["dtype"] == dtype
    ds = TargetCache(str(tmp_path), expect=spec, verify=True)
    H = spec.hidden_size
    for r in range(NUM_RECORDS):
        want, got = make_record(r, spec), ds[r]
        assert torch.equal(got["input_ids"], want["input_ids"].to(torch.int64))
        for key in ("hidden_states", "last_hidden_state"):
            x, x_hat = want[key], got[key]
            assert x_hat.dtype == spec.torch_dtype and x_hat.shape == x.shape
            # what data/states/online.py trains on is exactly what an offline run reads
            assert torch.equal(bits(x_hat), bits(as_stored(x, spec)))
            rows = x.view(x.shape[0], -1, H)  # each token's row of each layer is scaled on its own
            error = (x_hat.view_as(rows).float() - rows.float()).abs()
            assert (error <= fp8_error_bound(rows)).all()
            assert 0 < error.max()  # it is lossy: the bound is what the test is about


def test_fp8_rows_keep_their_precision_beside_outliers():
    """SmolLM2's attention-sink rows reach 24832 where others stay near 1: each row keeps its own precision (within
    the bound, which no zeroed, NaN or infinite value meets), an all-zero row and a row of tiny values included."""
    x = torch.tensor([[24832.0, -3.0, 0.5, 1e-3], [0.9, -1.1, 0.3, 0.02], [0, 0, 0, 0], [3e-30, -1e-30, 2e-31, 0]])
    x = x.to(torch.bfloat16)
    x_hat = as_stored(x, CacheSpec("t", (1,), 4, encoding="fp8"))
    assert ((x_hat.float() - x.float()).abs() <= fp8_error_bound(x)).all()


def test_fp8_writes_are_byte_identical_and_take_half_of_bf16_plus_a_byte_a_row(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a, FP8_SPEC)
    write_cache(b, FP8_SPEC)
    assert dir_digest(a) == dir_digest(b)
    # SmolLM2's shape (5 layers + the final norm, hidden 576): H + 1 bytes a row against bf16's 2H, 0.5009x
    raw = CacheSpec("t", (1, 8, 14, 21, 27), 576)
    fp8 = CacheSpec(**{**raw.__dict__, "encoding": "fp8"})
    assert bytes_per_token(fp8) == 4 + 1 + 6 * 577 and bytes_per_token(raw) == 4 + 1 + 6 * 1152
    num_records = 4
    for spec in (raw, fp8):
        manifest = write_cache(tmp_path / spec.encoding, spec, num_records=num_records, per_shard=2)
        on_disk = sum(s["num_bytes"] for s in manifest["shards"])
        # bytes_per_token is what the layout takes, give or take its alignment (under 64 B after each of 4 arrays)
        assert 0 <= on_disk - manifest["num_tokens"] * bytes_per_token(spec) < num_records * 4 * ALIGNMENT


# ------------------------------------------------------------------------- determinism and crash resume
KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests_dir!r})
    from test_cache import make_record, SPEC, NUM_RECORDS, PER_SHARD
    from data.states.cache_writer import CacheWriter

    root, mode = sys.argv[1], sys.argv[2]
    real_replace = os.replace

    def die():
        if mode == "os_exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)

    def replace_then_maybe_die(src, dst):
        name = os.path.basename(dst)
        if mode == "before_sidecar" and name == "shard-00002.idx.json":
            die()  # shard-00002.bin is already published, its commit marker is not
        real_replace(src, dst)
        if (mode, name) in (("after_index", "index.bin"), ("after_manifest", "manifest.json")):
            die()

    os.replace = replace_then_maybe_die
    w = CacheWriter(root, SPEC, NUM_RECORDS, PER_SHARD, meta={{"source": "unit"}})

    def records(shard):
        for k, r in enumerate(w.shard_range(shard)):
            if mode in ("sigkill", "os_exit") and shard == 2 and k == 1:
                die()  # midway through shard 2: one record already streamed into the .tmp
            yield make_record(r)

    for s in range(w.num_shards()):
        w.write_shard(s, records(s))
    w.finalize()
    """
)


@pytest.mark.parametrize("mode", ["sigkill", "os_exit", "before_sidecar", "after_index", "after_manifest"])
def test_interrupted_writer_resumes_to_identical_bytes(tmp_path, mode, drill):
    drill("kill", f"cache writer stopped: {mode}")
    ref, out = tmp_path / "ref", tmp_path / "out"
    write_cache(ref)
    script = tmp_path / "killer.py"
    script.write_text(KILL_SCRIPT.format(tests_dir=TESTS_DIR))
    proc = subprocess.run([sys.executable, str(script), str(out), mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == (3 if mode == "os_exit" else -signal.SIGKILL), proc.stderr

    w = CacheWriter(str(out), SPEC, NUM_RECORDS, PER_SHARD, meta={"source": "unit"})
    names = set(os.listdir(out))
    if mode == "after_manifest":
        # The manifest landed, so the cache is complete even though scratch files are still around.
        assert CacheWriter.is_complete(str(out)) and w.pending_shards() == []
        assert len(TargetCache(str(out), verify=True)) == NUM_RECORDS
    elif mode == "after_index":
        assert not CacheWriter.is_complete(str(out)) and w.pending_shards() == []
        with pytest.raises(CacheIncompleteError):
            TargetCache(str(out))
    else:
        assert not CacheWriter.is_complete(str(out))
        assert w.pending_shards() == [2, 3]
        if mode == "before_sidecar":
            assert "shard-00002.bin" in names and "shard-00002.idx.json" not in names
        else:
            assert "shard-00002.bin.tmp" in names and "shard-00002.bin" not in names
        with pytest.raises(CacheIncompleteError, match="re-run the cache stage"):
            TargetCache(str(out))
        with pytest.raises(RuntimeError, match=r"shard-00002\.bin, shard-00003\.bin"):
            w.finalize()
        for s in w.pending_shards():
            w.write_shard(s, (make_record(r) for r in w.shard_range(s)))
    w.finalize()
    assert dir_digest(out) == dir_digest(ref)
    assert sorted(os.listdir(out)) == ["index.bin", "manifest.json"] + [f"shard-0000{i}.bin" for i in range(4)]
    # finalize is idempotent
    w.finalize()
    assert dir_digest(out) == dir_digest(ref)


def test_two_writers_byte_identical_and_shard_order_free(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_cache(a)
    # Different process order (as two ranks would): shards written back to front by two writer objects.
    w1 = CacheWriter(str(b), SPEC, NUM_RECORDS, PER_SHARD, meta={"source": "unit"})
    w2 = CacheWriter(str(b), SPEC, NUM_RECORDS, PER_SHARD, meta={"source": "unit"})
    assert w1.shards_for_rank(0, 2) == [0, 2] and w2.shards_for_rank(1, 2) == [1, 3]
    for w, s in [(w2, 3), (w1, 2), (w2, 1), (w1, 0)]:
        w.write_shard(s, (make_record(r) for r in w.shard_range(s)))
    # Rewriting a finished shard is allowed and changes nothing.
    w1.write_shard(1, (make_record(r) for r in w1.shard_range(1)))
    w2.finalize()
    assert dir_digest(a) == dir_digest(b)
    manifest = json.loads((b / "manifest.json").read_text())
    assert "time" not in json.dumps(manifest).lower()
    assert manifest["meta"] == {"source": "unit"}


def test_resume_with_other_settings_refused(tmp_path):
    w = CacheWriter(str(tmp_path), SPEC, NUM_RECORDS, PER_SHARD)
    w.write_shard(0, (make_record(r) for r in w.shard_range(0)))
    with pytest.raises(CacheMismatchError, match="records_per_shard"):
        CacheWriter(str(tmp_path), SPEC, NUM_RECORDS, PER_SHARD + 1)
    with pytest.raises(CacheMismatchError, match="codec: directory has 'raw', this writer has 'fp8'"):
        CacheWriter(str(tmp_path), FP8_SPEC, NUM_RECORDS, PER_SHARD)


# ------------------------------------------------------------------------------------------- refusals
def test_reading_before_finalize_is_refused(tmp_path):
    w = CacheWriter(str(tmp_path), SPEC, NUM_RECORDS, PER_SHARD)
    for s in range(w.num_shards()):
        w.write_shard(s, (make_record(r) for r in w.shard_range(s)))
    # Every shard is written, but nothing is readable until the manifest exists.
    with pytest.raises(CacheIncompleteError, match="was not finished.*re-run the cache stage"):
        TargetCache(str(tmp_path))
    with pytest.raises(CacheIncompleteError):
        TargetCache(str(tmp_path / "does-not-exist"))
    assert not CacheWriter.is_complete(str(tmp_path))
    w.finalize()
    assert CacheWriter.is_complete(str(tmp_path))
    with pytest.raises(RuntimeError, match="already finalized"):
        w.write_shard(0, [])


def test_temp_leftover_never_counts_as_shard(tmp_path, drill):
    drill("corruption", "a temporary shard left by a crash")
    w = CacheWriter(str(tmp_path), SPEC, NUM_RECORDS, PER_SHARD)
    for s in (0, 1, 3):
        w.write_shard(s, (make_record(r) for r in w.shard_range(s)))
    # Leftovers a kill could leave: a complete-looking temp shard and its temp sidecar.
    (tmp_path / "shard-00002.bin.tmp").write_bytes(b"\0" * 4096)
    (tmp_path / "shard-00002.idx.json.tmp").write_text("{}")
    assert w.pending_shards() == [2]
    with pytest.raises(RuntimeError, match=r"1 of 4 shards.*shard-00002\.bin"):
        w.finalize()
    w.write_shard(2, (make_record(r) for r in w.shard_range(2)))
    manifest = w.finalize()
    assert [s["name"] for s in manifest["shards"]] == [f"shard-0000{i}.bin" for i in range(4)]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp") or n.endswith(".idx.json")]


@pytest.mark.parametrize(
    "field,value",
    [
        ("layer_ids", (1, 3, 7)),
        ("target", "other/target"),
        ("tokenizer_fingerprint", "tok-xyz"),
        ("hidden_size", 16),
        ("dtype", "float16"),
        ("encoding", "fp8"),
    ],
)
def test_mismatch_refused_naming_field(tmp_path, field, value):
    write_cache(tmp_path)
    expect = CacheSpec(**{**SPEC.__dict__, field: value})
    with pytest.raises(CacheMismatchError) as e:
        TargetCache(str(tmp_path), expect=expect)
    msg = str(e.value)
    assert field in msg
    shown = list(value) if field == "layer_ids" else value
    assert repr(shown) in msg and "Rebuild the cache" in msg
    # Only the mismatching field is named.
    for other in ("layer_ids", "target", "tokenizer_fingerprint", "hidden_size", "dtype", "encoding"):
        if other != field and other not in field:
            assert f"  {other}:" not in msg
    TargetCache(str(tmp_path), expect=SPEC)  # the matching spec is accepted


def test_a_recipe_reading_a_subset_of_the_layers_gets_their_columns(tmp_path):
    write_cache(tmp_path)
    subset = TargetCache(str(tmp_path), expect=CacheSpec(**{**SPEC.__dict__, "layer_ids": (5, 1)}))
    full = TargetCache(str(tmp_path), expect=SPEC)
    H = SPEC.hidden_size
    for i in (0, 4, NUM_RECORDS - 1):
        whole, part = full[i]["hidden_states"], subset[i]["hidden_states"]
        assert part.shape == (whole.shape[0], 2 * H)
        assert torch.equal(part[:, :H], whole[:, 2 * H:]) and torch.equal(part[:, H:], whole[:, :H])  # layers 5, 1
        assert torch.equal(subset[i]["last_hidden_state"], full[i]["last_hidden_state"])


@pytest.mark.parametrize("spec,where", [(SPEC, "value"), (FP8_SPEC, "value"), (FP8_SPEC, "exponent")])
def test_flipped_byte_detected(tmp_path, spec, where, drill):
    drill("corruption", f"a flipped {where} byte in a cache shard ({spec.encoding})")
    write_cache(tmp_path, spec)
    ds = TargetCache(str(tmp_path))
    # Flip one byte inside record 4's hidden states (shard 1): a value, or an fp8 row's exponent after the values.
    raw = (tmp_path / "index.bin").read_bytes()
    row = INDEX_STRUCT.unpack_from(raw, 4 * INDEX_STRUCT.size)
    assert row[1] == 1
    path = tmp_path / "shard-00001.bin"
    data = bytearray(path.read_bytes())
    values = row[2] * spec.num_layers * spec.hidden_size  # T*K*H bytes of fp8 values
    data[row[5] + (values + 1 if where == "exponent" else 3)] ^= 0x40
    path.write_bytes(bytes(data))
    del ds

    with pytest.raises(CacheCorruptedError, match=r"shard-00001\.bin"):
        TargetCache(str(tmp_path), verify=True)
    ds = TargetCache(str(tmp_path))  # without verify the open succeeds ...
    with pytest.raises(CacheCorruptedError, match=r"shard-00001\.bin.*record 4"):
        ds[4]  # ... but reading the damaged record fails
    ds[3], ds[5], ds[0]  # neighbours and other shards still read fine
    with pytest.raises(CacheCorruptedError, match=r"shard-00001\.bin"):
        ds.verify()


def test_truncated_shard_refused_on_open(tmp_path, drill):
    drill("corruption", "a truncated cache shard")
    write_cache(tmp_path)
    path = tmp_path / "shard-00002.bin"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(CacheCorruptedError, match=r"shard-00002\.bin"):
        TargetCache(str(tmp_path))


def test_unknown_codec_refused(tmp_path, drill):
    drill("corruption", "a manifest naming an unknown codec")
    write_cache(tmp_path)
    mpath = tmp_path / "manifest.json"
    m = json.loads(mpath.read_text())
    m["codec"] = "zstd"
    mpath.write_text(json.dumps(m))
    with pytest.raises(CacheMismatchError, match="codec 'zstd'"):
        TargetCache(str(tmp_path))


def _records_with(shard_range, **override):
    for r in shard_range:
        rec = make_record(r)
        for k, fn in override.items():
            rec[k] = fn(r, rec[k])
        yield rec


@pytest.mark.parametrize(
    "records,match",
    [
        (lambda rng: _records_with(rng, record_id=lambda r, v: v + 1), "expected record_id 3, got 4"),
        (lambda rng: (make_record(r) for r in (3, 5, 4)), "expected record_id 4, got 5"),
        (lambda rng: (make_record(r) for r in (3, 4)), "record 5 is missing"),
        (lambda rng: (make_record(r) for r in (3, 4, 5, 6)), "extra record.*6"),
        (
            lambda rng: _records_with(rng, hidden_states=lambda r, v: v[:, :-8] if r == 4 else v),
            r"record 4.*hidden_states has shape \[\d+, 16\], expected \[\d+, 24\]",
        ),
        (
            lambda rng: _records_with(rng, last_hidden_state=lambda r, v: torch.cat([v, v], 1) if r == 5 else v),
            r"record 5.*last_hidden_state has shape",
        ),
        (lambda rng: _records_with(rng, loss_mask=lambda r, v: v[:-1] if r == 3 else v), r"record 3.*loss_mask"),
        (lambda rng: _records_with(rng, input_ids=lambda r, v: v.float()), r"record 3.*input_ids must be an integer"),
    ],
)
def test_write_shard_rejects_bad_records(tmp_path, records, match):
    w = CacheWriter(str(tmp_path), SPEC, NUM_RECORDS, PER_SHARD)
    with pytest.raises(ValueError, match=match):
        w.write_shard(1, records(w.shard_range(1)))
    # Nothing was published and no temp file is left behind.
    assert w.pending_shards() == [0, 1, 2, 3]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("shard-")]


def test_bytes_per_token_and_format_bytes():
    spec = CacheSpec(target="t", layer_ids=(1, 9, 17, 25, 33), hidden_size=2560)
    assert bytes_per_token(spec) == 4 + 1 + 6 * 2560 * 2
    assert bytes_per_token(CacheSpec("t", (1,), 4, dtype="float32")) == 4 + 1 + 2 * 4 * 4
    assert bytes_per_token(CacheSpec("t", (1,), 4, dtype="float32", encoding="fp8")) == 4 + 1 + 2 * (4 + 1)
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(int(1.23 * 2**30)) == "1.23 GiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"
