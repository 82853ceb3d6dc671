"""The pre-flight: every step of a run that depends on the target's architecture, run on the real target in seconds,
before the first stage writes anything. A target outside the tested matrix used to fail late (the draft's config
after hours of regenerating and caching, the eval loop after training); here it passes, or is refused naming its
architecture, the step and the missing piece.

    report = check_target(load_target(path), recipe)      # PreflightError names what fails
    problems = preflight_problems(recipe, stages, out)     # what pipeline.check_inputs adds: [] or one line

The steps, in order: the decoder stack and the recipe's layer ids; the family's draft config and module, built from
the target as training builds them (no data yet: every token counted once); one forward with the capture hooks
(shapes, finite values, the model's logits as its head over the backbone's output, attention that looks only back);
the final norm, found by modeling/anatomy.py, turning the last layer's output into the backbone's; one cached decode
against the uncached forward, then rolled back and run again; one generate through the eval loop's own cache path with
the untrained draft (almost every draft rejected: a rollback each round), whose output must be the target's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from core import stage
from core.io import LinkedPathError, atomic_write_json, make_dir, read_json
from modeling import anatomy
from modeling import target as target_module
from modeling.anatomy import decoder_layers, final_norm, norm_eps, norm_kind, stack_name
from modeling.target import (TargetRunner, capture_hidden_states, check_layer_ids, draftsmith_home, load_target,
                             resolve_target, vocab_logits)
from train.algorithms import get_algorithm
from eval.spec_decode import DRAFTERS, Decoding, speculative_generate, target_generate

PROMPT_TOKENS = 12
NEW_TOKENS = 4
#: the stages that run the target, or a draft built beside it
TARGET_STAGES = ("regenerate", "cache", "train", "opd", "eval")
HALF_TOLERANCE = 3e-2  # of the largest value: what bf16/fp16 sums in another order may move
_PASSED: dict[tuple, "Preflight"] = {}  # this process's passes: a run of several stages, or a test, checks once


class PreflightError(ValueError):
    """A step the run would take on this target fails; the message names the architecture, the step and why."""


@dataclass
class Preflight:
    architecture: str
    passed: list[str] = field(default_factory=list)  # each step, as it passed
    notes: list[str] = field(default_factory=list)  # what passes here but limits a later step
    seconds: float = 0.0

    def line(self) -> str:
        notes = "".join(f"; note: {n}" for n in self.notes)
        return f"pre-flight of {self.architecture}: {', '.join(self.passed)} ({self.seconds:.1f} s){notes}"


@contextlib.contextmanager
def _step(report: Preflight, name: str):
    """Run one step; any failure in it becomes a PreflightError naming the architecture and the step."""
    try:
        yield
    except PreflightError:
        raise
    except Exception as exc:  # what the target's own code raises is the finding
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        raise PreflightError(f"the target ({report.architecture}) fails the pre-flight at {name}: "
                             f"{type(exc).__name__}: {first}") from exc


def _refuse(report: Preflight, name: str, why: str):
    raise PreflightError(f"the target ({report.architecture}) fails the pre-flight at {name}: {why}")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the target's dtype (bf16 on a GPU: an uncached and a cached forward sum in other
    orders)."""
    loose = a.dtype in (torch.bfloat16, torch.float16)
    scale = float(b.float().abs().amax()) or 1.0
    return bool(((a.float() - b.float()).abs().amax() <= (HALF_TOLERANCE if loose else 1e-3) * scale))


def _near_ties(rows: torch.Tensor) -> torch.Tensor:
    """[n] bool: which rows of logits hold a near-tie in half precision (the top two within _close's tolerance: another
    kernel's sum order may pick the other); none in float32."""
    if rows.dtype not in (torch.bfloat16, torch.float16):
        return torch.zeros(rows.shape[:-1], dtype=torch.bool, device=rows.device)
    top = rows.float().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]) <= HALF_TOLERANCE * rows.float().abs().amax(-1)


@torch.inference_mode()
def _greedy(model, ids: list[int], count: int) -> tuple[list[int], list[bool]]:
    """The target's greedy continuation by whole uncached forwards (what every cache path must reproduce), and for
    each token whether it was a near-tie (_near_ties)."""
    out, ties = list(ids), []
    for _ in range(count):
        logits = model(input_ids=torch.tensor([out], device=model.device), use_cache=False).logits[0, -1]
        ties.append(bool(_near_ties(logits)))
        out.append(int(logits.argmax()))
    return out[len(ids):], ties


@torch.no_grad()  # nothing here trains: no graph kept beside a large target
def check_target(model, recipe) -> Preflight:
    """Every target-dependent step of a run of `recipe` on the loaded target `model`; PreflightError at the first that
    fails. Returns what passed, and notes on what passes but limits a later step."""
    start = time.perf_counter()
    report = Preflight(type(model).__name__)
    layer_ids = list(recipe.target.layer_ids)
    with _step(report, "the decoder stack"):
        layers = decoder_layers(model)
        check_layer_ids(model, layer_ids)
    report.passed.append(f"decoder stack .{stack_name(model)} of {len(layers)}")
    with _step(report, f"building the {recipe.family} draft"):
        draft = get_algorithm(recipe.family).build(recipe, model, None).draft
        draft = draft.to(device=model.device, dtype=next(model.parameters()).dtype).eval()
    report.passed.append(f"{recipe.family} draft built")
    vocab = model.get_input_embeddings().num_embeddings
    ids = [(7919 * i + 11) % min(vocab, 30000) for i in range(PROMPT_TOKENS)]
    batch = torch.tensor([ids], device=model.device)
    last_id = len(layers) - 1
    read = sorted(set(layer_ids) | {last_id})
    with _step(report, "the capture forward"):
        hidden, final = capture_hidden_states(model, batch, torch.ones_like(batch), read)
        width = final.shape[-1]
        if hidden.shape != (1, len(ids), len(read) * width) or not bool(torch.isfinite(hidden).all()):
            _refuse(report, "the capture forward", f"the captured states are {tuple(hidden.shape)}, not "
                                                   f"{(1, len(ids), len(read) * width)} finite values")
    report.passed.append(f"capture of layers {layer_ids}")
    with _step(report, "attention that looks only back"):
        changed = batch.clone()
        changed[0, -1] = (changed[0, -1] + 1) % min(vocab, 30000)
        _, moved = capture_hidden_states(model, changed, torch.ones_like(changed), read)
        if not _close(moved[0, :-1], final[0, :-1]):
            _refuse(report, "attention that looks only back", "the earlier positions' states change with the last "
                                                              "token: the model attends both ways, no causal LM")
    report.passed.append("causal")
    with _step(report, "the logits"):
        logits = model(input_ids=batch, use_cache=False).logits[0]
        head = model.get_output_embeddings()
        own = head(final[0]) if head.bias is not None else vocab_logits(final[0], head.weight)
        if bool(((own.argmax(-1) != logits.argmax(-1)) & ~_near_ties(logits)).any()):
            _refuse(report, "the logits", "the causal LM's logits pick other tokens than its head over the "
                                          "backbone's output, which is what the loop and the engines read")
        if not _close(own, logits):
            report.notes.append("the causal LM rescales its logits after the head (the same argmax; the drafter "
                                "learns the head's)")
    report.passed.append("logits from the head")
    with _step(report, "the final norm"):
        norm = final_norm(model)
        before = hidden[0, :, read.index(last_id) * width:(read.index(last_id) + 1) * width]
        reproduced = _close(norm(before) if norm is not None else before, final[0])
        kind = norm_kind(norm, width)
    if reproduced:
        report.passed.append(f"final norm {kind} eps {norm_eps(norm, model.config):g}")
    elif recipe.cache.backend == "engine":
        _refuse(report, "the final norm", f"no norm module found turns the last layer's output into the backbone's "
                                          f"(found: {type(norm).__name__ if norm is not None else 'none'}), and the "
                                          f"engine's states need it: set cache.backend=hf")
    else:
        report.notes.append("no final-norm module reproduces the backbone's output (engine-computed states would "
                            "need it; this recipe's are computed in-process)")
    with _step(report, "the cached decode with a rollback"):
        with TargetRunner(model, layer_ids) as runner:
            runner.forward(ids[:-3], logits="none")
            cached, _ = runner.forward(ids[-3:])
            runner.crop(len(ids) - 2)
            again, _ = runner.forward(ids[-2:])
        if not (_close(cached, own[-3:]) and _close(again, own[-2:])):
            _refuse(report, "the cached decode with a rollback", "the target's logits through its cache (or after "
                                                                 "rolling it back) differ from its uncached forward's")
    report.passed.append("cached decode and rollback")
    with _step(report, "the eval loop"):
        plain = target_generate(model, ids, NEW_TOKENS).ids
        spec = speculative_generate(model, DRAFTERS[type(draft)](draft), ids,
                                    Decoding(max_new_tokens=NEW_TOKENS, gamma=2)).ids
        greedy, ties = _greedy(model, ids, NEW_TOKENS)
        if not spec == plain == greedy:
            first = next(i for i in range(NEW_TOKENS) if not spec[i] == plain[i] == greedy[i])
            if not ties[first]:
                _refuse(report, "the eval loop", f"its output {spec} (plain loop {plain}) is not the target's own "
                                                 f"greedy output {greedy}: the loop would not be lossless on this target")
            report.notes.append(f"output token {first} is a near-tie in {next(model.parameters()).dtype}, which the "
                                f"cached and uncached forwards broke apart")
    report.passed.append("eval loop lossless")
    report.seconds = time.perf_counter() - start
    return report


def _key(recipe, device: str) -> tuple:
    folder = Path(resolve_target(recipe.target.name_or_path))
    files = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.glob("*"))
                  if p.suffix in (".json", ".safetensors")) if folder.is_dir() else ()
    d = recipe.draft  # what the draft's build reads of the target; the schema bounds the rest
    return (str(folder), files, recipe.family, tuple(recipe.target.layer_ids), recipe.target.dtype, d.num_layers,
            d.init_layers, d.init_norm, d.mask_token_id, recipe.cache.backend, device)


def _record(key: tuple) -> Path:
    """Where a pass is kept for later processes (a resumed run, another rank count): $DRAFTSMITH_HOME/preflight/, named
    by the key and by the code and libraries that decided it (a changed check, or transformers, checks again)."""
    import transformers

    digest = hashlib.sha256(repr((key, torch.__version__, transformers.__version__)).encode())
    for source in (__file__, anatomy.__file__, target_module.__file__):
        digest.update(Path(source).read_bytes())
    return draftsmith_home() / "preflight" / f"{digest.hexdigest()[:24]}.json"


def _remembered(key: tuple) -> Preflight | None:
    try:
        return Preflight(**read_json(_record(key)))
    except (OSError, ValueError, TypeError):  # none yet, or not one of ours
        return None


def _remember(key: tuple, report: Preflight) -> None:
    try:
        make_dir(_record(key).parent)
        atomic_write_json(_record(key), asdict(report))
    except (OSError, LinkedPathError):  # a read-only or linked home: checked again next time, nothing lost
        pass


def preflight_problems(recipe, stages: list[str], out: Path) -> list[str]:
    """[] when the pre-flight passes (its line printed) or nothing left to run reads the target; else the one problem,
    for pipeline.check_inputs. Rank 0 alone runs it, on its device: the other ranks' targets are the same."""
    pending = [s for s in TARGET_STAGES if s in stages and not stage.is_done(out / ("regen" if s == "regenerate"
                                                                                    else s))]
    if not pending or int(os.environ.get("RANK", "0")) != 0:
        return []
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    try:
        key = _key(recipe, device)  # the embedded target is converted here, once, if it was not yet
        if key not in _PASSED and (earlier := _remembered(key)) is not None:
            earlier.notes.append(f"passed before, remembered in {_record(key)}")
            _PASSED[key] = earlier
        model = None if key in _PASSED else load_target(recipe.target.name_or_path, device, recipe.target.dtype)
    except LinkedPathError as exc:  # a link in $DRAFTSMITH_HOME: its own message names the setting
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the user is told it, not a traceback
        return [f"target.name_or_path: {recipe.target.name_or_path} cannot be loaded for the pre-flight "
                f"({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]})"]
    if model is not None:
        try:
            _PASSED[key] = check_target(model, recipe)
            _remember(key, _PASSED[key])
        except PreflightError as exc:
            return [f"target.name_or_path: {exc}"]
        finally:
            del model
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"[draftsmith] {_PASSED[key].line()}", flush=True)
    return []
