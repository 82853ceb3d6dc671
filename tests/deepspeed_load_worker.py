"""Run by tests/test_resume.py: one-process DeepSpeed ZeRO-2 on CPU saves a checkpoint, the trainer's
load_checkpoint loads it back (weights_only, DeepSpeed's own classes allowed); then a crafted optimizer-state file
must be refused without running its code. Prints one JSON line."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from core.dist import Dist  # noqa: E402
from core.io import write_checksums  # noqa: E402
from train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from train.trainer import Engine  # noqa: E402
from test_resume import Payload, TinyDraft  # noqa: E402

root, marker = Path(sys.argv[1]), Path(sys.argv[2])
train = SimpleNamespace(zero_stage=2, micro_batch_size=1, max_grad_norm=1.0, lr=1e-3, weight_decay=0.0, adam_beta1=0.9,
                        adam_beta2=0.95, adam_eps=1e-8, precision="fp32", fused_optimizer=False)
recipe = SimpleNamespace(train=train)


def engine_for(seed):
    torch.manual_seed(seed)
    module = TinyDraft(4, 4)
    return module, Engine(module, recipe, Dist(), grad_accum=1)


module, engine = engine_for(0)
engine.backward(engine.module(torch.ones(1, 4)).sum())
engine.step(1e-3, last_micro=True)
path = save_checkpoint(engine, module, engine.optimizer, 1, root, Dist(), {})
other, other_engine = engine_for(1)
result = {"step": load_checkpoint(other_engine, other, other_engine.optimizer, path)["step"],
          "same_weights": torch.equal(other.weight, module.weight)}
optim = next((path / "zero").glob("*optim_states.pt"))
torch.save({"optimizer_state_dict": Payload(marker)}, optim)
write_checksums(path)  # whoever crafts a checkpoint can rewrite its checksums too: weights_only must still refuse it
try:
    load_checkpoint(other_engine, other, other_engine.optimizer, path)
    result["crafted"] = "loaded"
except ValueError as err:
    result["crafted"] = str(err)
result["code_ran"] = marker.exists()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
