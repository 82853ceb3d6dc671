"""The OpenAI-compatible regeneration backend against real HTTP servers on loopback (two = data parallel), and the
handling of failed requests and over-long prompts."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from data.sources import Prompt
from data.regenerate import Answer, OpenAIBackend, regenerate_chunk
from core.recipe import load_recipe


class _ChatServer:
    """A minimal /v1/chat/completions server: answers 'echo <n>: <last user text>', HTTP 500 on 'FAIL'."""

    def __init__(self, name: str):
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                last = body["messages"][-1]["content"]
                if "FAIL" in last:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"internal error: model exploded")
                    return
                turn = sum(m["role"] == "user" for m in body["messages"])
                reply = {"choices": [{"message": {"role": "assistant", "content": f"echo {turn}: {last}"}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
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
    pair = [_ChatServer("a"), _ChatServer("b")]
    yield pair
    for server in pair:
        server.close()


def test_openai_backend_replays_turns_across_two_servers(servers, qwen3_tokenizer):
    urls = [s.url for s in servers]
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=openai", f"regen.server_urls={json.dumps(urls)}",
                                             "regen.max_new_tokens=32"])
    backend = OpenAIBackend(qwen3_tokenizer, recipe.regen, "Qwen/Qwen3-8B", retries=2)
    prompts = [Prompt(id=f"p{i}", turns=(f"hello {i}", f"again {i}"), source="t") for i in range(3)]
    prompts.append(Prompt(id="bad", turns=("please FAIL",), source="t"))
    records, errors, tokens = regenerate_chunk(backend, prompts, recipe, chunk_seed=7)

    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    conv = records[1]["conversations"]
    assert [m["content"] for m in conv] == ["hello 1", "echo 1: hello 1", "again 1", "echo 2: again 1"]
    assert records[1]["response_ids"][0] == qwen3_tokenizer.encode("echo 1: hello 1", add_special_tokens=False)
    assert tokens == sum(len(ids) for r in records for ids in r["response_ids"])
    # the failure is reported with the server's reason, after the retries
    assert errors == [{"id": "bad", "source": "t", "reason": errors[0]["reason"]}]
    assert "HTTP 500" in errors[0]["reason"] and "model exploded" in errors[0]["reason"]
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
    recipe = load_recipe("dspark_qwen3_8b", ["regen.backend=openai", "regen.server_urls=['http://127.0.0.1:9']",
                                             "regen.request_timeout_s=2"])
    backend = OpenAIBackend(qwen3_tokenizer, recipe.regen, "m", retries=1)
    records, errors, _ = regenerate_chunk(backend, [Prompt(id="x", turns=("hi",))], recipe, chunk_seed=0)
    assert records == [] and errors[0]["id"] == "x" and "ConnectionError" in errors[0]["reason"]


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
    assert errors == [{"id": "b", "source": "", "reason": "turn 0: prompt is too long"}]
    assert tokens == 2


def test_source_backend_keeps_the_sources_answers_and_generates_nothing():
    """regen.backend: source (EAGLE's fixed data): each turn's answer is the source's own; a conversation ends at the
    first turn without one, and a prompt without any fails, named."""
    from types import SimpleNamespace

    from data.regenerate import SourceBackend

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

    from data.regenerate import run_regenerate

    prompts = tmp_path / "five.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"question {i}"]}) + "\n" for i in range(5)))
    recipe = load_recipe("dspark_smollm2_135m", [f"data.sources=[{{name: '{prompts}'}}]", "data.num_prompts=8",
                                                 "data.holdout_fraction=0.0"])
    dist = SimpleNamespace(is_main=True, rank=0, print=print, mine=lambda xs: list(xs))

    def no_target():
        raise AssertionError("the target must not be loaded for a recipe that is refused")

    out = tmp_path / "regen"
    with pytest.raises(ValueError, match=r"asked for 8 prompts, but .*five\.jsonl' holds 5 .*data\.allow_fewer"):
        run_regenerate(recipe, out, dist, no_target, tokenizer=None)
    assert not (out.exists() and any(out.iterdir())), "the refused stage pinned or wrote something"
