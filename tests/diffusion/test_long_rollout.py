"""A tiny student at the long task specs of issue 16: it rolls out 33-slot completions (32
answer tokens and a stop) over 16-slot blocks at several tokens per forward, replays them
exactly, and is evaluated at 32-letter reverse."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from flax import nnx

from distill.config import ModelConfig, RolloutConfig
from distill.data.stream import TaskStream, encode_example
from distill.diffusion import replay
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.evaluate import at_parallelism, evaluate_student
from distill.models.transformer import Transformer

pytestmark = pytest.mark.slow  # two rollouts, a replay and an evaluation compile at 33 slots

BLOCK = 16
COMPLETION = 33  # 32 answer tokens and the stop token


@pytest.fixture(scope="module")
def student(tokenizer):
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        block_size=BLOCK,
        max_length=128,
        init_std=0.15,
    )
    return Transformer(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def examples():
    return TaskStream(tasks=["reverse"], seed=0, min_length=32, max_length=32).batch(0, 4)


@pytest.fixture(scope="module")
def base(tokenizer):
    config = RolloutConfig(max_completion_length=COMPLETION, stop_when_done=False)
    return SamplingSettings.from_config(config, tokenizer.special)


@pytest.fixture(scope="module")
def traces(student, tokenizer, examples, base):
    prompts = [encode_example(example, tokenizer)[0] for example in examples]
    return {
        k: rollout(student, prompts, at_parallelism(base, k, BLOCK), seed=0, global_step=0)
        for k in (4, 16)
    }


@pytest.fixture(scope="module", params=[4, 16])
def traced(request, traces):
    return request.param, traces[request.param]


def test_every_row_generates_all_33_completion_slots(traced):
    _, trace = traced
    assert np.asarray(trace.completion_mask).sum(axis=1).tolist() == [COMPLETION] * 4
    steps = np.asarray(trace.action_steps)[np.asarray(trace.completion_mask)]
    assert steps.min() == 0


def test_tokens_per_forward_follow_the_schedule(traced):
    k, trace = traced
    forwards = np.asarray(trace.forwards)
    # The prompt (bos + "reverse:" + 32 letters + "|") is 42 ids: the completion fills 6 slots
    # of block 2, all of block 3 and 11 of block 4; each block's budget is ceil(16 / k) steps.
    budget = -(-BLOCK // k)
    expected = sum(min(slots, budget) for slots in (6, 16, 11))
    assert forwards.tolist() == [expected] * 4
    assert trace.tokens_per_forward() == pytest.approx(COMPLETION / expected)


@functools.partial(nnx.jit, static_argnames=("num_chunks",))
def _packed(model, trace, num_chunks):
    return replay.replay_packed(model, trace, num_chunks=num_chunks)


def test_a_32_token_rollout_replays_exactly(student, tokenizer, traces):
    trace = traces[4]  # multi-token steps in every block
    replay.validate_trace(trace, tokenizer.vocab_size)
    logps = _packed(student, trace, replay.num_steps_bucket(trace))
    np.testing.assert_allclose(logps, trace.action_logps, atol=1e-5, rtol=0)


def test_a_tiny_student_is_evaluated_on_32_letter_reverse(student, tokenizer, examples, base):
    settings = at_parallelism(dataclasses.replace(base, stop_when_done=True), 8, BLOCK)
    report = evaluate_student(student, tokenizer, examples, settings, seed=0, samples_per_prompt=2)
    assert report.count == 8 and set(report.accuracy) == {"reverse"}
    assert 0.0 <= report.overall <= 1.0  # untrained: the plumbing, not the quality
    assert report.tokens_per_forward > 1.0
    assert report.distinct_fraction is not None and 0.5 <= report.distinct_fraction <= 1.0
