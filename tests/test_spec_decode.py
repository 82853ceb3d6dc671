"""Speculative decoding loop (eval/spec_decode.py): losslessness at T=0 for every drafter family, forced-perfect and
forced-wrong proposers, KV-cache rollback, drafter cache equivalence, load_draft, and the T>0 output distribution.

Tiny random models only (target: Llama, vocab 300, 4 layers, hidden 64, float64 so greedy ties cannot flip between
a batched verify and one-token decoding); CPU, a few seconds plus the distribution test.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from eval.spec_decode import (
    Decoding,
    DSparkDrafter,
    DraftLMDrafter,
    Drafter,
    Eagle3Drafter,
    OracleDrafter,
    Proposal,
    argmax,
    argmax_with_low_rank_bias,
    load_draft,
    speculative_generate,
    target_generate,
    verify_sampling,
)
from eval.lookup import LookupFirstDrafter, NgramDrafter, lookup_first_matches, lookup_matches, lookup_proposals
from eval.scheduler import VerifySchedule
from export.convert import ExportJob, export_draft
from export.serving import SpsTable
from modeling.dspark import DSparkModel, build_dspark_config
from modeling.eagle3 import Eagle3Model, build_eagle3_config
from modeling.target import TargetRunner, capture_hidden_states, vocab_logits, weights_fingerprint
from modeling.registry import TARGET_WEIGHTS_KEY, TargetMismatchError, save_draft
from modeling.vocab import build_vocab_mapping

V, H, LAYER_IDS, GAMMA = 300, 64, [0, 1, 2], 4
PROMPTS = [[7], [3, 14, 15, 92, 65], [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]]


def llama(vocab: int, hidden: int, layers: int, seed: int, logit_scale: float) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double().eval().requires_grad_(False)
    # Default init gives near-uniform logits (std ~0.16); scaling lm_head gives decisive, non-uniform distributions.
    model.lm_head.weight.mul_(logit_scale)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def target():
    return llama(V, H, 4, seed=0, logit_scale=20.0)


def make_dspark(target, *, markov_rank=16, confidence=True, anchor_first=True, head="vanilla", seed=1):
    config = build_dspark_config(target.config, num_layers=2, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                 mask_token_id=5, markov_rank=markov_rank, markov_head_type=head,
                                 enable_confidence_head=confidence, sample_from_anchor=anchor_first)
    torch.manual_seed(seed)
    model = DSparkModel.from_target(config, target).eval()
    if markov_rank:  # a visible Markov bias, so the left-to-right sampling actually matters
        model.markov_head.markov_w1.weight.data.mul_(50)  # bias std ~4, like the target's logits
        model.markov_head.markov_w2.weight.data.mul_(50)
    return model


def make_eagle3(target, seed=2):
    config = build_eagle3_config(target.config, draft_vocab_size=120, aux_layer_ids=LAYER_IDS, ttt_length=3)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_vocab_mapping(counts, 120)
    torch.manual_seed(seed)
    return Eagle3Model.from_target(config, target, d2t, t2d).eval()


def make_draft_lm(target, noise=0.002, seed=3):
    """The target with perturbed weights: agrees often, not always, so both accept and reject paths run."""
    model = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    for p in model.model.layers[2:].parameters():
        p.add_(noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def with_draft_vocab(model: DSparkModel) -> DSparkModel:
    """Drafting among a third of the vocabulary (a token map): the drafts it would pick over all of it are mostly
    outside, so the restriction decides them."""
    model.draft_vocab = torch.randperm(V, generator=torch.Generator().manual_seed(6))[: V // 3].sort().values
    return model


def make_drafter(name, target) -> Drafter:
    if name.endswith("+lookup"):  # lookup after any one-token match: most rounds of these prompts copy
        return LookupFirstDrafter(make_drafter(name.removesuffix("+lookup"), target), min_n=1)
    if name == "dspark":
        return DSparkDrafter(make_dspark(target))
    if name == "dspark-vocab":
        return DSparkDrafter(with_draft_vocab(make_dspark(target)))
    if name == "dflash-vocab":
        return DSparkDrafter(with_draft_vocab(make_dspark(target, markov_rank=0, confidence=False,
                                                          anchor_first=False)))
    if name == "dspark-rnn":
        return DSparkDrafter(make_dspark(target, head="rnn"))
    if name == "dflash":
        return DSparkDrafter(make_dspark(target, markov_rank=0, confidence=False, anchor_first=False))
    if name == "eagle3":
        return Eagle3Drafter(make_eagle3(target))
    if name == "ngram":
        return NgramDrafter()
    if name == "draft-lm":
        return DraftLMDrafter(make_draft_lm(target), vocab_size=V)
    raise KeyError(name)


class ScriptedDrafter(OracleDrafter):
    """Proposes the reference continuation (the oracle) or a token that differs from it at every position."""

    def __init__(self, prompt, reference, wrong=False):
        super().__init__(prompt, reference, GAMMA)
        self.wrong = wrong

    def propose(self, gamma, temperature, generator):
        proposal = super().propose(gamma, temperature, generator)
        if self.wrong:
            self.last = proposal._replace(tokens=[(t + 1) % V for t in proposal.tokens])
        return self.last


# --- T=0: output identical to plain greedy decoding ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn", "dflash", "dspark-vocab", "dflash-vocab", "eagle3", "ngram",
                                  "draft-lm", "dspark+lookup", "eagle3+lookup"])
def test_greedy_is_lossless(target, name):
    drafter = make_drafter(name, target)
    accepted, partial = 0, 0
    for prompt in PROMPTS:
        ref = target_generate(target, prompt, 24)
        spec = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=24))
        assert spec.ids == ref.ids, f"{name}, prompt {prompt}"
        accepted += sum(r.accepted for r in spec.rounds)
        partial += sum(0 < r.accepted < r.proposed for r in spec.rounds)
        assert all(r.proposed <= GAMMA and r.accepted <= r.proposed for r in spec.rounds)
        # EOS mid-generation: the token emitted at step 6 becomes EOS; output stops right after it.
        eos = ref.ids[6]
        ref_eos = target_generate(target, prompt, 24, eos_token_id=eos)
        spec_eos = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=24,
                                                                          eos_token_id=eos))
        assert spec_eos.ids == ref_eos.ids and spec_eos.ids[-1] == eos and len(spec_eos.ids) <= 7
        spec_short = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=13))
        assert spec_short.ids == ref.ids[:13]
        # As the serving engines do (eval/live.py): the first token comes from the prefill, with no round.
        spec_prefill = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=24,
                                                                              first_token_from_prefill=True))
        assert spec_prefill.ids == ref.ids and sum(r.emitted for r in spec_prefill.rounds) == len(ref.ids) - 1
        if name in ("dspark", "dspark-rnn"):
            conf = [c for r in spec.rounds for c in r.confidences]
            assert len(conf) == sum(r.proposed for r in spec.rounds) and all(0 < c < 1 for c in conf)
    if name in ("ngram", "draft-lm"):  # these agree with the target often enough: the accept path really ran
        assert accepted > 0
    if name == "draft-lm":  # partial acceptance: the draft LM's own cache was cropped mid-chain
        assert partial > 0


def test_confidence_schedule_stays_lossless_and_verifies_what_it_admits(target):
    """DSpark's verify scheduler inside the loop: each round verifies exactly the prefix of the drafts it admits (an
    independent one-request scan by hand), the output still equals plain greedy decoding, and on a cost table where
    longer verifies cost more the rounds verify between none and all of their drafts."""
    drafter = make_drafter("dspark", target)
    costs = SpsTable((1, 2, 3, 4, 5), (10.0, 6.76, 5.85, 5.3, 5.0), 8)  # c_1 > 0.48 pays for a first draft
    schedule, decided = VerifySchedule(costs), []

    def by_hand(conf):
        survival, length, best = 1.0, 0, 10.0
        for j, c in enumerate(conf, start=1):
            survival *= c
            theta = (1 + sum(math.prod(conf[:i]) for i in range(1, j + 1))) * costs.sps(1 + j)
            if theta <= best:
                break
            length, best = j, theta
        return length

    def recording(conf):
        decided.append((list(conf), schedule(conf)))
        assert decided[-1][1] == by_hand(conf), conf
        return decided[-1][1]

    for prompt in PROMPTS:
        ref = target_generate(target, prompt, 24)
        start = len(decided)
        spec = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=24),
                                    schedule=recording)
        assert spec.ids == ref.ids, prompt
        assert [r.proposed for r in spec.rounds] == [n for _, n in decided[start:]]
        assert all(r.confidences == conf[: r.proposed] for r, (conf, _) in zip(spec.rounds, decided[start:]))
    lengths = {n for _, n in decided}
    assert 0 in lengths and len(lengths) >= 3, lengths
    with pytest.raises(ValueError, match="confidences"):  # a drafter without a confidence head cannot be scheduled
        speculative_generate(target, make_drafter("dflash", target), PROMPTS[1],
                             Decoding(gamma=GAMMA, max_new_tokens=4), schedule=schedule)


def test_oracle_accepts_everything_and_wrong_accepts_nothing(target):
    prompt, budget = PROMPTS[1], 13
    reference = target_generate(target, prompt, budget + GAMMA + 1).ids
    oracle = speculative_generate(target, ScriptedDrafter(prompt, reference), prompt,
                                  Decoding(gamma=GAMMA, max_new_tokens=budget))
    assert oracle.ids == reference[:budget]
    assert [r.accepted for r in oracle.rounds] == [GAMMA] * 3
    assert all(r.accept_flags == [True] * GAMMA for r in oracle.rounds)
    # 13 = 5 + 5 + 3: tau = gamma+1 per round, and the last round is cut mid-round at the budget.
    assert [r.emitted for r in oracle.rounds] == [GAMMA + 1, GAMMA + 1, 3]
    assert oracle.accept_len == GAMMA + 1
    prefill = speculative_generate(target, ScriptedDrafter(prompt, reference), prompt,
                                   Decoding(gamma=GAMMA, max_new_tokens=budget, first_token_from_prefill=True))
    assert prefill.ids == reference[:budget] and [r.emitted for r in prefill.rounds] == [GAMMA + 1, GAMMA + 1, 2]

    wrong = speculative_generate(target, ScriptedDrafter(prompt, reference, wrong=True), prompt,
                                 Decoding(gamma=GAMMA, max_new_tokens=budget))
    assert wrong.ids == reference[:budget]
    assert len(wrong.rounds) == budget and wrong.accept_len == 1.0
    assert all(r.proposed == GAMMA and r.accept_flags == [False] * GAMMA for r in wrong.rounds)


def test_draft_lm_copy_of_target_is_always_accepted(target):
    """A draft LM identical to the target agrees at every position: at T=0 by argmax, at T>0 because p_d == p_t
    (so this also checks the draft LM's KV-cache bookkeeping and the distributions it reports)."""
    prompt = PROMPTS[1]
    for temperature in (0.0, 1.0):
        drafter = DraftLMDrafter(make_draft_lm(target, noise=0.0), vocab_size=V)
        result = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=23,
                                                                        temperature=temperature, seed=5))
        assert [r.accepted for r in result.rounds] == [GAMMA] * 5 and len(result.ids) == 23
        if temperature == 0:
            assert result.ids == target_generate(target, prompt, 23).ids


class SpyDrafter(NgramDrafter):
    """An n-gram drafter that reads (and records) the target hidden states handed to it."""

    layer_ids = LAYER_IDS

    def reset(self, tokens, target_hidden):
        super().reset(tokens, target_hidden)
        self.rows = [target_hidden]

    def accept(self, num_accepted, next_token, target_hidden):
        super().accept(num_accepted, next_token, target_hidden)
        self.rows.append(target_hidden)


def test_drafter_context_is_the_verified_hidden_states(target):
    """The context a drafter accumulates (prefill + accepted rows per round) equals the recipe layers' outputs of
    one full target pass over the verified tokens, position by position."""
    spy = SpyDrafter()
    result = speculative_generate(target, spy, PROMPTS[2], Decoding(gamma=GAMMA, max_new_tokens=30))
    assert any(r.accepted > 0 for r in result.rounds) and any(r.accepted < r.proposed for r in result.rounds)
    rows = torch.cat(spy.rows)
    ids = torch.tensor([spy.tokens[:-1]])
    expected, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
    assert rows.shape == expected[0].shape
    torch.testing.assert_close(rows, expected[0])


def test_kv_cache_rollback(target):
    prompt = PROMPTS[1]
    reference = target_generate(target, prompt, 10).ids
    result = speculative_generate(target, ScriptedDrafter(prompt, reference, wrong=True), prompt,
                                  Decoding(gamma=GAMMA, max_new_tokens=10))
    emitted = 0
    for r in result.rounds:  # every round verified gamma+1 tokens, rejected all drafts, kept only the pending one
        emitted += r.emitted
        assert r.accepted == 0 and r.cache_len == len(prompt) + emitted - 1

    # Rolled-back cache gives the same next-token logits as a fresh forward over the kept tokens.
    with TargetRunner(target, LAYER_IDS) as runner:
        runner.forward(prompt[:-1])
        logits, hidden = runner.forward([prompt[-1], 1, 2, 3])
        assert runner.length == len(prompt) + 3 and hidden.shape == (4, len(LAYER_IDS) * H)
        runner.crop(len(prompt) + 1)
        assert runner.length == len(prompt) + 1
        after, _ = runner.forward([9])
    fresh = target(torch.tensor([prompt + [1, 9]])).logits[0, -1]
    torch.testing.assert_close(after[-1], fresh)


def test_runner_logits_are_the_models_on_the_rows_asked_for(target):
    prompt = PROMPTS[0]
    full = target(torch.tensor([prompt])).logits[0]
    for rows, expected in (("all", full), ("last", full[-1:])):
        with TargetRunner(target, LAYER_IDS) as runner:
            logits, hidden = runner.forward(prompt, logits=rows)
        torch.testing.assert_close(logits, expected)
        assert hidden.shape == (len(prompt), len(LAYER_IDS) * H)
    with TargetRunner(target, LAYER_IDS) as runner:
        logits, hidden = runner.forward(prompt, logits="none")
        assert logits is None and runner.length == len(prompt)
        after, _ = runner.forward([5, 6])  # the cache a logit-free prefill leaves serves the next forward
    torch.testing.assert_close(after, target(torch.tensor([prompt + [5, 6]])).logits[0, -2:])


@pytest.mark.parametrize("bias_scale", [0.01, 1.0, 30.0])
def test_argmax_with_low_rank_bias_is_the_full_argmax(bias_scale):
    """Small biases (a pruned race), biases as large as the logits, and biases that swamp them (the full product)."""
    generator = torch.Generator().manual_seed(int(bias_scale * 100))
    w2 = torch.randn(3000, 16, generator=generator) * bias_scale
    norms = w2.norm(dim=1)
    for _ in range(50):
        base, u = torch.randn(3000, generator=generator) * 3, torch.randn(16, generator=generator)
        assert argmax_with_low_rank_bias(base, w2, u, norms) == int((base + w2 @ u).argmax())
        column = torch.stack([u.new_zeros(3000), base], dim=1)[:, 1]  # a row of vocab_logits' transposed view
        assert argmax_with_low_rank_bias(column, w2, u, norms) == int((base + w2 @ u).argmax())
    base = torch.zeros(3000)  # a tie everywhere: the first index wins, as with argmax
    assert argmax_with_low_rank_bias(base, w2 * 0, torch.ones(16), norms * 0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_for_rows_views_and_ties(dtype):
    """The loop's argmax (numpy's on a CPU) picks what torch's does: per row of a matrix, of a transposed view (what
    vocab_logits returns), of one row, and the first index among tied maxima."""
    logits = torch.randn(40, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[3, 2] = logits[9, 2] = logits[:, 2].max() + 1  # a tie: index 3 wins
    for view in (logits, logits.T, logits.T.contiguous()):
        assert argmax(view) == view.argmax(-1).tolist()
    assert argmax(logits.T[2]) == 3 and isinstance(argmax(logits.T[2]), int)


@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_vocab_logits_is_the_linear_head(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, hidden = torch.randn(5000, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    logits = vocab_logits(hidden, weight)
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, weight))
    assert logits.argmax(-1).tolist() == (hidden @ weight.T).argmax(-1).tolist()


# --- drafter internals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dspark", "dspark-rnn", "dflash", "dspark-vocab", "dflash-vocab"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dspark_context_cache_matches_recompute(target, kind, temperature):
    model = make_drafter(kind, target).model
    cached, recompute = DSparkDrafter(model, use_cache=True), DSparkDrafter(model, use_cache=False)
    g = torch.Generator().manual_seed(0)
    tokens = PROMPTS[2]
    hidden = torch.randn(len(tokens) - 1, len(LAYER_IDS) * H, generator=g, dtype=torch.float64)
    cached.reset(tokens, hidden)
    recompute.reset(tokens, hidden)
    for round_ in range(3):
        torch.testing.assert_close(cached.block_states(), recompute.block_states(), atol=1e-5, rtol=1e-5)
        a = cached.propose(GAMMA, temperature, torch.Generator().manual_seed(round_))
        b = recompute.propose(GAMMA, temperature, torch.Generator().manual_seed(round_))
        assert a.tokens == b.tokens and len(a.tokens) == GAMMA
        # Left-to-right Markov sampling == one teacher-forced pass with prev = [anchor, d_1..d_{gamma-1}].
        with torch.no_grad():
            states = cached.block_states()
            prev = torch.tensor([cached.tokens[-1]] + a.tokens[:-1])
            forced = model.draft_logits(states, prev)
            if model.draft_vocab is not None:  # outside the token map: never drafted
                outside = torch.ones(V, dtype=torch.bool)
                outside[model.draft_vocab] = False
                forced[:, outside] = -float("inf")
                assert set(a.tokens) <= set(model.draft_vocab.tolist())
        if temperature == 0:
            assert forced.argmax(-1).tolist() == a.tokens
            assert model.greedy_drafts(states, prev).tolist() == a.tokens  # what the replay drafts
        else:
            torch.testing.assert_close(a.probs, torch.softmax(forced, -1), atol=1e-5, rtol=1e-5)
        if model.confidence_head is not None:
            with torch.no_grad():
                expected = torch.sigmoid(model.confidence_logits(states, prev)).tolist()
            assert a.confidences == pytest.approx(expected, abs=1e-6)
        if temperature > 0:
            assert a.probs.shape == (GAMMA, V)
            torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.probs.sum(-1), torch.ones(GAMMA))
        if a.confidences is not None:
            assert a.confidences == pytest.approx(b.confidences, abs=1e-5)
        accepted = round_ % 3  # 0, 1, 2 drafts accepted: the context grows by accepted + 1 rows
        rows = torch.randn(accepted + 1, hidden.shape[1], generator=g, dtype=torch.float64)
        for d in (cached, recompute):
            d.accept(accepted, 17 + round_, rows)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle3_chain_matches_forward_train(target, temperature):
    model = make_eagle3(target)
    drafter = Eagle3Drafter(model)
    g = torch.Generator().manual_seed(0)
    width = len(LAYER_IDS) * H
    tokens = list(PROMPTS[1])
    aux = torch.randn(len(tokens) - 1, width, generator=g)
    drafter.reset(tokens, aux)
    kept = torch.arange(model.config.draft_vocab_size) + model.d2t
    for round_ in range(3):
        prop = drafter.propose(3, temperature, torch.Generator().manual_seed(round_))
        n = len(tokens) - 1
        # TTT step k at position n-1 consumes token n+k: the pending token, then the drafts.
        ids = torch.tensor([tokens + prop.tokens[:-1]])
        padded = torch.cat([aux, torch.zeros(len(prop.tokens), width)])[None]
        with torch.no_grad():
            steps = model.forward_train(ids, padded, ttt_length=3)
        for k, h in enumerate(steps):
            logits = model.step_logits(h)[0, n - 1]
            if temperature == 0:
                assert prop.tokens[k] == int(kept[logits.argmax()])
            else:
                assert bool(torch.isin(torch.tensor(prop.tokens[k]), kept))
                torch.testing.assert_close(prop.probs[k][kept], torch.softmax(logits, -1), atol=1e-5, rtol=1e-5)
                assert float(prop.probs[k].sum()) == pytest.approx(1.0, abs=1e-5)
        accepted = round_ % 3
        rows = torch.randn(accepted + 1, width, generator=g)
        tokens = tokens + prop.tokens[:accepted] + [40 + round_]
        aux = torch.cat([aux, rows])
        drafter.accept(accepted, 40 + round_, rows)


class TouchOnUnpickle:
    """Unpickling this runs code (touches a file): what a crafted token_map.pt would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_crafted_or_cut_token_map_is_refused_naming_it(target, tmp_path, drill):
    """A token_map.pt that is not a plain tensor (a pickle that would run code) used to end in torch's own message,
    which names no file and advises weights_only=False; a cut one in torch's zip error. Both are refused naming the
    file and the fix, and the crafted one's code never runs."""
    drill("corruption", "crafted / cut token_map.pt in a draft folder")
    folder, marker = tmp_path / "dspark-vocab", tmp_path / "code-ran"
    save_draft(with_draft_vocab(make_dspark(target)), folder)
    token_map = folder / "token_map.pt"
    good = token_map.read_bytes()
    torch.save({"ids": torch.arange(10), "payload": TouchOnUnpickle(marker)}, token_map)
    with pytest.raises(ValueError, match="could run code") as err:
        load_draft(folder, target)
    assert str(token_map) in str(err.value) and "delete it to draft over the whole vocabulary" in str(err.value)
    assert "weights_only=False" not in str(err.value) and not marker.exists()
    token_map.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="unreadable as a token map") as err:
        load_draft(folder, target)
    assert str(token_map) in str(err.value)


def test_ngram_lookup():
    d = NgramDrafter()
    d.reset([1, 2, 3, 4, 5, 9, 2, 3], None)
    assert d.propose(3, 0.0, None).tokens == [4, 5, 9]  # trigram miss, bigram [2, 3] matches
    d.reset([1, 2, 3, 8, 2, 3, 6, 7, 3], None)
    assert d.propose(2, 0.0, None).tokens == [6, 7]  # unigram [3]: the most recent earlier match wins
    d.reset([1, 2, 3], None)
    assert d.propose(4, 0.0, None).tokens == []


# --- load_draft ----------------------------------------------------------------------------------------------------


def test_load_draft_round_trip(target, tmp_path):
    dspark = make_dspark(target)
    save_draft(dspark, tmp_path / "dspark")
    loaded = load_draft(tmp_path / "dspark", target)
    assert isinstance(loaded, DSparkDrafter) and loaded.layer_ids == LAYER_IDS
    for name, value in dspark.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], value.to(torch.float64))

    # The SGLang export drops the frozen embed_tokens / lm_head copies: both come from the target.
    served = load_draft(export_draft(ExportJob(tmp_path / "dspark", "sglang", tmp_path / "export")), target)
    torch.testing.assert_close(served.model.lm_head.weight, target.lm_head.weight)
    torch.testing.assert_close(served.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert served.model.draft_vocab is None and loaded.model.draft_vocab is None

    # A drafting vocabulary travels beside the weights (token_map.pt), not in them; --full-vocab ignores it.
    save_draft(with_draft_vocab(make_dspark(target)), tmp_path / "dspark-vocab")
    assert set(load_file(str(tmp_path / "dspark-vocab" / "model.safetensors"))) == set(dspark.state_dict())
    mapped = load_draft(tmp_path / "dspark-vocab", target)
    assert torch.equal(mapped.model.draft_vocab, with_draft_vocab(dspark).draft_vocab)
    assert load_draft(tmp_path / "dspark-vocab", target, full_vocab=True).model.draft_vocab is None
    torch.save(torch.tensor([3, V]), tmp_path / "dspark-vocab" / "token_map.pt")
    with pytest.raises(ValueError, match="token_map.pt"):
        load_draft(tmp_path / "dspark-vocab", target)

    eagle = make_eagle3(target)
    save_draft(eagle, tmp_path / "eagle3")
    # SGLang's EAGLE3 export drops the embedding (the target's) and keeps the draft's own lm_head.
    loaded = load_draft(export_draft(ExportJob(tmp_path / "eagle3", "sglang", tmp_path / "eagle3-export")), target)
    assert isinstance(loaded, Eagle3Drafter) and torch.equal(loaded.model.d2t, eagle.d2t)
    torch.testing.assert_close(loaded.model.lm_head.weight, eagle.lm_head.weight.double())
    prompt = PROMPTS[2]
    assert speculative_generate(target, loaded, prompt, Decoding(gamma=3, max_new_tokens=8)).ids == \
        target_generate(target, prompt, 8).ids

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["MysteryDrafter"]}')
    with pytest.raises(ValueError, match="Qwen3DSparkModel"):
        load_draft(tmp_path / "bad", target)


def test_a_draft_refuses_a_target_with_other_weights(target, tmp_path):
    """Same name, same shape, other weights (a fine-tune): the draft's recorded fingerprint refuses it, naming both;
    dtype alone (fp32 vs bf16 loads of one checkpoint) is not a difference."""
    assert weights_fingerprint(target) == weights_fingerprint(copy.deepcopy(target).to(torch.bfloat16))
    tuned = make_draft_lm(target, noise=0.01)
    assert weights_fingerprint(tuned) != weights_fingerprint(target)
    dspark = make_dspark(target)
    setattr(dspark.config, TARGET_WEIGHTS_KEY, weights_fingerprint(target))
    save_draft(dspark, tmp_path / "dspark")
    assert isinstance(load_draft(tmp_path / "dspark", target), DSparkDrafter)
    with pytest.raises(TargetMismatchError, match=weights_fingerprint(tuned)) as refused:
        load_draft(tmp_path / "dspark", tuned)
    assert weights_fingerprint(target) in str(refused.value) and "--any-target" in str(refused.value)
    assert isinstance(load_draft(tmp_path / "dspark", tuned, any_target=True), DSparkDrafter)
    # the serving export keeps the key, so an exported draft is checked too
    with pytest.raises(TargetMismatchError):
        load_draft(export_draft(ExportJob(tmp_path / "dspark", "sglang", tmp_path / "export")), tuned)


# --- T>0: rejection sampling keeps the target distribution ---------------------------------------------------------


def test_verify_sampling_first_token_distribution():
    """One position, many draws: the emitted token (accepted draft or residual sample) is distributed as p_t."""
    g = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0] * 5])
    q = torch.softmax(torch.tensor([-1.0, 2.0, 1.0, 0.0, -2.0]), -1)  # deliberately unlike p_t
    p = torch.softmax(target_logits[0], -1)
    n, counts = 20000, torch.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        accepted, token = verify_sampling([x], q[None], target_logits, 1.0, g)
        counts[x if accepted else token] += 1
    # 5 cells: the 99.9% chi-square quantile with 4 degrees of freedom is 18.47.
    assert float(((counts - n * p) ** 2 / (n * p)).sum()) < 18.47


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z=3.09 is the 99.9% normal quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_pooled(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic with every cell of expected count < 5 pooled into one bin (the usual validity rule)."""
    n = float(counts.sum())
    expected = n * probs
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


class FixedDrafter(Drafter):
    """Context-free proposals: samples of a fixed q, or fixed tokens with no distribution (one-hot, like n-gram)."""

    def __init__(self, q, fixed_tokens=None):
        self.q, self.fixed, self.first = q, fixed_tokens, []

    def propose(self, gamma, temperature, generator):
        if self.fixed is not None:
            tokens, probs = self.fixed[:gamma], None
        else:
            tokens = torch.multinomial(self.q, gamma, replacement=True, generator=generator).tolist()
            probs = self.q.expand(gamma, -1)
        if len(self.tokens) == 3:  # first round of this run: remember the pure proposal
            self.first.append(tuple(tokens))
        self.last = Proposal(tokens, probs, None)
        return self.last


# gamma=2 exercises acceptance at the second position; gamma=1 makes the bonus token the second output token.
@pytest.mark.parametrize("one_hot, gamma, runs", [(False, 2, 3000), (True, 1, 1500)])
def test_sampled_output_matches_target_distribution(one_hot, gamma, runs):
    """Seeded runs of 2 tokens at T=1: the joint law of (x1, x2) over 64 cells matches the target's exact
    law (Pearson chi-square, cells with expected count < 5 pooled, below the 99.9% quantile: a correct sampler fails
    1 time in 1000, and the seeds are fixed, so the outcome is deterministic), while the drafter's own proposals are
    far from it (the same statistic on the first draft vs p(x1) > 10x the quantile), so the check has power."""
    target8 = llama(8, 16, 1, seed=4, logit_scale=40.0)
    prompt = [1, 2, 3]
    with torch.no_grad():  # exact target law: p(x1) from the prompt, p(x2 | x1) from prompt + x1
        logits = target8(torch.tensor([prompt + [x] for x in range(8)])).logits
    p1 = torch.softmax(logits[0, -2], -1)
    joint = (p1[:, None] * torch.softmax(logits[:, -1], -1)).reshape(-1)
    # Half the target's first-token law, half a skew toward tokens 0/1: drafts are accepted often but not always,
    # so the accept test, the residual resampling and the bonus token all contribute to the output.
    skew = torch.softmax(torch.tensor([2.5, 1.5, 0.0, 0.0, 0.0, -1.0, -1.0, -2.0], dtype=torch.float64), -1)
    # One-hot: propose the target's likeliest first token (accepted with probability p1[x]), then token 0.
    fixed = [int(p1.argmax()), 0] if one_hot else None
    drafter = FixedDrafter(0.5 * p1 + 0.5 * skew, fixed_tokens=fixed)
    counts = torch.zeros(64, dtype=torch.float64)
    first_accepts = torch.zeros(gamma + 1)
    for seed in range(runs):
        result = speculative_generate(target8, drafter, prompt,
                                      Decoding(gamma=gamma, max_new_tokens=2, temperature=1.0, seed=seed))
        counts[result.ids[0] * 8 + result.ids[1]] += 1
        first_accepts[result.rounds[0].accepted] += 1
    assert (first_accepts[0] > runs / 20) and (first_accepts[1:].sum() > runs / 20), first_accepts
    stat, df = chi2_pooled(counts, joint)
    assert stat < chi2_critical(df), (stat, df)
    # Power: the first drafted token alone against the target's first-token law.
    proposed = torch.bincount(torch.tensor([first[0] for first in drafter.first]), minlength=8).double()
    bad_stat, bad_df = chi2_pooled(proposed, p1)
    assert bad_stat > 10 * chi2_critical(bad_df), (bad_stat, bad_df)


# --- replay: the loop's T=0 rounds from one teacher-forced drafter pass over a cached greedy answer ---------------


def bigram_pair():
    """A target whose greedy next token is mostly pi(current token) (lm_head = permuted embeddings), and a DSpark whose
    Markov head drafts pi(previous token): long accepted runs, ended by the target's few departures from pi."""
    target = llama(V, H, 4, seed=0, logit_scale=1.0)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target.lm_head.weight.copy_(target.model.embed_tokens.weight[perm.argsort()] * 50)
    draft = make_dspark(target, markov_rank=V)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V))
        draft.markov_head.markov_w2.weight.zero_()
        draft.markov_head.markov_w2.weight[perm, torch.arange(V)] = 1000.0
    return target, DSparkDrafter(draft)


@pytest.mark.parametrize("name", ["dspark-bigram", "dspark-bigram-vocab", "dspark", "dspark-rnn", "dflash",
                                  "dspark-vocab", "eagle3"])
def test_replay_gives_the_loops_rounds(name, target):
    from train.rollout import answer_span, draft_matches, replay_rounds

    if name.startswith("dspark-bigram"):
        target, drafter = bigram_pair()
        if name.endswith("-vocab"):  # the bigram's successors outside the map are never drafted: shorter runs
            drafter = DSparkDrafter(with_draft_vocab(drafter.model))
    else:
        drafter = make_drafter(name, target)
    gamma = 3 if name == "eagle3" else GAMMA
    for prompt in PROMPTS[1:]:
        result = speculative_generate(target, drafter, prompt, Decoding(gamma=gamma, max_new_tokens=40))
        assert result.ids == target_generate(target, prompt, 40).ids
        ids = torch.tensor([prompt + result.ids])
        hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
        record = {"input_ids": ids[0], "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(result.ids)),
                  "hidden_states": hidden[0]}
        first, end = answer_span(record)
        assert (first, end) == (len(prompt) - 1, ids.shape[1])
        replayed = replay_rounds(draft_matches(drafter.model, record, gamma), first, end, gamma)
        loop = [r.accepted for r in result.rounds]
        if name == "dspark-bigram":
            assert result.accept_len > 3  # the case that exercises long accepted runs
        if name == "dspark-bigram-vocab":
            assert 1.0 < result.accept_len < 2.5  # runs cut where the successor is outside the map (a third is in)
        # the loop's last round may accept drafts past the budget, which the cached answer does not hold
        assert [r.accepted for r in replayed][:-1] == loop[:-1] and replayed[-1].accepted <= loop[-1]
        assert len(replayed) == len(loop)


def test_replay_stops_at_the_end_of_turn_token_like_the_loop(target):
    """A ChatML answer's supervised text goes on past <|im_end|> (its newline), but the loop stops at the eos token:
    with eos_token_id, answer_span ends the replayed answer there and the rounds are the loop's; without it the replay
    would run rounds the loop never runs."""
    from train.rollout import answer_span, draft_matches, replay_rounds

    target, drafter = bigram_pair()
    prompt = PROMPTS[1]
    full = target_generate(target, prompt, 40).ids
    eos = full[25]
    stopped = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=40, eos_token_id=eos))
    assert stopped.ids == full[: full.index(eos) + 1]
    ids = torch.tensor([prompt + full])
    hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
    record = {"input_ids": ids[0], "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(full)),
              "hidden_states": hidden[0]}
    first, end = answer_span(record, eos_token_id=[eos])
    assert end == len(prompt) + len(stopped.ids) < ids.shape[1]
    replayed = replay_rounds(draft_matches(drafter.model, record, GAMMA), first, end, GAMMA)
    assert len(replayed) == len(stopped.rounds)
    assert [r.accepted for r in replayed][:-1] == [r.accepted for r in stopped.rounds][:-1]
    assert len(replay_rounds(draft_matches(drafter.model, record, GAMMA), *answer_span(record), GAMMA)) > len(replayed)


@pytest.mark.parametrize("gamma", [1, GAMMA, 7])
def test_ngram_replay_gives_the_loops_rounds(gamma, target):
    """Prompt lookup replayed over the greedy answer (eval.replay.lookup_matches: no target, no loop) runs the loop's
    own rounds with the n-gram drafter: the baseline a learning curve prints beside the drafts' replayed tau."""
    from eval.replay import replay_records
    from train.rollout import answer_span, replay_rounds

    records, accepted = [], 0
    for prompt in PROMPTS + [[4, 5, 6, 4, 5, 6, 4, 5]]:  # a repeating prompt: lookup proposes from the start
        result = speculative_generate(target, NgramDrafter(), prompt, Decoding(gamma=gamma, max_new_tokens=40))
        ids = prompt + result.ids
        record = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(result.ids))}
        replayed = replay_rounds(lookup_matches(ids, gamma), *answer_span(record), gamma)
        loop = [r.accepted for r in result.rounds]
        assert [r.accepted for r in replayed][:-1] == loop[:-1] and replayed[-1].accepted <= loop[-1]
        assert len(replayed) == len(loop)
        records.append(record)
        accepted += sum(loop)
    assert accepted > 10  # lookup's drafts were accepted: the rounds compared are not all empty
    report = replay_records(NgramDrafter(), records, gamma)
    assert report["accept_len"] > 1.0 and report["first_draft_right_at_lookup_hits"] == 1.0


@pytest.mark.parametrize("min_n", [1, 2])
def test_lookup_first_is_lossless_and_replays_the_loops_rounds(min_n, target):
    """The lookup-first drafter (prompt lookup's proposal when the context's last >= min_n tokens occurred before,
    the draft's otherwise) emits the target's own tokens, uses both kinds of round, and eval.replay's
    lookup_first_matches replays its rounds exactly from the greedy answer (so quality.py can report the rule
    without running the loop)."""
    from train.rollout import answer_span, draft_matches, replay_rounds

    inner = make_drafter("dspark", target)
    drafter = LookupFirstDrafter(inner, min_n=min_n)
    copied = drafted = 0
    for prompt in PROMPTS[1:] + [[4, 5, 6, 4, 5, 6, 4, 5]]:
        result = speculative_generate(target, drafter, prompt, Decoding(gamma=GAMMA, max_new_tokens=40))
        assert result.ids == target_generate(target, prompt, 40).ids
        copied, drafted = copied + drafter.copied_rounds, drafted + len(result.rounds) - drafter.copied_rounds
        ids = torch.tensor([prompt + result.ids])
        hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
        record = {"input_ids": ids[0], "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(result.ids)),
                  "hidden_states": hidden[0]}
        looked_up, order = lookup_proposals(ids[0].tolist(), GAMMA)
        matches = lookup_first_matches(draft_matches(inner.model, record, GAMMA), looked_up, order, min_n)
        replayed = replay_rounds(matches, *answer_span(record), GAMMA)
        loop = [r.accepted for r in result.rounds]
        assert [r.accepted for r in replayed][:-1] == loop[:-1] and replayed[-1].accepted <= loop[-1]
        assert len(replayed) == len(loop)
    assert copied > 0 and drafted > 0


def test_rollout_split_over_ranks_gives_one_ranks_rounds(target):
    """The opd stage's rollout replays every world_size-th answer on each rank and gathers them back in order: the
    same round starts and tau as one rank replaying them all."""
    from core.dist import Dist
    from train.opd import rollout

    target, drafter = bigram_pair()

    class Records(list):
        def with_hidden(self, rows):
            return rows

    records = Records()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt + target_generate(target, prompt, 30).ids])
        hidden, _ = capture_hidden_states(target, ids, torch.ones_like(ids), LAYER_IDS)
        records.append({"input_ids": ids[0], "loss_mask": torch.tensor([0] * len(prompt) + [1] * 30),
                        "hidden_states": hidden[0]})
    order = [2, 0, 1]
    parts = {}

    class Rank(Dist):  # a rank of two; rank 1 runs first and stops at the gather, rank 0 then gets both parts
        def __init__(self, rank):
            super().__init__(rank=rank, world_size=2)

        def gather(self, part):
            parts[self.rank] = part
            if self.rank == 1:
                raise StopIteration
            return [parts[0], parts[1]]

    with pytest.raises(StopIteration):
        rollout(drafter.model, records, order, GAMMA, dist=Rank(1))
    split = rollout(drafter.model, records, order, GAMMA, dist=Rank(0))
    one = rollout(drafter.model, records, order, GAMMA)
    assert sorted(parts[0]) == [0, 2] and sorted(parts[1]) == [1]  # each rank replayed its share only
    assert [s.tolist() for s in split[0]] == [s.tolist() for s in one[0]] and len(one[0]) == 3
    assert split[1:] == one[1:] and max(one[1]) >= 2  # accepted runs of several drafts, in the same order
