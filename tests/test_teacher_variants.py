"""Teacher scoring variants: candidate ids, shared-prompt scoring, bucketed shapes and
warm-up (after it, no call compiles)."""

import jax
import numpy as np
import pytest
from flax import nnx

from distill.config import ModelConfig
from distill.models.transformer import Transformer
from distill.teacher import InProcessTeacher, ScoreShapes
from distill.tokenizer import CharTokenizer

VOCAB = CharTokenizer().vocab_size
SHAPES = ScoreShapes(rows=(1, 4), lengths=(16, 32), top_ks=(2, 4), candidates=(4,))


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="causal",
        init_std=0.2,
        max_length=48,
    )
    return Transformer(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def teacher(model):
    return InProcessTeacher(model, CharTokenizer())


@pytest.fixture(scope="module")
def warmed():
    """A bucketed teacher warmed up (score and shared-prompt shapes) before any call, how
    many shapes its warm-up compiled, and an unbucketed teacher of the same model. The model
    has its own architecture (d_ff), so no other teacher compiled any of its shapes first."""
    config = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        n_layers=1,  # many compiles: keep each one cheap
        attention_type="causal",
        init_std=0.2,
        max_length=48,
    )
    model = Transformer(config, rngs=nnx.Rngs(2))
    shaped = InProcessTeacher(model, CharTokenizer(), shapes=SHAPES)
    return shaped, shaped.warm_up(shared=True), InProcessTeacher(model, CharTokenizer())


def _sequences(rng, lengths, low=4):
    return [rng.integers(low, VOCAB, n).tolist() for n in lengths]


def _reference_log_softmax(model, sequences, width):
    """The full log-softmax ``[B, width, V]`` of a jitted model call, padded like the
    teacher pads (lengths to ``width``)."""
    tokens = np.zeros((len(sequences), width), np.int32)
    positions, segments = np.zeros_like(tokens), np.zeros_like(tokens)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
        positions[row, : len(sequence)] = np.arange(len(sequence))
        segments[row, : len(sequence)] = 1
    graphdef, state = nnx.split(model)

    @jax.jit
    def full(state, tokens, positions, segments):
        logits = nnx.merge(graphdef, state)(tokens, positions, segments)
        return jax.nn.log_softmax(logits, axis=-1)

    return np.asarray(full(state, tokens, positions, segments))


# ---- candidate ids --------------------------------------------------------------------


def test_candidate_log_probs_gather_the_full_log_softmax(teacher, model):
    rng = np.random.default_rng(0)
    sequences = _sequences(rng, (3, 9, 14))
    candidates = [rng.integers(0, VOCAB, (len(s) - 1, 5)) for s in sequences]
    for s, ids in zip(sequences, candidates, strict=True):
        ids[:, 0] = s[1:]  # the actual next token among the candidates
    scored = teacher.score(sequences, top_k=3, candidate_ids=candidates)
    full = _reference_log_softmax(model, sequences, 16)
    for row, (s, ids, result) in enumerate(zip(sequences, candidates, scored, strict=True)):
        expected = np.take_along_axis(full[row, : len(s) - 1], ids, axis=-1)
        assert result.candidate_log_probs.shape == (len(s) - 1, 5)
        assert result.candidate_log_probs.dtype == np.float32
        np.testing.assert_allclose(result.candidate_log_probs, expected, atol=1e-6)
        np.testing.assert_allclose(result.candidate_log_probs[:, 0], result.log_probs, atol=1e-6)
        assert result.top_ids.shape == (len(s) - 1, 3)
    assert all(r.candidate_log_probs is None for r in teacher.score(sequences))


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        ([np.zeros((3, 2)), np.full((4, 2), VOCAB)], r"`candidate_ids\[1\]` must hold ids in"),
        ([np.zeros((3, 2)), np.full((4, 2), -1)], r"`candidate_ids\[1\]` must hold ids in"),
        ([np.zeros((3, 2)), np.zeros((4, 3))], r"`candidate_ids\[1\]` must hold K = 2"),
        ([np.zeros((3, 2)), np.zeros((3, 2))], r"`candidate_ids\[1\]` must have shape \[4, K\]"),
        ([np.zeros((3, 0)), np.zeros((4, 0))], r"`candidate_ids\[0\]` must have shape"),
        ([np.zeros((3, 2)), np.zeros((4, 2), np.float32)], r"`candidate_ids\[1\]` must be a 2-D"),
        ([np.zeros((3, 2))], r"`candidate_ids` must hold one array per sequence \(2\)"),
    ],
)
def test_bad_candidate_ids_are_refused_by_name(teacher, candidates, message):
    sequences = [[2, 5, 6, 7], [2, 9, 10, 11, 12]]
    candidates = [c if c.dtype == np.float32 else c.astype(np.int64) for c in candidates]
    with pytest.raises(ValueError, match=message):
        teacher.score(sequences, candidate_ids=candidates)


# ---- shared prompt --------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("top_k", [None, 5])
def test_score_shared_equals_scoring_each_concatenation(teacher, groups, top_k):
    rng = np.random.default_rng(groups)
    prompt = _sequences(rng, (7,))[0]
    continuations = _sequences(rng, rng.integers(1, 12, groups))
    shared = teacher.score_shared(prompt, continuations, top_k=top_k)
    assert len(shared) == groups
    for continuation, result in zip(continuations, shared, strict=True):
        alone = teacher.score([prompt + continuation], top_k=top_k)[0]
        assert result.log_probs.shape == (len(prompt) + len(continuation) - 1,)
        np.testing.assert_allclose(result.log_probs, alone.log_probs, atol=1e-5)
        if top_k is None:
            assert result.top_ids is None and result.top_log_probs is None
        else:
            np.testing.assert_array_equal(result.top_ids, alone.top_ids)
            np.testing.assert_allclose(result.top_log_probs, alone.top_log_probs, atol=1e-5)


@pytest.mark.parametrize("prompt_length", [1, 6])
def test_score_shared_scores_candidates_over_the_whole_concatenation(teacher, prompt_length):
    rng = np.random.default_rng(prompt_length)
    prompt = _sequences(rng, (prompt_length,))[0]
    continuations = _sequences(rng, (1, 5, 9))
    candidates = [rng.integers(0, VOCAB, (prompt_length + len(c) - 1, 3)) for c in continuations]
    shared = teacher.score_shared(prompt, continuations, top_k=2, candidate_ids=candidates)
    for continuation, ids, result in zip(continuations, candidates, shared, strict=True):
        alone = teacher.score([prompt + continuation], top_k=2, candidate_ids=[ids])[0]
        np.testing.assert_allclose(result.log_probs, alone.log_probs, atol=1e-5)
        np.testing.assert_allclose(result.candidate_log_probs, alone.candidate_log_probs, atol=1e-5)
        np.testing.assert_array_equal(result.top_ids, alone.top_ids)


@pytest.mark.parametrize(
    ("prompt", "continuations", "field"),
    [
        ([], [[5]], "prompt"),
        ([2, 99], [[5]], "prompt"),
        ([2, 5], [], "continuations"),
        ([2, 5], [[5], []], r"continuations\[1\]"),
        ([2, 5], [[5] * 47], r"continuations\[0\]"),
        ([2, 5], [[5], [51]], r"continuations\[1\]"),
    ],
)
def test_bad_shared_requests_name_the_field(teacher, prompt, continuations, field):
    with pytest.raises(ValueError, match=f"`{field}` must"):
        teacher.score_shared(prompt, continuations)


def test_shared_candidate_ids_are_checked_against_the_concatenations(teacher):
    with pytest.raises(ValueError, match=r"`candidate_ids\[0\]` must have shape \[3, K\]"):
        teacher.score_shared([2, 5], [[6, 7]], candidate_ids=[np.zeros((1, 2), np.int32)])


# ---- bucketed shapes and warm-up ------------------------------------------------------


def test_a_top_k_between_buckets_maps_up_and_is_truncated(warmed):
    shaped, _, teacher = warmed
    sequences = _sequences(np.random.default_rng(1), (4, 11))
    exact = teacher.score(sequences, top_k=3)
    bucketed = shaped.score(sequences, top_k=3)
    bucket = shaped.score(sequences, top_k=4)
    for want, got, whole in zip(exact, bucketed, bucket, strict=True):
        assert got.top_ids.shape == want.top_ids.shape == (len(want.log_probs), 3)
        # k = 3 runs the k = 4 bucket: exactly its first 3 entries.
        np.testing.assert_array_equal(got.top_ids, whole.top_ids[:, :3])
        np.testing.assert_array_equal(got.top_log_probs, whole.top_log_probs[:, :3])
        # The exact top-3 of an unbucketed teacher (other padding: float rounding only).
        np.testing.assert_array_equal(got.top_ids, want.top_ids)
        np.testing.assert_allclose(got.top_log_probs, want.top_log_probs, atol=1e-5)
        np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)


def test_requests_above_the_largest_buckets_are_refused_by_name(warmed):
    shaped, _, _ = warmed
    with pytest.raises(ValueError, match=r"`top_k` must be at most 4 \(the largest top-k"):
        shaped.score([[2, 5, 6]], top_k=5)
    with pytest.raises(ValueError, match=r"`candidate_ids` must hold at most 4 ids per"):
        shaped.score([[2, 5, 6]], candidate_ids=[np.zeros((2, 5), np.int32)])
    # The longest sequence is the largest length bucket (below the model's max_length).
    assert shaped.info().max_length == 32
    with pytest.raises(ValueError, match=r"`sequences\[0\]` must hold at most 32 ids"):
        shaped.score([[5] * 33])


def test_after_warm_up_no_call_compiles(warmed):
    shaped, warmed_count, teacher = warmed
    # Score: 2 rows x 2 lengths x (forward + 2 top-k + 1 candidate heads) = 16. Shared: a
    # prefill per length (2), the prompt's candidate head for 4 rows x 4 ids per length (2;
    # 1 row x 4 ids is a score shape) and a decode per (rows, prompt, continuation) triple
    # within max_length 32 (2 x 3 = 6).
    assert len(SHAPES.combinations()) == 16
    assert len(SHAPES.shared_combinations(32)) == 6
    assert warmed_count == 16 + 2 + 2 + 6
    rng = np.random.default_rng(2)
    calls = []
    for lengths, top_k, width in (
        ((2,), None, None),
        ((5, 17, 3), 1, None),
        ((30, 2, 9, 4, 8, 6), 4, 3),  # 6 rows: split into 4 + 2
        ((12, 31), None, 4),
        ((20,), 2, 1),
    ):
        sequences = _sequences(rng, lengths)
        ids = None if width is None else [rng.integers(0, VOCAB, (n - 1, width)) for n in lengths]
        calls.append((sequences, dict(top_k=top_k, candidate_ids=ids)))
    shared_calls = []
    for prompt_length, groups, top_k, width in ((1, 3, None, None), (9, 6, 4, 2), (20, 1, 1, 4)):
        prompt = _sequences(rng, (prompt_length,))[0]
        continuations = _sequences(rng, rng.integers(1, 32 - prompt_length, groups))
        ids = (
            None
            if width is None
            else [
                rng.integers(0, VOCAB, (prompt_length + len(c) - 1, width)) for c in continuations
            ]
        )
        shared_calls.append((prompt, continuations, dict(top_k=top_k, candidate_ids=ids)))

    before = shaped.compile_count()
    scored = [shaped.score(sequences, **kwargs) for sequences, kwargs in calls]
    shared = [shaped.score_shared(p, c, **kwargs) for p, c, kwargs in shared_calls]
    assert shaped.compile_count() == before
    assert shaped.warm_up(shared=True) == 0

    # The unbucketed teacher (it compiles its own shapes) gives the same answers.
    exact = [teacher.score(sequences, **kwargs) for sequences, kwargs in calls]
    exact += [teacher.score_shared(p, c, **kwargs) for p, c, kwargs in shared_calls]
    for got_call, want_call in zip(scored + shared, exact, strict=True):
        for got, want in zip(got_call, want_call, strict=True):
            np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)
            for name in ("top_log_probs", "candidate_log_probs"):
                if getattr(want, name) is None:
                    assert getattr(got, name) is None
                else:
                    np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-5)


def test_a_new_shape_counts_as_a_compile(model):
    unbucketed = InProcessTeacher(model, CharTokenizer())
    before = unbucketed.compile_count()
    unbucketed.score([[2, 5, 6]] * 5, top_k=7)  # 5 rows and k = 7: used nowhere else here
    assert unbucketed.compile_count() == before + 2  # the forward and the top-k head
    unbucketed.score([[2, 5, 6, 7]] * 5, top_k=7)  # the same padded shape
    assert unbucketed.compile_count() == before + 2
    assert unbucketed.warm_up() == 0  # nothing to warm without shapes


# ---- ScoreShapes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(rows=(), lengths=(16,)), "rows"),
        (dict(rows=(1,), lengths=()), "lengths"),
        (dict(rows=(2, 1), lengths=(16,)), "rows"),
        (dict(rows=(1,), lengths=(16, 16)), "lengths"),
        (dict(rows=(0, 1), lengths=(16,)), "rows"),
        (dict(rows=(1.5,), lengths=(16,)), "rows"),
        (dict(rows=(True,), lengths=(16,)), "rows"),
        (dict(rows=(1,), lengths=(16,), top_ks=(8, 4)), "top_ks"),
        (dict(rows=(1,), lengths=(16,), candidates=(-8,)), "candidates"),
        (dict(rows=4, lengths=(16,)), "rows"),
    ],
)
def test_score_shapes_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}` must be .*; received"):
        ScoreShapes(**kwargs)


def test_score_shape_buckets():
    shapes = ScoreShapes(rows=[1, 2, 8], lengths=(16, 64), top_ks=(8, 64), candidates=(8,))
    assert shapes.rows == (1, 2, 8)
    assert [shapes.row_bucket(n) for n in (1, 2, 3, 8)] == [1, 2, 8, 8]
    assert [shapes.length_bucket(n) for n in (1, 16, 17, 64)] == [16, 16, 64, 64]
    assert [shapes.top_k_bucket(k) for k in (1, 8, 9)] == [8, 8, 64]
    assert shapes.candidate_bucket(3) == 8
    for method, value, message in (
        (shapes.row_bucket, 9, "`rows` must be at most 8 (the largest row bucket); received 9"),
        (shapes.length_bucket, 65, "`length` must be at most 64 (the largest length bucket)"),
        (shapes.top_k_bucket, 100, "`top_k` must be at most 64 (the largest top-k bucket); "),
        (shapes.candidate_bucket, 9, "`candidate_ids` must hold at most 8 ids per position"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            method(value)
    empty = ScoreShapes(rows=(1,), lengths=(16,))
    with pytest.raises(ValueError, match="`top_k` must be None"):
        empty.top_k_bucket(1)
    assert empty.combinations() == ((1, 16, 0, 0),)
    assert len(shapes.combinations()) == 3 * 2 * (1 + 2 + 1)
    assert (8, 64, 64, 0) in shapes.combinations() and (8, 64, 8, 8) not in shapes.combinations()
    # Prompt + continuation within 64: the pair (64, 64) needs at least 17 + 17 ids, fits.
    assert len(shapes.shared_combinations(64)) == 3 * 4
    assert (1, 64, 64) not in shapes.shared_combinations(33)


def test_default_score_shapes():
    shapes = ScoreShapes.default(2048, 64)
    assert shapes.rows == (1, 2, 4, 8, 16, 32, 64)
    assert shapes.lengths == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert (shapes.top_ks, shapes.candidates) == ((8, 64), (8, 64))
    assert len(shapes.combinations()) == 7 * 8 * 5 == 280
    small = ScoreShapes.default(100, 6)
    assert (small.rows, small.lengths) == ((1, 2, 4, 6), (16, 32, 64, 100))
    assert ScoreShapes.default(8, 1).lengths == (8,)
    with pytest.raises(ValueError, match="`max_rows` must be a positive int"):
        ScoreShapes.default(64, 0)


def test_the_default_shapes_fit_a_teacher(model):
    shaped = InProcessTeacher(model, CharTokenizer(), shapes=ScoreShapes.default(48, 4))
    assert shaped.info().max_length == 48
    # A top-k bucket above the vocabulary means the whole vocabulary.
    result = shaped.score([[2, 5, 6]], top_k=VOCAB)[0]
    assert result.top_ids.shape == (2, VOCAB)
    np.testing.assert_allclose(np.exp(result.top_log_probs).sum(-1), 1.0, atol=1e-5)
