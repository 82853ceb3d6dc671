"""The opd stage (on-policy distillation, train/opd.py) on the tiny Qwen3: on-policy batches train only at the
replayed rounds' starts, and rounds of rollout + update run after train, resumable, with eval and export reading the
distilled draft; on sampled answers (T>0) the replayed rounds are a step-by-step exact-match loop's."""

import json
import shutil

import pytest
import torch

from core.recipe import load_recipe
from eval.spec_decode import DSparkDrafter, target_generate
from modeling.registry import draft_digest, load_draft_model
from modeling.target import capture_hidden_states, load_target, load_tokenizer
from pipeline import check_inputs, final_draft, training_records
from safetensors.torch import load_file
from train.algorithms import get_algorithm
from train.opd import RolloutRecords, draft_gamma, rollout, rollout_sample
from train.rollout import answer_span

from conftest import run_cli
from test_spec_decode import GAMMA, LAYER_IDS, PROMPTS, bigram_pair
from test_trainer import copy_run, train_args


class ListRecords:
    """A stand-in for the cache: records with tokens only (make_batch never reads hidden states)."""

    def __init__(self, rows):
        self.rows, self.manifest = rows, {"index_sha256": "test"}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def with_hidden(self, records):
        return records


def rows():
    ids = torch.arange(20, dtype=torch.int32)
    mask = torch.tensor([0] * 6 + [1] * 14, dtype=torch.uint8)
    return [{"input_ids": ids, "loss_mask": mask}, {"input_ids": ids[:16], "loss_mask": mask[:16]}]


@pytest.mark.parametrize("family", ["dspark", "eagle3"])
def test_on_policy_batches_train_only_at_round_starts(family):
    recipe = load_recipe(f"{family}_qwen3_8b", ["draft.num_anchors=64", "draft.block_size=3", "draft.ttt_length=3"])
    starts = [torch.tensor([5, 8, 12]), torch.tensor([5, 9])]
    data = RolloutRecords(ListRecords(rows()), [0, 1], starts)
    algo = get_algorithm(family)
    plain = algo.make_batch(recipe, [ListRecords(rows())[i] for i in range(2)], seeds=[(1, 0, 0), (1, 0, 1)],
                            device="cpu")
    batch = algo.make_batch(recipe, [data[0], data[1]], seeds=[(1, 0, 0), (1, 0, 1)], device="cpu")
    if family == "dspark":
        for row, expected in zip(batch["anchor_positions"].tolist(), starts):
            assert sorted(a for a in row if a >= 0) == expected.tolist()
        assert (plain["anchor_positions"] >= 0).sum() > (batch["anchor_positions"] >= 0).sum()
    else:  # Eagle3: the TTT steps are supervised from t = start - 1 only
        for i, expected in enumerate(starts):
            for step in batch["step_valid"]:
                assert set(step[i].nonzero().flatten().tolist()) <= set((expected - 1).tolist())
            assert batch["step_valid"][0][i].sum() > 0
    assert 0 < batch["weight_sum"] < plain["weight_sum"]
    assert data.manifest["index_sha256"] != RolloutRecords(ListRecords(rows()), [0, 1], starts[::-1]).manifest[
        "index_sha256"]
    # opd.anchors=uniform, OPD's control: the same conversations as they are, i.e. the train stage's batches
    uniform = RolloutRecords(ListRecords(rows()), [0, 1], None)
    again = algo.make_batch(recipe, [uniform[0], uniform[1]], seeds=[(1, 0, 0), (1, 0, 1)], device="cpu")
    key = "anchor_positions" if family == "dspark" else "step_valid"
    assert all(torch.equal(a, b) for a, b in zip(again[key], plain[key])) and again["weight_sum"] == plain["weight_sum"]
    assert uniform.manifest["index_sha256"] not in (data.manifest["index_sha256"], "test")


def regenerated(tiny_qwen3, prompt_file, out, **sets) -> dict:
    """A dspark_qwen3_8b run folder with its regenerate and cache stages done (the tiny target), for copy_run."""
    done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="regenerate,cache", **sets))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"dspark": out}


@pytest.fixture(scope="module")
def greedy_run(tiny_qwen3, prompt_file, tmp_path_factory):
    return regenerated(tiny_qwen3, prompt_file, tmp_path_factory.mktemp("greedy"), **{"regen.temperature": 0.0})


def test_opd_rounds_follow_train_and_feed_export(greedy_run, tiny_qwen3, prompt_file, tmp_path):
    out = copy_run(greedy_run, "dspark", tmp_path / "run")
    extra = {"regen.temperature": 0.0, "train.max_steps": 4, "opd.rounds": 2, "opd.rollout_records": 6,
             "opd.steps_per_round": 2}
    args = train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="train,opd,export", **extra)
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[opd] round 1/2: rollout tau" in done.stdout and "[opd] done: rollout tau" in done.stdout
    stats = json.loads((out / "opd" / "DONE.json").read_text())
    assert [h["round"] for h in stats["rounds"]] == [1, 2, 3] and all(h["rollout_tau"] >= 1.0 for h in stats["rounds"])
    for k in (1, 2):
        rows = [json.loads(line) for line in (out / "opd" / f"round-{k:03d}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
    # round 1 starts from train/final (its first loss is a trained draft's), round 2 from round 1's draft
    first = json.loads((out / "opd" / "round-001" / "DONE.json").read_text())["first"]["loss"]
    assert first < json.loads((out / "train" / "DONE.json").read_text())["first"]["loss"]
    assert json.loads((out / "opd" / "round-002" / "settings.json").read_text())["init_from_sha256"] == draft_digest(
        out / "opd" / "round-001" / "final")
    # eval and export read the distilled draft (and the trained one without opd rounds)
    recipe = load_recipe("dspark_qwen3_8b", ["opd.rounds=2"])
    assert final_draft(recipe, out) == out / "opd" / "final"
    assert final_draft(load_recipe("dspark_qwen3_8b"), out) == out / "train" / "final"
    exported = load_file(str(out / "export" / "sglang" / "model.safetensors"))
    distilled = load_file(str(out / "opd" / "final" / "model.safetensors"))
    trained = load_file(str(out / "train" / "final" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], distilled["fc.weight"])
    assert not torch.equal(distilled["fc.weight"], trained["fc.weight"])
    # a second run finds every stage complete
    again = run_cli(args)
    assert again.returncode == 0 and "opd is complete; skipping" in again.stdout.replace(str(out / "opd"), "opd")


def test_opd_uniform_anchors_train_the_same_rounds_without_rollouts(greedy_run, tiny_qwen3, prompt_file, tmp_path):
    """opd.anchors=uniform (benchmarks/opd.py's control): rounds over the same sampled conversations from the same
    draft, anchored anywhere as the train stage does, and nothing rolled out before a round."""
    out = copy_run(greedy_run, "dspark", tmp_path / "run")
    extra = {"regen.temperature": 0.0, "train.max_steps": 2, "opd.rounds": 1, "opd.rollout_records": 6,
             "opd.steps_per_round": 2}
    done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="train,opd", **extra))
    assert done.returncode == 0, done.stderr[-3000:]
    # a rollout-anchored folder keeps the settings it had before opd.anchors existed
    assert "anchors" not in json.loads((out / "opd" / "settings.json").read_text())["opd"]
    control = tmp_path / "control"
    shutil.copytree(out, control, ignore=shutil.ignore_patterns("opd"))
    done = run_cli(train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, control, stages="opd",
                              **extra, **{"opd.anchors": "uniform"}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[opd] round 1/1: uniform anchors over 6 training conversations" in done.stdout
    assert "round 1/1: rollout tau" not in done.stdout
    rounds = json.loads((control / "opd" / "DONE.json").read_text())["rounds"]
    assert rounds[0]["rollout_tau"] is None and rounds[0]["rollout_s"] < 1.0 and rounds[1]["rollout_tau"] >= 1.0
    first = {run: json.loads((run / "opd" / "round-001" / "DONE.json").read_text())["first"]["loss"]
             for run in (out, control)}
    assert first[out] != first[control]  # the same draft and conversations, other anchors
    assert json.loads((control / "opd" / "settings.json").read_text())["opd"]["anchors"] == "uniform"


def exact_match_rounds(drafter, record, gamma, eos_token_id=None):
    """The reference the one-pass replay must equal: the speculative loop run round by round along the record's
    answer, the target's sample at each position being the answer's token there. Each round the drafter (eval's, fed
    only the verified prefix) proposes its argmax drafts; a draft is accepted iff it equals the answer's token, and
    the first mismatch emits the answer's token. Returns (pending position, accepted) per round."""
    ids, hidden = record["input_ids"].tolist(), record["hidden_states"].float()
    a, end = answer_span(record, eos_token_id=eos_token_id)
    drafter.reset(ids[: a + 1], hidden[:a])
    rounds = []
    while a < end - 1:
        drafts = drafter.propose(gamma, 0.0, torch.Generator()).tokens
        accepted = 0
        while accepted < len(drafts) and a + accepted + 1 < end and drafts[accepted] == ids[a + accepted + 1]:
            accepted += 1
        rounds.append((a, accepted))
        if a + accepted + 1 < end:  # the answer's token is the new pending one: the old one and the accepted verified
            drafter.accept(accepted, ids[a + accepted + 1], hidden[a: a + accepted + 1])
        a += accepted + 1
    return rounds


def test_replay_is_the_exact_match_loop_along_sampled_answers():
    """What OPD replays at T>0, on a pair whose drafts are often right: along answers the target sampled at T=0.7,
    rollout()'s rounds (one drafter pass per answer) are those of the exact-match loop run round by round."""
    target, drafter = bigram_pair()
    rows, off_greedy = [], 0
    for i, prompt in enumerate(PROMPTS):
        answer = target_generate(target, prompt, 40, temperature=0.7, seed=i).ids
        off_greedy += answer != target_generate(target, prompt, 40).ids
        ids = torch.tensor([prompt + answer])
        hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
        rows.append({"input_ids": ids[0], "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(answer)),
                     "hidden_states": hidden[0]})
    starts, accepted, tau = rollout(drafter.model, ListRecords(rows), [2, 0, 1], GAMMA)
    reference = [exact_match_rounds(drafter, rows[i], GAMMA) for i in (2, 0, 1)]
    assert [s.tolist() for s in starts] == [[a for a, _ in rounds] for rounds in reference]
    assert accepted == [n for rounds in reference for _, n in rounds]
    # sampled answers (off the greedy one), with rejected drafts and fully accepted blocks both replayed
    assert off_greedy >= 2 and 0 in accepted and GAMMA in accepted and 1.0 < tau < GAMMA + 1


@pytest.fixture(scope="module")
def sampled_run(tiny_qwen3, prompt_file, tmp_path_factory):
    return regenerated(tiny_qwen3, prompt_file, tmp_path_factory.mktemp("sampled"),
                       **{"regen.temperature": 0.7, "regen.max_new_tokens": 16})


def test_opd_runs_on_sampled_answers(sampled_run, tiny_qwen3, prompt_file, tmp_path):
    """regen.temperature > 0 (the Qwen3 recipes' 0.7): the opd stage rolls out along the sampled answers and trains
    at the round starts of the exact-match loop replayed along them (the round's data digest is the reference's)."""
    out = copy_run(sampled_run, "dspark", tmp_path / "run")
    extra = {"regen.temperature": 0.7, "regen.max_new_tokens": 16, "train.max_steps": 2, "opd.rounds": 1,
             "opd.rollout_records": 6, "opd.steps_per_round": 2}
    args = train_args("dspark_qwen3_8b", tiny_qwen3, prompt_file, out, stages="train,opd", **extra)
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[opd] round 1/1: rollout tau" in done.stdout and "(exact match along T=0.7 samples)" in done.stdout
    assert [h["round"] for h in json.loads((out / "opd" / "DONE.json").read_text())["rounds"]] == [1, 2]
    recipe = load_recipe("dspark_qwen3_8b", [a for a in args[6:] if a != "--set"])
    tokenizer, target = load_tokenizer(str(tiny_qwen3)), load_target(str(tiny_qwen3))
    records = training_records(recipe, out, tokenizer, lambda: target)
    indices = rollout_sample(len(records), 6, recipe.seed, 1)
    drafter = DSparkDrafter(load_draft_model(out / "train" / "final", target, dtype=torch.float32))
    starts = [torch.tensor([a for a, _ in exact_match_rounds(drafter, records.with_hidden([records[i]])[0],
                                                             draft_gamma(recipe), tokenizer.eos_token_id)])
              for i in indices]
    assert sum(len(s) for s in starts) > 2 * len(indices)  # answers of several rounds each
    trained_on = json.loads((out / "opd" / "round-001" / "settings.json").read_text())["cache_index_sha256"]
    assert RolloutRecords(records, indices, starts).manifest["index_sha256"] == trained_on


def test_qwen3_recipes_take_opd_rounds(tiny_qwen3, prompt_file, tmp_path):
    """The Qwen3 recipes regenerate at T=0.7: opd.rounds > 0 validates, and the preflight no longer refuses it."""
    recipe = load_recipe("dspark_qwen3_8b", ["opd.rounds=1", f"target.name_or_path={tiny_qwen3}",
                                             f"data.sources=[{{name: '{prompt_file}'}}]",
                                             "regen.backend=hf"])  # (the recipe's sglang needs a GPU)
    assert recipe.regen.temperature == 0.7 and recipe.opd.rounds == 1
    assert check_inputs(recipe, ["regenerate", "cache", "train", "opd"], tmp_path / "run", 1) == []
