"""OPD losses: estimator correctness, hand-computed advantages, clipping, top-k tails, OPD
weights, leak-proof zero batches, GRPO / k3 and input validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill import losses
from distill.config import LossConfig

KINDS = losses.DIVERGENCE_KINDS


def _np_divergence(kind, p, q):
    """Reference divergence between teacher p and student q (probability vectors)."""

    def kl(a, b):
        keep = a > 0
        return float(np.sum(a[keep] * (np.log(a[keep]) - np.log(b[keep]))))

    if kind == "forward_kl":
        return kl(p, q)
    if kind == "reverse_kl_full":
        return kl(q, p)
    m = 0.5 * (p + q)
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


# Inputs are made with numpy: every eager jax op would cost a compilation.


def _rng(seed):
    return np.random.default_rng(seed)


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _np_log_softmax(logits):
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return (shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))).astype(
            np.float32
        )


def _log_probs(rng, shape, mask_id=None):
    logits = 2.0 * _normal(rng, shape)
    if mask_id is not None:
        logits[..., mask_id] = -np.inf
    return _np_log_softmax(logits)


# ---- reverse KL policy gradient ------------------------------------------------------------

V = 5
TEACHER_LOGITS = np.array([1.0, 0.2, -0.5, 0.8, -1.0], np.float32)
THETA = np.array([0.3, -0.4, 0.9, 0.0, -0.2], np.float32)
STUDENT_PROBS = np.exp(THETA.astype(np.float64)) / np.exp(THETA.astype(np.float64)).sum()
SAMPLES = _rng(0).choice(V, size=20_000, p=STUDENT_PROBS).astype(np.int32)


def _exact_reverse_kl(theta, teacher_logits):
    student = jax.nn.log_softmax(theta)
    teacher = jax.nn.log_softmax(teacher_logits)
    return jnp.sum(jnp.exp(student) * (student - teacher))


@jax.jit
def _toy_gradients(theta, teacher_logits, samples):
    """For each advantage: the gradient of the surrogate (behaviour = the student, one
    position per sample) and its terms; plus the exact reverse KL and its gradient."""
    teacher = jax.nn.log_softmax(teacher_logits)[samples][:, None]
    behaviour = jax.lax.stop_gradient(jax.nn.log_softmax(theta)[samples][:, None])
    weights = jnp.ones_like(teacher)
    order = jnp.zeros(teacher.shape, jnp.int32)
    out = {}
    for advantage in losses.ADVANTAGES:

        def loss(theta, advantage=advantage):
            student = jax.nn.log_softmax(theta)[samples][:, None]
            terms = losses.reverse_kl(
                student, behaviour, teacher, weights, order, advantage=advantage
            )
            return terms.value(), terms

        out[advantage] = jax.grad(loss, has_aux=True)(theta)
    exact = jax.value_and_grad(_exact_reverse_kl)(theta, teacher_logits)
    return out, exact


@pytest.fixture(scope="module")
def toy():
    return _toy_gradients(THETA, TEACHER_LOGITS, SAMPLES)


@pytest.mark.parametrize("advantage", losses.ADVANTAGES)
def test_reverse_kl_policy_gradient_matches_exact_reverse_kl_gradient(toy, advantage):
    estimates, (exact_value, exact_grad) = toy
    estimate, terms = estimates[advantage]
    np.testing.assert_allclose(estimate, exact_grad, atol=0.03)
    assert float(jnp.max(jnp.abs(exact_grad))) > 0.1  # the check is not vacuous
    # The per-token reverse-KL metric estimates the exact divergence.
    np.testing.assert_allclose(terms.metrics["reverse_kl"].value(), exact_value, atol=0.03)
    np.testing.assert_allclose(terms.metrics["ratio"].value(), 1.0, rtol=1e-6)


def test_reverse_kl_is_exactly_zero_with_zero_gradient_when_student_equals_teacher():
    estimates, _ = _toy_gradients(THETA, THETA, SAMPLES)  # same shapes: no recompilation
    for grad, terms in estimates.values():
        assert float(terms.total) == 0.0
        assert float(terms.metrics["reverse_kl"].value()) == 0.0
        np.testing.assert_array_equal(grad, np.zeros(V))


# ---- advantages ----------------------------------------------------------------------------

# Three rows with weighted tokens (row 1 in a permuted slot order) and one all-zero row whose
# log-ratios are NaN (it must not affect the others).
ADV_WEIGHTS = np.array([[0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
ADV_ORDER = np.array([[0, 1, 2, 3], [5, 3, 4, 0], [0, 1, 2, 3], [0, 1, 2, 3]], np.int32)
ADV_RATIO = np.array(
    [[9.0, 1, 2, 3], [4, -1, 2, 7], [1, 1, 1, 1], [np.nan, np.nan, np.inf, 1]], np.float32
)
ADV_EXTRA = np.array([0.5, -0.5, 0.0, 3.0], np.float32)


@jax.jit
def _hand_advantages(log_ratio):
    """Per advantage kind: the advantages and, on-policy with ``log_ratio`` as the teacher
    and a zero student, the gradient of the reverse-KL loss w.r.t. the student log-probs."""
    teacher = jnp.where(jnp.isfinite(log_ratio), log_ratio, 0.0)
    student = jnp.zeros(log_ratio.shape)
    out = {}
    for advantage in losses.ADVANTAGES:

        def loss(s, advantage=advantage):
            terms = losses.reverse_kl(
                s, s, teacher, ADV_WEIGHTS, ADV_ORDER, advantage=advantage,
                extra_advantages=ADV_EXTRA,
            )  # fmt: skip
            return terms.value()

        advantages = losses.opd_advantages(log_ratio, ADV_WEIGHTS, ADV_ORDER, advantage=advantage)
        out[advantage] = advantages, jax.grad(loss)(student)
    return out


@pytest.fixture(scope="module")
def hand():
    return _hand_advantages(ADV_RATIO)


def test_return_to_go_advantage_on_hand_computed_example(hand):
    got = hand["return_to_go"][0]
    # Returns by rank (order among weighted tokens): row 0 [6, 5, 3], row 1 (slots 1, 2, 0)
    # [5, 6, 4], row 2 [4, 3, 2, 1]. Baselines by rank: 5, 14/3, 3, 1 (only row 2 reaches
    # rank 3, so its advantage there is 0).
    expected = np.array(
        [
            [0.0, 1.0, 1 / 3, 0.0],
            [1.0, 0.0, 4 / 3, 0.0],
            [-1.0, -5 / 3, -1.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_mean_to_go_advantage_divides_each_return_by_the_tokens_it_sums(hand):
    got = hand["mean_to_go"][0]
    # Mean returns by rank: row 0 [2, 5/2, 3], row 1 [5/3, 3, 4], row 2 [1, 1, 1, 1];
    # baselines by rank: 14/9, 13/6, 8/3, 1. A row that stops early is no longer favoured
    # for summing fewer negative log-ratios.
    expected = np.array(
        [
            [0.0, 4 / 9, 1 / 3, 1 / 3],
            [4 / 3, 1 / 9, 5 / 6, 0.0],
            [-5 / 9, -7 / 6, -5 / 3, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_sequence_and_token_advantages_on_hand_computed_example(hand):
    sequence = hand["sequence"][0]
    # Row sums 6, 5, 4 (row 3 has no weight and is left out of the mean 5).
    expected = np.array([[0, 1, 1, 1], [0, 0, 0, 0], [-1, -1, -1, -1], [0, 0, 0, 0]])
    np.testing.assert_allclose(sequence, expected, atol=1e-6)
    token = hand["token"][0]
    expected = np.where(ADV_WEIGHTS > 0, np.nan_to_num(ADV_RATIO), 0.0)
    np.testing.assert_allclose(token, expected)


def test_reverse_kl_gradient_is_minus_advantage_on_policy(hand):
    # On-policy (ratio 1), d loss / d student_logp = -A * w / sum(w): the OPD advantage of
    # r = teacher - student plus the per-row extra (task) advantage.
    extra = np.where(ADV_WEIGHTS > 0, ADV_EXTRA[:, None], 0.0)
    for advantages, grad in hand.values():
        expected = -(np.asarray(advantages) + extra) * ADV_WEIGHTS / ADV_WEIGHTS.sum()
        np.testing.assert_allclose(grad, expected, atol=1e-6)


def test_ppo_clipping_stops_the_gradient_only_outside_the_band_in_the_improving_direction():
    ratio = np.array([[1.5, 1.5, 0.5, 0.5, 1.0, 1.1]], np.float32)
    advantages = np.array([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0]], np.float32)
    behaviour = np.zeros((1, 6), np.float32)
    weights = np.ones((1, 6), np.float32)

    def loss(student, clip):
        terms = losses.policy_gradient(student, behaviour, advantages, weights, ppo_clip=clip)
        return terms.value(), terms

    student = np.log(ratio)

    @jax.jit
    def gradients(student):
        return [jax.grad(loss, has_aux=True)(student, clip) for clip in (0.2, None)]

    (grad, terms), (plain, _) = gradients(student)
    # d(-ratio * A)/d log-ratio = -ratio * A; zero where the clipped branch is active:
    # ratio above 1 + eps with A > 0, or below 1 - eps with A < 0.
    unclipped = -(ratio * advantages) / 6.0
    expected = unclipped * np.array([0, 1, 0, 1, 1, 1])
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    np.testing.assert_allclose(terms.metrics["clip_fraction"].value(), 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(plain, unclipped, rtol=1e-6)


# ---- full-vocabulary and top-k divergences -------------------------------------------------


@jax.jit
def _divergences_and_gradients(student, teacher, weights):
    out = {}
    for kind in KINDS:

        def loss(student, kind=kind):
            terms = losses.divergence(kind, student, teacher, weights)
            return terms.value(), terms

        grad, terms = jax.grad(loss, has_aux=True)(student)
        out[kind] = terms, grad
    return out


@pytest.fixture(scope="module")
def full_case():
    rng = _rng(2)
    student = _log_probs(rng, (2, 3, 7), mask_id=0)
    teacher = _log_probs(rng, (2, 3, 7), mask_id=0)
    weights = np.array([[1.0, 0.5, 0.0], [1.0, 1.0, 2.0]], np.float32)
    return student, teacher, weights, _divergences_and_gradients(student, teacher, weights)


@pytest.mark.parametrize("kind", KINDS)
def test_full_divergence_matches_reference_with_excluded_mask_id(full_case, kind):
    student, teacher, weights, results = full_case
    terms, grad = results[kind]
    p, q = np.exp(teacher.astype(np.float64)), np.exp(student.astype(np.float64))
    per_token = np.array(
        [[_np_divergence(kind, p[b, t], q[b, t]) for t in range(3)] for b in range(2)]
    )
    np.testing.assert_allclose(terms.total, np.sum(per_token * weights), rtol=1e-5)
    assert float(terms.denominator) == 5.5
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[..., 0] == 0.0)  # the excluded id gets no gradient


@jax.jit
def _topk_and_full(student_logits, teacher, ids, weights):
    """Per kind: (value, gradient w.r.t. the student logits) of the top-k and the full
    divergence (the mask id 5 excluded)."""

    def student_of(logits):
        return jax.nn.log_softmax(logits.at[..., 5].set(-jnp.inf), axis=-1)

    out = {}
    for kind in KINDS:

        def full(logits, kind=kind):
            return losses.divergence(kind, student_of(logits), teacher, weights).value()

        def topk(logits, kind=kind):
            student = losses.gather_topk(student_of(logits), ids)
            teacher_topk = jnp.take_along_axis(teacher, ids, axis=-1)
            return losses.topk_divergence(kind, student, teacher_topk, weights).value()

        out[kind] = (
            jax.value_and_grad(topk)(student_logits),
            jax.value_and_grad(full)(student_logits),
        )
    return out


@pytest.fixture(scope="module")
def topk_all_ids():
    rng = _rng(3)
    shape = (2, 3, 6)
    student_logits = 2.0 * _normal(rng, shape)
    teacher = _log_probs(rng, shape, mask_id=5)
    ids = np.argsort(rng.uniform(size=shape), axis=-1).astype(np.int32)  # every id, shuffled
    return _topk_and_full(student_logits, teacher, ids, np.ones(shape[:2], np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_topk_with_k_equal_vocab_equals_the_full_divergence(topk_all_ids, kind):
    (topk_value, topk_grad), (full_value, full_grad) = topk_all_ids[kind]
    assert float(full_value) > 0.01
    np.testing.assert_allclose(topk_value, full_value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(topk_grad, full_grad, atol=1e-6)


@jax.jit
def _coarse(student, teacher, ids, weights):
    out = {}
    for kind in KINDS:
        loss = losses.OpdLoss(kind=kind, teacher_top_k=3)
        terms = loss(
            weights,
            student_log_probs=student,
            teacher_topk_ids=ids,
            teacher_topk_logps=jnp.take_along_axis(teacher, ids, axis=-1),
        )
        out[kind] = terms, losses.divergence(kind, student, teacher, weights)
    return out


@pytest.fixture(scope="module")
def coarse_case():
    rng = _rng(4)
    student = _log_probs(rng, (1, 2, 6))
    teacher = _log_probs(rng, (1, 2, 6))
    ids = np.array([[[4, 1, 2], [0, 5, 3]]], np.int32)
    weights = np.array([[1.0, 3.0]], np.float32)
    return student, teacher, ids, weights, _coarse(student, teacher, ids, weights)


@pytest.mark.parametrize("kind", KINDS)
def test_topk_tail_bucket_equals_divergence_of_coarsened_distributions(coarse_case, kind):
    student, teacher, ids, weights, results = coarse_case
    terms, full = results[kind]
    p, q = np.exp(teacher.astype(np.float64)), np.exp(student.astype(np.float64))
    expected = 0.0
    for t in range(2):
        chosen = np.asarray(ids[0, t])
        coarse_p = np.append(p[0, t, chosen], 1 - p[0, t, chosen].sum())
        coarse_q = np.append(q[0, t, chosen], 1 - q[0, t, chosen].sum())
        assert min(coarse_p[-1], coarse_q[-1]) > 1e-3  # the tail bucket matters here
        expected += float(weights[0, t]) * _np_divergence(kind, coarse_p, coarse_q)
    np.testing.assert_allclose(terms.total, expected, rtol=1e-5)
    assert float(terms.total) <= float(full.total) + 1e-6  # coarsening never increases it


# ---- OPD weights ---------------------------------------------------------------------------

STOP = 9


def _row(tokens, completion, positions, segments):
    return tokens, completion, positions, segments


# Each row: tokens, completion mask, positions, segment ids (0 = padding).
WEIGHT_ROWS = {
    # First stop (slot 3) is weighted; the second stop and everything after is not.
    "stop": _row(
        [5, 6, 7, 9, 8, 9, 7, 0], [0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 2, 3, 4, 5, 6, 0],
        [1, 1, 1, 1, 1, 1, 1, 0],
    ),
    # Left padding carrying position 0; no stop; a real token equal to the pad id (0).
    "no_stop": _row(
        [0, 0, 4, 4, 0, 6, 0, 0], [0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 2, 3, 4, 0, 0],
        [0, 2, 2, 2, 2, 2, 0, 0],
    ),
    # Slots hold positions out of order: the first stop is the one at position 3 (slot 3),
    # not the one in the earlier slot 2 (position 4).
    "permuted": _row(
        [5, 6, 9, 9, 7, 8, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 4, 3, 2, 5, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
    ),
    "no_prompt": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ),
    "no_completion": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ),
    "prompt_after_completion": _row(
        [5, 6, 7, 8, 4, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 2, 3, 4, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ),
    "non_contiguous": _row(
        [5, 6, 7, 8, 4, 0, 0, 0], [0, 0, 1, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ),
    "duplicate_positions": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 2, 2, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ),
    "positions_from_one": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ),
    "completion_on_padding": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 2, 3, 4, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ),
    "two_segments": _row(
        [5, 6, 7, 8, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0],
        [1, 1, 2, 2, 0, 0, 0, 0],
    ),
}  # fmt: skip
VALID_ROWS = ("stop", "no_stop", "permuted")


@pytest.fixture(scope="module")
def weighted_rows():
    names = list(WEIGHT_ROWS)
    arrays = [np.array([WEIGHT_ROWS[n][i] for n in names], np.int32) for i in range(4)]
    tokens, completion, positions, segments = arrays
    weigh = jax.jit(functools.partial(losses.opd_weights, stop_ids=(STOP,)))
    out = weigh(tokens, completion.astype(bool), positions, segments)
    return {n: tuple(np.asarray(a[i]) for a in out) for i, n in enumerate(names)}


def test_opd_weights_train_the_first_stop_token_and_hide_everything_after_it(weighted_rows):
    weights, visible, invalid = weighted_rows["stop"]
    np.testing.assert_array_equal(weights, [0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(visible, [1, 1, 1, 1, 0, 0, 0, 0])
    assert not invalid
    weights, visible, invalid = weighted_rows["permuted"]
    np.testing.assert_array_equal(weights, [0, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(visible, [1, 1, 0, 1, 1, 0, 0, 0])
    assert not invalid
    assert weights.dtype == np.float32


def test_opd_weights_without_a_stop_weight_the_whole_completion(weighted_rows):
    weights, visible, invalid = weighted_rows["no_stop"]
    np.testing.assert_array_equal(weights, [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(visible, [0, 1, 1, 1, 1, 1, 0, 0])
    assert not invalid


@pytest.mark.parametrize("name", [n for n in WEIGHT_ROWS if n not in VALID_ROWS])
def test_opd_weights_zero_and_flag_rows_that_break_the_sequence_contract(weighted_rows, name):
    weights, visible, invalid = weighted_rows[name]
    assert invalid
    assert not weights.any()
    assert not visible.any()


def test_opd_weights_with_no_stop_ids_weight_through_the_end():
    tokens, completion, positions, segments = (np.array([a], np.int32) for a in WEIGHT_ROWS["stop"])
    weights, _, invalid = jax.jit(losses.opd_weights)(tokens, completion > 0, positions, segments)
    np.testing.assert_array_equal(weights[0], [0, 0, 1, 1, 1, 1, 1, 0])
    assert not invalid[0]


# ---- zero weight: exactly zero loss and gradients ------------------------------------------


def _poisoned(rng, shape):
    values = _normal(rng, shape)
    values[..., :3] = np.array([np.nan, np.inf, -np.inf], np.float32)[: shape[-1]]
    return values


TOPK_IDS = np.broadcast_to(np.array([4, 0, 2], np.int32), (3, 4, 3))


def _loss_cases():
    """Every loss (reverse_kl advantages, full, top-k, task + k3) as ``(weights, batch) ->
    value`` over ``batch = (s, b, t, sv, tv, rewards, groups)``, with the indices of the
    differentiable inputs (``s``: student log-probs of the sampled tokens, ``sv``: the
    student's full log-probs)."""
    cases = []
    for advantage, clip in zip(losses.ADVANTAGES, (None, 0.2, 0.2, None), strict=True):

        def policy(weights, batch, advantage=advantage, clip=clip):
            s, b, t = batch[:3]
            order = jnp.zeros(s.shape, jnp.int32)
            return losses.reverse_kl(
                s, b, t, weights, order, advantage=advantage, ppo_clip=clip, extra_advantages=t
            ).value()

        cases.append((policy, (0,)))

    def full(weights, batch):
        return sum(losses.divergence(kind, batch[3], batch[4], weights).value() for kind in KINDS)

    def topk(weights, batch):
        student = losses.gather_topk(batch[3], TOPK_IDS)
        teacher = jnp.take_along_axis(batch[4], TOPK_IDS, axis=-1)
        return sum(
            losses.topk_divergence(kind, student, teacher, weights).value() for kind in KINDS
        )

    def task(weights, batch):
        # Task policy gradient and reference k3 on top of a full-vocabulary kind.
        s, b, t, sv, tv, rewards, groups = batch
        loss = losses.OpdLoss(kind="jsd", task_reward_weight=0.5, kl_reference_weight=0.1)
        return loss(
            weights, student_logps=s, behaviour_logps=b, student_log_probs=sv,
            teacher_log_probs=tv, rewards=rewards, group_ids=groups, reference_logps=t,
        ).value()  # fmt: skip

    cases += [(full, (3,)), (topk, (3,)), (task, (0, 3))]

    def gradient_of(case, argnums):
        def value(differentiable, weights, batch):
            batch = list(batch)
            for index, array in zip(argnums, differentiable, strict=True):
                batch[index] = array
            return case(weights, batch)

        # One small jit per loss: XLA compiles these faster than one combined graph.
        return jax.jit(
            lambda weights, batch: jax.value_and_grad(value)(
                [batch[i] for i in argnums], weights, batch
            )
        )

    return [gradient_of(case, argnums) for case, argnums in cases]


LOSS_GRADIENTS = _loss_cases()


def _values_and_grads(weights, *batch):
    results = [gradient(weights, batch) for gradient in LOSS_GRADIENTS]
    values = np.array([float(value) for value, _ in results])
    return values, [np.asarray(grad) for _, grads in results for grad in grads]


def test_all_zero_weight_batch_gives_exactly_zero_loss_and_gradients_despite_nan():
    rng = _rng(5)
    shape = (3, 4)
    s, b, t = (_poisoned(rng, shape) for _ in range(3))
    sv, tv = _poisoned(rng, (*shape, 5)), _poisoned(rng, (*shape, 5))
    rewards, groups = np.array([1.0, np.nan, 3.0], np.float32), np.array([0, 0, 1], np.int32)
    weights = np.zeros(shape, np.float32)
    values, grads = _values_and_grads(weights, s, b, t, sv, tv, rewards, groups)
    np.testing.assert_array_equal(values, np.zeros(values.shape))
    for grad in grads:
        np.testing.assert_array_equal(grad, np.zeros(grad.shape))


def test_inactive_nan_does_not_leak_into_active_rows():
    rng = _rng(6)
    shape = (3, 4)
    s, b, t = (_normal(rng, shape) for _ in range(3))
    sv, tv = _log_probs(rng, (*shape, 5)), _log_probs(rng, (*shape, 5))
    rewards, groups = np.array([1.0, 2.0, 5.0], np.float32), np.zeros(3, np.int32)
    weights = np.array([[1.0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    clean = _values_and_grads(weights, s, b, t, sv, tv, rewards, groups)
    clean_values, clean_grads = clean
    poison = np.where(weights == 0, np.nan, 0.0).astype(np.float32)
    dirty = (s + poison, b - np.where(weights == 0, np.inf, 0.0).astype(np.float32), t + poison)
    dirty_v = (sv + poison[..., None], tv + poison[..., None])
    dirty_rewards = np.array([1.0, 2.0, np.nan], np.float32)
    values, grads = _values_and_grads(weights, *dirty, *dirty_v, dirty_rewards, groups)
    assert np.all(np.isfinite(values)) and np.any(np.asarray(values) != 0)
    np.testing.assert_allclose(values, clean_values, rtol=1e-5, atol=1e-7)
    for grad, clean in zip(grads, clean_grads, strict=True):
        np.testing.assert_allclose(grad, clean, rtol=1e-5, atol=1e-7)


def test_microbatches_accumulate_to_the_whole_batch():
    rng = _rng(7)
    s, t = _normal(rng, (4, 3)), _normal(rng, (4, 3))
    sv, tv = _log_probs(rng, (4, 3, 5)), _log_probs(rng, (4, 3, 5))
    weights = np.array([[1.0, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], np.float32)

    @jax.jit
    def parts():
        def part(rows):
            w = weights[rows]
            return (
                losses.reverse_kl(s[rows], s[rows], t[rows], w, advantage="token"),
                losses.divergence("jsd", sv[rows], tv[rows], w),
            )

        first, second = part(slice(0, 2)), part(slice(2, 4))
        accumulated = [losses.accumulate(a, b) for a, b in zip(first, second, strict=True)]
        return part(slice(0, 4)), accumulated, losses.denominator(weights)

    whole, accumulated, denominator = parts()
    for a, b in zip(whole, accumulated, strict=True):
        np.testing.assert_allclose(b.value(), a.value(), rtol=1e-6)
        for name, metric in a.metric_values().items():
            np.testing.assert_allclose(b.metric_values()[name], metric, rtol=1e-6, atol=1e-7)
        assert float(a.denominator) == float(b.denominator) == float(denominator) == 6.0


# ---- GRPO and k3 ---------------------------------------------------------------------------


def test_grpo_advantages_normalize_within_each_group():
    rewards = np.array([1.0, 2.0, 3.0, 5.0, 0.1, 0.1, 0.1, 7.0, 4.0, 8.0], np.float32)
    groups = np.array([0, 0, 0, 1, 2, 2, 2, 3, 3, 3])
    row_mask = np.array([True] * 9 + [False])
    weights = np.array([[0.0, 1.0]] * 9 + [[0.0, 0.0]], np.float32)
    got, task = jax.jit(
        lambda: (
            losses.grpo_advantages(rewards, groups, row_mask=row_mask),
            losses.task_advantages(rewards, groups, weights, scale=0.5),
        )
    )()
    got = np.asarray(got)
    std = np.sqrt(2 / 3)
    np.testing.assert_allclose(got[:3], np.array([-1.0, 0.0, 1.0]) / (std + 1e-6), rtol=1e-6)
    assert got[3] == 0.0  # group of one
    np.testing.assert_array_equal(got[4:7], 0.0)  # equal rewards: zero std
    # The masked row (reward 8) is left out of its group: the rest is [7, 4].
    np.testing.assert_allclose(got[7:9], np.array([1.5, -1.5]) / (1.5 + 1e-6), rtol=1e-6)
    assert got[9] == 0.0
    np.testing.assert_allclose(task[:, 1], 0.5 * got, rtol=1e-6)
    np.testing.assert_array_equal(task[:, 0], 0.0)


def test_k3_is_nonnegative_and_zero_when_student_equals_reference():
    rng = _rng(8)
    student, reference = _normal(rng, (4, 6)), _normal(rng, (4, 6))
    weights = np.ones((4, 6), np.float32)

    @jax.jit
    def k3(student, reference):
        return jax.value_and_grad(lambda s: losses.k3_kl(s, reference, weights).total)(student)

    gap = reference.astype(np.float64) - student
    total, _ = k3(student, reference)
    np.testing.assert_allclose(total, np.sum(np.exp(gap) - gap - 1), rtol=1e-5)
    assert float(total) > 0
    total, grad = k3(student, student)
    assert float(total) == 0.0
    np.testing.assert_array_equal(grad, np.zeros(grad.shape))


# ---- dispatcher and validation -------------------------------------------------------------


def test_opd_loss_from_config_dispatches_and_adds_the_reference_kl():
    rng = _rng(9)
    s, t, r = (_normal(rng, (2, 3)) for _ in range(3))
    weights = np.ones((2, 3), np.float32)
    order = np.broadcast_to(np.arange(3, dtype=np.int32), (2, 3))
    config = LossConfig(kl_reference_weight=0.25, ppo_clip=0.2)
    loss = losses.OpdLoss.from_config(config)
    assert loss.required_inputs() == (
        "student_logps", "behaviour_logps", "teacher_logps", "order", "reference_logps",
    )  # fmt: skip

    @jax.jit
    def run(s, t, r):
        inputs = dict(
            student_logps=s, behaviour_logps=s, teacher_logps=t, order=order, reference_logps=r
        )
        return (
            loss(weights, **inputs),
            losses.opd_loss(config, weights, **inputs),
            losses.reverse_kl(s, s, t, weights, order, advantage="return_to_go", ppo_clip=0.2),
            losses.k3_kl(s, r, weights),
        )

    terms, same, main, k3 = run(s, t, r)
    np.testing.assert_allclose(terms.total, main.total + 0.25 * k3.total, rtol=1e-6)
    np.testing.assert_allclose(terms.metrics["kl_reference"].value(), k3.value(), rtol=1e-6)
    np.testing.assert_allclose(same.value(), terms.value())


def test_teacher_nonfinite_on_weighted_tokens_raises_eagerly_and_is_flagged_under_jit():
    s = np.zeros((1, 3), np.float32)
    t = np.array([[0.0, np.nan, -np.inf]], np.float32)
    weights = np.array([[1.0, 1.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match="`teacher_logps` must be finite"):
        losses.reverse_kl(s, s, t, weights, advantage="token")
    terms = jax.jit(lambda t: losses.reverse_kl(s, s, t, weights, advantage="token"))(t)
    assert np.isfinite(terms.value())
    assert float(terms.metrics["teacher_nonfinite"].total) == 1.0
    full = np.full((1, 3, 4), np.log(0.25), np.float32)
    full[0, 0, 1] = np.nan
    with pytest.raises(ValueError, match="`teacher_log_probs` must be finite or -inf"):
        losses.divergence("forward_kl", np.log(np.full((1, 3, 4), 0.25)), full, weights)


def test_bad_inputs_fail_naming_the_field():
    z = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"`loss.kind` must be one of .*; received 'kl'"):
        losses.OpdLoss(kind="kl")
    with pytest.raises(ValueError, match=r"`loss.ppo_clip` must be > 0 or None; received -0.1"):
        losses.OpdLoss(ppo_clip=-0.1)
    with pytest.raises(ValueError, match=r"`loss.advantage` must be one of"):
        losses.OpdLoss(advantage="gae")
    with pytest.raises(ValueError, match=r"`loss.task_reward_weight` must be >= 0"):
        losses.OpdLoss(task_reward_weight=-1.0)
    with pytest.raises(ValueError, match=r"`ppo_clip` must be > 0"):
        losses.reverse_kl(z, z, z, z, advantage="token", ppo_clip=-1.0)
    with pytest.raises(ValueError, match=r"`teacher_logps` must have shape \(2, 3\)"):
        losses.reverse_kl(z, z, np.zeros((2, 4)), z, advantage="token")
    with pytest.raises(ValueError, match=r"`order` must be given"):
        losses.reverse_kl(z, z, z, z, advantage="return_to_go")
    with pytest.raises(ValueError, match=r"`kind` must be one of"):
        losses.divergence("reverse_kl", z[..., None], z[..., None], z)
    with pytest.raises(ValueError, match=r"`teacher_log_probs` must have shape \(2, 3, 4\)"):
        losses.divergence("jsd", np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 5)), z)
    with pytest.raises(ValueError, match=r"`group_ids` must have shape \(2,\)"):
        losses.grpo_advantages(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match=r"`positions` must have shape \(2, 3\)"):
        losses.opd_weights(z, z > 0, np.zeros((2, 2)), z, stop_ids=(1,))
    loss = losses.OpdLoss()
    with pytest.raises(ValueError, match=r"`order` must be given for loss.kind='reverse_kl'"):
        loss(z, student_logps=z, behaviour_logps=z, teacher_logps=z)
    with pytest.raises(ValueError, match=r"`teacher_logp` must not be given"):
        loss(z, student_logps=z, behaviour_logps=z, teacher_logp=z, order=z)
    topk = losses.OpdLoss(kind="forward_kl", teacher_top_k=2)
    v = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"`teacher_log_probs` must not be given"):
        topk(
            z, student_log_probs=v, teacher_log_probs=v, teacher_topk_ids=v[..., :2],
            teacher_topk_logps=v[..., :2],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"`teacher_topk_ids` must have shape \[B, L, loss"):
        topk(
            z, student_log_probs=v, teacher_topk_ids=v[..., :3].astype(int),
            teacher_topk_logps=v[..., :3],
        )  # fmt: skip


# ---- loss weights --------------------------------------------------------------------------

BAD_WEIGHTS = {
    "negative": np.array([[1.0, -1.0, 1.0]], np.float32),
    "nan": np.array([[1.0, np.nan, 1.0]], np.float32),
    "inf": np.array([[1.0, np.inf, 1.0]], np.float32),
}


def _every_weighted_loss(weights):
    """Every public entry that takes loss weights, called with ``weights`` ``[1, 3]``."""
    z = np.zeros((1, 3), np.float32)
    v = np.log(np.full((1, 3, 4), 0.25, np.float32))
    ids = np.broadcast_to(np.arange(2, dtype=np.int32), (1, 3, 2))
    order = np.arange(3, dtype=np.int32)[None]
    rewards, groups = np.zeros(1, np.float32), np.zeros(1, np.int32)
    return {
        "denominator": lambda: losses.denominator(weights),
        "policy_gradient": lambda: losses.policy_gradient(z, z, z, weights),
        "opd_advantages": lambda: losses.opd_advantages(z, weights, order),
        "reverse_kl": lambda: losses.reverse_kl(z, z, z, weights, order),
        "divergence": lambda: losses.divergence("jsd", v, v, weights),
        "topk_divergence": lambda: losses.topk_divergence("jsd", v[..., :2], v[..., :2], weights),
        "task_advantages": lambda: losses.task_advantages(rewards, groups, weights),
        "k3_kl": lambda: losses.k3_kl(z, z, weights),
        "OpdLoss": lambda: losses.OpdLoss(kind="forward_kl", teacher_top_k=2)(
            weights, student_log_probs=v, teacher_topk_ids=ids, teacher_topk_logps=v[..., :2]
        ),
    }


@pytest.mark.parametrize("bad", sorted(BAD_WEIGHTS))
def test_negative_or_non_finite_weights_are_refused_eagerly(bad):
    for name, call in _every_weighted_loss(BAD_WEIGHTS[bad]).items():
        with pytest.raises(ValueError, match=r"^`weights` must be finite and >= 0; received 1 "):
            call()
            pytest.fail(f"{name} accepted {bad} weights")


def test_invalid_weights_are_counted_and_left_out_under_jit():
    rng = _rng(12)
    s, b, t = (_normal(rng, (1, 3)) for _ in range(3))
    v = _log_probs(rng, (1, 3, 4))
    clean = np.array([[1.0, 0.0, 2.0]], np.float32)

    @jax.jit
    def run(weights):
        return (
            losses.reverse_kl(s, b, t, weights, advantage="token"),
            losses.divergence("forward_kl", v, v + 0.1, weights),
            losses.k3_kl(s, t, weights),
        )

    expected = run(clean)
    for bad in BAD_WEIGHTS.values():
        weights = clean.copy()
        weights[0, 1] = bad[0, 1]  # one invalid entry where the clean weights have 0
        for got, want in zip(run(weights), expected, strict=True):
            assert float(got.metrics["invalid_weights"].total) == 1.0
            assert float(want.metrics["invalid_weights"].total) == 0.0
            np.testing.assert_allclose(got.value(), want.value(), rtol=1e-6)
            assert float(got.denominator) == float(want.denominator) == 3.0
