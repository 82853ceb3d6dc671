"""SGLang 0.5.23's own code as the oracle for what we export: same weights, same inputs, same numbers.

test_export.py checks that SGLang *loads* every tensor of an export; here SGLang *computes* with it:
  * every head a DSpark export carries (vanilla, gated and rnn Markov heads; the confidence head with the STS
    temperatures of our sts.json) runs in SGLang's classes (`Qwen3DSparkModel.markov_head.step_bias`, stepped left
    to right as SGLang's drafting loop does, and `confidence_head.predict`) and in ours, on the same draft states and
    tokens, and the outputs must agree to float32 rounding;
  * SGLang's SPS loader reads our sps_table.json and its `SpsCostTable.lookup` equals our scheduler's `SpsTable.sps`;
  * the serve command `export/main.py` prints for a DSpark checkpoint goes through SGLang's own argument parser
    (`prepare_server_args`) with the ragged-verify mode it sets, and the files it names load in SGLang's readers.

SGLang runs in a subprocess (this file executed as a script) with tests/sglang_cpu_stub.py standing in for the
native `sgl_kernel`, like test_export.py; skipped when sglang is not installed
(`pip install --no-deps -r requirements-sglang-cpu-test.txt`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from eval.calibration import cumulative_confidence  # noqa: E402
from export.convert import ExportJob, export_draft  # noqa: E402
from export.main import main as export_main  # noqa: E402
from export.serving import SpsTable, save_sts  # noqa: E402
from modeling.dspark import DSparkModel, build_dspark_config  # noqa: E402
from modeling.registry import load_draft_model, save_draft  # noqa: E402

VOCAB, HIDDEN, GAMMA, RANK, BATCH = 96, 32, 4, 8, 3
HEADS = ("vanilla", "gated", "rnn")
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"  # SGLang's name (sglang/srt/environ.py)
STS_TEMPERATURES = [0.7, 1.3, 2.0, 0.9]
# The example: B=31 lies between the probes 16 and 32, so SGLang uses 950 (probe 16) and interpolation 528.
# The last probe reaches SGLang's largest verify batch, 48 running requests x (GAMMA+1) = 240: a table that stops
# short of it is not shipped (export/serving.py check_sps_range).
SPS_TABLE = SpsTable((8, 16, 32, 64, 240), (1000.0, 950.0, 500.0, 480.0, 300.0), 256)
SPS_QUERIES = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 239, 240, 256, 257, 1000]


def _target_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                       rms_norm_eps=1e-6)


def make_dspark_checkpoint(path: Path, head: str, seed: int = 0) -> Path:
    """A tiny DSpark draft with a `head` Markov head, the confidence head, an sts.json and an sps_table.json."""
    torch.manual_seed(seed)
    config = build_dspark_config(_target_config(), num_layers=1, block_size=GAMMA, target_layer_ids=[0, 2],
                                 mask_token_id=5, markov_rank=RANK, markov_head_type=head,
                                 enable_confidence_head=True)
    model = DSparkModel(config)
    with torch.no_grad():  # zero biases and N(0, 0.02) weights give near-zero heads: make every output non-trivial
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    save_draft(model, path)
    save_sts(path / "sts.json", STS_TEMPERATURES, dataset="unit-test", num_samples=10)
    SPS_TABLE.save(path / "sps_table.json")
    return path


def _block_inputs(seed: int = 0):
    """Draft states h_k and tokens of `BATCH` blocks: prev[:, 0] is the anchor, prev[:, k] the draft k that
    prediction k+1 is conditioned on, draft[:, k] = prev[:, k+1] (and one more token at the end)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, GAMMA, HIDDEN, generator=g)
    tokens = torch.randint(0, VOCAB, (BATCH, GAMMA + 1), generator=g)
    return hidden, tokens[:, :GAMMA], tokens[:, 1:]


@pytest.fixture(scope="module")
def sglang_oracle(tmp_path_factory):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed: pip install --no-deps -r requirements-sglang-cpu-test.txt")
    base = tmp_path_factory.mktemp("oracle")
    hidden, prev, draft = _block_inputs()
    torch.save({"hidden": hidden, "prev": prev, "draft": draft}, base / "inputs.pt")
    jobs, ours = [], {}
    for head in HEADS:
        ckpt = make_dspark_checkpoint(base / f"{head}-ckpt", head)
        out = export_draft(ExportJob(ckpt, "sglang", base / f"{head}-sglang"))
        jobs.append({"name": head, "path": str(out), "result": str(base / f"{head}-sglang.pt")})
        model = load_draft_model(ckpt)
        with torch.no_grad():
            z = model.confidence_logits(hidden, prev)
            temps = torch.tensor(STS_TEMPERATURES)
            ours[head] = {"bias": model.markov_head(hidden, prev), "confidence": torch.sigmoid(z / temps),
                          "survival": torch.from_numpy(cumulative_confidence(z, STS_TEMPERATURES)).float()}

    # The serve command exactly as `python export/main.py` prints it for the vanilla checkpoint.
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        assert export_main(["--checkpoint", str(base / "vanilla-ckpt"), "--to", "sglang",
                            "--out", str(base / "cli-export"), "--verifier", "Qwen/Qwen3-8B"]) == 0
    request = {"jobs": jobs, "inputs": str(base / "inputs.pt"), "sps_queries": SPS_QUERIES,
               "sps_path": str(base / "vanilla-ckpt" / "sps_table.json"), "printed": printed.getvalue(),
               "cli_export": str(base / "cli-export")}
    proc = subprocess.run([sys.executable, __file__, "--sglang-oracle", json.dumps(request)], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"SGLang subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    report = json.loads(lines[-1][len("RESULT "):])
    sglang = {job["name"]: torch.load(job["result"]) for job in jobs}
    return {"ours": ours, "sglang": sglang, "report": report, "base": base}


@pytest.mark.parametrize("head", HEADS)
def test_markov_head_bias_matches_sglang(sglang_oracle, head):
    """Same weights (through our export and SGLang's load_weights), same h_k and previous tokens: the logit bias of
    every prediction k equals SGLang's step-by-step `step_bias`. Before the rnn fix it differed by logits, not
    rounding: our rnn head used the gate the other way round and added the state inside the output tanh."""
    ours, theirs = sglang_oracle["ours"][head]["bias"], sglang_oracle["sglang"][head]["bias"]
    assert ours.shape == theirs.shape == (BATCH, GAMMA, VOCAB)
    assert theirs.abs().max() > 0.5  # a real bias, not a trivially agreeing zero
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_confidence_with_sts_matches_sglang(sglang_oracle, head):
    """Confidence head + the temperatures of our sts.json, as SGLang applies them (`predict`: sigmoid(z_k / T_k)),
    and the survival a_k = prod c_i our scheduler plans with."""
    ours, theirs = sglang_oracle["ours"][head], sglang_oracle["sglang"][head]
    assert theirs["sts_temperatures"].tolist() == pytest.approx(STS_TEMPERATURES)
    torch.testing.assert_close(ours["confidence"], theirs["confidence"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours["survival"], torch.cumprod(theirs["confidence"], dim=-1), atol=1e-6, rtol=1e-5)
    assert float(theirs["confidence"].std()) > 0.1  # spread out, not saturated at 0 or 1 where anything agrees


def test_sps_lookup_equals_sglang(sglang_oracle):
    """SGLang's loader reads our sps_table.json, and its lookup is our scheduler's: floor to the lower probe, clamp
    at both ends (interpolating gave 528 instead of 950 at B=31)."""
    report = sglang_oracle["report"]["sps"]
    assert report["table"] == SPS_TABLE.to_json()
    theirs = dict(zip(SPS_QUERIES, report["lookup"]))
    assert theirs[31] == 950.0 and SPS_TABLE.sps(31) == 950.0
    assert {b: SPS_TABLE.sps(b) for b in SPS_QUERIES} == theirs  # incl. past the last probe and max_batch_tokens


def test_printed_serve_command_is_accepted_by_sglang(sglang_oracle, capsys):
    """`python export/main.py` on a DSpark checkpoint prints a command with the ragged-verify mode that makes SGLang
    build the confidence head, the STS file and the SPS table; SGLang's own parser accepts it and its loaders read
    both files."""
    report = sglang_oracle["report"]["serve"]
    assert report["error"] is None, report["error"]
    out = sglang_oracle["base"] / "cli-export"
    assert report["args"]["speculative_dspark_sps_table_path"] == str(out / "sps_table.json")
    assert report["env"] == {RAGGED_VERIFY_ENV: "compact"} and report["mode"] == "compact"
    assert report["confidence_head_built"]
    assert report["args"]["speculative_algorithm"].upper() == "DSPARK"
    assert report["args"]["speculative_draft_model_path"] == str(out)
    assert report["args"]["speculative_dspark_confidence_sts_path"] == str(out / "sts.json")
    assert report["args"]["speculative_dspark_sps_table_path"] == str(out / "sps_table.json")
    assert report["args"]["model_path"] == "Qwen/Qwen3-8B"
    # the draft's dtype (no target config to read here: the draft's own, float32) as SGLang's GPU kernels run it,
    # bfloat16, and a backend with ragged verify
    assert (report["args"]["dtype"], report["args"]["attention_backend"]) == ("bfloat16", "fa3")
    assert report["sts_temperatures"] == pytest.approx(STS_TEMPERATURES)
    assert report["sps_max_batch_tokens"] == SPS_TABLE.max_batch_tokens


# ---------------------------------------------------------------------------------------------------------------------
# Subprocess side (`python tests/test_sglang_oracle.py --sglang-oracle REQUEST`)


def _set_environ(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _environ(env: dict[str, str | None]):
    """os.environ with `env` applied (None: unset) inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in env}
    _set_environ(env)
    try:
        yield
    finally:
        _set_environ(saved)


def _printed_command(stderr: str) -> tuple[dict[str, str], list[str]]:
    """(env assignments, argv after `python -m sglang.launch_server`) of the command export/main.py printed after
    `serve it with:`."""
    words = shlex.split(stderr.split("serve it with:\n", 1)[1].splitlines()[0])
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    rest = words[words.index("python"):]
    assert rest[:3] == ["python", "-m", "sglang.launch_server"], rest[:3]
    return env, rest[3:]


def _sglang_side(request: dict) -> dict:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[RAGGED_VERIFY_ENV] = "compact"  # builds the confidence head (static, the default, does not)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_cpu_stub

    sglang_cpu_stub.install()
    from sglang.srt.utils.hf_transformers.config import get_config

    sglang_cpu_stub.init_single_process_dist()
    from safetensors.torch import load_file
    from sglang.srt.models.dspark import Qwen3DSparkModel
    from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path
    from sglang.srt.speculative.dspark_components.dspark_sts import load_sts_calibration_from_path

    inputs = torch.load(request["inputs"])
    hidden, prev, draft = inputs["hidden"], inputs["prev"], inputs["draft"]
    for job in request["jobs"]:
        path = Path(job["path"])
        model = Qwen3DSparkModel(get_config(str(path), trust_remote_code=False))
        model.load_weights(list(load_file(str(path / "model.safetensors")).items()))
        head, conf = model.markov_head, model.confidence_head
        with torch.no_grad():
            # SGLang's drafting loop: one step per position, the state threaded through (rnn), prev = anchor/drafts.
            state, biases = head.init_state(hidden), []
            for k in range(hidden.shape[1]):
                bias, state = head.step_bias(prev[:, k], hidden_states=hidden[:, k], state=state)
                biases.append(bias)
            # What SGLang's planner does with --speculative-dspark-confidence-sts-path.
            conf.sts_temperatures = torch.tensor(load_sts_calibration_from_path(str(path / "sts.json")).temperatures,
                                                 dtype=torch.float32)
            confidence, _ = conf.predict(hidden.reshape(-1, hidden.shape[-1]), anchor_tokens=prev[:, 0],
                                         draft_tokens=draft, markov_head=head)
        torch.save({"bias": torch.stack(biases, dim=1), "confidence": confidence,
                    "sts_temperatures": conf.sts_temperatures}, job["result"])

    table = load_sps_table_from_path(request["sps_path"])
    sps = {"table": {"sample_batch_tokens": list(table.sample_batch_tokens),
                     "sample_steps_per_sec": list(table.sample_steps_per_sec),
                     "max_batch_tokens": table.max_batch_tokens},
           "lookup": [table.lookup(b) for b in request["sps_queries"]]}
    return {"sps": sps, "serve": _parse_serve_command(request, Qwen3DSparkModel, get_config)}


def _parse_serve_command(request: dict, model_class, get_config) -> dict:
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path
    from sglang.srt.speculative.dspark_components.dspark_sts import load_sts_calibration_from_path
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

    try:
        env, argv = _printed_command(request["printed"])
        # SGLang's default (static) unless the printed command sets it
        with _environ({RAGGED_VERIFY_ENV: None, **env}):
            args = prepare_server_args(argv)  # SGLang's own argparse + ServerArgs; an unknown flag exits here
            mode = read_ragged_verify_mode().value
            draft = model_class(get_config(request["cli_export"], trust_remote_code=False))
        names = ("speculative_algorithm", "speculative_draft_model_path", "speculative_dspark_confidence_sts_path",
                 "speculative_dspark_sps_table_path", "model_path", "dtype", "attention_backend")
        sts_path, sps_path = args.speculative_dspark_confidence_sts_path, args.speculative_dspark_sps_table_path
        return {"error": None, "env": env, "mode": mode, "confidence_head_built": draft.confidence_head is not None,
                "args": {n: getattr(args, n) for n in names},
                "sts_temperatures": list(load_sts_calibration_from_path(sts_path).temperatures) if sts_path else None,
                "sps_max_batch_tokens": load_sps_table_from_path(sps_path).max_batch_tokens if sps_path else None}
    except BaseException as exc:  # reported to the parent test (argparse exits with SystemExit on a bad flag)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sglang-oracle":
    print("RESULT " + json.dumps(_sglang_side(json.loads(sys.argv[2]))), flush=True)
