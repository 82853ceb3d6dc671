"""Live accept-length eval: serve the exported draft in a real engine, send the eval prompts, read acceptance from the
server, and compare it with the offline loop on the same prompts.

    python eval.py --live --engine vllm   --draft runs/dflash_smollm2_135m/train/final --target smollm2-135m-instruct \
        --dataset mtbench --num-samples 8 --max-new-tokens 64
    python eval.py --live --engine sglang --draft runs/dspark_qwen3_8b/train/final --target Qwen/Qwen3-8B ...

The draft folder is exported for the engine (vLLM: speculators format; SGLang: EAGLE3 / DFLASH / DSPARK) into
OUT/served-draft, the engine is started as a child process group, and every prompt is sent as token ids (the same
chat-template rendering as the offline eval) with greedy decoding. Acceptance comes from the server itself:
  * vLLM: the `vllm:spec_decode_*` counters on /metrics, read before and after (tau = 1 + accepted / drafts);
  * SGLang: each response's `meta_info` (`spec_verify_ct`, `spec_num_correct_drafts`, the accepted-count histogram),
    and `avg_spec_accept_length` from /server_info.
The offline loop then runs the same draft on the same prompt ids, with the first output token taken from the prefill
as both engines do, so the two see the same rounds. report.json holds both taus, their difference and the tolerance.

The server is always stopped: on success, on any error, on a timeout and on Ctrl-C / SIGTERM, by signalling its whole
process group; if the eval is killed outright (SIGKILL), the kernel kills the server and a watchdog kills the rest of
its tree (eval/server_procs.py). A server that dies or never becomes ready raises ServerStartError with the tail of its
log; it is ready only when its own process listens on the port, never another server that took the port first. The
engine gets this environment minus secret-like variables, and secret flag values never reach the printed command or
report.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.io import atomic_write_json, atomic_write_text
from data.prompts import eval_prompts
from eval.run import acceptance_metrics, first_turn_ids
from eval.server_procs import TAG_VAR, kill_tagged, port_held_by, tagged_processes
from eval.spec_decode import load_draft, speculative_generate
from export.convert import export_draft
from export.serving import ENGINES, detect_algorithm, sglang_command, sglang_env, sglang_serving_files, vllm_command
from modeling.registry import read_config
from modeling.target import load_target, load_tokenizer, resolve_target

# Default |tau_live - tau_offline| allowed; see tolerance_note() for why this is enough and not more.
DEFAULT_TOLERANCE = 0.02
LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    """The serving engine exited or never became ready; the message ends with the tail of its log."""


class LiveEvalError(RuntimeError):
    """A request to the running server failed, or its answer lacked the fields acceptance is read from."""


# ---------------------------------------------------------------------------------------------------------------------
# Server commands


def default_engine_python(engine: str) -> str:
    """vLLM lives in its own venv (it pins torch 2.13.0): $DRAFTSMITH_VLLM_PYTHON, else ./.venv-vllm, else PATH's
    python. SGLang is imported from this interpreter's environment."""
    if engine == "vllm":
        env = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
        if env:
            return env
        local = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
        return str(local) if local.is_file() else "python"
    return sys.executable


def free_port() -> int:
    """A port free now; another process may take it before the engine binds (LiveServer then refuses to start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# The server process


# Secret-like names. Environment variables: anywhere in the name (PGPASSWORD; dropping a harmless one costs little).
# Flags: as a whole word (--api-key, --hf-token; not --max-num-batched-tokens, --tokenizer: kept, to reproduce the run).
SECRET_WORDS = "key|token|secret|password|passwd|credentials?"
SECRET_ENV_NAME = re.compile(SECRET_WORDS, re.IGNORECASE)
SECRET_FLAG = re.compile(rf"(?<![a-z])(?:{SECRET_WORDS})(?![a-z])", re.IGNORECASE)
ENGINE_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # the engine fetches gated target weights with these
REDACTED = "<redacted>"


def engine_environment(parent: dict[str, str], explicit: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the engine: `parent` without the variables whose names look secret (API keys, cloud
    credentials; ENGINE_SECRETS kept), plus `explicit`, our own settings, kept whatever their names."""
    passed = {k: v for k, v in parent.items() if k in ENGINE_SECRETS or not SECRET_ENV_NAME.search(k)}
    return {**passed, **(explicit or {})}


def redact_args(argv: list[str] | tuple[str, ...]) -> list[str]:
    """`argv` with the value of every secret-named flag replaced by REDACTED, in both `--api-key VALUE` and
    `--api-key=VALUE` forms; a following `--flag` is not a value (vLLM's --hf-token may stand alone)."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            shown.append(REDACTED)
            hide_next = False
            continue
        flag, has_value, _ = arg.partition("=")
        secret = arg.startswith("-") and SECRET_FLAG.search(flag.lstrip("-")) is not None
        hide_next = secret and not has_value
        shown.append(f"{flag}={REDACTED}" if secret and has_value else arg)
    return shown


PR_SET_PDEATHSIG = 1


def die_with_parent_hook():
    """A preexec_fn making the kernel SIGKILL the server when this eval dies, even by SIGKILL; None where it cannot
    be set. PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so only from the main thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: loading a library after fork can deadlock
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the eval died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_parent


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LiveServer:
    """A serving engine started in its own process group, ready when `GET ready_path` answers 200 and every socket
    listening on `port` is held by one of its processes.

        with LiveServer(argv, log_path=..., port=...) as server:
            ...  # server.url
        # stopped here, whatever happened inside
    """

    def __init__(self, argv: list[str], *, port: int, log_path: Path, env: dict[str, str] | None = None,
                 ready_path: str = "/health", startup_timeout: float = 600.0, stop_timeout: float = 30.0):
        self.argv, self.port, self.log_path = list(argv), port, Path(log_path)
        self.command = redact_args(self.argv)  # what is printed, put in errors and in reports
        self.env = engine_environment(dict(os.environ), env)
        self.ready_path, self.startup_timeout, self.stop_timeout = ready_path, startup_timeout, stop_timeout
        self.tag = uuid.uuid4().hex
        self.env[TAG_VAR] = self.tag
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.watchdog: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._old_sigterm = None

    def __enter__(self) -> "LiveServer":
        self._trap_sigterm()
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _trap_sigterm(self) -> None:
        # SIGTERM's default action ends Python without running `finally`: turn it into KeyboardInterrupt meanwhile.
        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            self._old_sigterm = signal.signal(signal.SIGTERM, interrupt)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[live] starting: {' '.join(self.command)}\n[live] log: {self.log_path}", flush=True)
        # First, so no server runs unwatched: it kills the server's tree once its stdin, our pipe, closes. Its own
        # session keeps a terminal's Ctrl-C away from it.
        self.watchdog = subprocess.Popen([sys.executable, str(Path(__file__).with_name("server_procs.py")), self.tag],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                             preexec_fn=die_with_parent_hook())
            except OSError as e:
                raise ServerStartError(f"cannot run {self.argv[0]!r}: {e}") from e
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group, its workers join it
        self._started = time.monotonic()

    def wait_ready(self) -> None:
        deadline = self._started + self.startup_timeout
        foreign = ""  # set once another process answers on our port
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(self._start_failure(f"the server exited with code {code} before it was ready "
                                                           f"on port {self.port}{foreign}"))
            if self._answers():
                if port_held_by(self.port, tagged_processes(self.tag)):
                    self.startup_s = time.monotonic() - self._started
                    print(f"[live] server ready after {self.startup_s:.0f} s at {self.url}", flush=True)
                    return
                foreign = f"; another process listens on port {self.port} and answers {self.ready_path}"
            if time.monotonic() > deadline:
                raise ServerStartError(self._start_failure(
                    f"the server was not ready after {self.startup_timeout:.0f} s (GET {self.url}{self.ready_path})"
                    f"{foreign}"))
            time.sleep(1.0)

    def _start_failure(self, what: str) -> str:
        return f"{what}.\ncommand: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"

    def _answers(self) -> bool:
        """Whatever listens on the port answers `GET ready_path` with 200."""
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after stop_timeout; returns once no process of the group is left (or,
        should it never empty, stop_timeout after the SIGKILL)."""
        try:
            if self.pgid is not None and group_alive(self.pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGTERM)
                if not self._wait_group_gone():
                    print(f"[live] server group {self.pgid} ignored SIGTERM for {self.stop_timeout:.0f} s: SIGKILL",
                          flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pgid, signal.SIGKILL)
                    if not self._wait_group_gone():
                        # Bounded: a container whose init never reaps zombies keeps them listed in the group.
                        print(f"[live] warning: process group {self.pgid} is still listed {self.stop_timeout:.0f} s "
                              f"after SIGKILL (zombies this machine's init does not reap?); not waiting longer",
                              flush=True)
            # Anything that left the group (setsid) but is still the server's, gone before we return (slow on a
            # loaded machine).
            kill_tagged(self.tag, self.stop_timeout)
        finally:
            self._release_watchdog()
            if self._old_sigterm is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def _release_watchdog(self) -> None:
        """Close its pipe: it finds nothing left to kill and exits; reaped here."""
        if self.watchdog is None:
            return
        with contextlib.suppress(OSError):
            self.watchdog.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.watchdog.wait(timeout=self.stop_timeout)
        self.watchdog = None

    def _wait_group_gone(self) -> bool:
        """Wait up to stop_timeout for the group to empty, reaping the leader (our child) so it can; True if it did."""
        deadline = time.monotonic() + self.stop_timeout
        while group_alive(self.pgid) and time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()
            time.sleep(0.1)
        return not group_alive(self.pgid)

    # HTTP helpers

    def get(self, path: str, timeout: float = 60.0) -> str:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise LiveEvalError(f"GET {self.url}{path} failed: {e}\nlast lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}") from e

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LiveEvalError(f"POST {self.url}{path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}"
                                ) from e
        except (urllib.error.URLError, OSError) as e:
            raise LiveEvalError(f"POST {self.url}{path} failed: {e}\nlast lines of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}") from e


# ---------------------------------------------------------------------------------------------------------------------
# Reading acceptance from the server


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


@dataclass
class SpecCounters:
    """Speculative-decoding counters: cumulative server-wide ones, or one request's (a difference of them)."""

    drafts: float = 0.0  # verify steps that carried drafts
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def _combine(self, other: "SpecCounters", sign: float) -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: v + [0.0] * (n - len(v))  # noqa: E731
        return SpecCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                            self.accepted + sign * other.accepted,
                            [a + sign * b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))])

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, 1.0)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return self._combine(other, -1.0)

    def summary(self) -> dict:
        if self.drafts <= 0:
            raise LiveEvalError("the server reports no speculative drafts for these requests "
                                "(spec_decode_num_drafts did not grow): is speculative decoding on?")
        return {"accept_len": 1.0 + self.accepted / self.drafts,
                "accept_rate_at_k": [a / self.drafts for a in self.accepted_per_pos],
                "num_drafts": int(self.drafts), "num_draft_tokens": int(self.draft_tokens),
                "num_accepted": int(self.accepted)}


def vllm_spec_counters(metrics_text: str) -> SpecCounters:
    """vLLM's `vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total` and the per-position accepted
    counts, summed over engines/models."""
    out, per_pos = SpecCounters(), {}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    for name, labels, value in parse_prometheus(metrics_text):
        if name in names:
            setattr(out, names[name], getattr(out, names[name]) + value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    out.accepted_per_pos = [per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)]
    return out


def sglang_request_counters(meta_info: dict) -> SpecCounters:
    """One SGLang /generate answer's acceptance: `spec_verify_ct` verify steps, `spec_num_correct_drafts` accepted
    tokens, and `spec_correct_drafts_histogram` (steps by accepted count) for the per-position rates."""
    if not meta_info.get("spec_verify_ct"):
        raise LiveEvalError(f"SGLang's meta_info has no spec_verify_ct (keys: {sorted(meta_info)}): "
                            "was the server started with --speculative-algorithm?")
    steps = float(meta_info["spec_verify_ct"])
    histogram = [float(v) for v in meta_info.get("spec_correct_drafts_histogram") or []]
    # SGLang sets spec_num_correct_drafts and spec_num_proposed_drafts in the same block as spec_verify_ct
    # (TokenizerManager._calculate_spec_decoding_metrics), so there is nothing to fall back on.
    accepted = float(meta_info["spec_num_correct_drafts"])
    # histogram[j] = steps that accepted exactly j drafts: steps reaching position k accept >= k
    per_pos = [sum(histogram[k:]) for k in range(1, len(histogram))]
    proposed = float(meta_info["spec_num_proposed_drafts"])
    return SpecCounters(steps, proposed, accepted, per_pos)


def sglang_server_accept_length(server_info: dict) -> float | None:
    """`avg_spec_accept_length` from SGLang's /server_info (`internal_states[i]`), averaged over schedulers."""
    values = [s["avg_spec_accept_length"] for s in server_info.get("internal_states") or []
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------------------------------
# Clients: send one prompt (token ids, greedy), return the generated ids and that request's counters


def vllm_generate(server: LiveServer, model: str, prompt_ids: list[int], max_new_tokens: int
                  ) -> tuple[list[int], SpecCounters]:
    """One completion; its acceptance is the growth of the server-wide counters (requests go one at a time)."""
    before = vllm_spec_counters(server.get("/metrics"))
    answer = server.post("/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens,
                                             "temperature": 0.0, "return_token_ids": True})
    ids = answer["choices"][0].get("token_ids")
    if ids is None:
        raise LiveEvalError("vLLM's completion has no choices[0].token_ids (needs return_token_ids, vLLM >= 0.10)")
    return [int(t) for t in ids], vllm_spec_counters(server.get("/metrics")) - before


def sglang_generate(server: LiveServer, model: str, prompt_ids: list[int], max_new_tokens: int
                    ) -> tuple[list[int], SpecCounters]:
    answer = server.post("/generate", {"input_ids": prompt_ids,
                                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}})
    return [int(t) for t in answer["output_ids"]], sglang_request_counters(answer.get("meta_info") or {})


# ---------------------------------------------------------------------------------------------------------------------
# The live eval


def tolerance_note(tolerance: float, gamma: int, rounds: int) -> str:
    per_flip = gamma / max(rounds, 1)
    return (f"|tau_live - tau_offline| <= {tolerance}. Both sides decode greedily from the same prompt ids, take the "
            f"first token from the prefill and verify the same draft, so when the output tokens match (output_match) "
            f"the target side is identical and only the draft's kernel rounding can differ. That flips a draft token "
            f"only at a near-tie of its top two logits; one flip changes that round's accepted count by at most gamma "
            f"(tau by gamma/rounds = {gamma}/{rounds} = {per_flip:.3f}) and re-aligns the rest of that request: "
            f"the tolerance allows about one such event. rounds_match is the stricter check (per request, the same "
            f"rounds and accepted count). Under bf16 serving, or when outputs diverge, pass a wider --tolerance.")


def run_live_eval(*, engine: str, draft: str, target_name: str, dataset: str, out_dir: Path, num_samples: int,
                  max_new_tokens: int, block_size: int | None = None, seed: int = 0, system_prompt: str | None = None,
                  dataset_path: str | None = None, tolerance: float = DEFAULT_TOLERANCE,
                  engine_python: str | None = None, dtype: str | None = None, startup_timeout: float = 900.0,
                  server_args: tuple[str, ...] = (), enable_thinking: bool = False) -> dict:
    """Export `draft` for `engine`, serve it, compare live and offline acceptance; writes OUT/report.json and .md."""
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft_dir = Path(draft)
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"--live needs a trained draft folder (config.json + model.safetensors); got {draft!r}")
    python = engine_python or default_engine_python(engine)
    if shutil.which(python) is None:  # before minutes of offline decoding
        hint = "build it with `make venv-vllm`, or " if engine == "vllm" else "install sglang there, or "
        raise ServerStartError(f"no python at {python!r} to run {engine}: {hint}pass --engine-python")
    algorithm = detect_algorithm(read_config(draft_dir))
    target_path = resolve_target(target_name)

    # Offline first: it also fixes gamma and the prompt ids the server gets. fp32 on CPU, like the served default.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(target_name, device)
    tokenizer = load_tokenizer(target_name)
    drafter = load_draft(draft_dir, target)
    gamma = block_size or drafter.default_gamma
    prompts = eval_prompts(dataset, num_samples, seed, path=dataset_path)
    prompt_ids = [first_turn_ids(tokenizer, p, system_prompt, enable_thinking) for p in prompts]
    offline_outputs, offline_rounds, offline_counts = [], [], []
    for ids in prompt_ids:
        result = speculative_generate(target, drafter, ids, gamma=gamma, max_new_tokens=max_new_tokens,
                                      eos_token_id=tokenizer.eos_token_id, seed=seed, first_token_from_prefill=True)
        offline_outputs.append(result.ids)
        offline_rounds += result.rounds
        offline_counts.append((len(result.rounds), sum(r.accepted for r in result.rounds)))
    offline = acceptance_metrics(offline_rounds, gamma)
    del target, drafter

    served = export_draft(draft_dir, engine, out_dir / "served-draft", algorithm=algorithm, verifier=target_path,
                          overwrite=True)
    port = free_port()
    if engine == "vllm":
        # No GPU here: skip torch.compile (minutes on CPU, same numerics).
        eager = () if torch.cuda.is_available() or "--enforce-eager" in server_args else ("--enforce-eager",)
        argv = vllm_command(python, target_path, served, algorithm, gamma, port, dtype=dtype or "float32",
                            extra=eager + tuple(server_args))
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        generate = vllm_generate
    else:
        served_cfg = read_config(draft_dir)
        sts, sps = sglang_serving_files(served_cfg, algorithm, served)
        argv = sglang_command(python, target_path, served, algorithm, gamma, port, dtype=dtype or "auto",
                              sts_path=sts, sps_path=sps, extra=server_args)
        env, generate = sglang_env(served_cfg, algorithm), sglang_generate

    live_outputs, per_request = [], []
    start = time.monotonic()
    with LiveServer(argv, port=port, log_path=out_dir / f"{engine}-server.log", env=env,
                    startup_timeout=startup_timeout) as server:
        t0 = time.monotonic()
        for ids in prompt_ids:  # one at a time: no batching effects on the numerics
            out, counters = generate(server, target_path, ids, max_new_tokens)
            live_outputs.append(out)
            per_request.append(counters)
        gen_s = time.monotonic() - t0
        server_avg = sglang_server_accept_length(json.loads(server.get("/server_info"))) if engine == "sglang" \
            else None
        startup_s = server.startup_s
    live = sum(per_request, SpecCounters()).summary()
    live.update(server_startup_s=startup_s, tokens_per_s=sum(map(len, live_outputs)) / max(gen_s, 1e-9),
                wall_s=time.monotonic() - start)
    if server_avg is not None:
        live["server_info_avg_accept_length"] = server_avg

    diff = abs(live["accept_len"] - offline["accept_len"])
    matches = [a == b for a, b in zip(live_outputs, offline_outputs)]
    live_counts = [(int(c.drafts), int(c.accepted)) for c in per_request]
    same_rounds = [a == b for a, b in zip(live_counts, offline_counts)]
    report = {
        "engine": engine, "algorithm": algorithm, "draft": str(draft_dir), "served_draft": str(served),
        "target": target_name, "dataset": dataset, "num_samples": len(prompt_ids), "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": gamma, "server_command": server.command,  # secret flag values redacted
        "dtype": dtype or ("float32" if engine == "vllm" else "auto"),
        "live": live,
        "offline": {k: offline[k] for k in ("accept_len", "accept_rate_at_k", "num_rounds")},
        "accept_len_diff": diff, "tolerance": tolerance, "within_tolerance": diff <= tolerance,
        "tolerance_note": tolerance_note(tolerance, gamma, offline["num_rounds"]),
        "output_match": sum(matches) / max(len(matches), 1),
        # Stricter than tau: per request, the same number of verify rounds and of accepted drafts.
        "rounds_match": sum(same_rounds) / max(len(same_rounds), 1),
        "samples": [{"id": p.id, "prompt_tokens": len(ids), "live_tokens": len(a), "offline_tokens": len(b),
                     "outputs_equal": m, "live_rounds_accepted": lc, "offline_rounds_accepted": oc}
                    for p, ids, a, b, m, lc, oc in zip(prompts, prompt_ids, live_outputs, offline_outputs, matches,
                                                       live_counts, offline_counts)],
    }
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", live_markdown(report))
    return report


def live_markdown(report: dict) -> str:
    live, offline = report["live"], report["offline"]
    k = report["num_speculative_tokens"]
    row = lambda v: " | ".join(f"{x:.3f}" for x in (v + [float("nan")] * k)[:k])  # noqa: E731
    return "\n".join([
        f"# Live accept length: {report['engine']} ({report['algorithm']})", "",
        f"draft `{report['draft']}` served from `{report['served_draft']}`, target `{report['target']}`, "
        f"{report['num_samples']} {report['dataset']} prompts, {report['max_new_tokens']} new tokens, "
        f"{k} speculative tokens, greedy", "",
        "| | tau | rounds | accept rate @1.. |", "|---|---|---|---|",
        f"| live ({report['engine']}) | {live['accept_len']:.3f} | {live['num_drafts']} | "
        f"{row(live['accept_rate_at_k'])} |",
        f"| offline (DraftSmith) | {offline['accept_len']:.3f} | {offline['num_rounds']} | "
        f"{row(offline['accept_rate_at_k'])} |", "",
        f"|difference| {report['accept_len_diff']:.4f}, tolerance {report['tolerance']}: "
        f"{'OK' if report['within_tolerance'] else 'OUT OF TOLERANCE'}; outputs equal on "
        f"{report['output_match']:.0%} of prompts; the same rounds and accepted count on "
        f"{report['rounds_match']:.0%}.", "", report["tolerance_note"], ""])


def print_live_summary(report: dict) -> None:
    live, offline = report["live"], report["offline"]
    print(f"[live] {report['engine']} {report['algorithm']}: tau live {live['accept_len']:.3f} "
          f"({live['num_drafts']} drafts, {live['num_accepted']} accepted) vs offline {offline['accept_len']:.3f} "
          f"({offline['num_rounds']} rounds): |diff| {report['accept_len_diff']:.4f} "
          f"{'<=' if report['within_tolerance'] else '>'} {report['tolerance']}; outputs equal on "
          f"{report['output_match']:.0%} of prompts, rounds equal on {report['rounds_match']:.0%}; "
          f"server ready in {live['server_startup_s']:.0f} s", flush=True)
