"""Objectives: hand-computed MDLM, the NLL bound, self-corrupted and coordination semantics."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill import train
from distill.config import ModelConfig, ObjectiveConfig, OptimizerConfig, load_config
from distill.diffusion import objectives
from distill.diffusion.layout import build_training_layout
from distill.models.transformer import Transformer

VOCAB, MASK = 12, 1


@pytest.fixture(scope="module")
def student():
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        block_size=4,
        init_std=0.2,
    )
    return Transformer(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def layout():
    return build_training_layout(
        [[2, 5, 6], [2, 7, 8, 9, 4, 5]],
        [[3, 4, 5, 6, 7, 3], [8, 9, 3]],
        horizon=7,
        block_size=4,
        pad_id=0,
        mask_id=MASK,
        vocab_size=VOCAB,
    )


# `step` is traced (the ramp is a jnp schedule): one compile per objective, any step.
@functools.partial(nnx.jit, static_argnames=("chosen",))
def loss_of(chosen, model, layout, keys, step=0):
    return train.loss_and_metrics(chosen, model, layout, keys, step)


@functools.partial(nnx.jit, static_argnames=("chosen", "microbatches"))
def gradients(chosen, model, layout, keys, microbatches=1):
    return train.accumulated_gradients(chosen, model, layout, keys, 0, microbatches)


@functools.partial(nnx.jit, static_argnames=("chosen",))
def plan_and_sums(chosen, model, layout, keys, step=0):
    plan = chosen.plan(layout, keys, step)
    return plan, chosen.sums(model, layout, plan, keys), chosen.denominators(layout, plan)


@functools.partial(nnx.jit, static_argnames=("chosen",))
def terms_and_loss(chosen, model, layout, keys, step):
    """The plan's per-term sums and denominators, and the training loss, in one compile."""
    plan = chosen.plan(layout, keys, step)
    sums, denominators = chosen.sums(model, layout, plan, keys), chosen.denominators(layout, plan)
    loss, _ = train.loss_and_metrics(chosen, model, layout, keys, step)
    return sums, denominators, loss


def keys_for(layout, seed=0):
    return jax.random.split(jax.random.key(seed), layout.tokens.shape[0])


def objective(**fields):
    return objectives.Objective(ObjectiveConfig(**fields), MASK, vocab_chunk=None)


def test_mdlm_at_t_equal_one_is_the_plain_masked_cross_entropy(student, layout):
    mdlm = objective(kind="mdlm", min_noise=1.0, context="corrupted")
    loss, metrics = loss_of(mdlm, student, layout, keys_for(layout))
    # By hand: every completion token masked, weight 1/t = 1, mean over completion tokens.
    completion = np.asarray(layout.completion_mask)
    canvas = jnp.where(layout.completion_mask, MASK, layout.tokens)
    logits = student(canvas, layout.positions, layout.segment_ids).at[..., MASK].set(-jnp.inf)
    log_probs = jax.nn.log_softmax(logits)
    chosen = np.asarray(jnp.take_along_axis(log_probs, layout.tokens[..., None], -1)[..., 0])
    expected = -chosen[completion].sum() / completion.sum()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(metrics["mdlm/denominator"]) == completion.sum()


def test_mdlm_weights_each_target_by_the_inverse_of_its_block_noise(student, layout):
    mdlm = objective(kind="mdlm", min_noise=0.2, context="corrupted")
    keys = keys_for(layout, 3)
    plan, sums, _ = plan_and_sums(mdlm, student, layout, keys)
    corruption = plan.corruption
    logits = student(corruption.canvas, layout.positions, layout.segment_ids)
    log_probs = jax.nn.log_softmax(logits.at[..., MASK].set(-jnp.inf))
    chosen = jnp.take_along_axis(log_probs, layout.tokens[..., None], -1)[..., 0]
    target = np.asarray(corruption.target_mask)
    expected = (-np.asarray(chosen) / np.asarray(corruption.noise))[target].sum()
    np.testing.assert_allclose(float(sums["mdlm"]), expected, rtol=1e-5)


def test_nll_bound_is_at_least_the_exact_nll_of_a_uniform_model(layout):
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, block_size=4)
    uniform = Transformer(config, rngs=nnx.Rngs(0))
    uniform.embed.embedding[...] = jnp.zeros_like(uniform.embed.embedding[...])
    exact = np.log(VOCAB - 1)  # every non-mask token equally likely
    bound = nnx.jit(
        lambda model, keys: objectives.nll_bound(
            model, layout, keys, alignment="same_position", canvas="all_masked", mask_id=MASK
        )
    )
    samples = []
    for seed in range(48):
        nats, count = bound(uniform, keys_for(layout, seed))
        samples.append(float(nats) / float(count))
    mean, stderr = np.mean(samples), np.std(samples) / np.sqrt(len(samples))
    assert mean >= exact - 3 * stderr
    assert objectives.bits(float(nats), float(count)) > 0


@pytest.mark.parametrize("context", ["clean", "corrupted"])
def test_self_corrupted_with_zero_ramp_equals_mdlm(student, layout, context):
    keys = keys_for(layout, 5)
    mdlm = objective(kind="mdlm", context=context)
    self_corrupted = objective(kind="self_corrupted", context=context, ramp_steps=100)
    mdlm_loss, _ = loss_of(mdlm, student, layout, keys, 0)
    sc_loss, _ = loss_of(self_corrupted, student, layout, keys, 0)
    np.testing.assert_allclose(float(sc_loss), float(mdlm_loss), rtol=1e-6)
    # With the ramp up, some masked slots get self-generated tokens and the loss changes.
    ramped, _ = loss_of(self_corrupted, student, layout, keys, 100)
    assert not np.isclose(float(ramped), float(mdlm_loss))


@nnx.jit
def hand_run_logits(model, layout, canvas):
    """The mask-excluded logits of ``canvas`` in the clean context (one compile for every
    step of the hand-run decode below)."""
    hidden = objectives.target_hidden(
        model, layout, canvas, alignment="same_position", context="clean"
    )
    return model.logits(hidden).at[..., MASK].set(-jnp.inf)


def test_coordination_target_is_a_sequential_decode(student, layout):
    coordination = objective(kind="coordination", group=3, context="clean")
    keys = keys_for(layout, 7)
    plan = coordination.plan(layout, keys)
    decode_keys = jax.vmap(lambda key: jax.random.fold_in(key, 4))(keys)
    targets = np.asarray(
        objectives.coordination_targets(student, layout, plan, decode_keys, objective=coordination)
    )
    # Hand-run: fill the chosen slots one at a time, each sampled given the earlier picks.
    order = np.asarray(plan.coordination_order)
    canvas = np.asarray(plan.corruption.canvas).copy()
    for index in range(order.shape[1]):
        logits = hand_run_logits(student, layout, jnp.asarray(canvas))
        for row in range(order.shape[0]):
            slot = order[row, index]
            if slot < 0:
                continue
            key = jax.random.fold_in(decode_keys[row], index)
            token = int(jax.random.categorical(key, logits[row, slot][None], axis=-1)[0])
            assert targets[row, index] == token
            canvas[row, slot] = token
    # All chosen slots lie in one block of each row and were masked.
    block = np.asarray(layout.positions) // layout.block_size
    for row in range(order.shape[0]):
        chosen = order[row][order[row] >= 0]
        assert len(chosen) >= 1 and len(set(block[row][chosen])) == 1
        assert np.asarray(plan.corruption.corruption_mask)[row][chosen].all()


def test_cmd_is_mdlm_plus_weighted_self_corrupted_and_ramped_coordination(student, layout):
    keys = keys_for(layout, 9)
    cmd = objective(kind="cmd", alpha=0.5, beta=2.0, ramp_steps=10)
    sums, denominators, loss = terms_and_loss(cmd, student, layout, keys, 5)
    expected = (
        sums["mdlm"] / denominators["mdlm"]
        + 0.5 * sums["self_corrupted"] / denominators["self_corrupted"]
        + 2.0 * 0.5 * sums["coordination"] / denominators["coordination"]
    )
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


@pytest.mark.parametrize("kind", objectives.OBJECTIVES)
def test_all_zero_weights_give_zero_loss_and_exactly_zero_gradients(student, layout, kind):
    empty = dataclasses.replace(
        layout,
        completion_mask=jnp.zeros_like(layout.completion_mask),
        loss_weights=jnp.zeros_like(layout.loss_weights),
    )
    chosen = objective(kind=kind)
    loss, grads, _ = gradients(chosen, student, empty, keys_for(layout))
    assert float(loss) == 0.0
    assert all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(grads))


@pytest.mark.parametrize("kind", ["block_ce", "cmd"])
def test_two_microbatches_accumulate_to_the_whole_batch_gradient(student, layout, kind):
    # The corrupted context keeps the compiled graph small; accumulation does not depend on it.
    chosen = objective(kind=kind, ramp_steps=0, context="corrupted")
    keys = keys_for(layout, 11)
    whole_loss, whole, _ = gradients(chosen, student, layout, keys, 1)
    split_loss, split, _ = gradients(chosen, student, layout, keys, 2)
    np.testing.assert_allclose(float(split_loss), float(whole_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_microbatches_must_divide_the_batch(student, layout):
    with pytest.raises(ValueError, match="`microbatches`"):
        train.accumulated_gradients(objective(kind="mdlm"), student, layout, keys_for(layout), 0, 3)


@pytest.mark.parametrize("kind", objectives.OBJECTIVES)
def test_every_objective_is_selectable_from_yaml(tmp_path, kind):
    path = tmp_path / "objective.yaml"
    path.write_text(f"kind: {kind}\nalpha: 0.3\n")
    config = load_config(path, ObjectiveConfig)
    assert objectives.Objective(config, MASK).term_names()


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_invalid_loss_weights_are_refused_eagerly_and_counted_under_jit(student, layout, bad):
    block_ce = objective(kind="block_ce", context="corrupted")
    slot = int(np.argmax(np.asarray(layout.completion_mask)[0]))
    weights = np.asarray(layout.loss_weights).copy()
    weights[0, slot] = bad
    broken = dataclasses.replace(layout, loss_weights=jnp.asarray(weights))
    keys = keys_for(layout, 13)
    plan = block_ce.plan(broken, keys)
    with pytest.raises(ValueError, match=r"^`layout.loss_weights` must be finite and >= 0"):
        block_ce.denominators(broken, plan)
    with pytest.raises(ValueError, match=r"^`layout.loss_weights` must be finite and >= 0"):
        objectives.CausalLM().sums(student, broken, None, keys)
    model = nnx.clone(student)
    trainer = train.Trainer(model, train.make_train_state(model, OptimizerConfig()))
    with pytest.raises(ValueError, match=r"^`layout.loss_weights` must be finite and >= 0"):
        trainer.step(broken, keys, 0, objective=block_ce)
    # Under jit the weight counts as 0 (neither a sign flip nor a NaN) and is reported.
    weights[0, slot] = 0.0
    zeroed = dataclasses.replace(layout, loss_weights=jnp.asarray(weights))
    loss, metrics = loss_of(block_ce, student, broken, keys)
    want, clean = loss_of(block_ce, student, zeroed, keys)
    assert float(metrics["invalid_weights"]) == 1.0 and float(clean["invalid_weights"]) == 0.0
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert metrics["block_ce/denominator"] == clean["block_ce/denominator"]


def test_training_a_clone_leaves_the_original_usable(student, layout):
    """Steps donate the trainer's buffers; neither the model nor an ``nnx.clone`` of it (made
    before the trainer, or after a sync) may hold them."""
    original = nnx.clone(student)
    before = [np.asarray(leaf).copy() for leaf in jax.tree.leaves(nnx.state(original))]
    model = nnx.clone(original)  # shares every array with `original`
    trainer = train.Trainer(model, train.make_train_state(model, OptimizerConfig()))
    chosen = objective(kind="mdlm", context="corrupted")
    keys = keys_for(layout, 17)
    trainer.step(layout, keys, 0, objective=chosen)
    after = jax.tree.leaves(nnx.state(original))
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))  # readable and untouched
    synced = trainer.sync()
    copy = nnx.clone(synced)
    trainer.step(layout, keys, 1, objective=chosen)
    # The clone of the synced model and the model itself survive the next donated step.
    for leaf in jax.tree.leaves(nnx.state(copy)) + jax.tree.leaves(nnx.state(synced)):
        assert np.isfinite(np.asarray(leaf)).all()
    changed = trainer.sync()
    assert any(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(before, jax.tree.leaves(nnx.state(changed)), strict=True)
    )
