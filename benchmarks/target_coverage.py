"""Target coverage: which of transformers' causal-LM model types DraftSmith takes as a target. Each model type of
transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES is built tiny and random from its config class's defaults, then run
through DraftSmith's pre-flight (eval/preflight.py check_target: every target-dependent step of a run, in seconds).

    python benchmarks/target_coverage.py --out runs/target-coverage                # ~10 min on 2 CPU cores
    python benchmarks/target_coverage.py --types llama,gpt_neox,bert --family eagle3

Per model type: `CONFIG_MAPPING[type]()`'s defaults, shrunk by one rule per kind of size key (layer counts to 4,
widths to 64, heads to 4, key/value heads to 2, head sizes to 16, MLPs to 128 and MoE experts' to 32, experts to 4 of
which 2 per token, low ranks to 32, attention windows to 8 tokens), each touching only a key the default holds as an
int, and only downwards; the vocabulary is Qwen3's 151,936 (the dspark recipes' mask token is 151669), special token
ids past it move to its last rows; per-layer lists are cut to the new layer count keeping every kind of layer; a
vision or audio tower gets 2 layers. The few sizes some defaults leave None (head_dim, MoE counts) are filled, and
one type (gpt_neo) gets a tweak of its own (TWEAKS). The model is built on the meta device first and not built over
MAX_PARAMETERS (blt at its defaults needs more than a 24 GiB machine); then in fp32 on the CPU from seed 0, frozen,
its linears packed as modeling/target.py load_target does. The recipe is {family}_qwen3_8b with a one-layer draft
reading the target's layers 0-2.

Each type's verdict: `pass`; `refused` (check_target's PreflightError: the step and why); `could not build` (the
config or model raises, or it is too big); `timed out` (TIMEOUT_S); `FAIL` (any other exception out of check_target:
a traceback where the pre-flight should have named the problem). Goal: no type fails with a traceback; every
buildable type passes the pre-flight or is refused by name. Prints a markdown table and the counts; writes
OUT/coverage.json (each type's row, and a FAIL's traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import re
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("dspark", "dflash", "eagle3")
VERDICTS = ("pass", "refused", "could not build", "timed out", "FAIL")
TIMEOUT_S = 120
MAX_PARAMETERS = 40_000_000  # two Qwen3-vocabulary matrices of width 64 are 19.4M
VOCAB = 151_936  # Qwen3's: the dspark recipes' mask token id 151669 lies inside it
LAYERS = 4
# the draft's keys (a one-layer draft, as benchmarks/arch_matrix.py's), per family
DRAFT_SETS = {"dspark": ["draft.num_layers=1", "draft.block_size=3", "draft.markov_rank=8"],
              "dflash": ["draft.num_layers=1", "draft.block_size=3"],
              "eagle3": ["draft.num_layers=1", "draft.draft_vocab_size=512", "draft.ttt_length=3"]}

# One rule per kind of size key: (pattern over the key's name, the size it is cut to), first match wins; a rule
# touches only a key the default config holds as an int, and only downwards. A key no rule matches keeps its default.
TOTAL_LAYERS = re.compile(r"^(num_hidden_layers|n_layers?|num_layers|(en|de)coder_layers|num_(en|de)coder_layers|"
                          r"num_blocks|depth|num_layers_per_stack|conf_num_hidden_layers|num_global_layers)$")
PART_OF_STACK = re.compile(r"(layers|_replace)$")  # the dense layers before the MoE ones, layers sharing a KV cache
WIDTH = re.compile(r"hidden_size|^n_embd$|^d_model$|emb(ed|edding)?_(dim|size)$|_width$|_proj_dim$")
MLA_PARTS = re.compile(r"(nope|rope)_head_dim$")
HEAD_SIZE = re.compile(r"head_dim$|head_size$|headdim$|^d_head$|^dim_head$|^kv_channels$|^rotary_dim$|^d_rel$")
KV_HEADS = re.compile(r"key_value_heads|kv_heads$|^kv_n_heads$|^num_query_groups$")
HEADS = re.compile(r"heads$|^n_head$")
WINDOW = re.compile(r"sliding_window(_size)?$|^window_size$|^attention_window_size$|^local_attention$|"
                    r"^attention_chunk_size$")
SIZE_RULES = [
    (re.compile(r"vocab"), VOCAB),  # beside the model's: per-layer input embeddings (read by token id), byte hashes
    (KV_HEADS, 2),  # as many as the heads where the default has as many (no GQA, MLA): _shrunk_int
    (HEADS, 4),
    (MLA_PARTS, 8),  # MLA's query/key head: a part without rope and one with, 16 in all
    (HEAD_SIZE, 16),  # one equal at its defaults to an MLA part, or to both, stays so: _mla_head_sizes
    (re.compile(r"(moe|expert).*(intermediate|ffn|hidden)|(intermediate|ffn).*(moe|expert)"), 32),
    (re.compile(r"intermediate|ffn|feed_forward|^dff$|^d_inner$|^dim_ff$|^mlp_dim$|d_ssm$"), 128),
    (re.compile(r"per_layer"), 16),  # Gemma 3n's and 4's per-layer input embeddings: a vocabulary-sized table each
    (WIDTH, 64),  # k times the width at its defaults (Zamba's attention over [state, embedding]): k x 64
    (re.compile(r"experts_per_tok(en)?$|^moe_top_?k$|^moe_k$"), 2),
    (re.compile(r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$"), 1),
    (re.compile(r"experts$|^zero_expert_num$"), 4),
    (re.compile(r"^(n_group|num_expert_group|topk_group)$"), 1),  # expert groups: 4 experts make one
    (re.compile(r"rank$"), 32),  # low ranks: MLA's q/kv projections, adapters
    (re.compile(r"layer_period$"), 2), (re.compile(r"layer_offset$"), 1),  # Jamba's attention every 8th layer from 4
    (WINDOW, 8),  # attention windows and chunks, which the pre-flight's 12-token prompt and its decode run past
]
# A size the defaults leave None that the modeling code computes with (a checkpoint's config.json names it).
FILL_NONE = {"head_dim": 16, "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
             "num_experts_per_tok": 2}
# A state-space stack's heads span `expand` x the width: with heads of 16, expand x 64 / 16 of them (Mamba-2's config
# checks it). Its head count goes by these names (Mamba-2's `num_heads`, only where the config has an `expand`).
SSM_HEADS = re.compile(r"^(mamba_n_heads|mamba_num_heads|n_mamba_heads|num_heads)$")
TOKEN_ID = re.compile(r"token_(id|index)s?$")
# Per-type tweaks, only where no rule per key kind can work:
TWEAKS = {"gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]}}  # layers counted in pattern repeats


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(config) -> dict:
    """The config's constructor arguments, as the default holds them."""
    names = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set(vars(config))
    return {k: v for k, v in vars(config).items() if k in names}


def _sub_configs(config) -> dict:
    """The config's nested configs (a multimodal model's text and vision configs), by field name."""
    from transformers import PretrainedConfig

    return {name: value for name, value in _fields(config).items() if isinstance(value, PretrainedConfig)}


def _fewer_layers(values: list, layers: int = LAYERS) -> list:
    """A per-layer list cut to `layers` entries, in their order, keeping every kind of layer the full stack has (its
    sliding and full attention, linear-attention or state-space layers), twice where it has several: a kind's one
    layer can be what the model ties or shares the others to."""
    kinds = [repr(v) for v in values]
    quota = dict.fromkeys(kinds, 0)
    for cap in (1, 2, len(values)):  # each kind once, then twice, then as many as the full list has, in its order
        for kind in quota:
            room = layers - sum(quota.values())
            quota[kind] = max(quota[kind], min(cap, kinds.count(kind), quota[kind] + room))
    kept = []
    for value, kind in zip(values, kinds):
        if quota[kind]:
            kept.append(value)
            quota[kind] -= 1
    return kept


def _size(key: str, value: int) -> int:
    for pattern, size in SIZE_RULES:
        if pattern.search(key):
            return min(value, size)
    return value


def _shrunk_int(key: str, value: int, values: dict, layers: int):
    """An int key's tiny value (`values`: the config's defaults)."""
    total = next((v for k, v in values.items() if TOTAL_LAYERS.match(k) and _int(v)), None)
    width = next((v for k, v in values.items() if k in ("hidden_size", "n_embd", "d_model") and _int(v)), None)
    expand = values.get("expand") or values.get("mamba_expand")
    if "vocab" in key and value == values.get("vocab_size"):  # the model's vocabulary (Marian's decoder's too)
        return VOCAB
    if TOTAL_LAYERS.match(key):
        return min(value, layers)
    if PART_OF_STACK.search(key) and total:  # a part of the stack: as large a part of the tiny one
        return min(value, max(int(value > 0), value * layers // total), layers - 1)
    if KV_HEADS.search(key) and any(HEADS.search(k) and not KV_HEADS.search(k) and v == value
                                    for k, v in values.items()):
        return _size("heads", value)
    if WIDTH.search(key) and width and value > width and value % width == 0:
        return 64 * value // width
    if _int(expand) and SSM_HEADS.match(key):
        return min(value, expand * 64 // 16)
    return _size(key, value)


def _mla_head_sizes(values: dict, out: dict) -> None:
    """A head size equal at its defaults to one of MLA's parts (rope, no rope) or to both keeps being so."""
    parts = [k for k in out if MLA_PARTS.search(k)]
    derived = {**{values[a] + values[b]: out[a] + out[b] for a in parts for b in parts if a < b},
               **{values[a]: out[a] for a in parts}}
    for key in [k for k in out if HEAD_SIZE.search(k) and k not in parts and values.get(k) in derived]:
        out[key] = derived[values[key]]


def _token_ids(values: dict, vocab: int) -> dict:
    """Special token ids past the vocabulary moved to its last rows (which no prompt here reads), each its own."""
    past = sorted({i for k, v in values.items() if TOKEN_ID.search(k)
                   for i in (v if isinstance(v, (list, tuple)) else [v]) if _int(i) and i >= vocab})
    moved = {i: vocab - 1 - n for n, i in enumerate(past)}
    out = {}
    for key, value in values.items():
        if TOKEN_ID.search(key) and isinstance(value, (list, tuple)) and any(v in moved for v in value):
            out[key] = [moved.get(v, v) for v in value]
        elif TOKEN_ID.search(key) and _int(value) and value in moved:
            out[key] = moved[value]
    return out


def shrunk_fields(config, layers: int = LAYERS) -> dict:
    """The constructor arguments that make `config` (a default config) tiny: its int keys by their kind's rule, sizes
    it leaves None filled, per-layer lists and lists of layer indices cut to the tiny stack, special token ids kept in
    the vocabulary; nested configs shrunk the same way and rebuilt, all but the text model's to 2 layers (a vision
    tower as deep as the language model would be a second decoder stack of its length, which no real pair is)."""
    values = _fields(config)
    total = next((v for k, v in values.items() if TOTAL_LAYERS.match(k) and _int(v)), None)
    out = {}
    for key, value in values.items():
        if key in FILL_NONE and value is None:
            out[key] = FILL_NONE[key]
        elif _int(value) and not TOKEN_ID.search(key) and _shrunk_int(key, value, values, layers) != value:
            out[key] = _shrunk_int(key, value, values, layers)
        elif not isinstance(value, (list, tuple)) or not total or not value:
            continue
        elif len(value) == total > layers:
            out[key] = [_size(key, v) if _int(v) else v for v in _fewer_layers(list(value), layers)]
        elif all(_int(v) and 0 <= v < total for v in value) and list(value) == sorted(set(value)):
            out[key] = [v for v in value if v < layers] or [layers - 1]  # layer indices (full-attention, MoE layers)
    _mla_head_sizes(values, out)
    out.update(_token_ids(values, out.get("vocab_size", VOCAB)))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, sub in _sub_configs(config).items():  # its own values (its parent may have set some), shrunk
        own = {k: v for k, v in _fields(sub).items() if k not in _sub_configs(sub)}
        out[key] = type(sub)(**{**own, **shrunk_fields(sub, layers if sub is text else 2)})
    return out


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    default = CONFIG_MAPPING[model_type]()
    return type(default)(**{**shrunk_fields(default), **TWEAKS.get(model_type, {})})


class TooBig(ValueError):
    """The model's parameters at its defaults shrunk are more than MAX_PARAMETERS."""


def build_model(model_type: str):
    """(the tiny random model, its parameter count); TooBig, naming the count, before it is built."""
    import torch
    from transformers import AutoModelForCausalLM

    from modeling import cpu_linear

    config = tiny_config(model_type)
    with torch.device("meta"):  # counted before any memory is taken
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise TooBig(f"{count / 1e6:.0f} M parameters at its defaults shrunk (over {MAX_PARAMETERS / 1e6:.0f} M)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    cpu_linear.pack_linears(model)  # as modeling/target.py load_target runs a target on a CPU
    return model, count


def recipe_for(model, family: str):
    """The family's Qwen3-8B recipe with a one-layer draft reading the target's first three layers (fewer on a
    shallower stack; [0] where no stack is found: the pre-flight refuses that by name)."""
    from core.recipe import load_recipe
    from modeling.anatomy import decoder_layers

    try:
        count = len(decoder_layers(model))
    except Exception:  # noqa: BLE001 - the pre-flight's first step names it
        count = 1
    layer_ids = list(range(min(3, max(1, count - 1))))
    return load_recipe(f"{family}_qwen3_8b", [f"target.layer_ids={layer_ids}"] + DRAFT_SETS[family])


class TimedOut(BaseException):
    """A type's build and pre-flight ran past TIMEOUT_S (a BaseException: the pre-flight's steps turn every Exception
    into a refusal)."""


def _first_line(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:limit]}"


def check_type(model_type: str, family: str = "dspark", timeout_s: int = TIMEOUT_S) -> dict:
    """One model type's row: {type, class, verdict, reason, parameters, seconds[, traceback]}."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from eval.preflight import PreflightError, check_target

    row = {"type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"), "verdict": "",
           "reason": "", "parameters": None, "seconds": 0.0}
    start = time.perf_counter()

    def expire(_signum, _frame):
        raise TimedOut()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    model = None
    try:
        try:
            model, row["parameters"] = build_model(model_type)
        except TooBig as exc:
            row.update(verdict="could not build", reason=str(exc))
            return row
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the finding
            row.update(verdict="could not build", reason=_first_line(exc))
            return row
        try:
            report = check_target(model, recipe_for(model, family))
            row.update(verdict="pass", reason=report.line(),  # the table shows where the stack was found, and notes
                       summary="; ".join(report.passed[:1] + [f"note: {note}" for note in report.notes]))
        except PreflightError as exc:
            row.update(verdict="refused", reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - a traceback the pre-flight should have named: the goal is none
            row.update(verdict="FAIL", reason=_first_line(exc), traceback=traceback.format_exc()[-3000:])
    except TimedOut:
        row.update(verdict="timed out", reason=f"build and pre-flight past {timeout_s} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        del model
        gc.collect()
        row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run_coverage(types: list[str], family: str = "dspark", timeout_s: int = TIMEOUT_S) -> list[dict]:
    """Each type's row, in order; a progress line per type on stderr. transformers' logging and warnings are
    silenced, and anything a model prints goes to stderr, away from the table."""
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows = []
    for i, model_type in enumerate(types, 1):
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            rows.append(check_type(model_type, family, timeout_s))
        row = rows[-1]
        print(f"[target-coverage] {i}/{len(types)} {model_type}: {row['verdict']} ({row['seconds']:.1f} s) "
              f"{row['reason'][:150]}", file=sys.stderr, flush=True)
    return rows


def counts(rows: list[dict]) -> dict[str, int]:
    return {verdict: sum(r["verdict"] == verdict for r in rows) for verdict in VERDICTS}


def _cell(text: str, limit: int = 150) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short_reason(row: dict) -> str:
    """A pass's stack and notes; a refusal without the preamble every refusal shares (`the target (X) fails the
    pre-flight at `)."""
    return row.get("summary") or re.sub(r"^the target \([^)]*\) fails the pre-flight at ", "at ", row["reason"])


def refusals_by_step(rows: list[dict]) -> dict[str, list[str]]:
    """{the pre-flight step that refused: the types it refused}, most first."""
    steps: dict[str, list[str]] = {}
    for row in rows:
        if row["verdict"] == "refused":
            steps.setdefault(_short_reason(row).removeprefix("at ").split(":")[0], []).append(row["type"])
    return dict(sorted(steps.items(), key=lambda item: -len(item[1])))


def markdown(rows: list[dict], family: str, transformers_version: str, seconds: float) -> str:
    """The table, the counts and fractions (over all types and over the buildable ones), the refusals by step, and
    each FAIL's traceback."""
    lines = ["| model type | causal LM class | verdict | reason |", "|---|---|---|---|"]
    lines += [f"| {r['type']} | {r['class']} | {r['verdict']} | {_cell(_short_reason(r))} |" for r in rows]
    found = counts(rows)
    built = len(rows) - found["could not build"]
    lines += ["", f"{len(rows)} model types, family {family}, transformers {transformers_version}, "
                  f"{seconds:.0f} s wall time", "",
              "| verdict | types | of all | of buildable |", "|---|---|---|---|"]
    for verdict in VERDICTS:
        of_built = (f"{found[verdict] / built:.1%}" if built and verdict != "could not build" else "-")
        lines.append(f"| {verdict} | {found[verdict]} | {found[verdict] / max(1, len(rows)):.1%} | {of_built} |")
    met = found["FAIL"] == 0
    lines += ["", "Goal: no type fails with a traceback; every buildable type passes the pre-flight or is refused by "
                  f"name. {'Met' if met else 'NOT met'}: {found['FAIL']} FAIL ({found['timed out']} timed out, "
                  f"counted apart).", "", "Refusals by step:"]
    lines += [f"- {step}: {len(types)} ({', '.join(types)})" for step, types in refusals_by_step(rows).items()]
    for r in rows:
        if r["verdict"] == "FAIL":
            lines += ["", f"FAIL {r['type']}:", "```", r["traceback"].rstrip()[-1200:], "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="dspark", help="the drafter family's recipe")
    parser.add_argument("--types", default=None, help="comma-separated model types (default: every causal LM type)")
    parser.add_argument("--out", type=Path, default=None, help="folder for coverage.json")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per type (build and pre-flight)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from core.io import atomic_write_text

    types = args.types.split(",") if args.types else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"not a causal LM model type of transformers {transformers.__version__}: {unknown}")
    start = time.perf_counter()
    rows = run_coverage(types, args.family, args.timeout)
    seconds = time.perf_counter() - start
    print(markdown(rows, args.family, transformers.__version__, seconds))
    if args.out is not None:
        atomic_write_text(args.out / "coverage.json", json.dumps(
            {"family": args.family, "transformers": transformers.__version__, "seconds": round(seconds, 1),
             "counts": counts(rows), "rows": rows}, indent=2) + "\n")
    return 0 if counts(rows)["FAIL"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
