"""Tests pinning the evaluation summaries (``distill.evaluate``): d3LLM's AUP on points with
hand-computed answers, the diversity measures per prompt, and the parallelism settings."""

from __future__ import annotations

import math

import pytest

from distill.data.tasks import Example
from distill.diffusion.denoise import SamplingSettings
from distill.evaluate import (
    at_parallelism,
    at_threshold,
    aup,
    aup_weight,
    distinct_per_prompt,
    first_miss_index,
    free_choice_entropy_bits,
    miss_kind,
    schedule_steps_for,
    score_completions,
)


def test_aup_of_one_point_at_one_token_per_forward_is_its_accuracy():
    assert aup([1.0], [96.9]) == pytest.approx(96.9)


def test_aup_of_a_flat_curve_is_the_area_under_it():
    # No accuracy lost: every weight is 1, so AUP = 1 * 90 + (4 - 1) * 90.
    assert aup([1.0, 2.0, 4.0], [90.0, 90.0, 90.0]) == pytest.approx(360.0)


def test_aup_weights_degraded_points_by_d3llm_exponential():
    # rho 1 -> 3, accuracy 100 -> 97, y_max 100: W(97) = exp(-3 * 0.03).
    expected = 100.0 + 0.5 * 2.0 * (97.0 * math.exp(-0.09) + 100.0)
    assert aup([3.0, 1.0], [97.0, 100.0], y_max=100.0) == pytest.approx(expected)
    assert aup_weight(97.0, 100.0) == pytest.approx(math.exp(-0.09))
    assert aup_weight(100.0, 90.0) == 1.0  # capped at 1


def test_aup_drops_points_more_than_five_points_below_the_first():
    # (4, 80) is below y_1 - 5 = 85 and is left out; (8, 86) stays.
    kept = aup([1.0, 2.0, 4.0, 8.0], [90.0, 90.0, 80.0, 86.0], y_max=90.0)
    w86 = math.exp(-3.0 * (1.0 - 86.0 / 90.0))
    assert kept == pytest.approx(90.0 + 90.0 + 0.5 * 6.0 * (86.0 * w86 + 90.0))


def test_aup_uses_the_given_y_max_for_the_first_term_only_unweighted():
    # The first term rho_1 * y_1 is never weighted; later ones are, against y_max.
    value = aup([1.0, 2.0], [50.0, 50.0], y_max=100.0)
    assert value == pytest.approx(50.0 + 0.5 * (50.0 * 2 * math.exp(-1.5)))


def test_aup_of_all_zero_accuracy_is_zero():
    assert aup([1.0, 4.0], [0.0, 0.0]) == 0.0


@pytest.mark.parametrize(
    ("rhos", "ys", "kwargs", "field"),
    [
        ([], [], {}, "accuracy"),
        ([1.0, 2.0], [50.0], {}, "accuracy"),
        ([0.0], [50.0], {}, "tokens_per_forward"),
        ([1.0], [0.5 * 300], {}, "accuracy"),
        ([1.0], [float("nan")], {}, "accuracy"),
        ([1.0], [50.0], {"y_max": 0.0}, "y_max"),
        ([1.0], [50.0], {"y_max": 101.0}, "y_max"),
    ],
)
def test_aup_refuses_malformed_points_naming_the_field(rhos, ys, kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` must"):
        aup(rhos, ys, **kwargs)


def test_distinct_is_computed_per_prompt_over_its_repeated_samples():
    # Prompt 1: 3 of its 4 samples differ; prompt 2: one answer 4 times.
    completions = ["a", "b", "c", "a", "x", "x", "x", "x"]
    assert distinct_per_prompt(completions, 4) == pytest.approx((3 / 4 + 1 / 4) / 2)
    # The same completions read as 4 prompts of 2 samples each.
    assert distinct_per_prompt(completions, 2) == pytest.approx((1 + 1 + 0.5 + 0.5) / 4)
    assert distinct_per_prompt(completions, 1) is None
    with pytest.raises(ValueError, match="`samples_per_prompt` must"):
        distinct_per_prompt(completions, 3)


def test_free_choice_entropy_counts_correct_agree_answers_only():
    example = Example("agree", "agree:3|", "aaa", 0)
    texts = ["aaa", "bbb", "ccc", "ddd", "abc", "aa"]
    # four correct answers, four different letters: 2 bits; the wrong ones are ignored.
    assert free_choice_entropy_bits([example] * 6, texts) == pytest.approx(2.0)
    assert free_choice_entropy_bits([example] * 2, ["aaa", "aaa"]) == 0.0
    assert free_choice_entropy_bits([example], ["abc"]) is None


def test_misses_are_split_into_late_stops_early_stops_and_wrong_symbols():
    assert miss_kind("abcd", "abcdd") == "stopped_late"
    assert miss_kind("abcd", "abc") == "stopped_early"
    assert miss_kind("abcd", "") == "stopped_early"
    assert miss_kind("abcd", "abxd") == "wrong_symbols"
    assert miss_kind("abcd", "abxdd") == "wrong_symbols"


def test_the_first_miss_index_is_where_the_completion_departs_from_the_answer():
    assert first_miss_index("abcd", "abxd") == 2
    assert first_miss_index("abcd", "abdd") == 2  # a skipped letter
    assert first_miss_index("abcd", "abcdd") == 4  # a late stop misses at the answer's end
    assert first_miss_index("abcd", "ab") == 2
    assert first_miss_index("abcd", "") == 0
    with pytest.raises(ValueError, match="`text` must differ from `answer`"):
        first_miss_index("abcd", "abcd")


def test_the_report_gives_accuracy_by_answer_length_and_counts_each_miss_once():
    short = Example("copy", "copy:ab|", "ab", 0)
    long = Example("copy", "copy:abcd|", "abcd", 1)
    other = Example("reverse", "reverse:ab|", "ba", 2)
    report = score_completions(
        [short, short, long, long, other], ["ab", "abb", "abcd", "ab", "ba"], 3.0, 1
    )
    assert report.accuracy == {"copy": 0.5, "reverse": 1.0}
    assert report.accuracy_by_length == {"copy": {"2": 0.5, "4": 0.5}, "reverse": {"2": 1.0}}
    assert report.misses == {"stopped_late": 1, "stopped_early": 1, "wrong_symbols": 0}
    assert report.first_miss_at == {"2": 2}
    assert report.count == 5 and report.tokens_per_forward == 3.0


@pytest.mark.parametrize(
    ("k", "length", "block", "budget"),
    [
        (1, 33, 16, 16),
        (2, 33, 16, 8),
        (4, 33, 16, 4),
        (8, 33, 16, 2),
        (16, 33, 16, 1),
        (32, 33, 16, 1),
        (3, 17, 16, 6),
        (1, 5, 8, 8),
    ],
)
def test_schedule_steps_give_each_block_the_budget_of_k_tokens_per_step(k, length, block, budget):
    steps = schedule_steps_for(k, length, block)
    assert math.ceil(steps * block / length) == budget
    if steps > 1:  # the smallest such value
        assert math.ceil((steps - 1) * block / length) < budget


def _settings() -> SamplingSettings:
    return SamplingSettings(
        alignment="same_position",
        commit_rule="threshold",
        threshold=0.9,
        confidence="max_prob",
        schedule_steps=None,
        strategy="random",
        temperature=1.0,
        greedy=False,
        stop_when_done=True,
        completion_length=33,
        mask_id=1,
        pad_id=0,
        stop_ids=(3,),
    )


def test_parallelism_settings_change_only_the_commit_rule():
    base = _settings()
    scheduled = at_parallelism(base, 4, 16)
    assert (scheduled.commit_rule, scheduled.strategy) == ("schedule", "confidence")
    assert scheduled.schedule_steps == schedule_steps_for(4, 33, 16)
    assert scheduled.temperature == base.temperature and scheduled.stop_ids == base.stop_ids
    swept = at_threshold(base, 0.5)
    assert (swept.commit_rule, swept.threshold) == ("threshold", 0.5)
    with pytest.raises(ValueError, match="`settings.threshold` must"):
        at_threshold(base, 1.5)
