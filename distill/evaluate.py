"""Evaluation on verifiable tasks: exact match, tokens per forward, diversity.

Accuracy is measured at temperature 1 by default (greedy decoding hides the collapse of
parallel sampling). Diversity sits next to accuracy because reverse KL is mode-seeking:
the entropy (bits) of the free symbol chosen on ``agree`` among correct answers, and the
fraction of distinct completions among repeated samples of the same prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

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
    """Per-task exact match, overall exact match, tokens per forward and diversity."""

    accuracy: dict[str, float]
    overall: float
    tokens_per_forward: float
    agree_entropy_bits: float | None
    distinct_fraction: float | None
    count: int

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _report(
    examples: Sequence[Example],
    completions: Sequence[str],
    tokens_per_forward: float,
    samples_per_prompt: int,
) -> EvalReport:
    hits: dict[str, list[bool]] = collections.defaultdict(list)
    symbols: collections.Counter[str] = collections.Counter()
    for example, text in zip(examples, completions, strict=True):
        correct = verify(example, text)
        hits[example.task].append(correct)
        if example.task == "agree" and correct and text:
            symbols[text[0]] += 1
    entropy = None
    if symbols:
        total = sum(symbols.values())
        entropy = max(0.0, -sum(n / total * math.log2(n / total) for n in symbols.values()))
    distinct = None
    if samples_per_prompt > 1:
        groups = [
            completions[i : i + samples_per_prompt]
            for i in range(0, len(completions), samples_per_prompt)
        ]
        distinct = float(np.mean([len(set(group)) / len(group) for group in groups]))
    all_hits = [hit for task_hits in hits.values() for hit in task_hits]
    return EvalReport(
        accuracy={task: float(np.mean(task_hits)) for task, task_hits in sorted(hits.items())},
        overall=float(np.mean(all_hits)) if all_hits else float("nan"),
        tokens_per_forward=tokens_per_forward,
        agree_entropy_bits=entropy,
        distinct_fraction=distinct,
        count=len(all_hits),
    )


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
    return _report(examples, texts, 1.0, samples_per_prompt)


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
    return _report(examples, texts, trace.tokens_per_forward(), samples_per_prompt)
