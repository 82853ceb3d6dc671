"""What differs between drafter families, behind one seam the Trainer calls.

Each algorithm supplies:
  build(recipe, target_model, cache) -> TrainModule   the drafter plus what its loss needs; forward(batch, step) ->
                                              loss out (step: the optimizer step, which loss.ce_warmup_steps reads)
  make_batch(recipe, records, seeds, device)   padded tokens of some cache records (+ anchors, targets) and the
                                              batch's loss-weight sum; hidden states: attach_hidden
  accumulate(totals, out) / summarize(totals, dist, weight_total) -> metrics for the log

DSpark, DFlash and DFlash2 share one implementation (DFlash is the DSpark model with markov_rank=0 and the
confidence head off, CE only; DFlash2 is DFlash plus the candidate selector and its loss.selector_alpha term); Eagle3
has its own. Random choices in a batch (anchor positions) are seeded per sample from
(recipe seed, step, position in the global batch), so neither the rank count nor a resume changes them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from modeling.anatomy import draft_dims
from modeling.dspark import (DSparkDecoderLayer, DSparkModel, block_targets, build_dspark_config,
                            sample_anchor_positions)
from data.states.capture import read_loss_token_counts
from modeling.eagle3 import Eagle3DecoderLayer, Eagle3Model, build_eagle3_config, ttt_valid_mask
from modeling.registry import architecture_for_family, save_draft
from modeling.vocab import build_vocab_mapping, target_to_draft
from train.copy_init import freeze_copy_attention, init_copy_attention
from train.loss import (BlockLossBatch, BlockLossSettings, Eagle3LossSettings, block_loss, block_weight_sum,
                        eagle3_loss, eagle3_weight_sum)

# SmolLM2's vocabulary has no MASK token, and SGLang needs an id inside the target vocabulary (it reads the mask
# embedding from the target's embed_tokens). <|endoftext|> (id 0) never occurs inside a chat, so its embedding is a
# neutral marker. Qwen3 recipes use 151669, the first id past the tokenizer (an untrained embedding row), as DeepSpec.
DEFAULT_MASK_TOKEN_ID = 0


def _seed_value(*parts: int) -> int:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    return value


def _seeded(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_value(*parts))


def pad_records(records: list[dict], device) -> dict:
    """Right-pad the token fields of cache records into a batch (hidden states come later: `attach_hidden`)."""
    width = max(len(r["input_ids"]) for r in records)
    batch = {"input_ids": torch.zeros(len(records), width, dtype=torch.long),
             "loss_mask": torch.zeros(len(records), width, dtype=torch.bool),
             "attention_mask": torch.zeros(len(records), width, dtype=torch.long)}
    for i, r in enumerate(records):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = r["input_ids"]
        batch["loss_mask"][i, :n] = r["loss_mask"].bool()
        batch["attention_mask"][i, :n] = 1
    return {k: v.to(device) for k, v in batch.items()}


def rollout_mask(records: list[dict], width: int, shift: int) -> torch.Tensor:
    """[B, width] bool, True at a + shift for each replayed round start a of each record (`rollout_starts`)."""
    mask = torch.zeros(len(records), width, dtype=torch.bool)
    for i, r in enumerate(records):
        where = r["rollout_starts"].long() + shift
        mask[i, where[(where >= 0) & (where < width)]] = True
    return mask


def attach_hidden(batch: dict, records: list[dict], device, dtype) -> dict:
    """Add the records' padded hidden states, cast to the compute dtype. Done per micro-batch right before its
    forward, so a large global batch never holds every micro-batch's hidden states at once (the records themselves
    are memory-map views). The padded tensors are made on `device` and each row is cast as it is copied in: a cache's
    rows go up once, and online states already on the device never leave it."""
    width = batch["input_ids"].shape[1]
    hidden = torch.zeros(len(records), width, records[0]["hidden_states"].shape[-1], dtype=dtype, device=device)
    last = torch.zeros(len(records), width, records[0]["last_hidden_state"].shape[-1], dtype=dtype, device=device)
    for i, r in enumerate(records):
        n = len(r["input_ids"])
        hidden[i, :n].copy_(r["hidden_states"])
        last[i, :n].copy_(r["last_hidden_state"])
    return {**batch, "hidden_states": hidden, "last_hidden_state": last}


def add_feature_noise(batch: dict, std: torch.Tensor, seeds: list[tuple]) -> dict:
    """train.feature_noise: the batch's context features plus Gaussian noise of per-dimension `std` ([K*H]), drawn
    per sample from its seed (so a resumed run adds the same noise)."""
    hidden = batch["hidden_states"]
    noise = torch.stack([torch.randn(hidden.shape[1:], generator=_seeded(*seed, 1)) for seed in seeds])
    return {**batch, "hidden_states": hidden + (noise * std).to(hidden)}


def set_dropout(module: nn.Module, p: float) -> None:
    """train.dropout on every drafter decoder layer's residual branches (their `dropout` attribute)."""
    for layer in module.modules():
        if isinstance(layer, (DSparkDecoderLayer, Eagle3DecoderLayer)):
            layer.dropout = p


@contextmanager
def seeded_dropout(p: float, seed: tuple, device: torch.device):
    """The forward's dropout masks drawn from the RNG seeded by `seed` (seed, step, rank, micro-batch), so a resumed
    run drops the same units; the global RNG is left as it was. Nothing happens without dropout."""
    if p <= 0:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(_seed_value(*seed))
        yield


def input_scale(cache, max_records: int = 256) -> torch.Tensor:
    """[K*H] RMS of every dimension of the captured target states over (up to) the first `max_records` cached
    conversations, position 0 left out (its attention-sink activations are outliers of their own).

    A few dimensions of a transformer's residual stream hold most of its energy (SmolLM2: 4 of 576 dimensions hold
    half of it in every captured layer, up to 440x the median), and deeper layers are larger overall; fed raw to the
    drafter's fc they drown everything else, and the context features barely change from token to token.
    draft.init_fc=normalized divides fc's columns by it at the start."""
    total, count = None, 0
    for i in range(min(len(cache), max_records)):
        states = cache.with_hidden([cache[i]])[0]["hidden_states"][1:].double()
        total = states.pow(2).sum(0) if total is None else total + states.pow(2).sum(0)
        count += states.shape[0]
    return (total / max(count, 1)).sqrt().clamp(min=1e-3).float().cpu()  # online states may sit on a GPU


class _TrainModule(torch.nn.Module):
    """A drafter (`self.draft`) plus what its loss needs; checkpoints export the drafter alone."""

    def save_draft(self, path: Path) -> None:
        save_draft(self.draft, path)

    def has_idle_params(self) -> bool:
        """Whether some step's loss leaves trainable parameters without a gradient (plain DDP must be told)."""
        return False


def token_counts(cache, vocab: int) -> torch.Tensor:
    """The cache's supervised-token counts, or every token once without one (eval/preflight.py builds the draft
    before any data exists)."""
    return read_loss_token_counts(cache, vocab) if cache is not None else torch.ones(vocab, dtype=torch.int64)


def _init_draft(draft, recipe, target, cache) -> None:
    """The recipe's starts (draft.init_*): from the target's layers and norm, and fc's columns scaled to the data."""
    d = recipe.draft
    if d.init_copy != "none" and not isinstance(draft, DSparkModel):
        raise ValueError(f"draft.init_copy starts a block drafter's attention (dspark, dflash); the {recipe.family} "
                         "draft has none to start: set draft.init_copy=none")
    kwargs = {"markov": d.markov_init} if isinstance(draft, DSparkModel) else {}
    draft.init_from_target(target, layers=d.init_layers, fc="last" if d.init_fc == "last" else "random",
                           norm=d.init_norm, **kwargs)
    if d.init_fc == "normalized" and cache is not None:  # None: the pre-flight's draft, before any states exist
        with torch.no_grad():
            draft.fc.weight.div_(input_scale(cache)[None, :].to(draft.fc.weight))
    if d.init_copy != "none" and cache is not None:
        init_copy_attention(draft, cache, follows=d.copy_follows)
    if d.init_copy == "frozen":
        freeze_copy_attention(draft)


# --- DSpark / DFlash ----------------------------------------------------------------------------------------------


class BlockTrainModule(_TrainModule):
    def __init__(self, draft: DSparkModel, recipe, loss_t2d: torch.Tensor | None = None):
        super().__init__()
        self.draft, self.recipe = draft, recipe
        # loss.vocab_size: [V] bool, the target ids the softmaxes run over (Eagle3's t2d form); those ids in order are
        # the draft's drafting vocabulary (draft.draft_vocab). Rebuilt from the cache at every start: not in the state.
        self.register_buffer("loss_t2d", loss_t2d, persistent=False)

    def has_idle_params(self) -> bool:
        # the confidence head at conf_alpha 0, or during the CE-only first steps below
        loss = self.recipe.loss
        idle_selector = self.draft.candidate_selector is not None and (loss.selector_alpha == 0
                                                                       or loss.ce_warmup_steps > 0)
        return idle_selector or (self.draft.confidence_head is not None
                                 and (loss.conf_alpha == 0 or loss.ce_warmup_steps > 0))

    def forward(self, batch: dict, step: int):
        """The loss sums of one micro-batch of optimizer step `step` (CE only during loss.ce_warmup_steps)."""
        settings = BlockLossSettings.from_recipe(self.recipe.loss, step)
        draft_hidden = self.draft(batch["input_ids"], batch["hidden_states"], batch["anchor_positions"],
                                  attention_mask=batch["attention_mask"])
        keep = batch["anchor_positions"] >= 0  # [B, A]
        rows = torch.arange(batch["input_ids"].shape[0], device=keep.device)[:, None, None]
        target_hidden = batch["last_hidden_state"][rows, batch["target_pos"].clamp(min=0)]  # [B, A, gamma, H]
        labels, valid = batch["labels"][keep], batch["valid"][keep]
        if self.loss_t2d is not None and not settings.target_labels:
            # A label outside the loss vocabulary weighs nothing (it still counts in the batch's denominator, which
            # make_batch computed without the vocabulary: a constant share of ~1% of predictions).
            labels = target_to_draft(labels, self.loss_t2d)
            valid = valid & (labels >= 0)
            labels = labels.clamp(min=0)
        loss_batch = BlockLossBatch(draft_hidden[keep], target_hidden[keep], labels, batch["prev_ids"][keep], valid,
                                    vocab_ids=self.draft.draft_vocab)
        return block_loss(self.draft, loss_batch, settings)


class BlockAlgorithm:
    @staticmethod
    def build(recipe, target, cache) -> BlockTrainModule:
        d = recipe.draft
        mask_id = d.mask_token_id if d.mask_token_id is not None else DEFAULT_MASK_TOKEN_ID
        config = build_dspark_config(
            target, num_layers=d.num_layers, block_size=d.block_size,
            target_layer_ids=list(recipe.target.layer_ids), mask_token_id=mask_id, markov_rank=d.markov_rank,
            markov_head_type=d.markov_head_type, enable_confidence_head=d.enable_confidence_head,
            sample_from_anchor=d.sample_from_anchor, selector_rank=d.selector_rank, selector_top_k=d.selector_top_k)
        draft = DSparkModel.from_target(config, target)
        _init_draft(draft, recipe, target, cache)
        t2d = None
        if recipe.loss.vocab_size is not None:
            vocab = draft_dims(target)["vocab_size"]
            _, t2d = build_vocab_mapping(token_counts(cache, vocab), min(recipe.loss.vocab_size, vocab))
            if draft.markov_head is not None:
                # Rows outside the loss vocabulary get no gradient: zero, their Markov bias is none rather than noise
                # where the drafter drafts over the whole vocabulary (the serving engines, eval.py --full-vocab).
                with torch.no_grad():
                    draft.markov_head.markov_w2.weight[~t2d] = 0.0
            if draft.candidate_selector is not None:  # likewise a candidate outside it: no transition rather than noise
                with torch.no_grad():
                    draft.candidate_selector.successor_codebook[~t2d] = 0.0
            # and it drafts among those tokens only: its head learned nothing outside them, and a head of 8192 rows
            # costs a sixth of 49,152 (saved with every checkpoint as token_map.pt; eval.py --full-vocab ignores it)
            draft.draft_vocab = t2d.nonzero().squeeze(1)
        return BlockTrainModule(draft.float(), recipe, t2d)

    @staticmethod
    def make_batch(recipe, records: list[dict], seeds: list[tuple], device) -> dict:
        batch = pad_records(records, "cpu")  # anchors and targets are cut on the host, then the batch goes up once
        gamma, num_anchors = recipe.draft.block_size, recipe.draft.num_anchors
        loss_mask = batch["loss_mask"]
        # Anchors are drawn among positions a with loss_mask[a+1]; an on-policy batch (train/opd.py) allows only the
        # starts of its replayed rounds instead.
        anchor_mask = rollout_mask(records, loss_mask.shape[1], shift=1) if "rollout_starts" in records[0] else loss_mask
        per_sample = [sample_anchor_positions(anchor_mask[i: i + 1], num_anchors, _seeded(*seed))[0]
                      for i, seed in enumerate(seeds)]
        width = max(1, max(len(a) for a in per_sample))
        anchors = torch.full((len(per_sample), width), -1, dtype=torch.long)
        for i, a in enumerate(per_sample):
            anchors[i, : len(a)] = a
        labels, prev_ids, target_pos, valid = block_targets(batch["input_ids"], loss_mask, anchors, gamma)
        batch.update(anchor_positions=anchors, labels=labels, prev_ids=prev_ids, target_pos=target_pos, valid=valid)
        return {**{k: v.to(device) for k, v in batch.items()},
                "weight_sum": block_weight_sum(valid, recipe.loss.loss_decay_gamma)}

    @staticmethod
    def accumulate(totals: dict, out) -> None:
        for name in ("loss_sum", "ce_sum", "l1_sum", "conf_sum", "tau_sum", "num_anchors", "selector_sum"):
            totals[name] = totals.get(name, 0.0) + float(torch.as_tensor(getattr(out, name)).detach())
        for name in ("accept_sum", "accept_count", "top1_correct", "selector_top1"):
            value = getattr(out, name).detach().double().cpu()
            totals[name] = totals[name] + value if name in totals else value

    @staticmethod
    def summarize(totals: dict, dist, weight_total: float) -> dict:
        gamma = len(totals["accept_count"])
        flat = dist.sum(totals["loss_sum"], totals["ce_sum"], totals["l1_sum"], totals["conf_sum"],
                        totals["tau_sum"], totals["num_anchors"], totals["selector_sum"],
                        *totals["accept_sum"].tolist(), *totals["accept_count"].tolist(),
                        *totals["top1_correct"].tolist(), *totals["selector_top1"].tolist())
        loss, ce, l1, conf, tau, anchors, selector = flat[:7]
        accept, count = flat[7: 7 + gamma], flat[7 + gamma: 7 + 2 * gamma]
        top1, selector_top1 = flat[7 + 2 * gamma: 7 + 3 * gamma], flat[7 + 3 * gamma:]
        out = {"loss": loss / weight_total, "ce": ce / weight_total, "l1": l1 / weight_total,
               "conf_bce": conf / weight_total, "tau": tau / max(anchors, 1.0),
               "accept_rate": [a / max(c, 1.0) for a, c in zip(accept, count)],
               "top1_acc": [t / max(c, 1.0) for t, c in zip(top1, count)]}
        if selector:  # DFlash2: the selector's CE and how often its (teacher-forced) pick is the label
            out.update(selector_ce=selector / weight_total,
                       selector_acc=[t / max(c, 1.0) for t, c in zip(selector_top1, count)])
        return out


# --- Eagle3 -------------------------------------------------------------------------------------------------------


class Eagle3TrainModule(_TrainModule):
    def __init__(self, draft: Eagle3Model, target_lm_head: torch.nn.Linear, recipe):
        super().__init__()
        self.draft, self.target_lm_head, self.recipe = draft, target_lm_head.requires_grad_(False), recipe

    def forward(self, batch: dict, step: int):
        """The loss sums of one micro-batch (the same at every optimizer `step`)."""
        steps = self.recipe.draft.ttt_length
        step_hidden = self.draft.forward_train(batch["input_ids"], batch["hidden_states"], batch["attention_mask"],
                                               steps)
        return eagle3_loss(self.draft.step_logits, step_hidden, batch["last_hidden_state"], self.target_lm_head,
                           self.draft.t2d, batch["step_valid"], Eagle3LossSettings.from_recipe(self.recipe.loss))


class Eagle3Algorithm:
    @staticmethod
    def build(recipe, target, cache) -> Eagle3TrainModule:
        d = recipe.draft
        dims = draft_dims(target)
        vocab = dims["vocab_size"]
        counts = token_counts(cache, vocab)
        draft_vocab = min(d.draft_vocab_size or vocab, vocab)
        d2t, t2d = build_vocab_mapping(counts, draft_vocab)
        config = build_eagle3_config(target, num_layers=d.num_layers, draft_vocab_size=draft_vocab,
                                     aux_layer_ids=list(recipe.target.layer_ids), ttt_length=d.ttt_length)
        draft = Eagle3Model.from_target(config, target, d2t, t2d)
        _init_draft(draft, recipe, target, cache)
        draft = draft.float()
        head = torch.nn.Linear(dims["hidden_size"], vocab, bias=False)
        head.weight.data.copy_(target.get_output_embeddings().weight.detach().float())
        return Eagle3TrainModule(draft, head, recipe)

    @staticmethod
    def make_batch(recipe, records: list[dict], seeds: list[tuple], device) -> dict:
        batch = pad_records(records, "cpu")  # the masks and weights are made on the host, then the batch goes up once
        valid = ttt_valid_mask(batch["loss_mask"], batch["attention_mask"], recipe.draft.ttt_length)
        if "rollout_starts" in records[0]:  # on-policy batch: the rounds pending at a draft from t = a - 1
            valid = valid & rollout_mask(records, valid.shape[-1], shift=-1)
        if recipe.loss.eagle3_loss_norm == "positions":  # DeepSpec: every step's sum over the batch's tokens
            weight_sum = float(batch["attention_mask"].sum())
        else:
            counts = [v.sum().item() for v in valid]  # valid positions per TTT step
            weight_sum = float(eagle3_weight_sum(counts, recipe.loss.step_loss_decay))
        return {**{k: v.to(device) for k, v in batch.items()}, "step_valid": list(valid.to(device)),
                "weight_sum": weight_sum}

    @staticmethod
    def accumulate(totals: dict, out) -> None:
        totals["loss_sum"] = totals.get("loss_sum", 0.0) + float(out.loss_sum.detach())
        for name in ("acc_sum", "acc_count"):
            value = getattr(out, name).detach().double().cpu()
            totals[name] = totals[name] + value if name in totals else value

    @staticmethod
    def summarize(totals: dict, dist, weight_total: float) -> dict:
        steps = len(totals["acc_count"])
        flat = dist.sum(totals["loss_sum"], *totals["acc_sum"].tolist(), *totals["acc_count"].tolist())
        acc = [a / max(c, 1.0) for a, c in zip(flat[1: 1 + steps], flat[1 + steps:])]
        # SpecForge's simulated accept length: 1 + sum_k prod_{i<=k} acc_i.
        tau = 1.0 + sum(math.prod(acc[: k + 1]) for k in range(steps))
        return {"loss": flat[0] / weight_total, "accept_rate": acc, "tau": tau}


# How each drafter trains, keyed by the registry's architecture: DSpark, DFlash and DFlash2 are one model, hence one
# algorithm.
TRAINING_ALGORITHMS = {"Qwen3DSparkModel": BlockAlgorithm, "LlamaForCausalLMEagle3": Eagle3Algorithm}


def get_algorithm(family: str):
    return TRAINING_ALGORITHMS[architecture_for_family(family).name]
