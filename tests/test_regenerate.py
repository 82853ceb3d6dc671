"""The OpenAI-compatible regeneration backend against real HTTP servers on loopback (two = data parallel), the
handling of failed requests (retried, redone by the next run, never marked done), over-long prompts and answers cut
at the token limit, and the stage's refusals: nothing regenerated, a prompt file edited between two runs."""

import json
import os
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import carries
from data.regen import backends as regen_backends
from data.regen import regenerate
from data.sources.rows import Prompt
from data.regen.backends import Answer, OpenAIBackend
from data.regen.regenerate import RegenJob, regenerate_chunk, run_regenerate
from core.dist import Dist
from core.recipe import load_recipe
from core.stage import StageMismatchError

DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


class _ChatServer:
    """A minimal /v1/chat/completions server: answers 'echo <n>: <last user text>' (finish_reason 'length' when that
    text holds 'LONG'), HTTP 500 on 'FAIL'. `plan`: the statuses each distinct request gets before its answer, a 429
    with `Retry-After: retry_after`; `down_on`: HTTP 503 for every request whose last text holds it; `hold`: an
    Event every request waits for (at most a minute) before it is answered."""

    def __init__(self, plan=(), retry_after="1", down_on=None, hold=None):
        self.requests = []
        self.attempts = Counter()
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if hold is not None:
                    hold.wait(60)
                last = body["messages"][-1]["content"]
                with lock:
                    attempt = outer.attempts[json.dumps(body["messages"])]
                    outer.attempts[json.dumps(body["messages"])] += 1
                if attempt < len(plan):
                    status = plan[attempt]
                    self.reply(status, b"slow down" if status == 429 else b"overloaded",
                               {"Retry-After": retry_after} if status == 429 else {})
                elif "FAIL" in last:
                    self.reply(500, b"internal error: model exploded")
                elif down_on and down_on in last:
                    self.reply(503, b"service unavailable")
                else:
                    turn = sum(m["role"] == "user" for m in body["messages"])
                    finish = "length" if "LONG" in last else "stop"
                    reply = {"choices": [{"message": {"role": "assistant", "content": f"echo {turn}: {last}"},
                                          "finish_reason": finish}]}
                    self.reply(200, json.dumps(reply).encode(), {"Content-Type": "application/json"})

            def reply(self, status, data, headers=None):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    pair = [_ChatServer(), _ChatServer()]
    yield pair
    for server in pair:
        server.close()


def test_openai_backend_replays_turns_across_two_servers(servers, qwen3_tokenizer):
    urls = [s.url for s in servers]
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=openai", f"regen.server_urls={json.dumps(urls)}",
                                             "regen.max_new_tokens=32", "regen.request_attempts=2"])
    backend = OpenAIBackend(qwen3_tokenizer, recipe.regen, "Qwen/Qwen3-8B")
    prompts = [Prompt(id=f"p{i}", turns=(f"hello {i}", f"again {i}"), source="t") for i in range(3)]
    prompts.append(Prompt(id="bad", turns=("please FAIL",), source="t"))
    prompts.append(Prompt(id="cut", turns=("a LONG one", "never asked"), source="t"))
    records, errors, tokens = regenerate_chunk(backend, prompts, recipe, chunk_seed=7)

    assert [r["id"] for r in records] == ["p0", "p1", "p2", "cut"]
    # finish_reason 'length': the answer was cut, which ends the conversation
    assert [m["content"] for m in records[3]["conversations"]] == ["a LONG one", "echo 1: a LONG one"]
    assert [r["truncated"] for r in records] == [False, False, False, True]
    conv = records[1]["conversations"]
    assert [m["content"] for m in conv] == ["hello 1", "echo 1: hello 1", "again 1", "echo 2: again 1"]
    assert records[1]["response_ids"][0] == qwen3_tokenizer.encode("echo 1: hello 1", add_special_tokens=False)
    assert tokens == sum(len(ids) for r in records for ids in r["response_ids"])
    # the failure is reported with the server's reason, after the retries, as the server's (asked again next run)
    assert errors == [{"id": "bad", "source": "t", "reason": errors[0]["reason"], "retryable": True}]
    assert "HTTP 500" in errors[0]["reason"] and "model exploded" in errors[0]["reason"]
    assert sum("FAIL" in b["messages"][-1]["content"] for s in servers for _, b in s.requests) == 2
    # data parallel: both servers got work; the request carries the recipe's sampling settings
    assert all(s.requests for s in servers)
    path, body = servers[0].requests[0]
    assert path == "/v1/chat/completions"
    assert body["model"] == "Qwen/Qwen3-8B" and body["max_tokens"] == 32 and body["top_k"] == 20
    assert body["temperature"] == 0.7 and body["chat_template_kwargs"] == {"enable_thinking": False}
    # turn 2 was asked with the server's own first answer as context
    second_turns = [b for s in servers for _, b in s.requests if len(b["messages"]) == 3]
    assert {b["messages"][1]["content"] for b in second_turns} >= {"echo 1: hello 0", "echo 1: hello 2"}


def test_unreachable_server_is_an_error_record(qwen3_tokenizer):
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=openai", f"regen.server_urls=['{DEAD_URL}']",
                                             "regen.request_timeout_s=2", "regen.request_attempts=1"])
    backend = OpenAIBackend(qwen3_tokenizer, recipe.regen, "m")
    records, errors, _ = regenerate_chunk(backend, [Prompt(id="x", turns=("hi",))], recipe, chunk_seed=0)
    assert records == [] and errors[0]["id"] == "x" and "ConnectionError" in errors[0]["reason"]
    assert errors[0]["retryable"]


def _ask(server, tokenizer, text="hi"):
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=openai", f"regen.server_urls=['{server.url}']"])
    return OpenAIBackend(tokenizer, recipe.regen, "m").generate([[{"role": "user", "content": text}]], seed=0)[0]


def test_openai_backend_retries_server_errors_and_rate_limits_honouring_retry_after(qwen3_tokenizer, monkeypatch,
                                                                                    drill):
    """HTTP 5xx and 429 are asked again (3 attempts, the recipe's default), after the server's Retry-After when it
    sends one (capped at 30 s); any other 4xx is the request's own fault and is not."""
    drill("server", "regeneration server: 5xx, then 429 with Retry-After")
    sleeps = []
    monkeypatch.setattr("data.regen.backends.time.sleep", sleeps.append)
    flaky = _ChatServer(plan=(500, 429), retry_after="7")
    capped = _ChatServer(plan=(429,), retry_after="3600")
    refused = _ChatServer(plan=(400, 400, 400))
    try:
        answer = _ask(flaky, qwen3_tokenizer)
        assert (answer.text, answer.error, len(flaky.requests)) == ("echo 1: hi", None, 3)
        assert sleeps == [0.5, 7.0]  # the exponential backoff after the 500, the server's wait after the 429
        sleeps.clear()
        assert _ask(capped, qwen3_tokenizer).error is None and sleeps == [30.0]
        answer = _ask(refused, qwen3_tokenizer)
        assert len(refused.requests) == 1 and "HTTP 400" in answer.error and not answer.retryable
    finally:
        for server in (flaky, capped, refused):
            server.close()


class _LengthLimited:
    """A backend whose prompts stop fitting at turn 2 for 'long' and at turn 1 for 'huge'."""

    def generate(self, conversations, seed):
        out = []
        for messages in conversations:
            turn = sum(m["role"] == "user" for m in messages)
            last = messages[-1]["content"]
            if (last.startswith("long") and turn == 2) or last.startswith("huge"):
                out.append(Answer(error="prompt is too long", too_long=True))
            else:
                out.append(Answer(text=f"ok {turn}", token_ids=[1, 2]))
        return out


def test_over_long_later_turn_ends_the_conversation_and_over_long_first_turn_fails_it():
    recipe = load_recipe("dspark_smollm2_135m")
    prompts = [Prompt(id="a", turns=("short", "long second")), Prompt(id="b", turns=("huge",))]
    records, errors, tokens = regenerate_chunk(_LengthLimited(), prompts, recipe, chunk_seed=0)
    assert [r["id"] for r in records] == ["a"]
    assert [m["content"] for m in records[0]["conversations"] if m["role"] != "system"] == ["short", "ok 1"]
    assert errors == [{"id": "b", "source": "", "reason": "turn 0: prompt is too long", "skipped": True}]
    assert tokens == 2


def test_source_backend_keeps_the_sources_answers_and_generates_nothing():
    """regen.backend: source (EAGLE's fixed data): each turn's answer is the source's own; a conversation ends at the
    first turn without one, and a prompt without any fails, named."""
    from types import SimpleNamespace

    from data.regen.backends import SourceBackend

    recipe = load_recipe("dspark_smollm2_135m", ["regen.backend=source", "loss.ce_labels=target", "data.max_turns=2"])
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [len(w) for w in text.split()])
    prompts = [Prompt(id="two", turns=("q1", "q2", "q3"), answers=("a b", "c d e", "f")),
               Prompt(id="one", turns=("q1", "q2"), answers=("g h i j",)),
               Prompt(id="none", turns=("q1",))]
    records, errors, tokens = regenerate_chunk(SourceBackend(tokenizer), prompts, recipe, chunk_seed=0)
    assert [r["id"] for r in records] == ["two", "one"]
    assert [(m["role"], m["content"]) for m in records[0]["conversations"] if m["role"] != "system"] == [
        ("user", "q1"), ("assistant", "a b"), ("user", "q2"), ("assistant", "c d e")]  # data.max_turns=2
    assert [m["content"] for m in records[1]["conversations"] if m["role"] != "system"] == ["q1", "g h i j"]
    assert records[0]["response_ids"] == [[1, 1], [1, 1, 1]]
    assert tokens == 2 + 3 + 4
    assert [e["id"] for e in errors] == ["none"] and "has no answer" in errors[0]["reason"]


def test_source_answers_need_target_labels_for_block_drafters():
    from core.recipe import RecipeError

    with pytest.raises(RecipeError, match="loss.ce_labels=target"):
        load_recipe("dflash_smollm2_135m", ["regen.backend=source"])
    load_recipe("eagle3_smollm2_135m", ["regen.backend=source"])  # Eagle3 learns the target's distribution anyway


def test_recipe_asking_for_more_prompts_than_its_sources_hold_is_refused_before_regeneration(tmp_path):
    """data.allow_fewer false (the default): the stage refuses before it pins its folder or loads the target, so the
    fixed recipe runs in the same --out."""
    from types import SimpleNamespace

    from data.regen.regenerate import RegenJob, run_regenerate

    prompts = tmp_path / "five.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"question {i}"]}) + "\n" for i in range(5)))
    recipe = load_recipe("dspark_smollm2_135m", [f"data.sources=[{{name: '{prompts}'}}]", "data.num_prompts=8",
                                                 "data.holdout_fraction=0.0"])
    dist = SimpleNamespace(is_main=True, rank=0, print=print, mine=lambda xs: list(xs))

    def no_target():
        raise AssertionError("the target must not be loaded for a recipe that is refused")

    out = tmp_path / "regen"
    with pytest.raises(ValueError, match=r"asked for 8 prompts, but .*five\.jsonl' holds 5 .*data\.allow_fewer"):
        run_regenerate(RegenJob(recipe, out, dist, no_target, tokenizer=None))
    assert not (out.exists() and any(out.iterdir())), "the refused stage pinned or wrote something"


class _Truncating:
    """A backend whose answer to a text starting with 'cut' stops at the token limit."""

    def generate(self, conversations, seed):
        return [Answer(text="partial", token_ids=[1], truncated=messages[-1]["content"].startswith("cut"))
                for messages in conversations]


def test_a_truncated_answer_ends_the_conversation_and_marks_the_record():
    recipe = load_recipe("dspark_smollm2_135m")
    prompts = [Prompt(id="first", turns=("cut at once", "never asked")), Prompt(id="later", turns=("ok", "cut now")),
               Prompt(id="whole", turns=("ok", "fine"))]
    records, errors, _ = regenerate_chunk(_Truncating(), prompts, recipe, chunk_seed=0)
    users = {r["id"]: [m["content"] for m in r["conversations"] if m["role"] == "user"] for r in records}
    assert users == {"first": ["cut at once"], "later": ["ok", "cut now"], "whole": ["ok", "fine"]}
    assert {r["id"]: r["truncated"] for r in records} == {"first": True, "later": True, "whole": False}
    assert errors == []


class _WithEos:
    """A tokenizer whose eos is another token."""

    def __init__(self, tokenizer, eos_token_id):
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_hf_backend_marks_an_answer_that_reached_max_new_tokens_as_truncated(tiny_qwen3, qwen3_tokenizer):
    from data.regen.backends import HFBackend
    from modeling.target import load_target

    recipe = load_recipe("dspark_qwen3_8b", ["regen.temperature=0", "regen.max_new_tokens=4"])
    model = load_target(str(tiny_qwen3))  # the real Qwen3 tokenizer's
    messages = [{"role": "user", "content": "Count to ten."}]
    cut = HFBackend(model, qwen3_tokenizer, recipe.regen, max_length=128).generate([messages], seed=0)[0]
    assert cut.truncated and len(cut.token_ids) == 4  # the random tiny model never says its eos in 4 tokens
    # the same greedy answer, with its second token as eos: it ends there, within the limit
    ending = _WithEos(qwen3_tokenizer, cut.token_ids[1])
    ended = HFBackend(model, ending, recipe.regen, max_length=128).generate([messages], seed=0)[0]
    assert not ended.truncated
    assert ended.token_ids == cut.token_ids[: cut.token_ids.index(cut.token_ids[1]) + 1]


def test_hf_backend_limits_each_answer_by_its_own_prompt_not_the_batchs_longest(tiny_qwen3, qwen3_tokenizer):
    """data.max_length bounds prompt + answer per conversation: a short prompt batched with one near the limit still
    gets regen.max_new_tokens (it used to get max_length minus the longest prompt, for every row)."""
    from data.chat import render_prompt_ids
    from data.regen.backends import HFBackend
    from modeling.target import load_target

    recipe = load_recipe("dspark_qwen3_8b", ["regen.temperature=0", "regen.max_new_tokens=12"])
    backend = HFBackend(load_target(str(tiny_qwen3)), qwen3_tokenizer, recipe.regen, max_length=64)
    short = [{"role": "user", "content": "Count to ten."}]
    long = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 4}]
    long_len = len(render_prompt_ids(qwen3_tokenizer, long, enable_thinking=False))
    assert 64 - 12 < long_len < 64 - 2
    alone = backend.generate([short], seed=0)[0]
    together = backend.generate([short, long], seed=0)
    assert [len(a.token_ids) for a in together] == [12, 64 - long_len]  # the random model never ends: both cut
    assert together[0].token_ids == alone.token_ids and all(a.truncated for a in together)


def test_a_truncated_answer_is_not_supervised_as_ended(qwen3_tokenizer):
    """The end-of-turn marker the template puts after a cut answer was never generated there: its loss mask is 0, and
    the rest of the mask is the normal one (an old record, without the key, reads as not truncated)."""
    from data.states.capture import tokenize_records

    recipe = load_recipe("dspark_qwen3_8b", ["data.min_loss_tokens=1"])
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                    {"role": "user", "content": "Tell me more"},
                    {"role": "assistant", "content": "An answer that ran into the token"}]
    (whole, old, cut), _ = tokenize_records([{"id": "whole", "conversations": conversation, "truncated": False},
                                             {"id": "old", "conversations": conversation},
                                             {"id": "cut", "conversations": conversation, "truncated": True}],
                                            qwen3_tokenizer, recipe)
    assert whole == {**old, "id": "whole"} and cut["input_ids"] == whole["input_ids"]
    ids = whole["input_ids"]
    answer_end = next(i for i in range(len(ids), 0, -1) if qwen3_tokenizer.decode(ids[:i]).endswith("the token"))
    assert qwen3_tokenizer.decode(ids[answer_end:]) == "<|im_end|>\n"
    assert whole["loss_mask"][answer_end:] == [1, 1]  # an ended answer: its end-of-turn marker is supervised
    assert cut["loss_mask"] == whole["loss_mask"][:answer_end] + [0, 0]
    assert sum(cut["loss_mask"][:answer_end]) > 8  # both answers are still supervised


# --- the stage ----------------------------------------------------------------------------------------------------


def _openai_recipe(urls, prompt_file, *sets):
    return load_recipe("dspark_qwen3_8b", ["regen.backend=openai", f"regen.server_urls={json.dumps(urls)}",
                                           f"data.sources=[{{name: '{prompt_file}'}}]", "data.num_prompts=8",
                                           "regen.batch_size=3", *sets])


def _run(recipe, out, tokenizer):
    def no_target():
        raise AssertionError("no backend here needs the target model")

    return run_regenerate(RegenJob(recipe, out, Dist(), no_target, tokenizer))


@pytest.fixture
def healthy_records(prompt_file, qwen3_tokenizer, tmp_path):
    """records.jsonl of the stage against a healthy server, and that server (to count its requests)."""
    server = _ChatServer()
    _run(_openai_recipe([server.url], prompt_file), tmp_path / "healthy", qwen3_tokenizer)
    yield (tmp_path / "healthy" / "records.jsonl").read_bytes(), server
    server.close()


def test_stage_through_failing_then_rate_limiting_server_gives_the_healthy_servers_records(
        healthy_records, prompt_file, qwen3_tokenizer, tmp_path, monkeypatch, drill):
    drill("server", "regeneration server failing, then rate-limiting, then recovering")
    sleeps = []
    monkeypatch.setattr("data.regen.backends.time.sleep", sleeps.append)
    flaky = _ChatServer(plan=(500, 429), retry_after="2")  # every request: 500, then 429, then its answer
    try:
        done = _run(_openai_recipe([flaky.url], prompt_file), tmp_path / "flaky", qwen3_tokenizer)
    finally:
        flaky.close()
    expected, healthy = healthy_records
    assert (tmp_path / "flaky" / "records.jsonl").read_bytes() == expected
    assert done["records"] == 8 and done["errors"] == 0
    assert len(flaky.requests) == 3 * len(healthy.requests) and sleeps.count(2.0) == len(healthy.requests)


def test_server_failures_are_never_marked_done_and_a_rerun_with_a_working_url_completes(
        healthy_records, prompt_file, qwen3_tokenizer, tmp_path, monkeypatch, drill):
    drill("server", "regeneration server dead, then fixed URL")
    monkeypatch.setattr("data.regen.backends.time.sleep", lambda s: None)
    out = tmp_path / "regen"
    with pytest.raises(RuntimeError, match=r"8 conversations failed on the server, in 3 of 3 chunks .*"
                                           r"ConnectionError from http://127\.0\.0\.1:9.*"
                                           r"Fix the server / regen\.server_urls and rerun: finished chunks are kept"):
        _run(_openai_recipe([DEAD_URL], prompt_file), out, qwen3_tokenizer)
    assert not (out / "DONE.json").exists()

    # a server down for one prompt only: the other chunks are finished and kept, the stage is still not done
    partly = _ChatServer(down_on="haiku")
    try:
        with pytest.raises(RuntimeError, match=r"1 conversations failed on the server, in 1 of 3 chunks.*HTTP 503"):
            _run(_openai_recipe([partly.url], prompt_file), out, qwen3_tokenizer)
    finally:
        partly.close()
    assert not (out / "DONE.json").exists() and len(list((out / "chunks").glob("chunk-*.json"))) == 2

    working = _ChatServer()
    try:
        done = _run(_openai_recipe([working.url], prompt_file), out, qwen3_tokenizer)
    finally:
        working.close()
    expected, healthy = healthy_records
    assert (out / "records.jsonl").read_bytes() == expected and done["records"] == 8
    assert not list((out / "chunks").glob("failed-*.json"))
    # only the chunk that failed was asked again
    asked = {b["messages"][0]["content"] for _, b in working.requests}
    assert any("haiku" in text for text in asked) and len(working.requests) < len(healthy.requests)


@pytest.mark.parametrize("delivered_to", ["process", "another thread"])
def test_a_stop_signal_ends_the_stage_without_waiting_for_the_answers_in_flight(prompt_file, qwen3_tokenizer,
                                                                                 tmp_path, drill, delivered_to):
    """SIGTERM (a scheduler's preemption; the vLLM backend turns it into KeyboardInterrupt) while every request hangs
    on the server: the stage stops at once, not after the chunks in flight (which could take minutes), writes no
    chunk and is not done. The kernel may hand a process's signal to any of its threads: Python then runs the handler
    in the main thread only when that thread wakes, so the stage's own waits must be short."""
    drill("stop-signal", "SIGTERM while every regeneration request hangs on the server")
    hold = threading.Event()
    slow = _ChatServer(hold=hold)

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def stop_once_asked():
        while not slow.requests:
            time.sleep(0.05)
        if delivered_to == "process":
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # this thread takes it, as a worker blocked in a read might
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, interrupt)
    out = tmp_path / "regen"
    try:
        threading.Thread(target=stop_once_asked, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _run(_openai_recipe([slow.url], prompt_file), out, qwen3_tokenizer)
        stopped_after = time.monotonic() - start
    finally:
        signal.signal(signal.SIGTERM, old)
        hold.set()
        slow.close()
    assert stopped_after < 20  # the held requests would have answered after 60 s
    assert not list((out / "chunks").glob("*.json")) and not (out / "DONE.json").exists()


def test_a_stage_that_regenerates_nothing_fails_without_marking_itself_done(qwen3_tokenizer, tmp_path, drill):
    drill("bad-input", "sources that regenerate nothing")
    no_answers = tmp_path / "no_answers.jsonl"
    no_answers.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(4)))
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=source", "loss.ce_labels=target", "data.num_prompts=4",
                                             f"data.sources=[{{name: '{no_answers}'}}]", "data.holdout_fraction=0"])
    out = tmp_path / "failed"
    with pytest.raises(ValueError, match=r"no conversation was regenerated from data.sources \['.*no_answers\.jsonl'\]"
                                         r": all 4 prompts failed.*the source has no answer"):
        _run(recipe, out, qwen3_tokenizer)
    assert not (out / "DONE.json").exists()

    blank = tmp_path / "blank.jsonl"
    blank.write_text("".join(json.dumps({"prompt": " "}) + "\n" for _ in range(4)))
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=source", "loss.ce_labels=target", "data.allow_fewer=true",
                                             f"data.sources=[{{name: '{blank}'}}]", "data.num_prompts=4"])
    with pytest.raises(ValueError, match=r"no prompt was loaded from data.sources \['.*blank\.jsonl'\]"), \
            pytest.warns(UserWarning, match="has only 0 train prompts"):
        _run(recipe, tmp_path / "empty", qwen3_tokenizer)
    assert not (tmp_path / "empty").exists()


class _Killed(Exception):
    pass


def test_a_prompt_file_edited_between_two_runs_is_refused(prompt_file, qwen3_tokenizer, tmp_path, monkeypatch, drill):
    drill("bad-input", "prompt file edited before a resume")
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(prompt_file, prompts)
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=source", "loss.ce_labels=target", "data.num_prompts=8",
                                             f"data.sources=[{{name: '{prompts}'}}]", "regen.batch_size=3"])
    out = tmp_path / "regen"

    def killed_after_chunk_0(name, index):
        if index == 0:
            raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(regenerate, "fault_point", killed_after_chunk_0)
        with pytest.raises(_Killed):
            _run(recipe, out, qwen3_tokenizer)
    assert (out / "chunks" / "chunk-00000.json").is_file() and not (out / "DONE.json").exists()

    original = prompts.read_text()
    prompts.write_text(original.replace("what is 3 + 3?", "what is 3 + 4?"))
    with pytest.raises(StageMismatchError, match=r"prompts_sha256: '[0-9a-f]+' in the folder, '[0-9a-f]+' now"
                                                 r"(.|\n)*The prompts changed"):
        _run(recipe, out, qwen3_tokenizer)

    prompts.write_text(original)  # restored: the run resumes
    assert _run(recipe, out, qwen3_tokenizer)["records"] > 0
    prompts.unlink()  # a finished folder is skipped without reading its prompts
    assert _run(recipe, out, qwen3_tokenizer) == json.loads((out / "DONE.json").read_text())


# --- regen.backend: vllm (a real vLLM server this stage starts; `make venv-vllm`) ------------------------------------


def test_vllm_backend_serves_the_target_itself_and_regenerates_the_hf_backends_answers(vllm_python, prompt_file,
                                                                                       tmp_path, monkeypatch):
    """The stage starts a vLLM server for the real SmolLM2 target, sends each turn as the HF backend's token ids and
    keeps the ids vLLM returns: the greedy answers equal the HF backend's token for token, over two turns; the server
    and all its processes are gone when the stage ends, and its start-up time is in DONE.json."""
    from core.server_procs import tagged_processes
    from modeling.target import load_target, load_tokenizer

    sets = [f"data.sources=[{{name: '{prompt_file}'}}]", "data.num_prompts=6", "data.max_length=256",
            "regen.max_new_tokens=40", "regen.batch_size=3", "regen.max_concurrency=6",
            f"regen.engine_python={vllm_python}"]
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    run_regenerate(RegenJob(load_recipe("dspark_smollm2_135m", sets + ["regen.backend=hf"]), tmp_path / "hf", Dist(),
                            lambda: load_target("smollm2-135m-instruct"), tokenizer))
    marker = f"DRAFTSMITH_TEST_LIVE={uuid.uuid4().hex}"  # what this stage's server inherits, and no other run's
    monkeypatch.setenv(*marker.split("=", 1))
    done = _run(load_recipe("dspark_smollm2_135m", sets + ["regen.backend=vllm"]), tmp_path / "vllm", tokenizer)

    def answers(folder):
        return {r["id"]: (r["response_ids"], r["truncated"]) for r in regenerate.read_records(tmp_path / folder)}

    hf, served = answers("hf"), answers("vllm")
    assert len(hf) == 6 and served == hf
    assert any(len(ids) == 2 for ids, _ in hf.values())  # a second turn replayed the first answer
    assert done["server_startup_s"] > 0 and (tmp_path / "vllm" / "vllm-rank0.log").stat().st_size > 0
    assert [pid for pid in tagged_processes() if carries(pid, marker)] == []  # nothing of the server is left


def test_hf_backend_prefills_each_prompt_alone_on_cpu_with_generates_own_answers(monkeypatch):
    """The CPU prefill (each prompt run alone, its cache left-padded) gives the same greedy SmolLM2 answers as
    generate's own prefill of the padded batch, for prompts of very different lengths."""
    from data.chat import build_messages
    from modeling.target import load_target, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    recipe = load_recipe("dspark_smollm2_135m", ["regen.max_new_tokens=12"])
    backend = regen_backends.HFBackend(load_target("smollm2-135m-instruct"), tokenizer, recipe.regen, 512)
    questions = ["Hi!", "Name a color.", "Explain in detail, step by step, how a bicycle's gears let a rider climb a "
                 "steep hill without getting tired, and why the chain needs oil. " * 3]
    conversations = [build_messages([q], [], None) for q in questions]
    cached = backend.generate(conversations, seed=0)
    assert backend._prompt_cache([[1, 2, 3], [4, 5]], 3) is not None  # the path under test is taken
    monkeypatch.setattr(regen_backends.HFBackend, "_prompt_cache", lambda self, prompts, width: None)
    padded = backend.generate(conversations, seed=0)
    assert [a.token_ids for a in cached] == [a.token_ids for a in padded]
    assert all(len(a.token_ids) >= 2 for a in cached)
