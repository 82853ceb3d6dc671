"""The target-architecture matrix's quick half (issue 48): a tiny random target of each architecture
data/assets.py `make_tiny_target` writes (Llama 3, Qwen2.5, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, Gemma 3, Phi-3,
DeepSeek-V3, Qwen3-Next), in float64 (no greedy tie can flip between a batched and a one-token forward), through what
each stage does with the target, nothing trained:

* lossless: the eval loop's output equals the target's own greedy output (HF generate's, not the loop's runner) token
  for token, for each drafter family and for a drafter right for 0..gamma tokens in turn (every rollback length), past
  the sliding windows (8 tokens) and through Qwen3-Next's linear attention;
* the runner's rolled-back cache gives the logits of a fresh forward over the kept tokens;
* regeneration's batched greedy answers on a CPU equal each prompt's alone;
* a drafter's rope is the target's full-attention one, over its whole head (Gemma 3 keeps one per layer type,
  Qwen3-Next rotates a quarter of its heads);
* a target an engine cannot serve a family beside is refused up front, by the export and by the pipeline.

The slow half, every stage and both engines' own code on each architecture, is tests/test_arch_matrix.py.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from conftest import set_args
from core.recipe import load_recipe
from data.assets import TINY_ARCHITECTURES, build_qwen3_tokenizer, make_tiny_target
from data.chat import build_messages
from data.regen.backends import HFBackend
from eval.spec_decode import (Decoding, DSparkDrafter, Eagle3Drafter, OracleDrafter, speculative_generate,
                               target_generate)
from export.convert import ExportJob, export_draft
from modeling.dspark import DSparkModel, build_dspark_config
from modeling.eagle3 import Eagle3Model, build_eagle3_config
from modeling.registry import save_draft
from modeling.target import (TargetRunner, cut_to_parts, decoder_layers, load_target, load_target_parts,
                             load_tokenizer, weights_fingerprint)
from modeling.vocab import build_vocab_mapping
from pipeline import main

LAYER_IDS, GAMMA, MASK = [0, 1, 2], 4, 151669
PROMPT = [9707, 11, 1246, 525, 498, 30, 358, 1079, 264, 1661, 1614, 13, 3555, 374]  # 14 tokens: past the window


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root, tokenizer = tmp_path_factory.mktemp("arch"), build_qwen3_tokenizer()
    return lambda arch, layers=4: make_tiny_target(root / f"{arch}-{layers}", arch, tokenizer=tokenizer,
                                                   num_layers=layers)


def float64_target(path):
    model = load_target(path, dtype="float64")
    if model._can_set_experts_implementation():  # an MoE: grouped_mm has no float64 kernel, eager loops the experts
        model.set_experts_implementation("eager")
    # random init gives near-uniform logits: a scaled head gives decisive ones (tied heads scale the embedding too)
    model.get_output_embeddings().weight.mul_(20.0)
    return model


def drafters(target) -> dict:
    """Untrained drafters of each family: what they propose does not matter, only that the loop stays lossless."""
    torch.manual_seed(0)
    block = {name: build_dspark_config(target.config, num_layers=1, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                       mask_token_id=MASK, **keys)
             for name, keys in {"dspark": {"markov_rank": 8, "enable_confidence_head": True},
                                "dflash": {"sample_from_anchor": False}}.items()}
    d2t, t2d = build_vocab_mapping(torch.arange(target.config.vocab_size) % 97, 512)
    eagle3 = build_eagle3_config(target.config, draft_vocab_size=512, aux_layer_ids=LAYER_IDS, ttt_length=GAMMA)
    return {**{name: DSparkDrafter(DSparkModel.from_target(config, target).eval()) for name, config in block.items()},
            "eagle3": Eagle3Drafter(Eagle3Model.from_target(eagle3, target, d2t, t2d).eval())}


class PartlyRight(OracleDrafter):
    """The target's own continuation with its k-th draft wrong, k = 0..gamma in turn: every acceptance length, so
    every rollback length (gamma: none)."""

    rounds = 0

    def propose(self, gamma, temperature, generator):
        proposal = super().propose(gamma, temperature, generator)
        wrong, self.rounds = self.rounds % (gamma + 1), self.rounds + 1
        tokens = [t + 1 if i == wrong else t for i, t in enumerate(proposal.tokens)]
        self.last = proposal._replace(tokens=tokens)
        return self.last


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_speculative_output_is_the_targets_own_greedy_output(tiny, arch):
    """Before, Qwen3-Next failed in the runner (its linear-attention layers wrote into a cache of full-attention
    layers), and no drafter could be built beside Gemma 3 (its rope is one per layer type)."""
    target = float64_target(tiny(arch))
    with torch.no_grad():
        reference = target.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(PROMPT):].tolist()
    assert target_generate(target, PROMPT, 24).ids == reference
    for name, drafter in {**drafters(target), "partly right": PartlyRight(PROMPT, reference)}.items():
        result = speculative_generate(target, drafter, PROMPT, Decoding(gamma=GAMMA, max_new_tokens=24))
        assert result.ids == reference, f"{arch}, {name}"
    accepted = {r.accepted for r in result.rounds}  # the last one: PartlyRight
    assert accepted >= {0, 1, 2, 3}, accepted


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss", "qwen3-next", "deepseek-v3", "minimax", "lfm2"])
def test_a_rolled_back_cache_gives_a_fresh_forwards_logits(tiny, arch):
    """Cut back mid-verify, past the sliding window (8) and through linear attention's running state, the cache
    gives the next token the logits of one forward over the kept tokens (8 layers: Qwen3-Next's has two full-attention
    layers among its linear ones). MiniMax's cache is a class of its own (saved whole, run a token a forward), LFM2's
    short convolutions keep their last tokens."""
    target = float64_target(tiny(arch, 8))
    with TargetRunner(target, LAYER_IDS) as runner:
        runner.forward(PROMPT[:-1])
        _, hidden = runner.forward([PROMPT[-1], 5, 6, 7, 8])
        assert hidden.shape == (5, len(LAYER_IDS) * target.config.hidden_size)
        runner.crop(len(PROMPT) + 2)
        assert runner.length == len(PROMPT) + 2
        after, _ = runner.forward([9])
    with torch.no_grad():
        fresh = target(torch.tensor([PROMPT + [5, 6, 9]])).logits[0, -1]
    # Qwen3-Next's torch fallbacks run its delta rule in float32, chunked otherwise from one forward than the other;
    # MiniMax's lightning attention runs a prompt block by block and a decode token by token, which differ in
    # transformers itself by ~1e-4 of the logits' range (float64 here: not rounding; its own generate runs as the loop)
    assert after[-1].argmax() == fresh.argmax()
    torch.testing.assert_close(after[-1], fresh, rtol=1e-5, atol=1e-2 if arch == "minimax" else 1e-5)


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_batched_regeneration_answers_each_prompt_as_alone(tiny, arch):
    """On a CPU each prompt is prefilled alone and the caches merged, where the cache is keys and values over the
    whole sequence; sliding windows and linear attention fall back to generate's padded prefill. Before, Gemma 3,
    gpt-oss and Qwen3-Next failed ('Sizes of tensors must match': window caches merged as if full)."""
    path = tiny(arch)
    target, tokenizer = float64_target(path), load_tokenizer(path)
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=hf", "regen.temperature=0", "regen.max_new_tokens=8"])
    conversations = [build_messages([q], [], None) for q in ("Hi!", "Name three colours of the rainbow, please.",
                                                             "Why is the sky blue? " * 3)]
    backend = HFBackend(target, tokenizer, recipe.regen, 512)
    batched = backend.generate(conversations, seed=0)
    alone = [backend.generate([c], seed=0)[0] for c in conversations]
    assert [a.token_ids for a in batched] == [a.token_ids for a in alone]
    assert all(len(a.token_ids) == 8 for a in batched)


@pytest.mark.parametrize("arch, theta", [("gemma3", 1_000_000.0), ("qwen3-next", 10_000.0)])
def test_a_drafters_rope_is_the_targets_full_attention_rope_over_its_whole_head(tiny, arch, theta):
    """Before, Gemma 3's per-layer-type dict reached the drafter's config (its rotary embedding raised KeyError
    'rope_type'), and so did Qwen3-Next's partial_rotary_factor 0.25: DraftSmith's layers rotate the whole head
    whatever it says, while vLLM's and SGLang's get_rope, building the exported drafter, rotate a quarter of it."""
    config = load_target(tiny(arch)).config
    dspark = build_dspark_config(config, num_layers=1, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                 mask_token_id=MASK)
    eagle3 = build_eagle3_config(config, draft_vocab_size=512, aux_layer_ids=LAYER_IDS)
    assert dspark.rope_parameters == eagle3.rope_parameters == {"rope_type": "default", "rope_theta": theta}
    cos, _ = DSparkModel(dspark).rotary_emb(torch.zeros(1), torch.arange(3)[None])
    assert cos.shape[-1] == dspark.head_dim


@pytest.fixture(scope="module")
def drafts(tiny, tmp_path_factory):
    """An untrained draft of each family beside the Qwen3 target (the draft does not depend on the target's
    architecture: only the engine's support of it does)."""
    target, root = load_target(tiny("qwen3")), tmp_path_factory.mktemp("drafts")
    for name, drafter in drafters(target).items():
        save_draft(drafter.model, root / name)
    return root


@pytest.mark.parametrize("engine, arch, served", [
    ("sglang", "mixtral", ()), ("sglang", "gemma3", ("eagle3",)), ("sglang", "qwen2.5", ("eagle3",)),
    ("vllm", "mixtral", ()), ("vllm", "gemma3", ()), ("vllm", "qwen2.5", ("eagle3", "dflash", "dspark"))])
def test_an_export_an_engine_cannot_serve_is_refused_naming_why(tiny, drafts, tmp_path, engine, arch, served):
    for family in ("eagle3", "dflash", "dspark"):
        out = tmp_path / f"{family}-{engine}"
        if family in served:
            assert export_draft(ExportJob(drafts / family, engine, out, verifier=tiny(arch))) == out
            continue
        hook = "SupportsEagle3" if engine == "vllm" else \
            "set_eagle3_layers_to_capture" if family == "eagle3" else "set_dflash_layers_to_capture"
        with pytest.raises(ValueError, match=rf"cannot serve the {family.upper()} draft beside a \w+ target: .*{hook}"):
            export_draft(ExportJob(drafts / family, engine, out, verifier=tiny(arch)))
        assert not out.exists()


def test_a_run_whose_export_sglang_cannot_serve_is_refused_before_anything(tiny, tmp_path, drill):
    """The export stage writes SGLang's checkpoint: beside Qwen2.5 SGLang 0.5.23 serves EAGLE3 drafts only, so a
    DFlash run with the export among its stages is refused before regeneration (exit 2), naming vLLM, which serves it;
    without the export stage it runs."""
    drill("bad-input", "an export stage for a target SGLang cannot serve the family beside")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi!"]}) + "\n")
    args = ["--recipe", "dflash_qwen3_8b", "--out", str(tmp_path / "run")] + set_args({
        "target.name_or_path": tiny("qwen2.5"), "data.sources": f"[{{name: '{prompts}'}}]", "data.num_prompts": 1,
        "target.layer_ids": "[0, 1, 2]", "regen.backend": "hf", "regen.max_new_tokens": 2})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(args + ["--stages", "regenerate,cache,train,export"]) == 2
    assert "--stages export: SGLang 0.5.23 cannot serve the DFLASH draft beside a Qwen2ForCausalLM" in err.getvalue()
    assert "serve it with vLLM 0.32 (--to vllm)" in err.getvalue() and not (tmp_path / "run" / "regen").exists()
    assert main(args + ["--stages", "regenerate"]) == 0


@pytest.mark.parametrize("arch", ["gemma3", "qwen3-next"])
def test_a_drafter_starts_from_the_targets_norms_as_they_scale(tiny, arch):
    """Gemma 3's and Qwen3-Next's RMSNorms scale by 1 + weight: draft.init_norm=target (and init_layers=target)
    start the drafter's norms, which scale by their weight, at that factor. Before, they copied the weight itself."""
    target = load_target(tiny(arch))
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    config = build_dspark_config(target.config, num_layers=1, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                 mask_token_id=MASK)
    draft = DSparkModel.from_target(config, target)
    x = torch.randn(3, target.config.hidden_size)
    draft.init_from_target(target, norm="target")
    torch.testing.assert_close(draft.norm(x), target.model.norm(x), rtol=1e-5, atol=1e-5)
    if arch == "gemma3":  # its last layer is Llama-shaped: it starts the drafter's layer, norms as they scale
        draft.init_from_target(target, layers="target")
        torch.testing.assert_close(draft.layers[0].input_layernorm(x), target.model.layers[-1].input_layernorm(x),
                                   rtol=1e-5, atol=1e-5)
    else:  # a gated query: q_proj twice the drafter's
        with pytest.raises(ValueError, match=r"self_attn.q_proj \(128, 64\) \(the drafter's \(64, 64\)\).*"
                                             r"draft.init_layers=random"):
            draft.init_from_target(target, layers="target")


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_a_drafter_starts_alike_from_the_targets_parts_and_from_the_whole_target(tiny, arch):
    """A cache-fed train stage holds only the target's parts: loaded from the checkpoint (load_target_parts; a
    checkpoint transformers converts as it loads, MoE experts fused, is loaded whole and cut, where it used to fail
    on a tensor name) or cut down from the whole target an earlier stage loaded (cut_to_parts). Either holds the last
    layer only, has the whole target's fingerprint, and starts a drafter (the last layer copied where it can be, the
    final norm) bit for bit as the whole target does."""
    path = tiny(arch)
    starts = {}
    for how, loaded in (("whole", lambda: load_target(path)), ("parts", lambda: load_target_parts(path, last_layers=1)),
                        ("cut", lambda: cut_to_parts(load_target(path), last_layers=1))):
        target = loaded()
        layers = decoder_layers(target)
        if how != "whole":
            assert all(p.is_meta for layer in layers[:-1] for p in layer.parameters()), how
            assert not any(p.is_meta for p in layers[-1].parameters()), how
        torch.manual_seed(0)
        config = build_dspark_config(target.config, num_layers=1, block_size=GAMMA, target_layer_ids=LAYER_IDS,
                                     mask_token_id=MASK)
        draft = DSparkModel.from_target(config, target)
        try:
            draft.init_from_target(target, layers="target", fc="last", norm="target")
        except ValueError:  # MLA, fused q/k/v, experts, a gated query: no Llama-shaped layer to copy
            draft.init_from_target(target, fc="last", norm="target")
        starts[how] = (weights_fingerprint(target), draft.state_dict())
    for how in ("parts", "cut"):
        assert starts[how][0] == starts["whole"][0], how
        assert starts[how][1].keys() == starts["whole"][1].keys()
        assert all(torch.equal(starts[how][1][k], v) for k, v in starts["whole"][1].items()), how


@pytest.mark.parametrize("arch, lacks", [("deepseek-v3", "self_attn.q_proj absent"), ("phi3", "self_attn.q_proj absent"),
                                         ("mixtral", "mlp.gate_proj absent"), ("gpt-oss", "mlp.gate_proj absent")])
def test_a_target_layer_the_drafter_cannot_start_from_is_refused_naming_the_fix(tiny, arch, lacks):
    """draft.init_layers=target copies Llama-shaped projections: MLA, fused q/k/v and experts have none to copy.
    Before, an AttributeError named a module of the target's, not the recipe key."""
    target = load_target(tiny(arch))
    for drafter in drafters(target).values():
        with pytest.raises(ValueError, match=rf"{lacks}.*set draft.init_layers=random"):
            drafter.model.init_from_target(target, layers="target")


def test_a_tiny_target_with_heads_vllm_on_cpu_serves(tmp_path):
    """head_dim: vLLM's CPU attention refuses the default 16-wide heads, so the engine-fed rehearsal asks for 32; the
    default's checkpoints keep their settings (no head_dim key), and a folder made with other heads is refused."""
    tokenizer = build_qwen3_tokenizer()
    wide = make_tiny_target(tmp_path / "wide", "qwen3", tokenizer=tokenizer, num_layers=1, head_dim=32)
    model = load_target(wide, dtype="float32")
    assert model.config.head_dim == 32
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    default = make_tiny_target(tmp_path / "default", "qwen3", tokenizer=tokenizer, num_layers=1)
    assert "head_dim" not in json.loads((tmp_path / "default" / "draftsmith_tiny_model.json").read_text())
    assert load_target(default, dtype="float32").config.head_dim == 16
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_target(tmp_path / "wide", "qwen3", tokenizer=tokenizer, num_layers=1)
