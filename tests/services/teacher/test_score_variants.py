"""Score variants over gRPC, on a teacher with a closed set of compiled shapes: log-probs at
ids the caller chooses, continuations of a shared prompt, text scored with the teacher's own
tokenizer (cross-tokenizer), top-k mapped up to its bucket, and
no compile after the warm-up (counted through the compiles metric; shared-prompt shapes are
left out of this server's warm-up, which ``tests/test_teacher_variants.py`` covers).
"""

import grpc
import jax
import numpy as np
import pytest

from distill.cross_tokenizer import CrossTokenizerTeacher
from distill.teacher import InProcessTeacher
from distill.teacher_contract import ScoreShapes
from services.teacher.client import InvalidTeacherRequest, RemoteTeacher, TeacherServerError
from services.teacher.server import TeacherServerConfig, serve_teacher
from tests.support.fakes import tiny_char_teacher

WAIT_S = 120
SHAPES = ScoreShapes(rows=(1, 2, 4, 8), lengths=(16, 32), top_ks=(4, 8), candidates=(4,))


@pytest.fixture(scope="module")
def model():
    teacher = tiny_char_teacher(max_length=32, seed=3)
    return teacher.model, teacher.tokenizer


@pytest.fixture(scope="module")
def reference(model):
    """The same weights without a closed shape set: scores any shape exactly."""
    return InProcessTeacher(*model)


@pytest.fixture(scope="module")
def server(model):
    teacher = InProcessTeacher(*model, shapes=SHAPES)
    config = TeacherServerConfig(max_batch_sequences=8, max_delay_ms=1.0)
    with serve_teacher(teacher, config) as running:
        yield running


@pytest.fixture(scope="module")
def remote(server):
    with RemoteTeacher(server.address, timeout_s=WAIT_S) as client:
        yield client


def sequences_of(rng, lengths, vocab):
    return [rng.integers(4, vocab, length).tolist() for length in lengths]


def full_log_softmax(reference, sequence):
    """The teacher's whole float32 log-softmax at every position of ``sequence``."""
    model = reference.model
    tokens = np.asarray([sequence], np.int32)
    positions = np.arange(len(sequence), dtype=np.int32)[None]
    hidden = model.hidden_states(tokens, positions, np.ones_like(tokens))[:, :-1]
    return np.asarray(jax.nn.log_softmax(model.logits(hidden), axis=-1))[0]


def test_info_reports_the_compiled_buckets_and_the_tokenizer_kind(remote, server):
    message = server.servicer._info_message
    assert list(message.top_k_buckets) == [4, 8]
    assert list(message.candidate_buckets) == [4]
    assert remote.info().tokenizer_kind == "char"


def test_log_probs_at_caller_chosen_ids_equal_the_gathered_full_log_softmax(remote, reference):
    rng = np.random.default_rng(0)
    vocab = reference.info().vocab_size
    sequences = sequences_of(rng, [5, 9, 16], vocab)
    chosen = [rng.integers(0, vocab, (len(s) - 1, 3)) for s in sequences]
    scored = remote.score(sequences, candidate_ids=chosen)
    for result, sequence, ids in zip(scored, sequences, chosen, strict=True):
        want = np.take_along_axis(full_log_softmax(reference, sequence), ids, axis=-1)
        # 1e-6 relative and absolute: the served call pads to a length bucket.
        np.testing.assert_allclose(result.candidate_log_probs, want, atol=1e-6, rtol=1e-6)


def test_chosen_ids_outside_the_vocabulary_are_refused_by_name(remote, reference):
    vocab = reference.info().vocab_size
    chosen = [np.array([[1, vocab], [2, 3]])]
    with pytest.raises(InvalidTeacherRequest, match=r"^`candidate_ids\[0\]\.ids` must hold ids in"):
        remote.score([[4, 5, 6]], candidate_ids=chosen)
    with pytest.raises(InvalidTeacherRequest, match=r"^`candidates` must be in \[0, 4\]"):
        remote.score([[4, 5, 6]], candidate_ids=[np.zeros((2, 5), np.int64)])


@pytest.mark.parametrize("group", [1, 4, 8])
def test_a_shared_prompt_scores_equal_each_sequence_alone(remote, reference, group):
    rng = np.random.default_rng(group)
    vocab = reference.info().vocab_size
    prompt = sequences_of(rng, [11], vocab)[0]
    continuations = sequences_of(rng, rng.integers(1, 12, group), vocab)
    shared = remote.score_shared(prompt, continuations, top_k=4)
    alone = reference.score([prompt + c for c in continuations], top_k=4)
    for got, want in zip(shared, alone, strict=True):
        np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.top_log_probs, want.top_log_probs, atol=1e-5, rtol=0)


def test_a_top_k_between_buckets_is_mapped_up_and_one_above_them_is_refused(remote, reference):
    sequences = [[4, 9, 12, 7, 30, 2]]
    got = remote.score(sequences, top_k=3)[0]
    want = reference.score(sequences, top_k=3)[0]
    np.testing.assert_array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_log_probs, want.top_log_probs, atol=1e-6, rtol=0)
    with pytest.raises(InvalidTeacherRequest, match=r"^`top_k` must be in \[0, 8\]"):
        remote.score(sequences, top_k=9)


def test_after_the_warm_up_no_request_compiles(remote, server, reference):
    rng = np.random.default_rng(7)
    vocab = reference.info().vocab_size
    compiles = server.metrics.value("distill_teacher_compiles")
    assert compiles > 0
    for count, top_k, width in [(1, None, 0), (3, 4, 0), (6, 8, 0), (2, None, 4), (8, 2, 2)]:
        sequences = sequences_of(rng, rng.integers(2, 33, count), vocab)
        chosen = None
        if width:
            chosen = [rng.integers(0, vocab, (len(s) - 1, width)) for s in sequences]
        remote.score(sequences, top_k=top_k, candidate_ids=chosen)
    assert server.metrics.value("distill_teacher_compiles") == compiles


# ---- cross-tokenizer text scoring -------------------------------------------------------------


def test_served_text_scores_equal_the_in_process_text_teacher(remote, reference, model):
    _, tokenizer = model
    local = CrossTokenizerTeacher(reference, tokenizer)
    prompts = ["abc", "hello", "", "x"]
    completions = ["def", "world w", "a", "\u2603 not in the alphabet"]
    stopped = [True, False, False, True]
    served = remote.score_text(prompts, completions, stopped=stopped)
    want = local.score_text(prompts, completions, stopped=stopped)
    assert remote.info().tokenizer_kind == "char"
    for got, expected in zip(served, want, strict=True):
        assert got.refusal == expected.refusal
        np.testing.assert_array_equal(got.byte_ends, expected.byte_ends)
        np.testing.assert_allclose(got.log_probs, expected.log_probs, atol=1e-6, rtol=1e-6)
        if expected.stop_log_prob is None:
            assert got.stop_log_prob is None
        else:
            assert got.stop_log_prob == pytest.approx(expected.stop_log_prob, abs=1e-6)
    assert served[3].refusal is not None and not served[0].refusal


def test_text_scoring_without_the_teachers_tokenizer_is_unimplemented_by_name(reference):
    class NoTokenizer:
        def info(self):
            return reference.info()

        def score(self, sequences, *, top_k=None):
            return reference.score(sequences, top_k=top_k)

    with (
        serve_teacher(NoTokenizer()) as bare,
        RemoteTeacher(bare.address, timeout_s=WAIT_S, retries=0) as client,
    ):
        with pytest.raises(TeacherServerError, match="^`ScoreText` must be served with") as caught:
            client.score_text(["a"], ["b"])
        assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(ValueError, match=r"^`prompts` must hold one prompt"):
            client.score_text(["a", "b"], ["c"])
