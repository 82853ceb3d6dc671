"""Export: DraftSmith drafts -> SGLang 0.5.23 / vLLM (speculators) checkpoints.

The SGLang checks load each export into SGLang's *own* model class (`LlamaForCausalLMEagle3`, `DFlashDraftModel`,
`Qwen3DSparkModel`) from the `sglang==0.5.23` wheel and call its `load_weights`, inside a single-process gloo group,
with `tests/sglang_cpu_stub.py` standing in for the native `sgl_kernel` CPU build (import-only; no kernel runs).
That part runs in a subprocess (this file executed as a script) so SGLang's process group and the stub never leak
into the other tests. It is skipped when sglang is not installed:
`.venv/bin/pip install --no-deps -r requirements-sglang-cpu-test.txt` (sglang==0.5.23 plus pure-Python imports).
"""

from __future__ import annotations

import importlib.util
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

from export.convert import ExportJob, export_draft  # noqa: E402
from export.main import main as export_main  # noqa: E402
from modeling.dspark import DSparkModel, build_dspark_config  # noqa: E402
from modeling.eagle3 import Eagle3Model, build_eagle3_config  # noqa: E402
from modeling.registry import save_draft  # noqa: E402
from modeling.vocab import build_vocab_mapping  # noqa: E402

VOCAB, HIDDEN = 96, 32


def _target_config(kind: str = "qwen3"):
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if kind == "qwen3" else LlamaConfig
    return cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_block_draft(path: Path, *, markov_rank: int, head_type: str = "vanilla", confidence: bool = False,
                     sample_from_anchor: bool = True, gamma: int = 4, seed: int = 0,
                     layer_ids: tuple[int, ...] = (0, 1, 2)) -> Path:
    torch.manual_seed(seed)
    config = build_dspark_config(_target_config(), num_layers=2, block_size=gamma, target_layer_ids=list(layer_ids),
                                 mask_token_id=5, markov_rank=markov_rank, markov_head_type=head_type,
                                 enable_confidence_head=confidence, sample_from_anchor=sample_from_anchor)
    model = DSparkModel(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.5 + 0.25)
    save_draft(model, path)
    return path


def make_eagle3_draft(path: Path, *, draft_vocab: int = 48, seed: int = 0,
                      layer_ids: tuple[int, ...] = (0, 1, 2)) -> Path:
    torch.manual_seed(seed)
    config = build_eagle3_config(_target_config("llama"), num_layers=1, draft_vocab_size=draft_vocab,
                                 aux_layer_ids=list(layer_ids), ttt_length=3)
    counts = torch.randint(0, 100, (VOCAB,))
    d2t, t2d = build_vocab_mapping(counts, draft_vocab)
    model = Eagle3Model(config, d2t, t2d)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02 + 0.3)
    save_draft(model, path)
    return path


def _rewrite_weights(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def _no_leftovers(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temp dir left behind"


# ---------------------------------------------------------------------------------------------------------------------
# Format / strictness tests (no SGLang needed)


def test_sglang_configs_and_keys(tmp_path):
    dspark = export_draft(ExportJob(make_block_draft(tmp_path / "dspark", markov_rank=8, confidence=True), "sglang",
                          tmp_path / "out-dspark"))
    cfg = json.loads((dspark / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert (cfg["block_size"], cfg["markov_rank"], cfg["markov_head_type"], cfg["mask_token_id"]) == (4, 8, "vanilla", 5)
    assert cfg["sample_from_anchor"] is True and cfg["enable_confidence_head"] is True
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 5, "block_size": 4,
                                    "num_target_layers": 4}
    keys = set(load_file(str(dspark / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
            "confidence_head.proj.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)

    dflash = export_draft(ExportJob(make_block_draft(tmp_path / "dflash", markov_rank=0, sample_from_anchor=False),
                                    "sglang", tmp_path / "out-dflash"))
    cfg = json.loads((dflash / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["block_size"] == 5  # 1+N: verify width gamma+1
    assert "markov_rank" not in cfg
    keys = set(load_file(str(dflash / "model.safetensors")))
    assert not any(k.startswith(("embed_tokens", "lm_head", "markov", "confidence")) for k in keys)

    eagle = export_draft(ExportJob(make_eagle3_draft(tmp_path / "eagle"), "sglang", tmp_path / "out-eagle"))
    cfg = json.loads((eagle / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 48
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    state = load_file(str(eagle / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["lm_head.weight"].shape == (48, HIDDEN) and "embed_tokens.weight" not in state
    assert any(k.startswith("midlayer.") for k in state)


def test_sts_copied_for_dspark(tmp_path):
    ckpt = make_block_draft(tmp_path / "d", markov_rank=4, confidence=True)
    (ckpt / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.1, 1.2, 1.3]}))
    out = export_draft(ExportJob(ckpt, "sglang", tmp_path / "out"))
    assert json.loads((out / "sts.json").read_text())["temperatures"][1] == 1.1
    # a file SGLang would misread is refused by the eval stage's own STS reader, naming the file, and writes nothing
    bad = tmp_path / "bad-sts.json"
    bad.write_text(json.dumps({"temperatures": [1.0, -1.0, 1.2, 1.3]}))
    with pytest.raises(ValueError, match=r"bad-sts\.json.*temperatures\[1\]"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "out-bad", sts_path=bad))
    _no_leftovers(tmp_path / "out-bad")


def test_sps_table_shipped_and_serve_command_uses_it(tmp_path):
    """A DSpark export ships an SPS table that reaches SGLang's largest verify batch (48 running requests x
    (gamma+1) = 240 tokens for gamma 4) beside sts.json, and the printed SGLang command turns on what both need: the
    ragged-verify mode (SGLang's default `static` builds no confidence head and ignores both files), an attention
    backend that implements it, and the two paths. A draft without a confidence head gets none of it (SGLang's
    `compact` mode refuses such a draft)."""
    from export.serving import SpsTable, serve_command

    ckpt = make_block_draft(tmp_path / "d", markov_rank=4, confidence=True)
    (ckpt / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.1, 1.2, 1.3]}))
    SpsTable((1, 240), (100.0, 60.0), 240).save(ckpt / "sps_table.json")
    out = export_draft(ExportJob(ckpt, "sglang", tmp_path / "out"))
    assert json.loads((out / "sps_table.json").read_text())["sample_steps_per_sec"] == [100.0, 60.0]
    command = serve_command(ckpt, "sglang", out, "some/target")
    assert command.startswith("SGLANG_RAGGED_VERIFY_MODE=compact python -m sglang.launch_server ")
    # no GPU here: fa3 (the note names SM100's); the float32 draft is served in bfloat16 (SGLang's GPU kernels)
    assert "--attention-backend fa3" in command and "--dtype bfloat16" in command
    assert f"--speculative-dspark-confidence-sts-path {out / 'sts.json'}" in command
    assert f"--speculative-dspark-sps-table-path {out / 'sps_table.json'}" in command

    bad = tmp_path / "bad-sps.json"
    bad.write_text(json.dumps({"sample_batch_tokens": [8, 1], "sample_steps_per_sec": [1.0, 2.0],
                               "max_batch_tokens": 8}))
    with pytest.raises(ValueError, match=r"bad-sps\.json.*ascending"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "out-bad", sps_path=bad))
    _no_leftovers(tmp_path / "out-bad")

    plain = make_block_draft(tmp_path / "plain", markov_rank=4, confidence=False)
    SpsTable((1, 240), (100.0, 60.0), 240).save(plain / "sps_table.json")
    plain_out = export_draft(ExportJob(plain, "sglang", tmp_path / "plain-out"))
    command = serve_command(plain, "sglang", plain_out, "some/target")
    assert command.startswith("python -m sglang.launch_server ") and "--speculative-algorithm DSPARK" in command
    assert "sps-table" not in command and "RAGGED" not in command and "--attention-backend" not in command


def test_sps_table_short_of_sglang_batches_is_not_shipped(tmp_path, capsys):
    """The eval's CPU table stops at 128 tokens; SGLang looks up verify batches of up to 48 x (gamma+1) = 240 and
    clamps past the last probe. Found beside the draft, it is left out and the export prints SGLang's own profiler
    commands instead; named with --sps, it is refused naming the file and both numbers."""
    from export.serving import SpsTable

    ckpt = make_block_draft(tmp_path / "d", markov_rank=4, confidence=True)
    cpu_table = SpsTable((1, 8, 128), (100.0, 90.0, 60.0), 128)
    cpu_table.save(ckpt / "sps_table.json")
    assert export_main(["--checkpoint", str(ckpt), "--to", "sglang", "--out", str(tmp_path / "o")]) == 0
    assert not (tmp_path / "o" / "sps_table.json").exists()
    err = capsys.readouterr().err
    assert "python -m sglang.benchmark.dspark_sps_profiler all --base-url http://127.0.0.1:30000 " \
           "--max-batch-size 48" in err
    assert "SGLANG_RAGGED_VERIFY_MODE=static SGLANG_DSPARK_ENABLE_SPS_RECORD=1 SGLANG_SIMULATE_ACC_LEN=1.0 python -m " \
           "sglang.launch_server" in err
    cpu_table.save(tmp_path / "cpu-sps.json")
    with pytest.raises(ValueError, match=r"cpu-sps\.json: its largest probe is 128 batch tokens.*up to 240"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "o2", sps_path=tmp_path / "cpu-sps.json"))
    _no_leftovers(tmp_path / "o2")


def test_sts_length_must_match_gamma(tmp_path, capsys):
    """Three temperatures for a gamma-4 draft: SGLang refuses it at start-up, after loading the target; the export
    refuses it first, naming the file and both numbers, whether named with --sts or found beside the draft."""
    from export.serving import save_sts

    ckpt = make_block_draft(tmp_path / "d", markov_rank=4, confidence=True)
    save_sts(tmp_path / "three.json", [1.0, 1.1, 1.2])
    with pytest.raises(ValueError, match=r"three\.json holds 3 temperatures.*gamma = block_size = 4"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "out", sts_path=tmp_path / "three.json"))
    _no_leftovers(tmp_path / "out")
    save_sts(ckpt / "sts.json", [1.0, 1.1, 1.2])
    assert export_main(["--checkpoint", str(ckpt), "--to", "sglang", "--out", str(tmp_path / "out")]) == 2
    assert f"{ckpt / 'sts.json'} holds 3 temperatures" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["flipped byte", "cut", "removed"])
def test_damaged_draft_is_refused_naming_the_file(tmp_path, capsys, damage):
    """The train stage records checksums with its final draft; a flipped byte (which safetensors loads without a
    complaint), a cut file or a removed one is refused by export, naming the file, and nothing is written."""
    from core.io import write_checksums

    ckpt = make_block_draft(tmp_path / "d", markov_rank=4)
    write_checksums(ckpt)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flipped byte":
        data[-5] ^= 0x01  # inside the last tensor's values: the file still parses
        weights.write_bytes(bytes(data))
    elif damage == "cut":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        weights.unlink()
    assert export_main(["--checkpoint", str(ckpt), "--to", "sglang", "--out", str(tmp_path / "out")]) == 2
    assert str(weights) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hand_export_is_a_complete_serving_folder(tmp_path, monkeypatch, capsys):
    """The README's `export/main.py --checkpoint runs/R/train/final --to sglang --out ...`, with relative paths:
    the sts.json of the run's eval of this very draft ships (it stays in runs/R/eval), the eval's CPU-timed SPS
    table does not (SGLang's profiler is printed instead), the target and its bfloat16 come from the run's
    recipe.yaml, every path in the printed command is absolute, and every file is as readable as the umask allows
    (the safetensors writer made model.safetensors 0600). An eval of another draft is not taken."""
    import shlex

    import yaml

    from core import stage
    from core.io import write_checksums
    from core.recipe import load_recipe, recipe_to_dict
    from export.serving import SpsTable, save_sts
    from modeling.registry import draft_digest

    target = tmp_path / "target"
    config = _target_config()
    config.dtype = torch.bfloat16  # a Qwen3 target's config names bfloat16
    config.save_pretrained(target)
    run = tmp_path / "runs" / "r"
    final = make_block_draft(run / "train" / "final", markov_rank=4, confidence=True)
    write_checksums(final)  # as training publishes it: a run's draft without checksums is refused
    recipe = load_recipe("dspark_smollm2_135m", [f"target.name_or_path={target}"])
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    stage.begin(run / "eval", {"draft_sha256": draft_digest(final)})
    save_sts(run / "eval" / "sts.json", [1.0, 1.1, 1.2, 1.3])
    SpsTable((1, 8, 128), (100.0, 90.0, 60.0), 128).save(run / "eval" / "sps_table.json")
    stage.mark_done(run / "eval", {"accept_len": 2.0})
    monkeypatch.chdir(tmp_path)
    umask = os.umask(0o002)
    try:
        assert export_main(["--checkpoint", "runs/r/train/final", "--to", "sglang", "--out", "exports/dspark"]) == 0
    finally:
        os.umask(umask)
    out = tmp_path / "exports" / "dspark"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "sts.json"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == \
        {p.name: oct(0o664) for p in out.iterdir()}
    assert oct(out.stat().st_mode & 0o777) == oct(0o775)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}

    err = capsys.readouterr().err
    words = shlex.split(err.split("serve it with:\n", 1)[1].splitlines()[0])
    assert words[:2] == ["SGLANG_RAGGED_VERIFY_MODE=compact", "python"]
    value = {flag: words[words.index(flag) + 1] for flag in ("--model-path", "--speculative-draft-model-path",
                                                            "--speculative-dspark-confidence-sts-path", "--dtype",
                                                            "--attention-backend")}
    assert value["--model-path"] == str(target) and value["--speculative-draft-model-path"] == str(out)
    assert value["--speculative-dspark-confidence-sts-path"] == str(out / "sts.json")
    assert (value["--dtype"], value["--attention-backend"]) == ("bfloat16", "fa3")
    assert "--speculative-dspark-sps-table-path" not in words and "sglang.benchmark.dspark_sps_profiler" in err

    (run / "eval" / "settings.json").write_text(json.dumps({"draft_sha256": "an eval of another draft"}))
    assert export_main(["--checkpoint", "runs/r/train/final", "--to", "sglang", "--out", "exports/other"]) == 0
    assert not (tmp_path / "exports" / "other" / "sts.json").exists()


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("fc.weight"), "'fc.weight'"),
    (lambda s: s.__setitem__("norm.weight", torch.ones(HIDDEN + 1)), "'norm.weight'"),
    (lambda s: s.__setitem__("extra.bias", torch.zeros(3)), "'extra.bias'"),
    (lambda s: s.__setitem__("layers.0.mlp.up_proj.weight", s["layers.0.mlp.up_proj.weight"].double()),
     "'layers.0.mlp.up_proj.weight'"),
])
def test_strict_errors_leave_no_output(tmp_path, edit, needle):
    good = make_block_draft(tmp_path / "good", markov_rank=4)
    bad = _rewrite_weights(good, tmp_path / "bad", edit)
    for to in ("sglang", "vllm"):
        out = tmp_path / f"out-{to}"
        with pytest.raises(ValueError, match=needle):
            export_draft(ExportJob(bad, to, out))
        _no_leftovers(out)


def test_eagle3_strict_missing_d2t(tmp_path):
    bad = _rewrite_weights(make_eagle3_draft(tmp_path / "good"), tmp_path / "bad", lambda s: s.pop("d2t"))
    with pytest.raises(ValueError, match="'d2t'"):
        export_draft(ExportJob(bad, "sglang", tmp_path / "out"))
    _no_leftovers(tmp_path / "out")


def test_dflash_refuses_anchor_first(tmp_path):
    ckpt = make_block_draft(tmp_path / "anchor-first", markov_rank=0, sample_from_anchor=True)
    with pytest.raises(ValueError, match="DSPARK.*markov_rank=0"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "out", algorithm="dflash"))
    _no_leftovers(tmp_path / "out")
    # Auto-detection maps it to DSPARK, which SGLang 0.5.23 refuses for markov_rank=0: refused here too.
    with pytest.raises(ValueError, match="markov_rank > 0"):
        export_draft(ExportJob(ckpt, "sglang", tmp_path / "out"))
    _no_leftovers(tmp_path / "out")


def test_cli_exit_codes(tmp_path, capsys):
    ckpt = make_block_draft(tmp_path / "d", markov_rank=0, sample_from_anchor=True)
    assert export_main(["--checkpoint", str(ckpt), "--to", "sglang", "--out", str(tmp_path / "o"),
                        "--algorithm", "dflash"]) == 2
    assert "export as DSPARK" in capsys.readouterr().err
    ok = make_block_draft(tmp_path / "ok", markov_rank=0, sample_from_anchor=False)
    assert export_main(["--checkpoint", str(ok), "--to", "sglang", "--out", str(tmp_path / "o2")]) == 0
    assert "--speculative-algorithm DFLASH" in capsys.readouterr().err
    # a forced algorithm is the one the printed serve command names, not the detected one
    assert export_main(["--checkpoint", str(ok), "--to", "vllm", "--out", str(tmp_path / "o3"),
                        "--algorithm", "dspark"]) == 0
    assert '"method": "dspark"' in capsys.readouterr().err
    help_text = subprocess.run([sys.executable, str(ROOT / "export" / "main.py"), "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--checkpoint" in help_text and "DFLASH" in help_text


@pytest.mark.parametrize("to", ["sglang", "vllm"])
def test_serve_note_says_how_clients_on_other_machines_reach_the_server(tmp_path, capsys, to):
    """The printed serve command binds --host 127.0.0.1 (the live check's and regeneration's servers have their clients
    beside them), which no other machine reaches: a note printed with it says to serve with --host 0.0.0.0 for them,
    and what that opens. The pipeline's export stage prints the same notes (serve_notes)."""
    from export.serving import serve_notes

    ckpt = make_block_draft(tmp_path / "d", markov_rank=8)
    assert export_main(["--checkpoint", str(ckpt), "--to", to, "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    command = err.split("serve it with:\n  ", 1)[1].splitlines()[0]
    assert "--host 127.0.0.1 " in command
    host_notes = [line for line in err.splitlines() if line.startswith("note: ") and "--host 0.0.0.0" in line]
    assert len(host_notes) == 1 and "--host 127.0.0.1" in host_notes[0] and "other machines" in host_notes[0]
    assert "--api-key" in host_notes[0]  # 0.0.0.0 answers anyone who reaches the port
    assert host_notes[0].removeprefix("note: ") in serve_notes(ckpt, to, tmp_path / "o")


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "dspark-1+N"])
def test_vllm_speculators_config(tmp_path, kind):
    algorithm = kind.removesuffix("-1+N")
    if kind == "eagle3":
        ckpt = make_eagle3_draft(tmp_path / "d")
    else:
        ckpt = make_block_draft(tmp_path / "d", markov_rank=0 if kind == "dflash" else 8,
                                sample_from_anchor=kind == "dspark", confidence=algorithm == "dspark")
    out = export_draft(ExportJob(ckpt, "vllm", tmp_path / "out", verifier="some/target"))
    cfg = json.loads((out / "config.json").read_text())
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == algorithm and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["verifier"]["name_or_path"] == "some/target"
    assert cfg["speculators_model_type"] == algorithm and "transformer_layer_config" in cfg
    state = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" in state
    if kind == "eagle3":
        assert cfg["architectures"] == ["Eagle3Speculator"]
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM counts layers run: HF output id + 1
        assert any(k.startswith("layers.0.") for k in state) and not any(k.startswith("midlayer") for k in state)
        return
    assert cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
    # gamma = 4 drafted tokens either way; speculators' block_size counts the block's slots, and in the 1+N layout
    # (sample_from_anchor false) the anchor slot drafts nothing: block_size - 1 = gamma, as its DFlash converter writes
    one_plus_n = kind != "dspark"
    assert cfg["sample_from_anchor"] is (not one_plus_n)
    assert cfg["block_size"] == (5 if one_plus_n else 4)
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_vllm_refuses_non_vanilla_dspark(tmp_path, head):
    """vLLM 0.32's DSpark drafter has only the vanilla Markov head: a gated/rnn draft would load what it knows and
    draft from another distribution, so the vLLM export refuses it and says why; SGLang serves it."""
    ckpt = make_block_draft(tmp_path / "d", markov_rank=8, head_type=head, confidence=True)
    with pytest.raises(ValueError, match=rf"markov_head_type='{head}'.*vLLM 0\.32.*only the vanilla"):
        export_draft(ExportJob(ckpt, "vllm", tmp_path / "out"))
    _no_leftovers(tmp_path / "out")
    assert export_main(["--checkpoint", str(ckpt), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    export_draft(ExportJob(ckpt, "sglang", tmp_path / "out-sglang"))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_refuses_aux_layer_equal_to_last_target_layer(tmp_path, kind):
    """The target has 4 layers: HF layer-output id 3 is its last layer. Engines capture id k as the input of layer
    k+1, which does not exist for it, and speculators' DFlash converter drops it: refused for both engines."""
    if kind == "eagle3":
        ckpt = make_eagle3_draft(tmp_path / "d", layer_ids=(0, 1, 3))
    else:
        ckpt = make_block_draft(tmp_path / "d", markov_rank=8 if kind == "dspark" else 0,
                                sample_from_anchor=kind == "dspark", layer_ids=(0, 2, 3))
    for to in ("sglang", "vllm"):
        with pytest.raises(ValueError, match=r"includes 3, the target's last decoder layer.*below 3"):
            export_draft(ExportJob(ckpt, to, tmp_path / f"out-{to}"))
        _no_leftovers(tmp_path / f"out-{to}")


# ---------------------------------------------------------------------------------------------------------------------
# SGLang's own model classes load the exports


SGLANG_CASES = {  # name -> (builder kwargs or "eagle3", SGLang class, env)
    "eagle3": ("eagle3", "LlamaForCausalLMEagle3", {}),
    "dflash": (dict(markov_rank=0, sample_from_anchor=False), "DFlashDraftModel", {}),
    "dspark-vanilla": (dict(markov_rank=8), "Qwen3DSparkModel", {}),
    "dspark-gated-conf": (dict(markov_rank=8, head_type="gated", confidence=True), "Qwen3DSparkModel",
                          {"SGLANG_RAGGED_VERIFY_MODE": "compact"}),
    "dspark-rnn-1+N": (dict(markov_rank=8, head_type="rnn", sample_from_anchor=False), "Qwen3DSparkModel", {}),
}


@pytest.fixture(scope="module")
def sglang_results(tmp_path_factory):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps "
                    "-r requirements-sglang-cpu-test.txt")
    base = tmp_path_factory.mktemp("sglang")
    jobs = []
    for name, (build, cls, env) in SGLANG_CASES.items():
        ckpt = make_eagle3_draft(base / f"{name}-ckpt") if build == "eagle3" else \
            make_block_draft(base / f"{name}-ckpt", **build)
        out = export_draft(ExportJob(ckpt, "sglang", base / f"{name}-sglang"))
        jobs.append({"name": name, "path": str(out), "cls": cls, "env": env})
    proc = subprocess.run([sys.executable, __file__, "--sglang-load", json.dumps(jobs)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang load subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", list(SGLANG_CASES))
def test_sglang_loads_export(sglang_results, name):
    r = sglang_results[name]
    assert r["error"] is None, r["error"]
    assert r["num_params"] > 0
    assert r["unchanged"] == r["allowed_unchanged"], f"parameters not loaded: {r['unchanged']}"
    assert r["loaded"] == r["num_params"] - len(r["allowed_unchanged"])
    assert r["mismatched"] == [], f"loaded values differ from the export: {r['mismatched']}"
    assert r["shape_errors"] == [], r["shape_errors"]
    if name == "eagle3":
        assert r["hot_token_id_ok"]
    if name == "dflash":
        assert r["block_size"] == 5  # SGLang resolved the 1+N verify width gamma+1 from dflash_config
    if name.startswith("dspark"):
        assert r["gamma"] == 4 and r["sample_from_anchor"] == ("1+N" not in name)
    if name == "dspark-gated-conf":
        assert any(p.startswith("confidence_head.") for p in r["checked"])
    if name.startswith("dspark"):
        assert any(p.startswith("markov_head.") for p in r["checked"])


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess side: build SGLang's classes and load the exports (run as `python tests/test_export.py --sglang-load`)


def _expected_tensor(param_name: str, exported: dict[str, torch.Tensor]):
    """The exported tensor(s) SGLang's parameter `param_name` should hold after load_weights (fused q/k/v, gate/up)."""
    name = param_name.removeprefix("model.")
    alias = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else None

    def get(n):
        if n in exported:
            return exported[n]
        if alias is not None:
            a = n.replace("layers.0.", "midlayer.", 1)
            if a in exported:
                return exported[a]
        return None

    if ".qkv_proj." in name:
        parts = [get(name.replace("qkv_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        return None if any(p is None for p in parts) else torch.cat(parts, 0)
    if ".gate_up_proj." in name:
        parts = [get(name.replace("gate_up_proj", p)) for p in ("gate_proj", "up_proj")]
        return None if any(p is None for p in parts) else torch.cat(parts, 0)
    return get(name)


def _sglang_load(jobs: list[dict]) -> dict:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_cpu_stub

    sglang_cpu_stub.install()
    from sglang.srt.utils.hf_transformers.config import get_config

    sglang_cpu_stub.init_single_process_dist()
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.dspark import Qwen3DSparkModel
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    classes = {c.__name__: c for c in (DFlashDraftModel, Qwen3DSparkModel, LlamaForCausalLMEagle3)}
    results = {}
    for job in jobs:
        saved_env = {k: os.environ.get(k) for k in job["env"]}
        os.environ.update(job["env"])
        try:
            cfg = get_config(job["path"], trust_remote_code=False)
            assert cfg.architectures[0] == job["cls"], cfg.architectures
            torch.manual_seed(0)
            model = classes[job["cls"]](cfg)
            params = dict(model.named_parameters())
            # SGLang allocates parameters with torch.empty: fill a sentinel so "changed by loading" is well defined.
            sentinel = -7.25
            with torch.no_grad():
                for v in params.values():
                    v.fill_(sentinel)
            exported = load_file(str(Path(job["path"]) / "model.safetensors"))
            model.load_weights(list(exported.items()))
            changed = sorted(k for k, v in params.items() if not (v.detach() == sentinel).all())
            partially = sorted(k for k, v in params.items() if k in changed and (v.detach() == sentinel).any()
                               and not k.endswith("lm_head.weight"))  # lm_head: vocab padding rows stay
            assert not partially, f"partially loaded parameters: {partially}"
            unchanged = sorted(set(params) - set(changed))
            mismatched, shape_errors, checked = [], [], []
            for k, v in params.items():
                want = _expected_tensor(k, exported)
                if want is None:
                    continue
                checked.append(k.removeprefix("model."))
                got = v.detach()
                if k.endswith("lm_head.weight") and got.shape[0] > want.shape[0] and got.shape[1:] == want.shape[1:]:
                    got = got[: want.shape[0]]  # SGLang's ParallelLMHead pads the vocab rows (to a multiple of 64)
                if tuple(want.shape) != tuple(got.shape):
                    shape_errors.append(f"{k}: {tuple(got.shape)} vs export {tuple(want.shape)}")
                elif not torch.equal(got.float(), want.float()):
                    mismatched.append(k)
            # SGLang shares the target's embedding with an EAGLE3 draft: its own embed_tokens is never loaded.
            allowed = sorted(k for k in params if k.removeprefix("model.") == "embed_tokens.weight")
            result = {"error": None, "num_params": len(params), "loaded": len(changed), "unchanged": unchanged,
                      "allowed_unchanged": allowed, "mismatched": mismatched, "shape_errors": shape_errors,
                      "checked": checked, "block_size": getattr(model, "block_size", None),
                      "gamma": getattr(model, "gamma", None),
                      "sample_from_anchor": getattr(model, "sample_from_anchor", None)}
            if job["cls"] == "LlamaForCausalLMEagle3":
                d2t = exported["d2t"]
                result["hot_token_id_ok"] = bool(torch.equal(model.hot_token_id.cpu(),
                                                             d2t + torch.arange(d2t.numel())))
        except Exception as exc:  # reported per case to the parent test
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results[job["name"]] = result
    return results


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sglang-load":
    print("RESULT " + json.dumps(_sglang_load(json.loads(sys.argv[2]))), flush=True)
