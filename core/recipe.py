"""Recipes: plain YAML data in recipes/, one typed schema, strict validation.

A recipe is `recipes/<name>.yaml`. It may name shared pieces under `base:` (files in recipes/base/, merged in
order, the recipe's own keys last), so a family's loss weights or a target's data settings live in one place.
Every key is checked against the dataclasses below: an unknown key names the closest valid one, a wrong type
names the expected type, a value outside the bound declared beside its key names the valid range, and all errors
are reported at once. `--set a.b=value` overrides any key before
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from core.redact import redact_url, redact_urls
from core.server import sglang_selector_top_k_problem
from core.schema import (FRACTION_BELOW_ONE, NON_NEGATIVE, POSITIVE, SELECTOR_RANK, SELECTOR_TOP_K, Bound,
                         bound_problems, dataclass_keys, setting, type_name)

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
#: the drafter families a recipe trains; modeling/registry.py maps each to its model class. The block families are
#: one model (modeling/dspark.py): DFlash is DSpark with its Markov and confidence heads off, DFlash2 is DFlash plus
#: the candidate selector (modeling/selector.py).
BLOCK_FAMILIES = ("dspark", "dflash", "dflash2")
FAMILIES = (*BLOCK_FAMILIES, "eagle3")


# --- schema -------------------------------------------------------------------------------------------------------
# Each key is declared once, with its type (the annotation), default, bound and one-line doc (`setting(...)`); the
# validator (core/schema.bound_problems), `draftsmith recipes --keys` and the generated key table (recipes/KEYS.md) read
# these. Longer reasons stay in the `#` comments beside a key.


@dataclass
class TargetConfig:
    name_or_path: str = setting("smollm2-135m-instruct", "Hugging Face id or local path, or smollm2-135m-instruct "
                                "(the embedded offline target)")
    layer_ids: list[int] = setting(doc="HF layer-output ids whose hidden states the drafter reads (0-based decoder "
                                   "layers)", bound=Bound(low=0, says="decoder layer indices >= 0"),
                                   factory=lambda: [1, 8, 14, 21, 27])
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = setting("auto", "auto = bfloat16 on GPU, float32 on "
                                                                       "CPU")
    # a tokenizer with no template of its own is refused where a chat is rendered
    chat_template: Optional[str] = setting(None, "a Jinja chat template file used instead of the tokenizer's own "
                                           "(None: the tokenizer's)")


@dataclass
class SourceConfig:
    name: str = setting("sharegpt", "sharegpt | humaneval | mtbench | gsm8k | libcode | wordmath | a local "
                        ".json/.jsonl path | a Hugging Face dataset id")
    path: Optional[str] = setting(None, "a local copy of the source's file (gsm8k: a JSONL; json: the file)")
    weight: float = setting(1.0, "relative share of the prompts drawn from this source", bound=POSITIVE)
    split: str = setting("train", "the source's split (a training source's held-out share is data.holdout_fraction)")


@dataclass
class DataConfig:
    sources: list[SourceConfig] = setting(doc="the prompt sources, mixed by weight", factory=lambda: [SourceConfig()])
    num_prompts: int = setting(100_000, "training prompts drawn from the sources", bound=POSITIVE)
    allow_fewer: bool = setting(False, "true = train on what the sources hold when they hold fewer than num_prompts "
                                "(with a warning); false = refuse before regeneration")
    holdout_fraction: float = setting(0.05, "share of each training source kept out of training (the eval draws from "
                                      "it)", bound=FRACTION_BELOW_ONE)
    max_length: int = setting(4096, "tokens per conversation at most (longer ones are cut)", bound=POSITIVE)
    system_prompt: Optional[str] = setting(None, "None keeps the chat template's own default system prompt (training "
                                           "and eval alike)")
    thinking: Literal["drop", "keep"] = setting("drop", "drop = strip <think> blocks from answers before training; "
                                                "keep = train on them")
    min_loss_tokens: int = setting(8, "conversations with fewer supervised tokens are not cached", bound=NON_NEGATIVE)
    max_turns: int = setting(4, "only the first N user turns of each prompt are replayed", bound=POSITIVE)


@dataclass
class RegenConfig:
    # hf = in-process batched generation; vllm, sglang = a vLLM or SGLang server this stage starts and stops itself
    # (one per rank, on its GPU; the token ids the HF backend would use; vLLM also on CPU, ~3x faster there; SGLang
    # on GPUs only); openai = any OpenAI-compatible server already running (SGLang, vLLM); source = keep the
    # source's own answers, generating nothing (train with loss.ce_labels: target: the target's labels on that text);
    # auto = vllm on a machine without CUDA where a python with vLLM is found (regen.engine_python,
    # $DRAFTSMITH_VLLM_PYTHON or ./.venv-vllm), else hf; the run says which (data/regen/backends.choose_backend).
    backend: Literal["auto", "hf", "vllm", "sglang", "openai", "source"] = setting(
        "hf", "who answers the prompts: hf in-process, a vllm/sglang server started here, openai servers already "
        "running, source (the sources' own answers), auto (vllm on CPU when found, else hf)")
    server_urls: list[str] = setting(doc="the openai backend's servers (several = data parallel)", factory=list)
    served_model: Optional[str] = setting(None, "model name sent to the server (default: target.name_or_path)")
    temperature: float = setting(0.7, "sampling temperature (0 = greedy)", bound=NON_NEGATIVE)
    top_p: float = setting(0.8, "nucleus mass", bound=Bound(low=0, high=1, low_open=True, says="in (0, 1] (a "
                           "probability mass; 1 = no nucleus cut)"))
    top_k: int = setting(20, "top-k cut (0 or -1 = none)", bound=Bound(low=-1, says=">= 1, or 0 / -1 for no top-k cut"))
    max_new_tokens: int = setting(4096, "answer tokens per turn at most (a cut answer is marked truncated)",
                                  bound=POSITIVE)
    enable_thinking: bool = setting(False, "the chat template's thinking switch (Qwen3)")
    batch_size: int = setting(16, "prompts per generation batch (hf) and per resumable chunk (all backends)",
                              bound=POSITIVE)
    max_concurrency: int = setting(64, "server backends: requests in flight per rank (the Qwen3 recipes: 256)",
                                   bound=POSITIVE)
    request_timeout_s: float = setting(600.0, "server backends: seconds a request may take", bound=POSITIVE)
    # HTTP 429, 5xx, refused connections and timeouts are tried again after a backoff (a Retry-After header is
    # honoured, up to 30 s); what still fails is asked again by the next run.
    request_attempts: int = setting(3, "tries per request (openai backend)", bound=POSITIVE)
    # one server that accepts connections but never answers would otherwise cost request_timeout_s x request_attempts
    # per request, hours over a dataset; the chunks in flight are not marked done, a rerun does them.
    stall_timeout_s: float = setting(1800.0, "server backends: no request finished for this long stops the stage, "
                                     "naming the servers", bound=POSITIVE)
    # each: a padded batch costs batch x its longest prompt on a CPU; the same greedy answers.
    prefill: Literal["each", "padded"] = setting("each", "hf backend: each = every prompt's prefill alone on a CPU; "
                                                 "padded = generate's left-padded batch (always on a GPU)")
    engine_python: Optional[str] = setting(None, "vllm, sglang backends: the python that runs the engine (vLLM: "
                                           "$DRAFTSMITH_VLLM_PYTHON, else ./.venv-vllm; SGLang: this one)")
    server_args: list[str] = setting(doc="vllm, sglang backends: extra flags of the regeneration servers (the "
                                     "states servers': cache.server_args)", factory=list)
    server_startup_s: float = setting(900.0, "vllm, sglang backends: seconds the server's start may take",
                                      bound=POSITIVE)


@dataclass
class CacheConfig:
    dtype: Literal["bfloat16", "float16", "float32"] = setting("bfloat16", "the dtype hidden states are read back in")
    # fp8 matched raw's held-out tau at equal steps for each family, within 0.6% (benchmarks/README.md, "Hidden-state
    # cache encoding"); online runs round through it too, so that they train on what an offline run reads.
    encoding: Literal["raw", "fp8"] = setting("fp8", "fp8 = e4m3 + a power-of-two scale per token and layer (H + 1 "
                                              "bytes a row, 0.501x bf16's 2H) | raw = the dtype's bytes")
    batch_size: int = setting(8, "conversations per target forward", bound=POSITIVE)
    # engine: the training processes then load only the target's embedding, final norm and lm_head
    # (modeling/target.load_target_parts); with train.hidden_states online the train stage asks the engine per
    # micro-batch. vLLM only: SGLang 0.5.23's stock capture (--enable-return-aux-hidden-states) gives the named
    # layers' inputs but not the last layer's output the final-norm state needs, and returns states as JSON lists.
    backend: Literal["hf", "engine"] = setting("hf", "where hidden states come from: hf = the target in-process (each "
                                               "rank loads it whole) | engine = a vLLM server (extract_hidden_states; "
                                               "data/states/engine.py)")
    server_urls: list[str] = setting(doc="engine backend: running vLLM servers started with "
                                     "data/states/engine.engine_server_args' flags (none: each rank starts its own)",
                                     factory=list)
    states_dir: Optional[str] = setting(None, "engine backend: the folder those servers' connector writes states to, "
                                        "as this machine sees it (required with cache.server_urls)")
    # its own key, not regen.server_args: those go to regeneration's engine (often SGLang), whose flags differ
    server_args: list[str] = setting(doc="engine backend without cache.server_urls: extra flags of each rank's vLLM "
                                     "states server (last: they replace the train stage's --gpu-memory-utilization "
                                     "0.5)", factory=list)
    records_per_shard: int = setting(1024, "conversations per shard file (the unit of resume and of work split "
                                     "across ranks)", bound=POSITIVE)
    # not regen.max_concurrency: a row in flight holds its states (Qwen3-8B: 200 MB at 4096 tokens) until it is read
    max_concurrency: int = setting(64, "engine backend: rows in flight to the vLLM states servers", bound=POSITIVE)


@dataclass
class DraftConfig:
    num_layers: int = setting(5, "the drafter's decoder layers", bound=POSITIVE)
    block_size: int = setting(7, "gamma: tokens proposed per round", bound=POSITIVE)
    num_anchors: int = setting(512, "block drafters: anchor positions sampled per sequence", bound=POSITIVE)
    sample_from_anchor: bool = setting(True, "true = anchor-first block (DeepSpec); false = 1+N layout (z-lab "
                                       "DFlash, SGLang DFLASH)")
    markov_rank: int = setting(256, "DSpark's Markov head rank (0 = none: DFlash)", bound=NON_NEGATIVE)
    markov_head_type: Literal["vanilla", "gated", "rnn"] = setting("vanilla", "DSpark's Markov head (vLLM serves "
                                                                   "vanilla only)")
    enable_confidence_head: bool = setting(True, "DSpark's confidence head (the verify schedule)")
    mask_token_id: Optional[int] = setting(None, "None = the family's documented default for the target vocabulary",
                                           bound=NON_NEGATIVE)
    # starts: the defaults keep N(0, 0.02) everywhere and unit norms; see init_from_target in modeling/.
    init_layers: Literal["random", "target"] = setting("random", "target = the draft's decoder layers start as copies "
                                                       "of the target's last ones")
    # normalized: the outlier dimensions do not drown the rest at the start.
    init_fc: Literal["random", "last", "normalized"] = setting(
        "random", "last = the identity on the last captured layer; normalized = N(0, 0.02) with column j divided by "
        "input dimension j's RMS over the cache")
    init_norm: Literal["ones", "target"] = setting("ones", "output norm weight at start: ones | target (the target's "
                                                   "final-norm weight)")
    markov_init: Literal["normal", "zero_w2"] = setting("normal", "Markov head start: normal = N(0, 0.02) both factors "
                                                        "| zero_w2 = first N(0, 1), second zero")
    # trained: fitted on the cache at the start (train/copy_init.py).
    init_copy: Literal["none", "trained", "frozen"] = setting(
        "none", "block drafters: trained = layer 0's attention starts as prompt lookup does; frozen = that start kept "
        "while the rest trains")
    # text: the key names the previous token, so the match lands where the earlier occurrence was followed
    copy_follows: Literal["prediction", "text"] = setting(
        "prediction", "draft.init_copy: what the copy start copies: prediction = the target's prediction after the "
        "earlier occurrence of the pending token; text = the token that followed it (as prompt lookup)")
    # the tables rescore the lm_head's top K per slot with the transition from the previous slot's pick
    selector_rank: int = setting(0, "DFlash2's candidate selector: rank of its predecessor/successor tables (0 = "
                                 "none)", bound=SELECTOR_RANK)
    selector_top_k: int = setting(16, "DFlash2's candidate selector: the K candidates per slot (the lm_head's top K; "
                                  "a power of two, as SGLang's kernel needs)", bound=SELECTOR_TOP_K)
    ttt_length: int = setting(7, "Eagle3: test-time-training steps unrolled", bound=POSITIVE)
    draft_vocab_size: Optional[int] = setting(None, "Eagle3: the pruned draft vocabulary (None: the family's default)",
                                              bound=POSITIVE)


@dataclass
class LossConfig:
    ce_alpha: float = setting(0.1, "weight of the cross-entropy term", bound=NON_NEGATIVE)
    l1_alpha: float = setting(0.9, "weight of the L1 (acceptance) term", bound=NON_NEGATIVE)
    conf_alpha: float = setting(1.0, "weight of the confidence head's term", bound=NON_NEGATIVE)
    loss_decay_gamma: float = setting(4.0, "w_k = exp(-(k-1)/gamma) per block position", bound=POSITIVE)
    soft_ce_alpha: float = setting(0.0, "block drafters: CE against the target's whole distribution (dense soft "
                                   "labels)", bound=NON_NEGATIVE)
    # speculators' selector_loss_alpha; the label is put in place of the K-th candidate when absent.
    selector_alpha: float = setting(0.0, "DFlash2: weight of the selector's K-way CE over the draft's top-K "
                                    "candidates (against loss.ce_labels)", bound=NON_NEGATIVE)
    # the L1 term has almost no gradient while the draft puts ~1/V on the target's token.
    ce_warmup_steps: int = setting(0, "block drafters: the first N optimizer steps train CE only", bound=NON_NEGATIVE)
    accept_stats: bool = setting(True, "compute training tau and accept_rate even when no loss term needs the target "
                                 "distribution (false saves a vocabulary-sized matmul)")
    step_loss_decay: float = setting(0.8, "Eagle3: per-TTT-step loss decay", bound=POSITIVE)
    # valid_tokens: late steps, with fewer valid positions, weigh as much per token as early ones; positions: the
    # batch's token count for every step (DeepSpec's code notes the token mean hurt accept length).
    eagle3_loss_norm: Literal["valid_tokens", "positions"] = setting(
        "valid_tokens", "Eagle3 loss denominator: valid_tokens (a token mean) | positions (DeepSpec's)")
    checkpoint: bool = setting(True, "recompute vocabulary-sized chunks in the backward (GPU memory); false is faster "
                               "where memory is plenty")
    # tokens: the target's own greedy answer after a T=0 regeneration; target: the label a greedy target would verify,
    # needed with regen.backend: source. Eagle3 always learns the target's distribution.
    ce_labels: Literal["tokens", "target"] = setting("tokens", "block drafters' CE label: the cached text's next token "
                                                     "| the target's argmax there")
    # On a small drafter the vocabulary-sized matmuls are nearly all of a step (SmolLM2: 49,152 x 576 per prediction).
    # The draft then drafts among those N only: its folder keeps them as token_map.pt (the form of SGLang's
    # --speculative-token-map); eval.py --full-vocab drafts over the whole vocabulary, as the engines serve it.
    vocab_size: Optional[int] = setting(None, "block drafters: softmaxes (and drafting) over the N most frequent "
                                        "supervised tokens (token_map.pt); null = the whole vocabulary",
                                        bound=POSITIVE)


@dataclass
class TrainConfig:
    max_steps: int = setting(20_000, "optimizer steps", bound=POSITIVE)
    lr: float = setting(6e-4, "peak learning rate (cosine decay)", bound=POSITIVE)
    warmup_ratio: float = setting(0.04, "share of max_steps with a linear warm-up",
                                  bound=Bound(low=0, high=1, says="in [0, 1] (a fraction of train.max_steps)"))
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay", bound=NON_NEGATIVE)
    # EAGLE's feature noise, on the drafter's context features (not the states its loss distils), so the drafter
    # cannot key on exact states it has seen.
    feature_noise: float = setting(0.0, "std of Gaussian noise on the captured target states, in units of each "
                                   "dimension's RMS (0 = off)", bound=NON_NEGATIVE)
    # masks drawn per micro-batch from (seed, step, rank), so a resumed run drops the same units; nothing of it is in
    # the exported config.
    dropout: float = setting(0.0, "dropout on the drafter's residual branches while training (0 = off)",
                             bound=FRACTION_BELOW_ONE)
    global_batch_size: int = setting(512, "sequences per optimizer step, over all ranks", bound=POSITIVE)
    micro_batch_size: int = setting(1, "sequences per forward on one rank", bound=POSITIVE)
    max_grad_norm: float = setting(1.0, "gradient clipping norm", bound=POSITIVE)
    adam_beta1: float = setting(0.9, "AdamW beta1", bound=FRACTION_BELOW_ONE)
    adam_beta2: float = setting(0.95, "AdamW beta2", bound=FRACTION_BELOW_ONE)
    adam_eps: float = setting(1e-8, "AdamW epsilon", bound=POSITIVE)
    fused_optimizer: bool = setting(False, "DDP engine (zero_stage 0): torch's fused AdamW (about 4x faster optimizer "
                                    "step on a CPU)")
    # ZeRO-3 frees each parameter after the forward; the chunked loss recomputes the logits with the lm_head in the
    # backward and finds it empty. A drafter's weights and Adam state fit ZeRO-2.
    zero_stage: int = setting(0, "0 = plain DDP; 1 or 2 = DeepSpeed ZeRO stage", bound=Bound(
        low=0, high=2, says="0 (DDP), 1 or 2 (DeepSpeed ZeRO)",
        then=": ZeRO-3 is not supported (the loss reads the lm_head outside the forward); use 2"))
    # bf16 on a CPU autocasts over fp32 weights (fast where the CPU has bf16 matrix units, e.g. AMX); fp32 everywhere
    # is the bit-exact reference.
    precision: Literal["auto", "bf16", "fp32"] = setting("auto", "auto = bf16 on GPU and on CPUs with bf16 matrix "
                                                         "units, else fp32")
    hidden_states: Literal["cache", "online"] = setting("cache", "cache = read the cache stage's states; online = run "
                                                        "the frozen target on each step's rows (data/states/online.py)")
    save_every: int = setting(1000, "optimizer steps between checkpoints", bound=POSITIVE)
    keep_checkpoints: int = setting(2, "checkpoints kept on disk, newest first (0 keeps all)", bound=NON_NEGATIVE)
    # capped by (1 + t) / (10 + t) at step t, so the start fades early (train/ema.py); the last checkpoint's draft
    # keeps the last step's own weights.
    ema_decay: float = setting(0.0, "decay of an EMA of the draft weights that train/final holds (0 = off)",
                               bound=FRACTION_BELOW_ONE)
    log_every: int = setting(10, "optimizer steps between metric lines", bound=POSITIVE)
    wandb_project: Optional[str] = setting(None, "log to this wandb project (None: no wandb)")


@dataclass
class OpdConfig:
    """On-policy distillation after `train` (train/opd.py): rounds of rollout with the current drafter along the
    training answers (greedy or sampled: regen.temperature), then updates where verification rejected its drafts."""

    rounds: int = setting(0, "0 = no opd stage (eval and export read train/final)", bound=NON_NEGATIVE)
    rollout_records: int = setting(64, "training conversations rolled out per round (a seeded sample)",
                                   bound=POSITIVE)
    steps_per_round: int = setting(20, "optimizer steps per round (train.global_batch_size sequences each)",
                                   bound=POSITIVE)
    lr: float = setting(3.0e-4, "learning rate at a round's start (it decays within the round)", bound=POSITIVE)
    # uniform: the same rounds as plain continued SFT, OPD's control.
    anchors: Literal["rollout", "uniform"] = setting("rollout", "rollout = update at the rollouts' round starts "
                                                     "(Draft-OPD) | uniform = anywhere in the answers")


@dataclass
class EvalConfig:
    dataset: str = setting("mtbench", "the held-out prompt set (a prompt source; a training source's held-out split)")
    num_samples: int = setting(80, "prompts decoded", bound=POSITIVE)
    temperature: float = setting(0.0, "decoding temperature (0 = greedy)", bound=NON_NEGATIVE)
    max_new_tokens: int = setting(512, "tokens decoded per prompt", bound=POSITIVE)
    ngram_baseline: bool = setting(True, "also decode with the n-gram drafter and report the draft's tau as a ratio "
                                   "of its")
    allow_training_prompts: bool = setting(False, "true = measure on prompts the drafter trained on (the overfit "
                                           "recipes); false drops the eval prompts training answered (compared by "
                                           "what they say; report training_prompts) and refuses an eval set of "
                                           "nothing else, or a shared source at data.holdout_fraction 0")


@dataclass
class Recipe:
    family: Literal[FAMILIES] = setting("dspark", "the drafter family (modeling/registry.py maps each to its model)")
    seed: int = setting(42, "seeds data order, initialisation and sampling", bound=Bound(
        low=0, high=2**32, high_open=True, says="in [0, 2**32) (numpy's and the samplers' range)"))
    target: TargetConfig = setting(doc="the target model", factory=TargetConfig)
    data: DataConfig = setting(doc="the training prompts", factory=DataConfig)
    regen: RegenConfig = setting(doc="the regenerate stage", factory=RegenConfig)
    cache: CacheConfig = setting(doc="the cache stage", factory=CacheConfig)
    draft: DraftConfig = setting(doc="the drafter's shape and start", factory=DraftConfig)
    loss: LossConfig = setting(doc="the training loss", factory=LossConfig)
    train: TrainConfig = setting(doc="the optimizer and checkpoints", factory=TrainConfig)
    opd: OpdConfig = setting(doc="on-policy distillation after train", factory=OpdConfig)
    eval: EvalConfig = setting(doc="the eval stage", factory=EvalConfig)
    name: str = setting("", "the run's name (runs/<name>); filled in by load_recipe from the file's name")


def recipe_keys() -> list[dict]:
    """Every recipe key, in declaration order: dotted name, type, default, bound and doc (core/schema.py)."""
    return dataclass_keys(Recipe)


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
    return _finish(_read_with_bases(path, seen=()), overrides, path.stem)


def compose_recipe(bases: list[str], fields: dict, overrides: list[str], name: str) -> Recipe:
    """A recipe with no file of its own (train/main.py --target): `bases` (recipes/base/) merged in order, then
    `fields` (keys derived from the target), then the --set `overrides`, which win over both."""
    raw: dict = {}
    for base in bases:
        _deep_merge(raw, _read_with_bases(RECIPES_DIR / "base" / f"{base}.yaml", seen=()))
    _deep_merge(raw, fields)
    return _finish(raw, overrides, name)


def overridden(overrides: list[str], key: str) -> bool:
    """Whether a --set in `overrides` sets dotted `key` (or a section holding it)."""
    return any(key == k or key.startswith(k + ".") for k in (item.split("=", 1)[0].strip() for item in overrides))


def _finish(raw: dict, overrides: list[str], name: str) -> Recipe:
    for item in overrides:
        _apply_override(raw, item)
    raw.setdefault("name", name)
    errors: list[str] = []
    recipe = _build(Recipe, raw, "", errors)
    if errors:
        raise RecipeError(f"recipe '{name}' is invalid:\n  " + "\n  ".join(errors))
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
            errors.append(f"{dotted}: expected a list of {type_name(item_tp)}, got {type(value).__name__} "
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
            errors.append(f"{dotted}: expected {type_name(tp)}, got {type(value).__name__} {redact_urls(repr(value))}")
        return value
    raise TypeError(f"schema type {tp} of {dotted} is not supported")  # a bug in this file, not in the recipe


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
    problems += bound_problems(recipe)
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
    if not is_plain_name(recipe.name):
        problems.append(f"name {recipe.name!r} must be a plain name (no '/', not '.' or '..'): it names the run's "
                        f"folder runs/<name> and must stay inside runs/; use --out to write elsewhere")
    if problems:
        raise RecipeError(f"recipe '{recipe.name}' is invalid:\n  " + "\n  ".join(problems))


def _cache_backend_problems(recipe: Recipe) -> list[str]:
    cache = recipe.cache
    problems = [f"cache.server_urls[{i}]: {redact_url(url)!r} is not an http(s) URL; write it as http://host:port"
                for i, url in enumerate(cache.server_urls) if not url.startswith(("http://", "https://"))]
    if cache.backend != "engine":
        if cache.server_urls or cache.states_dir or cache.server_args:
            problems.append(f"cache.server_urls / cache.states_dir / cache.server_args are read only under "
                            f"cache.backend: engine (this recipe has cache.backend: {cache.backend}): set --set "
                            f"cache.backend=engine, or drop them")
        return problems
    if cache.server_urls and cache.server_args:
        problems.append("cache.server_args are the flags of the states servers the stages start, and with "
                        "cache.server_urls they start none: give those flags to the servers you start, or drop them")
    stages = _flag_value(cache.server_args, ("--pipeline-parallel-size", "-pp"))
    if stages is not None and stages.isdigit() and int(stages) > 1:
        # vLLM's extract_hidden_states keeps its cache-only layer on the last pipeline stage, and the hidden-states
        # connector asserts one on every worker
        problems.append(f"cache.server_args: --pipeline-parallel-size {stages}: the vLLM states server cannot run "
                        f"pipeline parallel (the layer its states are read from exists on the last stage only). For "
                        f"a target beyond one GPU, start vLLM yourself with --tensor-parallel-size and "
                        f"data/states/engine.engine_server_args' flags, and give it as cache.server_urls")
    if cache.server_urls and not cache.states_dir:
        problems.append("cache.backend engine with cache.server_urls needs cache.states_dir: the folder those servers' "
                        "connector writes the states to (their shared_storage_path), as this machine sees it")
    return problems


def _flag_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value `args` last give one of the flags `names` (`--name value` or `--name=value`; vLLM reads `_` in a
    long flag as `-`), None where they give none."""
    value = None
    for i, arg in enumerate(args):
        flag, equals, given = arg.partition("=")
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag in names:
            value = given if equals else (args[i + 1] if i + 1 < len(args) else None)
    return value


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
    elif (problem := sglang_selector_top_k_problem(d.selector_top_k)) is not None:
        # the run's export stage serves with SGLang; vLLM pads K to a power of two anyway, so another K saves nothing
        problems.append(f"draft.selector_top_k={problem}: set draft.selector_top_k to a power of two such as 16 "
                        f"(base: [dflash2]'s)")
    if d.sample_from_anchor or d.markov_rank or d.enable_confidence_head:
        problems.append("family dflash2 serves through SGLang's and vLLM's DFLASH worker: set "
                        "draft.sample_from_anchor=false, draft.markov_rank=0, draft.enable_confidence_head=false")
    return problems


def _get(recipe: Recipe, dotted: str):
    node = recipe
    for key in dotted.replace("[", ".[").split("."):
        node = node[int(key[1:-1])] if key.startswith("[") else getattr(node, key)
    return node
