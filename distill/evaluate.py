"""Evaluation on verifiable tasks: exact match, tokens per forward, diversity, AUP.

Accuracy is measured at temperature 1 by default (greedy decoding hides the collapse of
parallel sampling). Diversity sits next to accuracy because reverse KL is mode-seeking:
the entropy (bits) of the free symbol chosen on ``agree`` among correct answers
(:func:`free_choice_entropy_bits`), and the fraction of distinct completions among the
repeated samples of each prompt, averaged over prompts (:func:`distinct_per_prompt`).

The accuracy-parallelism curve of a decoder (exact match against measured tokens per
forward, over commit rules and their settings: :func:`at_parallelism`, :func:`at_threshold`)
is summarized by :func:`aup`, d3LLM's accuracy under parallelism.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from distill.data.stream import encode_example
from distill.data.tasks import Example, verify
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.models.sampling import sample_causal
from distill.models.transformer import Transformer
from distill.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """Per-task exact match, overall exact match, tokens per forward and diversity.

    Where the misses are (both against each example's canonical answer, so for a task with
    several right answers, ``agree``, they are indicative): ``accuracy_by_length`` is each
    task's exact match by answer length (keys are lengths as strings, JSON's form), and
    ``misses`` counts the wrong completions by kind: ``stopped_late`` (the answer followed by
    more), ``stopped_early`` (a proper prefix of it) and ``wrong_symbols`` (the rest);
    ``first_miss_at`` counts the wrong completions by the answer index of their first wrong
    character (:func:`first_miss_index`; keys as strings), which shows a positional blind
    spot (every miss at one index) that the length table cannot.
    """

    accuracy: dict[str, float]
    overall: float
    tokens_per_forward: float
    agree_entropy_bits: float | None
    distinct_fraction: float | None
    count: int
    accuracy_by_length: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    misses: dict[str, int] = dataclasses.field(default_factory=dict)
    first_miss_at: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def free_choice_entropy_bits(
    examples: Sequence[Example], completions: Sequence[str]
) -> float | None:
    """Entropy (bits) of the free symbol of the correct ``agree`` completions (the answer's
    first letter), pooled over prompts; None when no ``agree`` completion is correct. At most
    log2(8) = 3 bits: a collapsed decoder that always picks one letter has 0."""
    if len(examples) != len(completions):
        raise ValueError(
            f"`completions` must have one entry per example ({len(examples)}); "
            f"received {len(completions)}"
        )
    symbols: collections.Counter[str] = collections.Counter()
    for example, text in zip(examples, completions, strict=True):
        if example.task == "agree" and text and verify(example, text):
            symbols[text[0]] += 1
    if not symbols:
        return None
    total = sum(symbols.values())
    return max(0.0, -sum(n / total * math.log2(n / total) for n in symbols.values()))


def distinct_per_prompt(completions: Sequence[str], samples_per_prompt: int) -> float | None:
    """Mean over prompts of (distinct completions / samples) among each prompt's repeated
    samples; ``completions`` holds each prompt's ``samples_per_prompt`` samples
    consecutively (as :func:`_repeat` lays them out). None with one sample per prompt (the
    fraction would be 1 by construction). 1.0: every sample differs; 1/samples: one answer."""
    if isinstance(samples_per_prompt, bool) or not isinstance(samples_per_prompt, int):
        raise ValueError(f"`samples_per_prompt` must be an int; received {samples_per_prompt!r}")
    if samples_per_prompt < 1 or len(completions) % samples_per_prompt:
        raise ValueError(
            f"`samples_per_prompt` must be >= 1 and divide the {len(completions)} "
            f"completions; received {samples_per_prompt}"
        )
    if samples_per_prompt == 1 or not completions:
        return None
    groups = [
        completions[i : i + samples_per_prompt]
        for i in range(0, len(completions), samples_per_prompt)
    ]
    return float(np.mean([len(set(group)) / samples_per_prompt for group in groups]))


def score_completions(
    examples: Sequence[Example],
    completions: Sequence[str],
    tokens_per_forward: float,
    samples_per_prompt: int,
) -> EvalReport:
    """Verify each completion (stop-cut answer text) against its example and summarise;
    ``completions[i]`` answers ``examples[i]`` (each prompt's samples consecutive)."""
    hits: dict[str, list[bool]] = collections.defaultdict(list)
    by_length: dict[str, dict[int, list[bool]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    misses = dict.fromkeys(MISS_KINDS, 0)
    first_miss_at: collections.Counter[int] = collections.Counter()
    for example, text in zip(examples, completions, strict=True):
        hit = verify(example, text)
        hits[example.task].append(hit)
        by_length[example.task][len(example.answer)].append(hit)
        if not hit:
            misses[miss_kind(example.answer, text)] += 1
            first_miss_at[first_miss_index(example.answer, text)] += 1
    all_hits = [hit for task_hits in hits.values() for hit in task_hits]
    return EvalReport(
        accuracy={task: float(np.mean(task_hits)) for task, task_hits in sorted(hits.items())},
        overall=float(np.mean(all_hits)) if all_hits else float("nan"),
        tokens_per_forward=tokens_per_forward,
        agree_entropy_bits=free_choice_entropy_bits(examples, completions),
        distinct_fraction=distinct_per_prompt(completions, samples_per_prompt),
        count=len(all_hits),
        accuracy_by_length={
            task: {str(length): float(np.mean(h)) for length, h in sorted(lengths.items())}
            for task, lengths in sorted(by_length.items())
        },
        misses=misses,
        first_miss_at={str(index): n for index, n in sorted(first_miss_at.items())},
    )


MISS_KINDS = ("stopped_late", "stopped_early", "wrong_symbols")


def miss_kind(answer: str, text: str) -> str:
    """How a wrong completion ``text`` differs from the canonical ``answer``: one of
    :data:`MISS_KINDS` (``stopped_late``: the answer then more; ``stopped_early``: a proper
    prefix of the answer; ``wrong_symbols``: anything else)."""
    if len(text) > len(answer) and text.startswith(answer):
        return "stopped_late"
    if len(text) < len(answer) and answer.startswith(text):
        return "stopped_early"
    return "wrong_symbols"


def first_miss_index(answer: str, text: str) -> int:
    """The index of the first character where ``text`` departs from the canonical
    ``answer``: the first differing index, else the shorter length (a late stop misses at
    ``len(answer)``, an early one at ``len(text)``). Equal strings have no miss: ValueError."""
    if text == answer:
        raise ValueError(f"`text` must differ from `answer`; received {text!r} for both")
    for index, (expected, produced) in enumerate(zip(answer, text, strict=False)):
        if expected != produced:
            return index
    return min(len(answer), len(text))


def _repeat(examples: Sequence[Example], times: int) -> list[Example]:
    if times < 1:
        raise ValueError(f"`samples_per_prompt` must be >= 1; received {times}")
    return [example for example in examples for _ in range(times)]


def completion_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The answer text of completion ``ids``: stop tokens dropped, then decoded."""
    stops = set(tokenizer.special.stop_ids)
    return tokenizer.decode([i for i in ids if i not in stops])


def evaluate_teacher(
    model: Transformer,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    *,
    horizon: int,
    seed: int,
    temperature: float = 1.0,
    greedy: bool = False,
    samples_per_prompt: int = 1,
) -> EvalReport:
    """Sample the causal teacher on each prompt and verify the stop-cut answers."""
    examples = _repeat(examples, samples_per_prompt)
    prompts = [encode_example(example, tokenizer)[0] for example in examples]
    special = tokenizer.special
    sample = sample_causal(
        model,
        prompts,
        max_new_tokens=horizon,
        key=jax.random.key(seed),
        pad_id=special.pad_id,
        stop_ids=special.stop_ids,
        excluded_ids=(special.mask_id,),
        temperature=temperature,
        greedy=greedy,
    )
    texts = [completion_text(tokenizer, ids) for ids in sample.completions()]
    return score_completions(examples, texts, 1.0, samples_per_prompt)


def evaluate_student(
    model: Transformer,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    settings: SamplingSettings,
    *,
    seed: int,
    global_step: int = 0,
    samples_per_prompt: int = 1,
) -> EvalReport:
    """Roll the block-diffusion student out on each prompt (eval RNG stream) and verify."""
    examples = _repeat(examples, samples_per_prompt)
    prompts = [encode_example(example, tokenizer)[0] for example in examples]
    trace = rollout(model, prompts, settings, seed=seed, global_step=global_step, mode="eval")
    texts = [completion_text(tokenizer, ids) for ids in trace.completions()]
    return score_completions(examples, texts, trace.tokens_per_forward(), samples_per_prompt)


# ---- parallelism: decoding settings and the accuracy-parallelism summary -------------------


def schedule_steps_for(tokens_per_step: int, completion_length: int, block_size: int) -> int:
    """The ``schedule_steps`` that gives each block a budget of ``ceil(block_size /
    tokens_per_step)`` denoising steps under the schedule rule (whose per-block budget is
    ``ceil(schedule_steps * block_size / completion_length)``, see
    :mod:`distill.diffusion.denoise`): the smallest such value, so a full block commits
    ``tokens_per_step`` tokens per forward. A completion that starts or ends inside a block
    commits fewer there, so the measured tokens per forward can fall below the nominal one."""
    for name, value in (
        ("tokens_per_step", tokens_per_step),
        ("completion_length", completion_length),
        ("block_size", block_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1; received {value!r}")
    wanted = math.ceil(block_size / tokens_per_step)
    for steps in range(1, completion_length + 1):
        if math.ceil(steps * block_size / completion_length) >= wanted:
            return steps
    return completion_length


def at_parallelism(
    settings: SamplingSettings, tokens_per_step: int, block_size: int
) -> SamplingSettings:
    """``settings`` with the schedule rule committing ``tokens_per_step`` tokens per forward
    (most confident first: the ``confidence`` strategy), everything else unchanged."""
    steps = schedule_steps_for(tokens_per_step, settings.completion_length, block_size)
    return dataclasses.replace(
        settings, commit_rule="schedule", schedule_steps=steps, strategy="confidence"
    )


def at_threshold(settings: SamplingSettings, threshold: float) -> SamplingSettings:
    """``settings`` with the adaptive threshold rule at ``threshold`` (validated on
    construction: a number in [0, 1])."""
    return dataclasses.replace(settings, commit_rule="threshold", threshold=threshold)


#: d3LLM's penalty factor for accuracy degradation in the AUP weight.
AUP_ALPHA: float = 3.0
#: d3LLM's cut: points more than this many accuracy points below the lowest-parallelism
#: point's accuracy are left out of the AUP.
AUP_MIN_OFFSET: float = 5.0


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"`{name}` must be a number; received {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"`{name}` must be finite; received {value!r}")
    return float(value)


def aup_weight(accuracy: float, y_max: float, alpha: float = AUP_ALPHA) -> float:
    """d3LLM's quality weight ``W(y) = min(exp(-alpha * (1 - y / y_max)), 1)`` (accuracies in
    percent, ``y_max`` > 0)."""
    y, top = _finite("accuracy", accuracy), _finite("y_max", y_max)
    if top <= 0:
        raise ValueError(f"`y_max` must be > 0; received {y_max!r}")
    return min(math.exp(-_finite("alpha", alpha) * (1.0 - y / top)), 1.0)


def aup(
    tokens_per_forward: Sequence[float],
    accuracy: Sequence[float],
    *,
    y_max: float | None = None,
    alpha: float = AUP_ALPHA,
    min_offset: float = AUP_MIN_OFFSET,
) -> float:
    """Accuracy under parallelism (AUP), as d3LLM defines it (Qian et al., "AUP: when Accuracy
    Meets Parallelism in Diffusion Language Models", hao-ai-lab.github.io/blogs/text-diffusion,
    and github.com/hao-ai-lab/d3LLM): for points ``(rho_i, y_i)`` sorted by parallelism
    ``rho`` (tokens per forward, > 0; ties keep their given order) with accuracy ``y`` in
    percent [0, 100], keep those with ``y_i >= y_1 - min_offset`` (``y_1``: the accuracy of the
    lowest-parallelism point), then

        AUP = rho_1 * y_1 + 1/2 * sum_{i>=2} (rho_i - rho_{i-1}) * (y_i W(y_i) + y_{i-1} W(y_{i-1}))

    with ``W(y) = min(exp(-alpha (1 - y / y_max)), 1)`` (:func:`aup_weight`), ``alpha = 3``, and
    ``y_max`` the best accuracy on the task across the decoders being compared (default: the
    best of these points). One point at one token per forward scores its accuracy; a decoder
    that keeps its accuracy scores the area under its curve. A ``y_max`` of 0 (every accuracy
    0) gives 0. Raises ``ValueError`` naming the field for empty or unequal inputs, a
    non-finite value, ``rho <= 0`` or an accuracy outside [0, 100]."""
    if isinstance(tokens_per_forward, str) or isinstance(accuracy, str):
        raise ValueError("`tokens_per_forward` and `accuracy` must be sequences of numbers")
    rhos = [_finite("tokens_per_forward", value) for value in tokens_per_forward]
    ys = [_finite("accuracy", value) for value in accuracy]
    if not rhos or len(rhos) != len(ys):
        raise ValueError(
            f"`accuracy` must have one value per tokens_per_forward value ({len(rhos)}, at "
            f"least one); received {len(ys)}"
        )
    if min(rhos) <= 0:
        raise ValueError(f"`tokens_per_forward` must be > 0; received {min(rhos)}")
    if min(ys) < 0 or max(ys) > 100:
        raise ValueError(f"`accuracy` must be in percent, within [0, 100]; received {ys}")
    top = max(ys) if y_max is None else _finite("y_max", y_max)
    if top < 0 or top > 100:
        raise ValueError(f"`y_max` must be in [0, 100]; received {y_max!r}")
    order = sorted(range(len(rhos)), key=lambda index: rhos[index])
    floor = ys[order[0]] - _finite("min_offset", min_offset)
    kept = [(rhos[index], ys[index]) for index in order if ys[index] >= floor]
    if top == 0:
        if max(ys) > 0:
            raise ValueError(f"`y_max` must be > 0 when an accuracy is; received {y_max!r}")
        return 0.0
    total = kept[0][0] * kept[0][1]
    for (rho_prev, y_prev), (rho, y) in zip(kept, kept[1:], strict=False):
        weighted = y * aup_weight(y, top, alpha) + y_prev * aup_weight(y_prev, top, alpha)
        total += 0.5 * (rho - rho_prev) * weighted
    return total
