"""TEST-ONLY stand-in for a serving engine, to drive core/server.py's LiveServer through its failure paths.

    python tests/fake_engine.py MODE PORT

Every mode first starts a worker child (like vLLM's engine core) that just sleeps, so the tests can check that the
whole process tree is gone afterwards. Modes:
  ok        serve GET /health -> 200 until killed
  crash     print an error and exit 3 at once
  hang      never listen (the startup timeout must fire)
  stubborn  serve /health but ignore SIGTERM (SIGKILL must follow)
"""

import http.server
import signal
import subprocess
import sys
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


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
