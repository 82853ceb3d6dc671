"""TEST-ONLY stand-in for SGLang 0.5.23's `python -m sglang.launch_server`, for the regeneration backend's tests
(tests/test_regen_sglang.py), where no GPU runs the real one:

    python tests/fake_sglang.py --model-path M --port P [the rest of launch_server's flags]

It serves what data/regen/backends.SGLangBackend uses, in SGLang's shapes (sglang/srt/entrypoints/http_server.py,
openai/serving_completions.py, openai/protocol.py): GET /health -> 200; POST /v1/completions with a prompt of token
ids -> a CompletionResponse whose choice carries `token_ids` (the stop token included, as `output_ids_through_stop`
keeps it) under `return_token_ids`, finish_reason `stop` (matched_stop: the eos id) or `length`. Like SGLang it
stops on the eos ids of the model's config.json and generation_config.json, and refuses with HTTP 400 what its
request validation refuses: top_k 0, prompt + max_tokens past --context-length. The answer is a fixed function of the
prompt ids and the seed (a few of the prompt's own ids, then eos), not a model's.

It starts a sleeping child first (SGLang's scheduler and detokenizer are child processes), so a test can check the
whole tree is gone. With $FAKE_SGLANG_LOG set, it appends a JSON line for its start (argv, CUDA_VISIBLE_DEVICES) and
for every request and response. With $FAKE_SGLANG_HOLD_S set, it holds every completion until no new one has arrived
for that many seconds, and logs each arrival with the count then in flight ({"in_flight": n}): all the client keeps in
flight at once is seen together.
"""

import argparse
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

LOCK = threading.Lock()
HOLD_S = float(os.environ.get("FAKE_SGLANG_HOLD_S") or 0)
ARRIVALS = {"in_flight": 0, "last": 0.0}  # under LOCK


def log(entry: dict) -> None:
    path = os.environ.get("FAKE_SGLANG_LOG")
    if path:
        with LOCK, open(path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


def eos_ids(model_path: str) -> list[int]:
    """config.json's eos ids and generation_config.json's, as SGLang's ModelConfig._get_hf_eos_token_id joins them."""
    found: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        found |= {value} if isinstance(value, int) else set(value or ())
    return sorted(found)


def answer(prompt: list[int], seed: int, max_tokens: int, eos: int) -> tuple[list[int], str]:
    """(token ids, finish reason): 1-4 of the prompt's ids from a seed-chosen place, then eos; cut at max_tokens."""
    words = [prompt[(seed * 7 + 3 * j) % len(prompt)] for j in range(1 + seed % 4)] + [eos]
    return (words, "stop") if len(words) <= max_tokens else (words[:max_tokens], "length")


def hold() -> None:
    """Wait until no completion has arrived for HOLD_S seconds; log this one's arrival with the count in flight."""
    with LOCK:
        ARRIVALS["in_flight"] += 1
        ARRIVALS["last"] = time.monotonic()
        in_flight = ARRIVALS["in_flight"]
    log({"in_flight": in_flight})
    while True:
        with LOCK:
            quiet = time.monotonic() - ARRIVALS["last"]
        if quiet >= HOLD_S:
            break
        time.sleep(min(HOLD_S - quiet, 0.05))
    with LOCK:
        ARRIVALS["in_flight"] -= 1


def error(handler, message: str) -> None:
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
    handler.reply(400, body)


def make_handler(args, eos: list[int]):
    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, status: int, body: dict | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200) if self.path == "/health" else self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            if self.path != "/v1/completions":
                return self.reply(404, {"detail": "Not Found"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt, max_tokens = body["prompt"], body.get("max_tokens", 16)
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                return error(self, "fake sglang: this fake answers token-id prompts only")
            top_k = body.get("top_k", -1)
            if top_k < 1 and top_k != -1:
                return error(self, f"top_k must be -1 (disable) or at least 1, got {top_k}.")
            if len(prompt) + max_tokens > args.context_length:
                return error(self, f"Requested token count exceeds the model's maximum context length of "
                                   f"{args.context_length} tokens.")
            if HOLD_S:
                hold()
            ids, finish = answer(prompt, body.get("seed") or 0, max_tokens, eos[0])
            choice = {"index": 0, "text": f"<{len(ids)} tokens>", "logprobs": None, "finish_reason": finish,
                      "matched_stop": eos[0] if finish == "stop" else None}
            if body.get("return_token_ids"):
                choice |= {"token_ids": ids, "prompt_token_ids": prompt}
            log({"request": body, "choice": choice})
            self.reply(200, {"id": "fake", "object": "text_completion", "created": 0, "model": body.get("model"),
                             "choices": [choice], "metadata": None,
                             "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids),
                                       "completion_tokens": len(ids), "prompt_tokens_details": None,
                                       "reasoning_tokens": 0, "completion_tokens_details": None}})

        def log_message(self, *args):
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--context-length", type=int, required=True)
    args, _ = parser.parse_known_args()  # the rest: SGLang's own parser checks them (test_regen_sglang.py)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    log({"argv": sys.argv[1:], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})
    print(f"fake sglang: {args.model_path} on port {args.port}", flush=True)
    # SGLang's uvicorn listens with a backlog of 2048; http.server's 5 would drop a burst of connections (the client
    # then retries a second later) and spread what is in flight over time
    http.server.ThreadingHTTPServer.request_queue_size = 2048
    server = http.server.ThreadingHTTPServer((args.host, args.port), make_handler(args, eos_ids(args.model_path)))
    server.serve_forever()


if __name__ == "__main__":
    main()
