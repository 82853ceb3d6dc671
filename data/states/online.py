"""Online hidden states: the train stage runs the frozen target itself, so no hidden-state cache is written.

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --stages regenerate,train \
        --set train.hidden_states=online

With `train.hidden_states: online` the Trainer reads the regenerated records (tokenized exactly as the cache stage
tokenizes them, in the same order) and, for each micro-batch, runs the target (no grad) over exactly those rows to
get the selected layers' outputs and the final-norm state. Nothing reaches the disk but checkpoints: a cache costs
6.9 KB per token for SmolLM2 and 30-40 KB per token for an 8B target, terabytes for a real run.

The states are rounded to `cache.dtype` and through `cache.encoding`, exactly as an offline run reads them back from
the cache (data/states/cache.py's `as_stored`), so an online run and an offline run of one recipe (same seed, same rows)
train on the same numbers and log the same losses. With the in-process target the states stay on its device from the
forward to the draft's input: the rounding (frexp, ldexp and the e4m3 cast are exact or round to nearest even on every
device) and the Trainer's padding run there, so a GPU rank copies no states to the host (tests/test_online.py runs
this path on the `meta` device, where any host copy fails). The price is one target forward per sequence per epoch
instead of one in all; a target too large to sit beside the drafter in every training process keeps the offline cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.dist import Dist
from data.states.cache import as_stored
from data.states.capture import (TARGET_WEIGHTS_META, TOKEN_COUNTS_KEY, cache_spec, capture_rows, loss_token_counts,
                          regen_digest, training_rows)
from data.states.engine import ONLINE_GPU_SHARE, EngineStates
from modeling.anatomy import final_norm
from modeling.target import decoder_layers, target_hidden_size, weights_fingerprint


class OnlineRecords:
    """What the Trainer reads of a TargetCache (len, [i], manifest, with_hidden), over regenerated records.

    `[i]` gives a record's tokens only; `with_hidden(records)` adds their hidden states, one target forward per
    `cache.batch_size` records, right before the micro-batch's forward (so a step never holds more than one
    micro-batch of states).

    Under cache.backend engine the states come from a vLLM server instead (data/states/engine.py: the stage's own,
    started here, before the trainer allocates its drafter and optimizer, with ONLINE_GPU_SHARE of a GPU, and stopped
    by `close`; or cache.server_urls'), and `get_model` gives the target without its decoder layers."""

    def __init__(self, recipe, regen_dir: Path, tokenizer, get_model, dist: Dist | None = None,
                 log_dir: Path | None = None):
        self.root = Path(regen_dir)
        self.recipe, self.dist, self.log_dir = recipe, dist or Dist(), Path(log_dir or regen_dir)
        self.engine: EngineStates | None = None
        records_sha256 = regen_digest(regen_dir)
        self.rows, dropped = training_rows(recipe, regen_dir, tokenizer)
        self.get_model = get_model
        self.layer_ids = list(recipe.target.layer_ids)
        #: the cache the cache stage would write: the states go through its dtype and encoding
        self.spec = cache_spec(recipe, target_hidden_size(recipe.target.name_or_path), tokenizer)
        self.batch_size = recipe.cache.batch_size
        model = get_model()
        # The manifest keys the Trainer and the families read: the data's identity (the train stage pins it, so a
        # resume that would round or encode the states otherwise is refused), Eagle3's token counts.
        identity = (f"online:{records_sha256}" + ("" if self.spec.encoding == "raw" else f":{self.spec.encoding}")
                    + ("" if recipe.cache.dtype == "bfloat16" else f":{recipe.cache.dtype}")
                    + (":engine" if recipe.cache.backend == "engine" else ""))
        self.manifest = {"index_sha256": identity, "num_records": len(self.rows),
                         "num_tokens": sum(len(r["input_ids"]) for r in self.rows),
                         "meta": {"regen_records_sha256": records_sha256, "dropped": dropped,
                                  TOKEN_COUNTS_KEY: loss_token_counts(self.rows),
                                  TARGET_WEIGHTS_META: weights_fingerprint(model)}}
        if recipe.cache.backend == "engine":
            # now, not at the first micro-batch: vLLM takes its share of the GPU only if that much is free when it
            # starts, and the trainer's allocations come after this
            self._start_engine(model)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[index]
        return {"record_id": index, "input_ids": torch.tensor(row["input_ids"], dtype=torch.int32),
                "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.uint8)}

    def with_hidden(self, records: list[dict]) -> list[dict]:
        capture = self._capture()
        out = []
        for start in range(0, len(records), self.batch_size):
            chunk = records[start: start + self.batch_size]
            states = capture(chunk, self.spec.torch_dtype)
            out += [{**r, "hidden_states": as_stored(hidden, self.spec),
                     "last_hidden_state": as_stored(last, self.spec)} for r, (hidden, last) in zip(chunk, states)]
        return out

    def _capture(self):
        model = self.get_model()
        if self.recipe.cache.backend != "engine":
            # on the target's device: the rounding below and the Trainer's padding run there too (no host copy)
            return lambda rows, dtype: capture_rows(model, rows, self.layer_ids, dtype, to_host=False)
        if self.engine is None:  # closed, then read again
            self._start_engine(model)
        return self.engine.capture

    def _start_engine(self, model) -> None:
        self.engine = EngineStates(self.recipe, self.dist, self.log_dir, final_norm(model),
                                   len(decoder_layers(model)), gpu_share=ONLINE_GPU_SHARE)

    def close(self) -> None:
        """Stop the engine's server, if this started one (the in-process target needs nothing)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
