"""Known answers for the distribution losses (``forward_kl``, ``reverse_kl_full``, ``jsd``).

One position: the gradient with respect to the student's logits has a closed form and the
minimum is the teacher. Two positions that must agree (``agree`` with two letters, a
causal teacher): the losses are trained exactly as the OPD update trains them, with the
teacher's causal conditional ``q(x_p | x_<p)`` at the sampled prefix as the target of the
student's distribution at the step it committed ``x_p``, and the expectation over the
student's rollouts taken exactly (every outcome a row, weighted by its probability). The
fixed points are known in closed form and depend on the student's commit order; the
sequence-level ``reverse_kl`` is order-free. docs/opd.md ("Why mass-covering losses fail
on agree") has the measurements on the demo job.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from distill import losses

KINDS = losses.DIVERGENCE_KINDS
MASK_ID = 1


# ---- one position ------------------------------------------------------------------------

V = 6


def _log_softmax64(logits):
    finite = np.isfinite(logits)
    shifted = np.where(finite, logits - np.max(logits[finite]), -np.inf)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted)))


def _divergence64(kind, teacher, student):
    """The divergence between probability vectors (0 log 0 = 0), float64."""

    def kl(a, b):
        keep = a > 0
        return float(np.sum(a[keep] * (np.log(a[keep]) - np.log(b[keep]))))

    if kind == "forward_kl":
        return kl(teacher, student)
    if kind == "reverse_kl_full":
        return kl(student, teacher)
    mixture = 0.5 * (teacher + student)
    return 0.5 * kl(teacher, mixture) + 0.5 * kl(student, mixture)


def _closed_form_gradient(kind, teacher, logits):
    """d divergence / d logits (float64) for a softmax student; the mask id's logit is
    pinned to -inf, so its gradient is 0."""
    student = np.exp(_log_softmax64(logits))
    live = student > 0
    if kind == "forward_kl":
        return np.where(live, student - teacher, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "reverse_kl_full":
            # d/dq_i KL(q || p) = log(q_i / p_i) + 1; the constant cancels through softmax.
            per_entry = np.log(student) - np.log(teacher)
        else:
            # d/dq_i JSD(p, q) = log(q_i / m_i) / 2 with m = (p + q) / 2.
            per_entry = 0.5 * (np.log(student) - np.log(0.5 * (teacher + student)))
    per_entry = np.where(live, per_entry, 0.0)
    return np.where(live, student * (per_entry - np.sum(student * per_entry)), 0.0)


def _log(probabilities):
    """Entrywise log with log 0 = -inf (no warning)."""
    positive = probabilities > 0
    return np.where(positive, np.log(np.where(positive, probabilities, 1.0)), -np.inf)


def _masked_log_softmax(logits):
    ids = jnp.arange(logits.shape[-1])
    return jax.nn.log_softmax(jnp.where(ids == MASK_ID, -jnp.inf, logits), axis=-1)


def _one_position_loss(kind, path, logits, teacher_log_probs):
    """The divergence at one weighted token, through the full or the top-k (k = V) path."""
    student = _masked_log_softmax(logits)[None, None]
    teacher = teacher_log_probs[None, None]
    weights = jnp.ones((1, 1), jnp.float32)
    if path == "full":
        return losses.divergence(kind, student, teacher, weights).value()
    # The teacher's entries in another order, as a top-k answer lists them.
    ids = jnp.asarray(np.roll(np.arange(V), 2))[None, None]
    gathered = losses.gather_topk(student, ids)
    ordered = jnp.take_along_axis(teacher, ids, axis=-1)
    return losses.topk_divergence(kind, gathered, ordered, weights).value()


_one_position_value_and_grad = jax.jit(
    jax.value_and_grad(_one_position_loss, argnums=2), static_argnames=("kind", "path")
)


@pytest.fixture(scope="module")
def one_position():
    rng = np.random.default_rng(0)
    teacher_logits = 1.5 * rng.standard_normal(V)
    teacher_logits[MASK_ID] = -np.inf
    teacher = np.exp(_log_softmax64(teacher_logits))
    logits = rng.standard_normal(V)
    return teacher, logits


@pytest.mark.parametrize("path", ["full", "topk"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_wrt_student_logits_is_the_closed_form(one_position, kind, path):
    teacher, logits = one_position
    teacher_log = jnp.asarray(_log(teacher), jnp.float32)
    value, grad = _one_position_value_and_grad(
        kind, path, jnp.asarray(logits, jnp.float32), teacher_log
    )
    student = np.exp(_log_softmax64(np.where(np.arange(V) == MASK_ID, -np.inf, logits)))
    np.testing.assert_allclose(
        float(value), _divergence64(kind, teacher, student), rtol=1e-5, atol=1e-6
    )
    expected = _closed_form_gradient(
        kind, teacher, np.where(np.arange(V) == MASK_ID, -np.inf, logits)
    )
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-6)
    assert float(grad[MASK_ID]) == 0.0


@functools.partial(jax.jit, static_argnames=("kind", "steps"))
def _descend_one_position(kind, teacher_log_probs, logits, steps=300):
    optimizer = optax.adam(0.1)

    def step(carry, _):
        logits, state = carry
        grad = jax.grad(_one_position_loss, argnums=2)(kind, "full", logits, teacher_log_probs)
        updates, state = optimizer.update(grad, state)
        return (optax.apply_updates(logits, updates), state), None

    (logits, _), _ = jax.lax.scan(step, (logits, optimizer.init(logits)), None, length=steps)
    return jnp.exp(_masked_log_softmax(logits))


@pytest.mark.parametrize("kind", KINDS)
def test_one_position_minimum_is_the_teacher(one_position, kind):
    teacher, _ = one_position
    student = _descend_one_position(
        kind, jnp.asarray(_log(teacher), jnp.float32), jnp.zeros(V, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(student), teacher, atol=2e-3)


# ---- two positions that must agree, a causal teacher --------------------------------------

LETTERS = np.array([0, 2, 3, 4])  # the free symbols; id 1 is the mask id
K = len(LETTERS)
VOCAB = K + 1
EPSILON = 0.02  # the teacher's chance of a disagreeing second letter (keeps every KL finite)
ORDERS = ("one_forward", "left_to_right", "right_to_left", "copy_back")
# Every outcome (x0, x1) of a rollout is one row; weights are its probability.
OUTCOMES = np.array(list(itertools.product(range(K), range(K))))


def _teacher_conditionals():
    """``[K*K, 2, VOCAB]`` log-probs: the causal teacher's ``q(x0)`` (uniform over the
    letters) and ``q(x1 | x0)`` at each row's sampled ``x0`` (the copy with 1 - EPSILON)."""
    first = np.full(VOCAB, -np.inf)
    first[LETTERS] = -np.log(K)
    rows = []
    for a, _ in OUTCOMES:
        second = np.full(VOCAB, -np.inf)
        second[LETTERS] = np.log(EPSILON / (K - 1))
        second[LETTERS[a]] = np.log(1.0 - EPSILON)
        rows.append([first, second])
    return jnp.asarray(np.array(rows), jnp.float32)


def _letters_log_probs(logits):
    """Log-probs over the vocabulary from logits over the K letters (mask id -inf)."""
    full = jnp.full((*logits.shape[:-1], VOCAB), -jnp.inf).at[..., LETTERS].set(logits)
    return jax.nn.log_softmax(full, axis=-1)


def _student(order, params):
    """``[K*K, 2, VOCAB]``: the student's distribution at each position in the context it
    had when committing it, per row, and the rows' probabilities ``[K*K]``.

    ``one_forward``: both letters in one forward (empty context each). ``left_to_right``:
    x0 first, then x1 seeing x0. ``right_to_left``: x1 first, then x0 seeing x1.
    ``copy_back``: as ``right_to_left`` with x0 a frozen copy of x1 (the teacher's target
    for x1 is then a copy of the student's own sample)."""
    first, second = OUTCOMES[:, 0], OUTCOMES[:, 1]
    alone0, alone1 = _letters_log_probs(params["alone"])  # [2, VOCAB]: empty context
    seeing = _letters_log_probs(params["seeing"])  # [K, VOCAB]: context holds letter i
    if order == "copy_back":
        seeing = _letters_log_probs(jnp.asarray(20.0 * np.eye(K), jnp.float32))
    if order == "one_forward":
        position0, position1 = alone0[None].repeat(K * K, 0), alone1[None].repeat(K * K, 0)
    elif order == "left_to_right":
        position0, position1 = alone0[None].repeat(K * K, 0), seeing[first]
    else:  # right_to_left, copy_back
        position0, position1 = seeing[second], alone1[None].repeat(K * K, 0)
    log_probs = jnp.stack([position0, position1], axis=1)
    sampled = jnp.stack([LETTERS[first], LETTERS[second]], axis=1)
    token_logps = jnp.take_along_axis(log_probs, sampled[..., None], axis=-1)[..., 0]
    return log_probs, token_logps, jnp.exp(jnp.sum(token_logps, axis=1))


def _expected_loss(kind, order, params, teacher):
    """The OPD update's loss in exact expectation over the student's rollouts: the
    rollouts are data (their probabilities carry no gradient), as in the trained loop."""
    log_probs, token_logps, probability = _student(order, params)
    weights = jnp.broadcast_to(jax.lax.stop_gradient(probability)[:, None], (K * K, 2))
    if kind == "reverse_kl":
        sampled = jnp.stack([LETTERS[OUTCOMES[:, 0]], LETTERS[OUTCOMES[:, 1]]], axis=1)
        teacher_logps = jnp.take_along_axis(teacher, sampled[..., None], axis=-1)[..., 0]
        behaviour = jax.lax.stop_gradient(token_logps)
        return losses.reverse_kl(
            token_logps, behaviour, teacher_logps, weights, advantage="sequence"
        ).value()
    return losses.divergence(kind, log_probs, teacher, weights).value()


@functools.partial(jax.jit, static_argnames=("kind", "orders"))
def _fixed_points(kind, orders, params, teacher):
    """Trains the student's tables (one independent set per order: Adam is per-parameter,
    so one run over their summed losses is each order's own run) to the loss's fixed point.
    Per order: the probability that the two letters agree and the entropy (bits) of the
    letter committed first."""
    optimizer = optax.adam(0.05)

    def total(params):
        return sum(_expected_loss(kind, order, params[order], teacher) for order in orders)

    def step(carry, _):
        params, state = carry
        updates, state = optimizer.update(jax.grad(total)(params), state)
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), None, length=1500)
    out = {}
    for order in orders:
        _, _, probability = _student(order, params[order])
        agree = jnp.sum(jnp.where(OUTCOMES[:, 0] == OUTCOMES[:, 1], probability, 0.0))
        free = OUTCOMES[:, 0] if order in ("one_forward", "left_to_right") else OUTCOMES[:, 1]
        marginal = jnp.zeros(K).at[free].add(probability)
        out[order] = (agree, -jnp.sum(jnp.where(marginal > 0, marginal * jnp.log2(marginal), 0)))
    return out


@functools.partial(jax.jit, static_argnames=("kind", "order"))
def _expected_gradient(kind, order, params, teacher):
    return jax.grad(_expected_loss, argnums=2)(kind, order, params, teacher)


def _start(seed):
    rng = np.random.default_rng(seed)
    return {
        "alone": jnp.asarray(0.3 * rng.standard_normal((2, K)), jnp.float32),
        "seeing": jnp.asarray(0.3 * rng.standard_normal((K, K)), jnp.float32),
    }


@pytest.fixture(scope="module")
def fixed_points():
    teacher = _teacher_conditionals()
    found = {}
    for kind in (*KINDS, "reverse_kl"):
        orders = ORDERS if kind != "reverse_kl" else ("one_forward", "right_to_left")
        points = _fixed_points(kind, orders, {order: _start(1) for order in orders}, teacher)
        found |= {(kind, order): tuple(map(float, points[order])) for order in orders}
    return found


TEACHER_AGREES = 1.0 - EPSILON
TEACHER_ENTROPY = np.log2(K)


@pytest.mark.parametrize("kind", KINDS)
def test_token_losses_recover_the_teacher_when_the_student_commits_left_to_right(
    fixed_points, kind
):
    agree, entropy = fixed_points[kind, "left_to_right"]
    assert agree == pytest.approx(TEACHER_AGREES, abs=2e-3)
    assert entropy == pytest.approx(TEACHER_ENTROPY, abs=2e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_token_losses_in_one_forward_reach_the_product_of_teacher_marginals(fixed_points, kind):
    # Independent letters with the teacher's (uniform) marginals agree by chance: 1 / K.
    agree, entropy = fixed_points[kind, "one_forward"]
    assert agree == pytest.approx(1.0 / K, abs=2e-3)
    assert entropy == pytest.approx(TEACHER_ENTROPY, abs=2e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_token_losses_teach_a_student_that_commits_a_later_letter_first_to_ignore_it(
    fixed_points, kind
):
    # x0 is committed seeing x1, but its target is the causal teacher's q(x0), which cannot
    # see x1: the student learns a uniform x0 whatever x1 says, and agrees by chance only.
    agree, entropy = fixed_points[kind, "right_to_left"]
    assert agree == pytest.approx(1.0 / K, abs=2e-3)
    assert entropy == pytest.approx(TEACHER_ENTROPY, abs=2e-3)


def test_sequence_reverse_kl_is_order_free_and_recovers_the_teacher_right_to_left(fixed_points):
    # The joint q(x0, x1) factorizes in any order, so the sequence-level reverse KL (the
    # policy gradient) has the teacher as its optimum whatever the commit order.
    agree, entropy = fixed_points["reverse_kl", "right_to_left"]
    assert agree == pytest.approx(TEACHER_AGREES, abs=5e-3)
    assert entropy == pytest.approx(TEACHER_ENTROPY, abs=5e-3)


def test_sequence_reverse_kl_in_one_forward_agrees_by_collapsing_the_free_choice(fixed_points):
    # Independent letters can only agree by being deterministic; the mode-seeking reverse
    # KL goes there (the demo's threshold-0 collapse), where the token losses stay at chance.
    agree, entropy = fixed_points["reverse_kl", "one_forward"]
    assert agree > 0.9
    assert entropy < 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_a_letter_scored_against_its_own_copy_keeps_its_entropy_only_under_forward_kl(
    fixed_points, kind
):
    # x1 is committed first and x0 copies it, so the causal teacher's target for x1,
    # q(x1 | x0), is (up to EPSILON) the student's own sample. In expectation forward KL
    # then only smooths, by EPSILON (E_x[-grad log pi(x)] = 0), and keeps the free choice;
    # JSD and the full reverse KL push the likelier letters up until the choice collapses
    # (jsd's near-0 bits on agree).
    teacher = _teacher_conditionals()
    start = _start(1)
    free_logits = np.asarray(start["alone"][1])
    grad = _expected_gradient(kind, "copy_back", start, teacher)
    sharpening = float(np.dot(-np.asarray(grad["alone"][1]), free_logits - free_logits.mean()))
    _, entropy = fixed_points[kind, "copy_back"]
    if kind == "forward_kl":
        assert sharpening < 0.0
        assert entropy == pytest.approx(TEACHER_ENTROPY, abs=2e-3)
    else:
        assert sharpening > 0.0
        assert entropy < 0.3
