"""TEST-ONLY stand-in for a serving engine, to drive core/server.py's LiveServer through its failure paths.

    python tests/fake_engine.py MODE PORT

Every mode first starts a worker child (like vLLM's engine core) that just sleeps, so the tests can check that the
whole process tree is gone afterwards. Modes:
  ok        serve GET /health -> 200 until killed
  crash     print an error and exit 3 at once
  hang      never listen (the startup timeout must fire)
  stubborn  serve /health but ignore SIGTERM (SIGKILL must follow)

`StatesServer` (imported by the tests, run in a thread) stands in for vLLM's hidden-states connector instead: it
writes each request's `req-N.safetensors` (token_ids, hidden_states [T, layers, hidden]) into a states folder and
answers as vLLM does, or, picked by the first part of the URL's path (http://host:port/MODE), badly: see MODES.
"""

import http.server
import itertools
import json
import signal
import subprocess
import sys
import threading
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


#: answers naming another file than the request's (a user's file, a folder, a link the test plants as link.safetensors)
ODD_ANSWERS = {"delete": {"kv_transfer_params": {"hidden_states_path": "/x/notes.txt"}},
               "dotdot": {"kv_transfer_params": {"hidden_states_path": "/remote/states/.."}},
               "link": {"kv_transfer_params": {"hidden_states_path": "/remote/states/link.safetensors"}},
               "theirs": {"kv_transfer_params": {"hidden_states_path": "/remote/states/model.safetensors"}},
               "list": [1, 2, 3], "pathint": {"kv_transfer_params": {"hidden_states_path": 12345}}}
#: states written as asked but wrong: what a broken engine (or the wrong model) gives
BAD_STATES = ("nan", "inf", "huge", "int32", "wrongH", "flat")
MODES = ("good", "nonjson", "big", "bigchunked", "notokids", *ODD_ANSWERS, *BAD_STATES)
BIG_BYTES = 300_000_000


class ThreadServer:
    """An http.server on a free loopback port, served from a daemon thread: `url`, `close()`."""

    def serve(self, handler) -> None:
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class StatesServer(ThreadServer):
    """A thread serving /MODE/v1/completions into `states_dir`, `layers` states of width `hidden` a token; `sent`
    counts the bytes its big answers got out before the client hung up."""

    def __init__(self, states_dir, layers: int, hidden: int):
        import torch
        from safetensors.torch import save_file

        self.sent, self.requests, numbering = 0, 0, itertools.count()
        spoil = {"nan": lambda h: h * float("nan"), "inf": lambda h: h + float("inf"),
                 "huge": lambda h: torch.full_like(h, 1e30), "int32": lambda h: h.to(torch.int32),
                 "wrongH": lambda h: h[:, :, :100], "flat": lambda h: h[:, :, 0]}
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                owner.requests += 1
                mode = self.path.strip("/").split("/")[0]
                ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                if mode in ("big", "bigchunked"):
                    return self._big(declared=mode == "big")
                if mode == "nonjson":
                    body = b"<html>not json</html>"
                elif mode in ODD_ANSWERS:
                    body = json.dumps(ODD_ANSWERS[mode]).encode()
                else:
                    h = torch.randn(len(ids), layers, hidden, generator=torch.Generator().manual_seed(len(ids)))
                    tensors = {"hidden_states": spoil.get(mode, lambda x: x)(h).contiguous(),
                               "token_ids": torch.tensor(ids, dtype=torch.int64)}
                    if mode == "notokids":
                        del tensors["token_ids"]
                    name = f"req-{next(numbering)}.safetensors"
                    save_file(tensors, f"{states_dir}/{name}")
                    body = json.dumps({"kv_transfer_params": {"hidden_states_path": f"/remote/states/{name}"}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _big(self, declared: bool):
                self.send_response(200)
                if declared:
                    self.send_header("Content-Length", str(BIG_BYTES))
                self.end_headers()
                chunk = b"x" * (1 << 20)
                try:
                    while owner.sent < BIG_BYTES:
                        self.wfile.write(chunk)
                        owner.sent += len(chunk)
                except OSError:  # the client hung up
                    pass

            def log_message(self, *args):
                pass

        self.serve(Handler)


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"fake engine: mode {mode}, port {port}", flush=True)
    if mode == "crash":
        print("ValueError: fake engine cannot load the draft model", flush=True)
        sys.exit(3)
    if mode == "hang":
        time.sleep(3600)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()


if __name__ == "__main__":
    main()
