"""A scale rehearsal on CPU: the dspark_qwen3_8b recipe's code path end to end (regenerate through the openai backend,
cache, train with ZeRO-2 on gloo ranks) with a tiny random Qwen3 target (Qwen3Config, hidden 64, 36 layers so the
recipe's own target.layer_ids [1, 9, 17, 25, 33] stand), at two prompt counts. Per stage it measures the wall seconds
per 10k prompts and the peak RSS of the ranks, and the ratio of the larger count's numbers to the smaller's: a stage
that holds the whole dataset at once shows a memory ratio above 1 and a time ratio that grows.

    python benchmarks/scale_rehearsal.py --out runs/scale --prompts 5000,50000 --layers 12  # ~40 min, 2 CPU cores
    python benchmarks/scale_rehearsal.py --out runs/scale-smoke --prompts 500,2000 --no-write  # a smoke run
    # the trainer ranks' memory against the target's depth, states in-process (hf) and from a vLLM server (engine):
    python benchmarks/scale_rehearsal.py --out runs/scale-engine --prompts 500 --layers 12,36 --hidden 512 \\
        --head-dim 32 --cache-backend hf,engine --no-write

With --cache-backend engine the cache stage gets its states from one vLLM server per target, started here with
data/states/engine.engine_server_args' flags and shared by the ranks (cache.server_urls + cache.states_dir: one
server fits 2 cores where one a rank does not), and the train stage loads only the target's embedding, final norm and
lm_head. The server is up for the cache stages only (beside 4 training ranks on 23 GB it ran the machine low), and
its processes' peak RSS is recorded beside the ranks'. vLLM's CPU attention needs heads 32 wide or more: --head-dim 32.
With several backends the regeneration of a target runs once and its records are copied to the other backends' runs.
Each stage's figures land in RUN/stages.json as it ends; a rerun into the same --out measures only what is missing.

The answers come from a fake OpenAI-compatible server started here (TEST/BENCH-ONLY: a threaded http.server that
answers every /v1/chat/completions request at once with a short answer made from a hash of the conversation; it
samples nothing and no model runs behind it). Each stage runs as its own torchrun (--stages regenerate, then cache,
then train) while a thread polls /proc for the ranks (torchrun's children): their peak RSS (VmHWM) is summed over the
ranks and its largest taken. The train stage runs a fixed number of steps (--train-steps), so its per-10k view is the
data loading that scales with the prompt count. Writes OUT/scale.json and, unless --no-write, the JSON to
benchmarks/results/scale-rehearsal-cpu.json. Measured: benchmarks/README.md, "Scale rehearsal on CPU".
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import OFFLINE, ratio, sets  # noqa: E402
from core.io import atomic_open, atomic_write_json, atomic_write_text, make_dir, open_append  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "scale-rehearsal-cpu.json"
STAGES = ("regenerate", "cache", "train")
WORDS = ("the", "answer", "is", "a", "number", "that", "we", "add", "then", "check", "twice", "so", "it", "holds",
         "for", "every", "case", "here", "and", "done")


# --- the fake server (TEST/BENCH-ONLY) ----------------------------------------------------------------------------


def fake_answer(messages: list[dict], words: int) -> str:
    """A short deterministic answer: `words` words picked by a hash of the conversation."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return " ".join(WORDS[b % len(WORDS)] for b in digest[:words]).capitalize() + "."


class FakeChatHandler(http.server.BaseHTTPRequestHandler):
    """POST /v1/chat/completions -> {"choices": [{"message": {"content"}, "finish_reason": "stop"}]}, the shape
    data/regen/regenerate.py OpenAIBackend parses."""

    protocol_version = "HTTP/1.1"  # keep-alive: requests' session pool reuses the connection
    answer_words = 12

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            self.send_error(404)
            return
        text = fake_answer(body["messages"], self.answer_words)
        data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # one line a request would flood the log
        pass


class FakeServer(http.server.ThreadingHTTPServer):
    # the ranks keep regen.max_concurrency requests in flight each: with http.server's backlog of 5, connections were
    # reset under load (6 of 50,000 conversations at 4 ranks x 64)
    request_queue_size = 1024


def start_fake_server(answer_words: int) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = type("Handler", (FakeChatHandler,), {"answer_words": answer_words})
    server = FakeServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# --- inputs -------------------------------------------------------------------------------------------------------


def write_prompts(path: Path, count: int) -> None:
    """`count` distinct ShareGPT-shaped conversations (human/gpt turns; every fourth has a second human turn), written
    line by line. The file holds more rows than asked for: data.holdout_fraction keeps 5% of them aside."""
    with atomic_open(path) as handle:
        for i in range(count):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(4 + i % 29))
            turns = [{"from": "human", "value": f"Question {i}: {words}?"},
                     {"from": "gpt", "value": "a source answer that regeneration replaces"}]
            if i % 4 == 0:
                turns.append({"from": "human", "value": f"And why is {i % 97} the case?"})
            handle.write((json.dumps({"id": f"q{i}", "conversations": turns}) + "\n").encode())


RECIPE_LAYER_IDS = (1, 9, 17, 25, 33)  # dspark_qwen3_8b's, of Qwen3-8B's 36 layers


def layer_ids(layers: int) -> list[int]:
    """The recipe's layer ids spread over `layers` decoder layers the way they spread over Qwen3-8B's 36."""
    return [min(round(i * layers / 36), layers - 1) for i in RECIPE_LAYER_IDS]


def overrides(target: str, prompt_file: Path, count: int, url: str, layers: int, args, engine=None) -> list[str]:
    engine_sets = {} if engine is None else {"cache.backend": "engine", "cache.server_urls": f"['{engine.url}']",
                                             "cache.states_dir": str(engine.states_dir)}
    return sets(**engine_sets, **{
        "target.name_or_path": target,
        "target.layer_ids": str(layer_ids(layers)),
        "data.sources": f"[{{name: '{prompt_file}'}}]",
        "data.num_prompts": count,
        "data.max_length": 256,
        "data.min_loss_tokens": 1,
        "regen.backend": "openai",
        "regen.server_urls": f"['{url}']",
        "regen.max_new_tokens": 32,
        "regen.batch_size": 64,
        "regen.max_concurrency": 16,
        "cache.batch_size": 64,  # a tiny target's forward is all per-op overhead: many rows per forward
        "train.hidden_states": "cache",  # the cache stage is what the rehearsal measures (the recipe trains online)
        "draft.num_anchors": 16,
        "draft.markov_rank": 16,  # the head is 2 x rank x the 151,936-token vocabulary: 256 is 78M parameters a rank
        "train.max_steps": args.train_steps,
        "train.global_batch_size": 2 * args.nproc,
        "train.micro_batch_size": 1,
        "train.save_every": 10_000,
        "train.log_every": 1,
        "train.warmup_ratio": 0.0,
    })


# --- measuring ----------------------------------------------------------------------------------------------------


def _status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [int(p) for p in text.split()]


def _descendants(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


class RankMemory:
    """Polls the ranks (the launcher's children) every `period` s: each one's peak RSS (VmHWM, read until it exits)
    and the largest sum of their current RSS seen at one poll."""

    def __init__(self, launcher: int, period: float = 0.2, with_launcher: bool = False):
        """with_launcher: the launcher and all its descendants (a vLLM server's engine core and its worker), not
        only its children (torchrun's ranks)."""
        self.launcher, self.period, self.with_launcher = launcher, period, with_launcher
        self.hwm_kb: dict[int, int] = {}
        self.rss_sum_kb = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.stop.is_set():
            now = 0
            pids = [self.launcher, *_descendants(self.launcher)] if self.with_launcher else _children(self.launcher)
            for pid in pids:
                hwm, rss = _status_kb(pid, "VmHWM"), _status_kb(pid, "VmRSS")
                if hwm is not None:
                    self.hwm_kb[pid] = max(self.hwm_kb.get(pid, 0), hwm)
                now += rss or 0
            self.rss_sum_kb = max(self.rss_sum_kb, now)
            self.stop.wait(self.period)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        peaks = list(self.hwm_kb.values()) or [0]
        return {"ranks_seen": len(self.hwm_kb), "peak_mb_max_rank": round(max(peaks) / 1024, 1),
                "peak_mb_sum_ranks": round(sum(peaks) / 1024, 1), "rss_mb_sum_at_once": round(self.rss_sum_kb / 1024, 1)}


def run_stage(name: str, out: Path, extra: list[str], nproc: int, log: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train/main.py", "--recipe", "dspark_qwen3_8b", "--out", str(out), "--stages", name] + extra
    start = time.perf_counter()
    with open_append(log) as handle:
        handle.write(f"\n$ {' '.join(command)}\n")
        handle.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"},
                                stdout=handle, stderr=subprocess.STDOUT)
        memory = RankMemory(proc.pid)
        code = proc.wait()
    wall = time.perf_counter() - start
    peaks = memory.finish()
    if code != 0:
        raise SystemExit(f"[scale] stage {name} failed (exit {code}); see {log}")
    found = re.findall(rf"\[{name}\] stage time ([0-9.]+) s", log.read_text())
    return {"wall_s": round(wall, 1), "stage_s": float(found[-1]) if found else None, **peaks}


def rehearse(count: int, run: Path, target: str, url: str, layers: int, args, names=STAGES, engine=None,
             regen_from: Path | None = None) -> dict:
    """One prompt count through the stages `names` in `run`; each stage's figures are kept in run/stages.json as it
    ends, and a stage found there is not run again (a rerun picks up where one stopped). `regen_from`: a run of the
    same target and count whose regeneration is copied here instead of run again (the cache backend does not change
    it). Returns the count's result once the train stage is measured, else None."""
    run.mkdir(parents=True, exist_ok=True)
    prompt_file = args.out / f"prompts-n{count}.jsonl"  # one file a count: the copied regeneration's settings match
    if not prompt_file.is_file():
        write_prompts(prompt_file, int(count * 1.1) + 16)  # 5% held out, and room to spare
    extra = overrides(target, prompt_file, count, url, layers, args, engine)
    log = run / "log.txt"
    stages = measured_stages(run)
    if regen_from is not None and "regenerate" not in stages:
        shutil.copytree(regen_from / "run" / "regen", run / "run" / "regen", dirs_exist_ok=True)
        stages["regenerate"] = {**measured_stages(regen_from)["regenerate"], "copied_from": str(regen_from)}
    for name in names:
        if name in stages:
            print(f"[scale] N={count} {name}: measured before, {run / 'stages.json'}", flush=True)
            continue
        stages[name] = result = run_stage(name, run / "run", extra, args.nproc, log)
        result["s_per_10k"] = round(result["stage_s"] / count * 10_000, 2) if result["stage_s"] else None
        print(f"[scale] N={count} {name}: {result}", flush=True)
        if name == "train":
            result["steps_s"] = train_steps_s(run / "run")
        atomic_write_json(run / "stages.json", stages)
    if "train" not in stages:
        return None
    done = json.loads((run / "run" / "regen" / "DONE.json").read_text())
    return {"prompts": count, "records": done.get("records"), "stages": stages}


def measured_stages(run: Path) -> dict:
    path = run / "stages.json"
    return json.loads(path.read_text()) if path.is_file() else {}


# all the cores (vLLM keeps one back by default: half of 2), and a small KV cache: the default's share of the machine's
# memory does not fit beside 4 training ranks (vLLM refuses to start when less is free)
SERVER_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
                  "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class EngineServer:
    """One vLLM server for `target` running extract_hidden_states for the recipe's layers, shared by the cache
    stage's ranks through cache.server_urls (its states land in `states_dir`, which the ranks read), and the peak RSS
    of its processes (the API server and its engine core) while it runs."""

    def __init__(self, target: str, layers: int, out: Path, max_length: int = 256):
        from core.server import LiveServer, default_engine_python, free_port, vllm_server_command
        from data.states.engine import engine_layer_ids, engine_server_args

        aux_ids, _, _ = engine_layer_ids(layer_ids(layers), layers)
        self.states_dir = make_dir(out / f"states-{layers}l")
        port = free_port()
        argv = vllm_server_command(default_engine_python("vllm"), target, port, dtype="float32",
                                   max_model_len=max_length + 1,  # the row and the one token asked for
                                   extra=("--enforce-eager", *engine_server_args(aux_ids, str(self.states_dir))))
        start = time.perf_counter()
        self.live = LiveServer(argv, port=port, log_path=out / f"vllm-states-{layers}l.log",
                               env={"PYTHONPATH": str(ROOT), **SERVER_CPU_ENV}, startup_timeout=900)
        self.live.__enter__()
        self.startup_s = round(time.perf_counter() - start, 1)
        self.url = self.live.url
        self.memory = RankMemory(self.live.proc.pid, period=1.0, with_launcher=True)

    def close(self) -> dict:
        peaks = self.memory.finish()
        self.live.stop()
        return {"startup_s": self.startup_s, "peak_mb_processes_summed": peaks["peak_mb_sum_ranks"],
                "processes": peaks["ranks_seen"], "url": self.url, "states_dir": str(self.states_dir)}


def train_steps_s(run: Path) -> float:
    """The train stage's optimizer steps alone (metrics.jsonl): the stage's time is mostly its start (on CPU
    DeepSpeed builds its shared-memory op with ninja into ~/.cache/torch_extensions first, minutes when another
    checkout's build holds the lock)."""
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return round(sum(json.loads(line)["step_s"] for line in lines), 1)


def table(results: list[dict]) -> str:
    """Stage x prompt count: stage seconds per 10k prompts, the largest rank's peak RSS and the ranks' summed RSS at
    its highest poll, each with the large count's ratio to the small one's."""
    small, large = results[0], results[-1]
    n1, n2 = f"N={small['prompts']:,}", f"N={large['prompts']:,}"
    lines = [f"| stage | s / 10k prompts, {n1} | {n2} | ratio | peak MB, largest rank, {n1} | {n2} | ratio "
             f"| MB, ranks summed, {n1} | {n2} | ratio |", "|" + "---|" * 10]
    for name in STAGES:
        a, b = small["stages"][name], large["stages"][name]
        cells = [name]
        for key in ("s_per_10k", "peak_mb_max_rank", "rss_mb_sum_at_once"):
            cells += [f"{a[key]:,.1f}" if key == "s_per_10k" else f"{a[key]:,.0f}",
                      f"{b[key]:,.1f}" if key == "s_per_10k" else f"{b[key]:,.0f}", f"{ratio(b[key], a[key]):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def depth_table(runs: list[dict]) -> str:
    """Target depth x cache backend at one prompt count: the cache and train stages' peak RSS (the largest rank, the
    ranks summed at once), each against the shallowest target's under the same backend, and the engine's server."""
    lines = ["| target layers | cache backend | prompts | cache: peak MB, largest rank | train: peak MB, largest rank "
             "| vs shallowest | train: MB, ranks summed | vs shallowest | train steps s | vLLM server peak MB |",
             "|" + "---|" * 10]
    base: dict[tuple[str, int], dict] = {}
    for run in runs:
        for result in run["results"]:
            key = (run["backend"], result["prompts"])
            train, cache = result["stages"]["train"], result["stages"]["cache"]
            first = base.setdefault(key, train)
            server = run.get("server")
            served = f"{server['peak_mb_processes_summed']:,.0f}" if server else ""
            lines.append(f"| {run['layers']} | {run['backend']} | {result['prompts']:,} | "
                         f"{cache['peak_mb_max_rank']:,.0f} | {train['peak_mb_max_rank']:,.0f} | "
                         f"{ratio(train['peak_mb_max_rank'], first['peak_mb_max_rank']):.2f} | "
                         f"{train['rss_mb_sum_at_once']:,.0f} | "
                         f"{ratio(train['rss_mb_sum_at_once'], first['rss_mb_sum_at_once']):.2f} | "
                         f"{train['steps_s']} | {served} |")
    return "\n".join(lines)


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if len(counts) not in (1, 2) or min(counts) < 1 or counts != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected SMALL,LARGE prompt counts (e.g. 5000,50000) or one "
                                         f"count (e.g. 500)")
    return counts


def parse_list(kind, allowed=None):
    def parse(text: str) -> list:
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or (allowed and set(values) - set(allowed)) or len(set(values)) != len(values):
            choices = f" from {', '.join(allowed)}" if allowed else ""
            raise argparse.ArgumentTypeError(f"{text!r}: expected distinct comma-separated values{choices}")
        return values
    return parse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--out", type=Path, required=True, help="working folder (tiny target, prompts, runs)")
    parser.add_argument("--prompts", type=parse_counts, default=[5000, 50000],
                        help="SMALL,LARGE prompt counts (default 5000,50000), or one count")
    parser.add_argument("--nproc", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--layers", type=parse_list(int), default=[36],
                        help="tiny target's decoder layers, or several (e.g. 12,36: one target each, same hidden "
                             "size and vocabulary) (default 36, the recipe's own layer ids; fewer spread the ids the "
                             "same way: 12 gives [0, 3, 6, 8, 11] at a third of the cache stage's work)")
    parser.add_argument("--hidden", type=int, default=64,
                        help="tiny target's hidden size (default 64; at 64 a layer is 37k parameters, too few for "
                             "depth to show in RSS: 512 makes one 1.67M)")
    parser.add_argument("--head-dim", type=int, default=16,
                        help="tiny target's attention head size (default 16; vLLM's CPU attention needs 32 and up, "
                             "so --cache-backend engine asks for 32 or more)")
    parser.add_argument("--cache-backend", type=parse_list(str, ("hf", "engine")), default=["hf"],
                        help="hf (the target in-process), engine (states from a vLLM server), or both: hf,engine")
    parser.add_argument("--train-steps", type=int, default=4, help="optimizer steps, the same at every count")
    parser.add_argument("--answer-words", type=int, default=12, help="words in each fake answer (default 12)")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if "engine" in args.cache_backend and args.head_dim < 32:
        parser.error(f"--cache-backend engine with --head-dim {args.head_dim}: vLLM's CPU attention refuses heads "
                     f"under 32 wide (\"Unsupported CPU attention configuration: head_dim=16\"); pass --head-dim 32")

    from data.assets import make_tiny_qwen3

    make_dir(args.out)
    server, url = start_fake_server(args.answer_words)
    runs = []
    try:
        for layers in args.layers:
            # the 64-wide targets with 16-wide heads keep their old folders
            suffix = ("" if args.hidden == 64 else f"-h{args.hidden}") + ("" if args.head_dim == 16 else
                                                                          f"-d{args.head_dim}")
            target = make_tiny_qwen3(args.out / f"tiny-qwen3-{layers}l{suffix}", hidden_size=args.hidden,
                                     num_layers=layers, head_dim=args.head_dim)
            first: dict[int, Path] = {}
            for backend in args.cache_backend:
                folder = (args.out / f"{layers}l{suffix}-{backend}" if len(args.cache_backend) > 1
                          or len(args.layers) > 1 else args.out)
                runs_here = [(count, folder / f"n{count}") for count in args.prompts]
                served = None
                if backend == "engine":
                    # the server runs for the cache stages only: the train stage is measured without it beside
                    # (on 2 cores and 23 GB its ~4.7 GB beside 4 training ranks ran the machine out of memory)
                    pending = [(c, r) for c, r in runs_here if "cache" not in measured_stages(r)]
                    if pending:
                        engine = EngineServer(target, layers, args.out)
                        try:
                            for count, run in pending:
                                rehearse(count, run, target, url, layers, args, STAGES[:2], engine, first.get(count))
                        finally:
                            served = engine.close()
                        atomic_write_json(folder / "server.json", served)
                    elif (folder / "server.json").is_file():
                        served = json.loads((folder / "server.json").read_text())
                # the train stage reads the cache only; the same cache.* settings the cache stage pinned
                engine_sets = (SimpleNamespace(url=served["url"], states_dir=served["states_dir"])
                               if backend == "engine" else None)
                results = []
                for count, run in runs_here:
                    results.append(rehearse(count, run, target, url, layers, args, STAGES, engine_sets,
                                            first.get(count)))
                    first.setdefault(count, run)
                runs.append({"layers": layers, "backend": backend, "results": results, "server": served,
                             "table": table(results) if len(results) == 2 else None})
                print(f"[scale] {layers} layers, {backend}: server {served}", flush=True)
    finally:
        server.shutdown()
    texts = [f"{run['layers']} layers, cache.backend {run['backend']}:\n{run['table']}" for run in runs if run["table"]]
    if len(runs) > 1:
        texts.append(depth_table(runs))
    text = "\n\n".join(texts)
    print(text)
    report = {"machine": os.uname().nodename, "nproc": args.nproc, "hidden": args.hidden, "head_dim": args.head_dim,
              "train_steps": args.train_steps, "answer_words": args.answer_words,
              "runs": [{**run, "layer_ids": layer_ids(run["layers"])} for run in runs], "table": text}
    if len(runs) == 1:  # the single-target report keeps its old keys
        report.update(target_layers=runs[0]["layers"], layer_ids=layer_ids(runs[0]["layers"]),
                      results=runs[0]["results"])
    atomic_write_text(args.out / "scale.json", json.dumps(report, indent=2) + "\n")
    if not args.no_write:
        make_dir(RESULT.parent)
        atomic_write_text(RESULT, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
