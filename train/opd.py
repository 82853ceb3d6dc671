"""The `opd` stage: on-policy distillation of the trained drafter (Draft-OPD), rounds of rollout and update.

    torchrun --nproc_per_node 2 train/main.py --recipe dspark_smollm2_135m --set opd.rounds=3

Supervised training sees anchors drawn uniformly over the target's answers; in speculative decoding a drafter drafts
from where its own previous round ended, i.e. right after verification rejected one of its drafts. Each round:
  1. rollout: the current drafter drafts along training answers with the target verifying. The target's rollout of a
     training prompt IS its regenerated answer: the greedy answer at T=0; at T>0 (regen.temperature) the sample that a
     loop verifying by exact match (a draft is accepted iff it equals the token the target samples there) emits,
     losslessly. So the rounds are replayed from one drafter pass per answer (train/rollout.py; equal to the
     step-by-step loop's rounds, a tested fact), the answers split over the ranks; the bar shows the rollout tau. At
     T>0 that tau is exact-match acceptance of the argmax draft, which is the same in distribution as rejection
     sampling of a one-hot draft (accepted with the target's probability of it, as SGLang verifies DFlash); for a
     sampled draft exact match is a lower bound on rejection sampling (sum p*q <= sum min(p, q)). Eval's T>0 loop
     samples its drafts, so its tau can differ either way;
  2. update: opd.steps_per_round steps (lr opd.lr, cosine within the round) of the same Trainer and the family's own
     loss (CE/TV/confidence for DSpark and DFlash, TTT for Eagle3), started from the current drafter, trained only at
     the rounds' starts: the verified prefixes where the previous draft was rejected, with the target's next tokens
     (its distribution, via the frozen head) as labels. At T>0 too the labels are the untempered distribution, as in
     the train stage: temperature, top-k and top-p keep its argmax, the draft that exact match accepts most often,
     and OPD then differs from train (and from its opd.anchors=uniform control) in the anchors alone.
Rollouts use training conversations only, never eval prompts. Each round is a train run of its own under
OUT/opd/round-NNN (checkpointed and resumable like the train stage); OUT/opd/final is the last round's draft, which
eval and export read when opd.rounds > 0. With train.ema_decay > 0 a round, a train run, averages its weights too: it
starts from the previous round's average and its final is the average of its own steps (at 20 steps a round the
early-step cap of train/ema.py keeps the decay at most 0.69).
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from core import stage
from core.dist import Dist
from core.recipe import Recipe
from core.io import CHECKSUMS_NAME, publish_dir
from modeling.registry import draft_digest, load_draft_model
from train.rollout import answer_span, draft_matches, replay_rounds
from train.trainer import TrainJob, run_train


def draft_gamma(recipe) -> int:
    """Tokens a round drafts: the block size, or Eagle3's TTT length."""
    return recipe.draft.ttt_length if recipe.family == "eagle3" else recipe.draft.block_size


class RolloutRecords:
    """The records one round rolled out, each with `rollout_starts` (its replayed rounds' pending positions): the
    train/algorithms.py families anchor (or, Eagle3, supervise) only there. Same interface as the cache. With
    `starts` None (opd.anchors: uniform) the records go out as they are and train as in the train stage."""

    def __init__(self, records, indices: list[int], starts: list[torch.Tensor] | None):
        self.records, self.indices, self.starts = records, indices, starts
        digest = hashlib.sha256(str(records.manifest.get("index_sha256")).encode())
        for i, index in enumerate(indices):
            digest.update(f"{index}:{'uniform' if starts is None else starts[i].tolist()}".encode())
        self.manifest = {**records.manifest, "index_sha256": f"opd:{digest.hexdigest()}"}

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        if self.starts is None:
            return self.records[self.indices[i]]
        return {**self.records[self.indices[i]], "rollout_starts": self.starts[i]}

    def with_hidden(self, records: list[dict]) -> list[dict]:
        return self.records.with_hidden(records)


def rollout_sample(num_records: int, count: int, seed: int, round_index: int) -> list[int]:
    """The training conversations round `round_index` rolls out: a seeded sample of `count` (all when fewer)."""
    order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed * 1_000_003 + round_index))
    return order[: min(count, num_records)].tolist()


def rollout(draft, records, indices: list[int], gamma: int, eos_token_id=None,
            dist: Dist | None = None) -> tuple[list[torch.Tensor], list[int], float]:
    """Replayed rounds over each record's first answer (greedy drafts accepted while equal to its tokens), ended where the loop stops (answer_span): (round starts
    per record, accepted per round, tau). With `dist` each rank replays every world_size-th record and every rank
    gets all of them back, in order."""
    dist = dist or Dist()  # one process: its own share is everything
    mine = {}
    for position in dist.mine(range(len(indices))):
        record = records.with_hidden([records[indices[position]]])[0]
        first, end = answer_span(record, eos_token_id=eos_token_id)
        rounds = replay_rounds(draft_matches(draft, record, gamma), first, end, gamma)
        mine[position] = (torch.tensor([r.pending for r in rounds], dtype=torch.long), [r.accepted for r in rounds])
    replayed = {k: v for part in dist.gather(mine) for k, v in part.items()}
    starts = [replayed[position][0] for position in range(len(indices))]
    accepted = [a for position in range(len(indices)) for a in replayed[position][1]]
    tau = sum(a + 1 for a in accepted) / max(len(accepted), 1)
    return starts, accepted, tau


@dataclass
class OpdJob:
    """What one opd stage runs: the recipe, the training records (a TargetCache or OnlineRecords), the train stage's
    draft it starts from, the folder it writes, its ranks, the target (loaded on first call) and the tokenizer's
    end-of-sequence id (where rollouts stop)."""

    recipe: Recipe
    records: object
    train_final: Path
    out_dir: Path
    dist: Dist
    get_target: Callable
    eos_token_id: int | None = None


def run_opd(job: OpdJob) -> dict:
    """The `opd` stage: rounds of rollout and update from `job.train_final`. Returns the stats in DONE.json."""
    recipe, records, train_final, dist, get_target = job.recipe, job.records, job.train_final, job.dist, job.get_target
    out_dir, opd, eos_token_id = Path(job.out_dir), job.recipe.opd, job.eos_token_id
    if not (Path(train_final) / "model.safetensors").is_file():
        raise RuntimeError(f"{train_final} holds no trained draft: run the train stage first (--stages train,opd)")
    opd_settings = dataclasses.asdict(opd)
    if opd.anchors == "rollout":  # as every opd folder made before the key existed: those still match
        del opd_settings["anchors"]
    settings = {"opd": opd_settings, "start_draft_sha256": draft_digest(train_final),
                "data": records.manifest.get("index_sha256")}
    done = stage.start(out_dir, settings, "opd", dist.is_main)
    if done is not None:
        return done
    gamma = draft_gamma(recipe)
    # a sampled answer's rounds: exact-match acceptance of the argmax draft (see the docstring), said in the log
    acceptance = f" (exact match along T={recipe.regen.temperature} samples)" if recipe.regen.temperature > 0 else ""
    round_recipe = dataclasses.replace(recipe, train=dataclasses.replace(
        recipe.train, max_steps=opd.steps_per_round, lr=opd.lr, warmup_ratio=0.0, save_every=opd.steps_per_round,
        keep_checkpoints=1))
    draft_dir, history = Path(train_final), []
    bar = tqdm(total=opd.rounds, desc="opd", unit="round", disable=not dist.is_main)
    for k in range(1, opd.rounds + 1):
        indices = rollout_sample(len(records), opd.rollout_records, recipe.seed, k)
        t0 = time.perf_counter()
        if opd.anchors == "uniform":  # the control: same conversations and steps, SFT's anchors, nothing rolled out
            starts, accepted, tau = None, [], None
            dist.print(f"[opd] round {k}/{opd.rounds}: uniform anchors over {len(indices)} training conversations")
        else:
            draft = load_draft_model(draft_dir, get_target(), dtype=torch.float32)
            starts, accepted, tau = rollout(draft, records, indices, gamma, eos_token_id, dist)
            bar.set_postfix(rollout_tau=f"{tau:.3f}")
            dist.print(f"[opd] round {k}/{opd.rounds}: rollout tau {tau:.3f}{acceptance} over {len(accepted)} rounds "
                       f"of {len(indices)} training conversations")
        rollout_s = time.perf_counter() - t0
        round_dir = out_dir / f"round-{k:03d}"
        run_train(TrainJob(round_recipe, RolloutRecords(records, indices, starts), round_dir, dist, get_target,
                           init_from=draft_dir))
        history.append({"round": k, "rollout_tau": tau, "rollout_rounds": len(accepted), "rollout_s": rollout_s,
                        "last_loss": stage.read_done(round_dir)["last"].get("loss")})
        draft_dir = round_dir / "final"
        bar.update(1)
    bar.close()
    # the last update's effect, on the sample the next round would roll out
    _, accepted, tau = rollout(load_draft_model(draft_dir, get_target(), dtype=torch.float32), records,
                               rollout_sample(len(records), opd.rollout_records, recipe.seed, opd.rounds + 1), gamma,
                               eos_token_id, dist)
    history.append({"round": opd.rounds + 1, "rollout_tau": tau, "rollout_rounds": len(accepted)})
    stats = {"rounds": history, "final": str(out_dir / "final")}
    if dist.is_main:
        with publish_dir(out_dir / "final") as tmp:
            shutil.copytree(draft_dir, tmp, dirs_exist_ok=True)
        stage.mark_done(out_dir, stats, outputs=[f"final/{CHECKSUMS_NAME}"])  # its deletion is refused too
        print("[opd] done: rollout tau " + " -> ".join(f"{h['rollout_tau']:.3f}" for h in history
                                                       if h["rollout_tau"] is not None) + acceptance, flush=True)
    dist.barrier()
    return stats
