"""Several drafters ("arms") on the same prompts, every prompt decoded by each of them back to back between two plain
decodes of it, so that every arm's speed is a ratio over the plain loop's in the same minutes.

A shared 2-core machine's speed drifts by tens of percent over minutes: an arm timed after another against the first
one's plain decodes measured the drift, not the drafter (three `eval.py --ngram-baseline` runs at the same lookup tau
gave lookup 1.30x, 1.40x and 1.54x). Here the arms run in reversed order on every other prompt (as
benchmarks/verify_schedule.py does), and each sample keeps its own decode time and the two plain decodes' mean, so an
arm's `speed_ratio` is read from its own samples.

    arms = [Arm("served", full_vocab_drafter), Arm("token_map", map_drafter), Arm("ngram", NgramDrafter(gamma=7))]
    reference = decode_interleaved(target, arms, prompt, ids, i, Decoding(gamma=7, max_new_tokens=128,
                                   eos_token_id=eos, seed=i))   # eval/spec_decode.py Decoding
    speed_ratio(arms[2].samples)   # lookup's tokens/s over the plain loop's, beside it
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from eval.compare import record_source
from eval.spec_decode import Decoding, Drafter, GenerationResult, is_greedy, speculative_generate, target_generate


@dataclass
class Arm:
    """One drafter's decodes of the prompts: its per-prompt samples, every round, and its totals (prefill apart)."""

    name: str
    drafter: Drafter
    schedule: Callable[[list[float]], int] | None = None  # a verify schedule (eval/scheduler.py); None: every draft
    gamma: int | None = None  # drafts a round, over the Decoding's (arms of several draft lengths on the same prompts)
    samples: list[dict] = field(default_factory=list)
    rounds: list = field(default_factory=list)
    decode_s: float = 0.0  # wall time of its decodes, prefill included
    prefill_s: float = 0.0
    copied_rounds: int = 0  # lookup-first: rounds lookup proposed


@dataclass
class PlainLoop:
    """The plain decodes bracketing every prompt: their mean time per prompt, and how far a prompt's two differ."""

    decode_s: float = 0.0
    prefill_s: float = 0.0
    tokens: int = 0
    spreads: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def decode_interleaved(target, arms: list[Arm], prompt, ids: list[int], index: int, how: Decoding,
                       plain: PlainLoop | None = None) -> GenerationResult:
    """Decode `ids` plainly, then with every arm (reversed on odd `index`), then plainly again, each as `how` says
    (its seed: this prompt's); each arm's sample of the prompt gets its decode time beside the mean of the two plain
    ones (`plain_s`). Returns the first plain decode: the reference the arms' outputs must equal at T=0."""
    temperature = how.temperature
    before = target_generate(target, ids, how.max_new_tokens, temperature, how.eos_token_id, seed=how.seed)
    results = {}
    for arm in arms if index % 2 == 0 else list(reversed(arms)):
        arm_how = how if arm.gamma is None else replace(how, gamma=arm.gamma)
        results[arm.name] = speculative_generate(target, arm.drafter, ids, arm_how, schedule=arm.schedule)
        arm.copied_rounds += getattr(arm.drafter, "copied_rounds", 0)
    after = target_generate(target, ids, how.max_new_tokens, temperature, how.eos_token_id, seed=how.seed)
    plain_s = (before.wall_s + after.wall_s) / 2
    if plain is not None:
        plain.decode_s += plain_s
        plain.prefill_s += (before.prefill_s + after.prefill_s) / 2
        plain.tokens += len(before.ids)
        plain.spreads.append(abs(before.wall_s / after.wall_s - 1.0) if after.wall_s else 0.0)
    for arm in arms:
        result = results[arm.name]
        arm.rounds += result.rounds
        arm.decode_s += result.wall_s
        arm.prefill_s += result.prefill_s
        arm.samples.append({
            "id": prompt.id, "source": record_source(prompt.id), "accept_len": result.accept_len,
            "tokens": len(result.ids), "exact": result.ids == before.ids if is_greedy(temperature) else None,
            # tau = round_tokens / rounds: a paired bootstrap resamples them (eval/compare.py)
            "round_tokens": sum(r.accepted + 1 for r in result.rounds), "rounds": len(result.rounds),
            # its speed beside the plain loop's on the same prompt, minutes apart at most
            "decode_s": result.wall_s, "plain_s": plain_s, "plain_tokens": len(before.ids)})
    return before


def speed_ratio(samples: list[dict]) -> float:
    """An arm's tokens/s over the plain loop's, both summed over the arm's own samples (each with the plain decodes
    of its prompt, timed beside it)."""
    decode_s = sum(s["decode_s"] for s in samples)
    plain_s = sum(s["plain_s"] for s in samples)
    plain_tokens = sum(s["plain_tokens"] for s in samples)
    if not decode_s or not plain_s or not plain_tokens:
        return 0.0
    return (sum(s["tokens"] for s in samples) / decode_s) / (plain_tokens / plain_s)


def speed_by_source(arms_samples: list[list[dict]]) -> dict[str, list[float]]:
    """{source: [speed_ratio of each arm's samples of that source]}, sources sorted, then "all"."""
    sources = sorted({x["source"] for x in arms_samples[0]})
    return {group: [speed_ratio([x for x in samples if group == "all" or x["source"] == group])
                    for samples in arms_samples] for group in [*sources, "all"]}
