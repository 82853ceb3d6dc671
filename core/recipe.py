"""Recipes: plain YAML data in recipes/, one typed schema, strict validation.

A recipe is `recipes/<name>.yaml`. It may name shared pieces under `base:` (files in recipes/base/, merged in
order, the recipe's own keys last), so a family's loss weights or a target's data settings live in one place.
Every key is checked against the dataclasses below: an unknown key names the closest valid one, a wrong type
names the expected type, and all errors are reported at once. `--set a.b=value` overrides any key before
validation (values are parsed as YAML, so `--set train.max_steps=10` is an int and `--set draft.mask_token_id=null`
is None).

    recipe = load_recipe("dspark_smollm2_135m", overrides=["data.num_prompts=64"])
    recipe.target.layer_ids  # [1, 8, 14, 21, 27]
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from core.redact import redact_url, redact_urls

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
#: the drafter families a recipe trains; modeling/registry.py maps each to its model class. The block families are
#: one model (modeling/dspark.py): DFlash is DSpark with its Markov and confidence heads off, DFlash2 is DFlash plus
#: the candidate selector (modeling/selector.py).
BLOCK_FAMILIES = ("dspark", "dflash", "dflash2")
FAMILIES = (*BLOCK_FAMILIES, "eagle3")


# --- schema -------------------------------------------------------------------------------------------------------


@dataclass
class TargetConfig:
    #: Hugging Face id or local path, or `smollm2-135m-instruct` (the embedded offline target).
    name_or_path: str = "smollm2-135m-instruct"
    #: HF layer-output ids whose hidden states the drafter reads (0-based decoder layers).
    layer_ids: list[int] = field(default_factory=lambda: [1, 8, 14, 21, 27])
    #: auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"


@dataclass
class SourceConfig:
    #: sharegpt | humaneval | mtbench | gsm8k | a local .json/.jsonl path | a Hugging Face dataset id
    name: str = "sharegpt"
    path: Optional[str] = None
    weight: float = 1.0
    split: str = "train"


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    num_prompts: int = 100_000
    #: false = a recipe asking for more prompts than its sources hold is refused before regeneration; true = it
    #: trains on what the sources hold (with a warning).
    allow_fewer: bool = False
    holdout_fraction: float = 0.05
    max_length: int = 4096
    #: None keeps the chat template's own default system prompt (training and eval alike).
    system_prompt: Optional[str] = None
    #: drop = strip <think> blocks from answers before training; keep = train on them.
    thinking: Literal["drop", "keep"] = "drop"
    #: conversations with fewer supervised tokens are not cached.
    min_loss_tokens: int = 8
    #: only the first N user turns of each prompt are replayed.
    max_turns: int = 4


@dataclass
class RegenConfig:
    #: hf = in-process batched generation; vllm, sglang = a vLLM or SGLang server this stage starts and stops itself
    #: (one per rank, on its GPU; the token ids the HF backend would use; vLLM also on CPU, ~3x faster there; SGLang
    #: on GPUs only); openai = any OpenAI-compatible server already running (SGLang, vLLM); source = keep the
    #: source's own answers, generating nothing (train with loss.ce_labels: target: the target's labels on that text);
    #: auto = vllm on a machine without CUDA where a python with vLLM is found (regen.engine_python,
    #: $DRAFTSMITH_VLLM_PYTHON or ./.venv-vllm), else hf; the run says which (data/regen_backends.choose_backend).
    backend: Literal["auto", "hf", "vllm", "sglang", "openai", "source"] = "hf"
    #: several URLs = data parallel over servers (openai backend).
    server_urls: list[str] = field(default_factory=list)
    #: model name sent to the server (default: the target's name_or_path).
    served_model: Optional[str] = None
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 4096
    enable_thinking: bool = False
    #: prompts per generation batch (hf) and per resumable chunk (both backends).
    batch_size: int = 16
    max_concurrency: int = 64
    request_timeout_s: float = 600.0
    #: tries per request (openai backend): HTTP 429, 5xx, refused connections and timeouts are tried again after a
    #: backoff (a Retry-After header is honoured, up to 30 s); what still fails is asked again by the next run.
    request_attempts: int = 3
    #: server backends: no request finished for this long stops the stage with an error naming the servers (one that
    #: accepts connections but never answers would otherwise cost request_timeout_s x request_attempts per request,
    #: hours over a dataset); the chunks in flight are not marked done, a rerun does them.
    stall_timeout_s: float = 1800.0
    #: hf backend: each = on a CPU, every prompt's prefill runs alone (a padded batch costs batch x its longest
    #: prompt; the same greedy answers); padded = generate's own prefill of the left-padded batch (always on a GPU).
    prefill: Literal["each", "padded"] = "each"
    #: vllm, sglang backends: the python that runs the engine (None: for vLLM $DRAFTSMITH_VLLM_PYTHON, else
    #: ./.venv-vllm, built by `make venv-vllm`; for SGLang this interpreter), extra server flags, and how long its start
    #: may take.
    engine_python: Optional[str] = None
    server_args: list[str] = field(default_factory=list)
    server_startup_s: float = 900.0


@dataclass
class CacheConfig:
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    #: how hidden states are stored: fp8 (e4m3 with a power-of-two scale per token and layer: H + 1 bytes a row,
    #: 0.501x bf16's 2H; read back in `dtype`) | raw (the dtype's bytes). fp8 matched raw's held-out tau at equal steps
    #: for each family, within 0.6% (benchmarks/README.md, "Hidden-state cache encoding"); online runs round through it
    #: too, so that they train on what an offline run reads. See data/cache.py.
    encoding: Literal["raw", "fp8"] = "fp8"
    #: conversations per target forward.
    batch_size: int = 8
    #: where the hidden states come from: hf = the target in-process (each rank loads it whole); engine = a vLLM server
    #: (extract_hidden_states; data/engine_states.py): the stage's own, one per rank, or cache.server_urls' (a target
    #: too large for one device, served with tensor or expert parallelism elsewhere), and the training processes then
    #: load only the target's embedding, final norm and lm_head (modeling/target.load_target_parts). With
    #: train.hidden_states online the train stage asks the engine for each micro-batch's states instead.
    backend: Literal["hf", "engine"] = "hf"
    #: engine backend: running vLLM servers started with data/engine_states.engine_server_args' flags (several = data
    #: parallel over them; regen.served_model names the model they serve); none = each rank starts its own
    #: (regen.engine_python, regen.server_args, regen.*_s).
    server_urls: list[str] = field(default_factory=list)
    #: engine backend: the folder the servers write the states to (their connector's shared_storage_path) as this
    #: machine sees it; required with cache.server_urls, a scratch folder otherwise.
    states_dir: Optional[str] = None
    #: conversations per shard file; a shard is the unit of resume and of work split across ranks.
    records_per_shard: int = 1024


@dataclass
class DraftConfig:
    num_layers: int = 5
    #: gamma: tokens proposed per round.
    block_size: int = 7
    num_anchors: int = 512
    #: True = anchor-first block (DeepSpec); False = 1+N layout (z-lab DFlash, SGLang DFLASH).
    sample_from_anchor: bool = True
    #: 0 = no Markov head (DFlash).
    markov_rank: int = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    #: None = pick the family's documented default for the target vocabulary.
    mask_token_id: Optional[int] = None
    #: starts (the defaults keep N(0, 0.02) everywhere and unit norms; see init_from_target in modeling/):
    #: random | target = the draft's decoder layers start as copies of the target's last ones.
    init_layers: Literal["random", "target"] = "random"
    #: random | last = the identity on the last captured layer | normalized = N(0, 0.02) with column j divided by
    #: input dimension j's RMS over the cache (the outlier dimensions do not drown the rest at the start).
    init_fc: Literal["random", "last", "normalized"] = "random"
    #: output norm weight at start: ones | target (the target's final-norm weight).
    init_norm: Literal["ones", "target"] = "ones"
    #: Markov head: normal = N(0, 0.02) both factors | zero_w2 = first factor N(0, 1), second factor zero.
    markov_init: Literal["normal", "zero_w2"] = "normal"
    #: DSpark/DFlash: none | trained = layer 0's attention starts as prompt lookup does (match the pending token in the
    #: context, read the target's prediction there), fitted on the cache at the start (train/copy_init.py) | frozen =
    #: that start kept as fitted while the rest trains.
    init_copy: Literal["none", "trained", "frozen"] = "none"
    #: DFlash2's candidate selector: rank of its predecessor/successor tables (0 = none) and the K candidates per slot
    #: (the lm_head's top K) it rescores with the transition from the previous slot's pick.
    selector_rank: int = 0
    selector_top_k: int = 16
    #: Eagle3 only.
    ttt_length: int = 7
    draft_vocab_size: Optional[int] = None


@dataclass
class LossConfig:
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    #: w_k = exp(-(k-1)/gamma) per block position.
    loss_decay_gamma: float = 4.0
    #: block drafters: cross-entropy against the target's whole distribution at each prediction (dense soft labels).
    soft_ce_alpha: float = 0.0
    #: DFlash2: weight of the selector's K-way cross-entropy (speculators' selector_loss_alpha): its scores over the
    #: draft's top-K candidates (the label put in place of the K-th when absent) against the CE label (loss.ce_labels).
    selector_alpha: float = 0.0
    #: block drafters: the first N optimizer steps train CE only (the L1 term has almost no gradient while the draft
    #: puts ~1/V on the target's token), then the alphas above.
    ce_warmup_steps: int = 0
    #: compute the acceptance statistics (training tau, accept_rate) even when no loss term needs the target
    #: distribution (DFlash); false saves a vocabulary-sized matmul per prediction.
    accept_stats: bool = True
    #: Eagle3 per-TTT-step decay.
    step_loss_decay: float = 0.8
    #: Eagle3 loss denominator. valid_tokens = sum_k decay^k x (valid positions of step k) over the global batch (a
    #: token mean: late steps, with fewer valid positions, weigh as much per token as early ones); positions =
    #: DeepSpec's choice: the batch's token count, the same for every step (its code notes the token mean hurt
    #: accept length).
    eagle3_loss_norm: Literal["valid_tokens", "positions"] = "valid_tokens"
    #: recompute each chunk of vocabulary-sized tensors in the backward instead of keeping it (GPU memory); false is
    #: faster where memory is plenty (small drafters on a CPU).
    checkpoint: bool = True
    #: block drafters' CE label: tokens = the next token of the cached text (the target's own greedy answer after a
    #: T=0 regeneration); target = the target's argmax there, read from the cached final state (the label a greedy
    #: target would verify; needed when the text is not the target's, regen.backend: source). Eagle3 always learns the
    #: target's distribution.
    ce_labels: Literal["tokens", "target"] = "tokens"
    #: block drafters: the losses' softmaxes run over the N most frequent supervised tokens of the cache (a
    #: prediction whose label is outside them weighs nothing); null = the whole target vocabulary. Training only:
    #: the drafter still drafts over the whole vocabulary, as SGLang serves it (with the target's lm_head). On a
    #: small drafter the vocabulary-sized matmuls are nearly all of a step (SmolLM2: 49,152 x 576 per prediction).
    vocab_size: Optional[int] = None


@dataclass
class TrainConfig:
    max_steps: int = 20_000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    #: std of Gaussian noise added to the captured target states (the drafter's context features, not the states its
    #: loss distils) while training, in units of each dimension's RMS over the data: EAGLE's feature noise, so the
    #: drafter cannot key on exact states it has seen. 0 = off.
    feature_noise: float = 0.0
    #: dropout on the drafter's residual branches (each decoder layer's attention and MLP output) while training, a
    #: regulariser against memorising the training answers; masks drawn per micro-batch from (seed, step, rank), so a
    #: resumed run drops the same units. Training only: nothing of it is in the exported config. 0 = off.
    dropout: float = 0.0
    global_batch_size: int = 512
    micro_batch_size: int = 1
    max_grad_norm: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    #: DDP engine (zero_stage 0): torch's fused AdamW (about 4x faster optimizer step on a CPU).
    fused_optimizer: bool = False
    #: 0 = plain DDP; 1 or 2 = DeepSpeed ZeRO stage (3 is refused: see _check_values).
    zero_stage: int = 0
    #: auto = bf16 on GPU and on CPUs with bf16 matrix units, else fp32; bf16 on a CPU autocasts over fp32 weights (fast where the CPU has bf16
    #: matrix units, e.g. AMX), fp32 everywhere is the bit-exact reference.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    #: cache = read the cache stage's hidden states; online = run the frozen target on each step's rows in the training
    #: processes (no cache stage, nothing on disk but checkpoints; see data/online.py).
    hidden_states: Literal["cache", "online"] = "cache"
    save_every: int = 1000
    #: checkpoints kept on disk (newest first); older ones are deleted once a newer one is complete. 0 keeps all.
    keep_checkpoints: int = 2
    #: decay of an exponential moving average of the trainable draft weights, updated after every optimizer step
    #: (capped by (1 + t) / (10 + t) at step t, so the start fades early; train/ema.py); train/final (which eval,
    #: export and opd read; opd's rounds average too) holds the average, the last checkpoint's draft the last step's
    #: own weights. 0 = off.
    ema_decay: float = 0.0
    log_every: int = 10
    wandb_project: Optional[str] = None


@dataclass
class OpdConfig:
    """On-policy distillation after `train` (train/opd.py): rounds of rollout with the current drafter along the
    training answers (greedy or sampled: regen.temperature), then updates where verification rejected its drafts."""

    #: 0 = no opd stage (the pipeline skips it and eval/export read train/final).
    rounds: int = 0
    #: training conversations rolled out per round (a seeded sample; all of them when the data holds fewer).
    rollout_records: int = 64
    #: optimizer steps per round (train.global_batch_size sequences each); the lr decays from opd.lr within a round.
    steps_per_round: int = 20
    lr: float = 3.0e-4
    #: where a round's updates anchor: "rollout" = the rollouts' round starts (Draft-OPD); "uniform" = anywhere in the
    #: answers as the train stage does, with no rollout: the same rounds as plain continued SFT, OPD's control.
    anchors: Literal["rollout", "uniform"] = "rollout"


@dataclass
class EvalConfig:
    dataset: str = "mtbench"
    num_samples: int = 80
    temperature: float = 0.0
    max_new_tokens: int = 512
    #: also decode the same prompts with the free n-gram drafter and report the draft's tau as a ratio of its.
    ngram_baseline: bool = True
    #: false = a run whose eval set holds training prompts (a training source read whole, or its held-out split at
    #: data.holdout_fraction 0) is refused before anything runs; true = measure how the drafter fits the prompts it
    #: trained on (the overfit recipes).
    allow_training_prompts: bool = False


@dataclass
class Recipe:
    family: Literal[FAMILIES] = "dspark"
    seed: int = 42
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    opd: OpdConfig = field(default_factory=OpdConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: filled in by load_recipe; not a key you set.
    name: str = ""


# --- loading ------------------------------------------------------------------------------------------------------


def is_plain_name(name: str) -> bool:
    """A run name: one folder under runs/, never a path out of it (`../x`, `/abs`, `.`)."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


class RecipeError(ValueError):
    """A recipe (or a --set override) does not match the schema; the message lists every problem."""


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    path = Path(name_or_path)
    if not path.suffix:
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(str(name_or_path), list_recipes(), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RecipeError(f"no recipe '{name_or_path}'.{hint} `python train/main.py --list-recipes` lists them.")
    raw = _read_with_bases(path, seen=())
    for item in overrides:
        _apply_override(raw, item)
    raw.setdefault("name", path.stem)
    errors: list[str] = []
    recipe = _build(Recipe, raw, "", errors)
    if errors:
        raise RecipeError(f"recipe '{path.stem}' is invalid:\n  " + "\n  ".join(errors))
    _check_values(recipe)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def shareable_recipe_dict(recipe: Recipe) -> dict:
    """recipe_to_dict with the server URLs' credentials and query strings redacted: what is written to a run's
    recipe.yaml and to the experiment trackers (a token in http://user:token@host must not travel with them)."""
    shared = recipe_to_dict(recipe)
    shared["regen"]["server_urls"] = [redact_url(url) for url in recipe.regen.server_urls]
    shared["cache"]["server_urls"] = [redact_url(url) for url in recipe.cache.server_urls]
    return shared


def _read_with_bases(path: Path, seen: tuple) -> dict:
    if path in seen:
        raise RecipeError(f"recipe base cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    try:
        with open(path) as handle:  # a stream, so that YAML's own messages name the file and line
            data = yaml.safe_load(handle) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a mapping of keys, got {type(data).__name__}")
    bases = data.pop("base", [])
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = RECIPES_DIR / "base" / f"{base}.yaml"
        if not base_path.is_file():
            raise RecipeError(f"{path.name}: base '{base}' not found (looked for {base_path})")
        _deep_merge(merged, _read_with_bases(base_path, seen + (path,)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise RecipeError(f"--set expects dotted.key=value, got '{item}'")
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {dotted}: '{key}' is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or err
        raise RecipeError(f"--set {redact_urls(item)}: the value is not valid YAML ({problem}{where}); quote it or fix "
                          f"its brackets") from None


def _build(cls, raw: Any, prefix: str, errors: list[str]):
    """Turn a nested dict into dataclass `cls`, appending one message per problem to `errors`."""
    if not isinstance(raw, dict):
        errors.append(f"{prefix or 'recipe'}: expected a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            errors.append(f"unknown key '{dotted}'{hint}")
            continue
        kwargs[key] = _convert(hints[key], value, dotted, errors)
    return cls(**kwargs)


def _convert(tp, value: Any, dotted: str, errors: list[str]):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, dotted + ".", errors)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, dotted, errors)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            errors.append(f"{dotted}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            errors.append(f"{dotted}: expected a list of {_type_name(item_tp)}, got {type(value).__name__} "
                          f"{redact_urls(repr(value))}")  # a URL's password stays out of the message
            return value
        return [_convert(item_tp, v, f"{dotted}[{i}]", errors) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # PyYAML reads `1e-4` (no dot) as a string; a float field takes it as the number it clearly is.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, str, bool, float):
        # bool is an int subclass in Python: reject it where a number is expected.
        if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
            errors.append(f"{dotted}: expected {_type_name(tp)}, got {type(value).__name__} {redact_urls(repr(value))}")
        return value
    raise TypeError(f"schema type {tp} of {dotted} is not supported")  # a bug in this file, not in the recipe


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _non_finite(obj, prefix: str = "") -> list[str]:
    """Dotted keys of every NaN/inf float in the recipe (`--set train.lr=nan` parses, and would train on NaN)."""
    if dataclasses.is_dataclass(obj):
        return [k for f in dataclasses.fields(obj) for k in _non_finite(getattr(obj, f.name), f"{prefix}{f.name}.")]
    if isinstance(obj, list):
        return [k for i, v in enumerate(obj) for k in _non_finite(v, f"{prefix.rstrip('.')}[{i}].")]
    if isinstance(obj, float) and not math.isfinite(obj):
        return [prefix.rstrip(".")]
    return []


def _check_values(recipe: Recipe) -> None:
    """Range and cross-field checks, named by dotted key; each message says what a valid value is."""
    problems = [f"{k} must be a finite number, got {_get(recipe, k)}" for k in _non_finite(recipe)]
    positive = {
        "data.num_prompts": recipe.data.num_prompts,
        "data.max_length": recipe.data.max_length,
        "data.max_turns": recipe.data.max_turns,
        "regen.max_new_tokens": recipe.regen.max_new_tokens,
        "regen.batch_size": recipe.regen.batch_size,
        "cache.batch_size": recipe.cache.batch_size,
        "cache.records_per_shard": recipe.cache.records_per_shard,
        "draft.num_layers": recipe.draft.num_layers,
        "draft.block_size": recipe.draft.block_size,
        "train.max_steps": recipe.train.max_steps,
        "train.global_batch_size": recipe.train.global_batch_size,
        "train.micro_batch_size": recipe.train.micro_batch_size,
        "train.save_every": recipe.train.save_every,
        "train.log_every": recipe.train.log_every,
        "train.lr": recipe.train.lr,
        "train.max_grad_norm": recipe.train.max_grad_norm,
        "train.adam_eps": recipe.train.adam_eps,
        "loss.loss_decay_gamma": recipe.loss.loss_decay_gamma,
        "loss.step_loss_decay": recipe.loss.step_loss_decay,
        "regen.max_concurrency": recipe.regen.max_concurrency,
        "regen.request_timeout_s": recipe.regen.request_timeout_s,
        "regen.request_attempts": recipe.regen.request_attempts,
        "regen.stall_timeout_s": recipe.regen.stall_timeout_s,
        "regen.server_startup_s": recipe.regen.server_startup_s,
        "draft.num_anchors": recipe.draft.num_anchors,
        "draft.ttt_length": recipe.draft.ttt_length,
        "eval.num_samples": recipe.eval.num_samples,
        "eval.max_new_tokens": recipe.eval.max_new_tokens,
        "opd.rollout_records": recipe.opd.rollout_records,
        "opd.steps_per_round": recipe.opd.steps_per_round,
        "opd.lr": recipe.opd.lr,
        "data.sources[].weight": min((s.weight for s in recipe.data.sources), default=1.0),
    }
    for key in ("draft.draft_vocab_size", "loss.vocab_size"):
        if _get(recipe, key) is not None:
            positive[key] = _get(recipe, key)
    problems += [f"{k} must be > 0, got {v}" for k, v in positive.items() if v <= 0]
    if not 0.0 < recipe.regen.top_p <= 1.0:
        problems.append(f"regen.top_p must be in (0, 1] (a probability mass; 1 = no nucleus cut), "
                        f"got {recipe.regen.top_p}")
    if recipe.regen.top_k < -1:
        problems.append(f"regen.top_k must be >= 1, or 0 / -1 for no top-k cut, got {recipe.regen.top_k}")
    for key in ("regen.temperature", "eval.temperature", "train.weight_decay", "train.feature_noise", "loss.ce_alpha",
                "loss.l1_alpha", "loss.conf_alpha", "loss.soft_ce_alpha", "loss.selector_alpha",
                "loss.ce_warmup_steps",
                "data.min_loss_tokens", "opd.rounds"):
        if _get(recipe, key) < 0:
            problems.append(f"{key} must be >= 0, got {_get(recipe, key)}")
    if not 0.0 <= recipe.train.warmup_ratio <= 1.0:
        problems.append(f"train.warmup_ratio must be in [0, 1] (a fraction of train.max_steps), "
                        f"got {recipe.train.warmup_ratio}")
    for key in ("train.adam_beta1", "train.adam_beta2", "train.dropout", "train.ema_decay"):
        if not 0.0 <= _get(recipe, key) < 1.0:
            problems.append(f"{key} must be in [0, 1), got {_get(recipe, key)}")
    if any(i < 0 for i in recipe.target.layer_ids):
        problems.append(f"target.layer_ids must be decoder layer indices >= 0, got {recipe.target.layer_ids}")
    if not 0.0 <= recipe.data.holdout_fraction < 1.0:
        problems.append(f"data.holdout_fraction must be in [0, 1), got {recipe.data.holdout_fraction}")
    if not recipe.data.sources:
        problems.append("data.sources must name at least one prompt source")
    elif not math.isfinite(sum(s.weight for s in recipe.data.sources)):
        weights = ", ".join(f"data.sources[{i}].weight {s.weight}" for i, s in enumerate(recipe.data.sources))
        problems.append(f"{weights} sum past the largest number: the weights are relative shares, scale them down "
                        f"(e.g. 1.0 each)")
    if not recipe.target.layer_ids:
        problems.append("target.layer_ids must list at least one layer")
    if len(set(recipe.target.layer_ids)) != len(recipe.target.layer_ids):
        problems.append(f"target.layer_ids has duplicates: {recipe.target.layer_ids}")
    if recipe.regen.backend == "source" and recipe.family in BLOCK_FAMILIES and recipe.loss.ce_labels != "target":
        problems.append("regen.backend 'source' trains on the source's text, not the target's: block drafters need "
                        "loss.ce_labels=target (the target's own argmax as the label)")
    if recipe.draft.init_copy == "frozen" and recipe.train.weight_decay > 0:
        # freezing zeroes the copy path's gradient, but AdamW's decoupled decay would still shrink it every step
        problems.append(f"train.weight_decay={recipe.train.weight_decay} would shrink the frozen copy attention of "
                        "draft.init_copy=frozen: set train.weight_decay=0 or draft.init_copy=trained")
    if recipe.regen.backend == "openai" and not recipe.regen.server_urls:
        problems.append("regen.server_urls must list at least one URL when regen.backend is 'openai'")
    problems += [f"regen.server_urls[{i}]: {redact_url(url)!r} is not an http(s) URL; write it as http://host:port"
                 for i, url in enumerate(recipe.regen.server_urls) if not url.startswith(("http://", "https://"))]
    problems += _cache_backend_problems(recipe)
    problems += _selector_problems(recipe)
    non_negative = {"draft.markov_rank": recipe.draft.markov_rank,
                    "train.keep_checkpoints": recipe.train.keep_checkpoints}
    problems += [f"{k} must be >= 0, got {v}" for k, v in non_negative.items() if v < 0]
    if not is_plain_name(recipe.name):
        problems.append(f"name {recipe.name!r} must be a plain name (no '/', not '.' or '..'): it names the run's "
                        f"folder runs/<name> and must stay inside runs/; use --out to write elsewhere")
    if not 0 <= recipe.seed < 2**32:
        problems.append(f"seed must be in [0, 2**32) (numpy's and the samplers' range), got {recipe.seed}")
    if recipe.train.zero_stage not in (0, 1, 2):
        # ZeRO-3 frees each parameter after the forward; the chunked loss recomputes the logits with the
        # lm_head in the backward and finds it empty. A drafter's weights and Adam state fit ZeRO-2.
        problems.append(f"train.zero_stage must be 0 (DDP), 1 or 2 (DeepSpeed ZeRO), got {recipe.train.zero_stage}: "
                        f"ZeRO-3 is not supported (the loss reads the lm_head outside the forward); use 2")
    if problems:
        raise RecipeError(f"recipe '{recipe.name}' is invalid:\n  " + "\n  ".join(problems))


def _cache_backend_problems(recipe: Recipe) -> list[str]:
    cache = recipe.cache
    problems = [f"cache.server_urls[{i}]: {redact_url(url)!r} is not an http(s) URL; write it as http://host:port"
                for i, url in enumerate(cache.server_urls) if not url.startswith(("http://", "https://"))]
    if cache.backend != "engine":
        if cache.server_urls or cache.states_dir:
            problems.append(f"cache.server_urls / cache.states_dir are read only under cache.backend: engine (this "
                            f"recipe has cache.backend: {cache.backend}): set --set cache.backend=engine, or drop them")
        return problems
    if cache.server_urls and not cache.states_dir:
        problems.append("cache.backend engine with cache.server_urls needs cache.states_dir: the folder those servers' "
                        "connector writes the states to (their shared_storage_path), as this machine sees it")
    return problems


def _selector_problems(recipe: Recipe) -> list[str]:
    """DFlash2 is the family with a candidate selector, and the selector serves only in SGLang's and vLLM's DFLASH
    worker (the 1+N layout, no Markov or confidence head)."""
    d = recipe.draft
    if recipe.family != "dflash2":
        return [] if d.selector_rank == 0 else [f"draft.selector_rank={d.selector_rank} is DFlash2's candidate "
                                                f"selector: set family: dflash2, or draft.selector_rank=0"]
    problems = []
    if d.selector_rank < 1 or d.selector_top_k < 2:
        problems.append(f"family dflash2 needs draft.selector_rank >= 1 and draft.selector_top_k >= 2 (got "
                        f"{d.selector_rank}, {d.selector_top_k}); base: [dflash2] sets 256 and 16")
    if d.sample_from_anchor or d.markov_rank or d.enable_confidence_head:
        problems.append("family dflash2 serves through SGLang's and vLLM's DFLASH worker: set "
                        "draft.sample_from_anchor=false, draft.markov_rank=0, draft.enable_confidence_head=false")
    return problems


def _get(recipe: Recipe, dotted: str):
    node = recipe
    for key in dotted.replace("[", ".[").split("."):
        node = node[int(key[1:-1])] if key.startswith("[") else getattr(node, key)
    return node
