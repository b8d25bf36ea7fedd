"""Teachers with another tokenizer: the built-in character tokenizer on one side, a
byte-level BPE trained here with the `tokenizers` library on the other.

Each row's mapped total equals the teacher's own log-probability of the text (1e-5); a
completion that cannot be detokenized exactly is refused for that row and counted, never
misaligned; an OPD run across the two tokenizers trains (its reverse-KL estimate falls);
the per-token and vocabulary-level kinds are refused by name.
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from distill import pipeline
from distill.config import ConfigError
from distill.cross_tokenizer import (
    CrossTokenizerTeacher,
    DetokenizeError,
    TextScores,
    _byte_level_chars,  # the byte-level alphabet
    check_cross_tokenizer_loss,
    detokenize_exactly,
    map_to_student,
    score_completions,
    token_byte_spans,
)
from distill.data.stream import TaskStream, encode_example
from distill.models.transformer import Transformer
from distill.opd.batch import prepare_batch
from distill.opd.learner import OpdLearner
from distill.teacher import CompatibilityError, InProcessTeacher, check_compatible
from distill.tokenizer import CharTokenizer, HFTokenizer, TokenizerError
from services.teacher.messages import info_from_proto, info_to_proto
from tests.support.fakes import tiny_job

SPECIALS = ["<pad>", "<mask>", "<bos>", "<eos>"]
OPD_STEPS = 24


def silent(_):
    return None


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A byte-level BPE (every byte in its alphabet, so any text encodes) trained on the
    tiny job's task texts."""
    texts = []
    for example in TaskStream(tiny_job().data).batch(0, 300):
        texts += [example.prompt, example.answer, example.prompt + example.answer]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*texts, "héllo wörld"], trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(bpe_path):
    return HFTokenizer.from_file(
        bpe_path, pad_token="<pad>", mask_token="<mask>", bos_token="<bos>", stop_tokens=["<eos>"]
    )


def teacher_spec(path) -> str:
    return (
        f"teacher_tokenizer={{kind: hf, path: '{path}', pad_token: <pad>, mask_token: <mask>, "
        "bos_token: <bos>, stop_tokens: [<eos>]}"
    )


def cross_job(bpe_path, bpe, *overrides):
    return tiny_job(teacher_spec(bpe_path), f"teacher.vocab_size={bpe.vocab_size}", *overrides)


@pytest.fixture(scope="module")
def bpe_teacher(bpe_path, bpe):
    """An untrained causal teacher on the BPE tokenizer, scoring text."""
    job = cross_job(bpe_path, bpe)
    return pipeline.in_process_teacher(job, Transformer(job.teacher, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def char_teacher():
    """An untrained causal teacher on the character tokenizer, scoring text."""
    job = tiny_job()
    char = CharTokenizer()
    return CrossTokenizerTeacher(
        InProcessTeacher(Transformer(job.teacher, rngs=nnx.Rngs(0)), char), char
    )


def own_totals(teacher: CrossTokenizerTeacher, rows) -> list[float]:
    """The teacher's log-probability of each ``(prompt, completion, stopped)`` row's
    completion (and stop) after its prompt, scored on its own ids in one call."""
    tok = teacher.tokenizer
    bos, stop = tok.special.bos_id, tok.special.stop_ids[0]
    prompts = [tok.encode(prompt) for prompt, _, _ in rows]
    sequences = [
        [bos, *prompt_ids, *tok.encode(completion), *([stop] if stopped else [])]
        for prompt_ids, (_, completion, stopped) in zip(prompts, rows, strict=True)
    ]
    return [
        float(np.sum(scored.log_probs[len(prompt_ids) :].astype(np.float64)))
        for prompt_ids, scored in zip(prompts, teacher.score(sequences), strict=True)
    ]


def byte_ids(bpe: HFTokenizer, data: bytes) -> list[int]:
    """The byte-level BPE's single-byte token of each byte (a character split across
    tokens)."""
    char_of = {byte: char for char, byte in _byte_level_chars().items()}
    return [bpe.token_to_id(char_of[byte]) for byte in data]


# ---- exact detokenization -------------------------------------------------------------------


def test_byte_spans_of_characters_and_of_bpe_tokens(bpe):
    char = CharTokenizer()
    np.testing.assert_array_equal(token_byte_spans(char, char.encode("ab c")), [1, 2, 3, 4])
    ids = bpe.encode("agree:5|eeeee")
    ends = token_byte_spans(bpe, ids)
    assert ends[-1] == len("agree:5|eeeee") and len(ends) < 13  # merged tokens
    # "é" split across two byte tokens: the first ends inside the character, bytes add up.
    split = detokenize_exactly(bpe, byte_ids(bpe, "xé".encode()))
    assert split.text == "xé"
    np.testing.assert_array_equal(split.byte_ends, [1, 2, 3])


def test_other_decoders_are_measured_by_decoding_prefixes():
    """A word-level tokenizer whose decoder joins tokens with spaces: no byte pieces, so
    each prefix is decoded (and must be a prefix of the whole text)."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*SPECIALS, "ab", "c"])}))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    words = HFTokenizer(
        backend, pad_token="<pad>", mask_token="<mask>", bos_token="<bos>", stop_tokens=["<eos>"]
    )
    decoded = detokenize_exactly(words, words.encode("ab c ab"))
    assert decoded.text == "ab c ab"
    np.testing.assert_array_equal(decoded.byte_ends, [2, 4, 7])


@pytest.mark.parametrize(
    ("side", "ids", "reason"),
    [
        ("char", [6, 2, 7], "special id 2 at index 1"),  # <bos> inside a completion
        ("char", [6, 0], "special id 0 at index 1"),  # <pad>
        ("char", [6, 99], "id 99 at index 1, outside"),
        ("bpe", "lone-continuation", "decode to"),  # not valid UTF-8
        ("bpe", [5, 3, 5], "special id 3 at index 1"),  # <eos> inside
    ],
)
def test_ids_that_do_not_detokenize_exactly_are_refused(bpe, side, ids, reason):
    tokenizer = CharTokenizer() if side == "char" else bpe
    if ids == "lone-continuation":
        ids = byte_ids(bpe, b"a\xa9")
    with pytest.raises(DetokenizeError, match=r"`completion` must detokenize exactly; received"):
        detokenize_exactly(tokenizer, ids)
    with pytest.raises(DetokenizeError, match=reason):
        token_byte_spans(tokenizer, ids)


def test_map_to_student_sums_teacher_tokens_ending_inside_each_student_token():
    scores = TextScores(np.array([-1.0, -2.0, -0.5], np.float32), np.array([2, 4, 5]))
    mapped = map_to_student(scores, np.array([1, 2, 3, 5]))
    np.testing.assert_allclose(mapped, [0.0, -1.0, 0.0, -2.5])
    with pytest.raises(ValueError, match=r"`text_scores.byte_ends` must end at the student's"):
        map_to_student(scores, np.array([1, 2, 6]))
    empty = TextScores(np.zeros(0, np.float32), np.zeros(0, np.int64))
    assert map_to_student(empty, np.zeros(0, np.int64)).shape == (0,)


# ---- row totals ---------------------------------------------------------------------------


def text_rows(count: int, seed: int = 0):
    """(prompt, completion, stopped) texts over the character alphabet: task examples and
    random strings, some empty, some not stopped."""
    rng = np.random.default_rng(seed)
    examples = TaskStream(tiny_job().data).batch(0, count)
    alphabet = "abcdefghij 0123456789+=|:"
    rows = []
    for index, example in enumerate(examples):
        length = int(rng.integers(0, 14))
        random_text = "".join(rng.choice(list(alphabet), length))
        completion = example.answer if index % 2 else random_text
        rows.append((example.prompt, completion, index % 3 != 0))
    rows.append(("copy:ab|", "", True))  # only a stop
    return rows


def test_char_student_rows_total_the_bpe_teachers_own_log_prob(bpe_teacher):
    char = CharTokenizer()
    stop = char.special.stop_ids[0]
    rows = text_rows(12)
    prompts = [[char.special.bos_id, *char.encode(p)] for p, _, _ in rows]
    completions = [char.encode(c) + ([stop] if s else []) for _, c, s in rows]
    mapped = score_completions(bpe_teacher, char, prompts, completions)
    totals = own_totals(bpe_teacher, rows)
    for (_, completion, _), ids, result, own in zip(rows, completions, mapped, totals, strict=True):
        assert result.refusal is None and result.log_probs.shape == (len(ids),)
        assert abs(float(np.sum(result.log_probs.astype(np.float64))) - own) < 1e-5
        # Each BPE token's log-prob sits on the character where that token ends.
        ends = token_byte_spans(bpe_teacher.tokenizer, bpe_teacher.tokenizer.encode(completion))
        text_part = result.log_probs[: len(completion)]
        assert set(np.flatnonzero(text_part)) <= set((ends - 1).tolist())


def test_bpe_student_rows_total_the_char_teachers_own_log_prob(bpe, char_teacher):
    stop = bpe.special.stop_ids[0]
    rows = text_rows(8, seed=1)
    prompts = [[bpe.special.bos_id, *bpe.encode(p)] for p, _, _ in rows]
    completions = [bpe.encode(c) + ([stop] if s else []) for _, c, s in rows]
    mapped = score_completions(char_teacher, bpe, prompts, completions)
    totals = own_totals(char_teacher, rows)
    for ids, result, own in zip(completions, mapped, totals, strict=True):
        assert result.refusal is None and result.log_probs.shape == (len(ids),)
        assert abs(float(np.sum(result.log_probs.astype(np.float64))) - own) < 1e-5


def test_rows_that_cannot_be_scored_exactly_are_refused_one_by_one(bpe, bpe_teacher, char_teacher):
    char = CharTokenizer()
    bos, stop = char.special.bos_id, char.special.stop_ids[0]
    prompt = [bos, *char.encode("copy:ab|")]
    completions = [char.encode("ab") + [stop], [*char.encode("a"), bos, stop], [6, 0, 7]]
    mapped = score_completions(bpe_teacher, char, [prompt] * 3, completions)
    assert mapped[0].refusal is None and mapped[0].log_probs.shape == (3,)
    assert mapped[1].log_probs is None and "row 1: `completion` must detokenize" in (
        mapped[1].refusal
    )
    assert mapped[2].log_probs is None and "special id 0" in mapped[2].refusal
    # The teacher refuses what its own tokenizer cannot encode (no upper case in the
    # character teacher's alphabet), for that row only.
    mapped = score_completions(
        char_teacher,
        bpe,
        [bpe.encode("copy:ab|")] * 2,
        [
            bpe.encode("ab"),
            bpe.encode("aB"),
        ],
    )
    assert mapped[0].refusal is None
    assert "`completions[1]` must be encodable by the teacher's tokenizer" in mapped[1].refusal


def test_text_teachers_validate_arguments_and_lengths(bpe_teacher):
    with pytest.raises(ValueError, match=r"`prompts` must hold one prompt per completion"):
        bpe_teacher.score_text(["a"], ["b", "c"])
    with pytest.raises(ValueError, match=r"`completions\[0\]` must be a str"):
        bpe_teacher.score_text(["a"], [3])
    with pytest.raises(ValueError, match=r"`stopped` must hold one bool per completion"):
        bpe_teacher.score_text(["a"], ["b"], stopped=[True, False])
    too_long = "ab " * bpe_teacher.info().max_length
    (refused,) = bpe_teacher.score_text(["copy:"], [too_long])
    assert "must fit the teacher's max_length" in refused.refusal
    (empty,) = bpe_teacher.score_text(["copy:"], [""])
    assert empty.log_probs.shape == (0,) and empty.stop_log_prob is None


# ---- contract: info, compatibility, config ---------------------------------------------------


def test_info_carries_the_tokenizer_kind_and_round_trips_the_wire(bpe_teacher, char_teacher):
    assert bpe_teacher.info().tokenizer_kind == "hf"
    assert char_teacher.info().tokenizer_kind == "char"
    for teacher in (bpe_teacher, char_teacher):
        assert info_from_proto(info_to_proto(teacher.info())) == teacher.info()


def test_check_compatible_accepts_another_tokenizer_only_when_allowed(bpe_teacher):
    char = CharTokenizer()
    with pytest.raises(CompatibilityError, match=r"`teacher.tokenizer_hash` must equal"):
        check_compatible(bpe_teacher.info(), char, char.vocab_size)
    check_compatible(bpe_teacher.info(), char, char.vocab_size, cross_tokenizer_ok=True)
    with pytest.raises(CompatibilityError, match=r"`teacher_tokenizer` must be the teacher's"):
        CrossTokenizerTeacher(bpe_teacher.teacher, char)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "loss.advantage=token",
            r"`loss.advantage` must be one of \('sequence', 'return_to_go', 'mean_to_go'\) when "
            r"the teacher's tokenizer differs from the student's .*; received 'token'",
        ),
        ("loss.kind=forward_kl", r"`loss.kind` must be 'reverse_kl' when .*received 'forward_kl'"),
        ("loss.kind=reverse_kl_full", r"`loss.kind` must be 'reverse_kl' .*'reverse_kl_full'"),
        ("loss.kind=jsd", r"`loss.kind` must be 'reverse_kl' .*received 'jsd'"),
        ("loss.teacher_top_k=4", r"`loss.teacher_top_k` must be unset when .*received 4"),
        ("student_init=teacher", r"`student_init` must be 'scratch' when teacher_tokenizer"),
    ],
)
def test_kinds_that_need_one_tokenizer_are_refused_by_name(bpe_path, bpe, override, message):
    with pytest.raises(ConfigError, match=message):
        cross_job(bpe_path, bpe, override)


def test_the_teacher_tokenizer_is_built_and_checked_from_the_job(bpe_path, bpe):
    job = cross_job(bpe_path, bpe)
    assert pipeline.job_teacher_tokenizer(job).content_hash() == bpe.content_hash()
    assert pipeline.job_tokenizer(job).vocab_size == job.student.vocab_size
    wrong = tiny_job(teacher_spec(bpe_path), "teacher.vocab_size=51")
    with pytest.raises(ValueError, match=r"`teacher.vocab_size` must equal the teacher token"):
        pipeline.job_teacher_tokenizer(wrong)
    missing = tiny_job(teacher_spec(bpe_path.parent / "nope.json"), "teacher.vocab_size=300")
    with pytest.raises(TokenizerError, match=r"`teacher_tokenizer.path` must point to"):
        pipeline.job_teacher_tokenizer(missing)
    with pytest.raises(ConfigError, match=r"`teacher_tokenizer.kind` must be one of"):
        tiny_job("teacher_tokenizer={kind: sentencepiece}")
    with pytest.raises(ValueError, match=r"must be 'reverse_kl'"):
        check_cross_tokenizer_loss("jsd", "sequence", None)


def test_a_learner_refuses_a_teacher_with_another_tokenizer_it_cannot_use(bpe_path, bpe):
    job = cross_job(bpe_path, bpe)
    teacher_model = Transformer(job.teacher, rngs=nnx.Rngs(0))
    student = Transformer(job.student, rngs=nnx.Rngs(1))
    char = pipeline.job_tokenizer(job)
    plain = InProcessTeacher(teacher_model, bpe)
    with pytest.raises(CompatibilityError, match=r"`teacher` must score text"):
        OpdLearner(job, student, plain, char, log=silent)
    same_tokenizer_job = tiny_job()
    with pytest.raises(CompatibilityError, match=r"`teacher.tokenizer_hash` must equal"):
        OpdLearner(same_tokenizer_job, student, CrossTokenizerTeacher(plain, bpe), char, log=silent)


# ---- OPD across tokenizers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(bpe_path, bpe, tmp_path_factory):
    """The cross-tokenizer job and a causal teacher trained briefly on its BPE (next-token
    CE on the task data, through the job's teacher_tokenizer)."""
    job = cross_job(
        bpe_path,
        bpe,
        "data.batch_size=8",
        "opd.steps=1000",  # stepped by hand: no evaluation, no checkpoint
        "opd.optimizer.learning_rate=0.01",
        "opd.checkpoint_every=1000",
        "teacher_training.steps=1000",
        "teacher_training.optimizer.schedule=constant",
        "teacher_training.optimizer.warmup_steps=0",
        "teacher_training.checkpoint_every=1000",
    )
    teacher_model, _ = pipeline.train_teacher(
        job, tmp_path_factory.mktemp("teacher"), progress=False, log=silent, stop_after=120
    )
    return job, pipeline.in_process_teacher(job, teacher_model)


@pytest.fixture(scope="module")
def opd_run(trained):
    """A learner after OPD_STEPS in-process OPD steps across the tokenizers (fixed seeds),
    and each step's metrics. Nearly all of the time is compilation."""
    job, teacher = trained
    student = Transformer(job.student, rngs=nnx.Rngs(1))
    learner = OpdLearner(job, student, teacher, pipeline.job_tokenizer(job), log=silent)
    return learner, [learner.train(learner.roll_out()) for _ in range(OPD_STEPS)]


@pytest.mark.slow  # trains a teacher, then OPD: ~90 s, nearly all compiles
def test_an_opd_run_across_tokenizers_trains(opd_run):
    learner, history = opd_run
    assert learner.cross_tokenizer and learner.top_k is None
    # The reverse-KL estimate (student log-prob minus the mapped teacher log-prob per
    # weighted token) is what falls; `loss` is the on-policy policy-gradient surrogate.
    # Per-step values are noisy (8 rows): compare the first and the last quarter.
    divergence = [metrics["reverse_kl"] for metrics in history]
    quarter = OPD_STEPS // 4
    first, last = np.mean(divergence[:quarter]), np.mean(divergence[-quarter:])
    assert last < 0.7 * first, divergence
    assert all(np.isfinite(metrics["loss"]) for metrics in history)
    assert all(metrics["invalid_rows"] >= metrics["refused_rows"] for metrics in history)


@pytest.mark.slow  # shares the trained OPD run
def test_a_row_that_does_not_detokenize_is_refused_and_counted(opd_run):
    learner, _ = opd_run
    batch = learner.roll_out()
    tokens, completion = batch.slots["tokens"].copy(), batch.slots["completion_mask"]
    first = int(np.flatnonzero(completion[0])[0])
    tokens[0, first] = learner.tokenizer.special.pad_id
    broken = dataclasses.replace(batch, slots={**batch.slots, "tokens": tokens})
    prepared = prepare_batch(
        broken.to_trace(), learner.teacher, learner.tokenizer, cross_tokenizer=True
    )
    refused, weights = np.asarray(prepared.refused_rows), np.asarray(prepared.weights)
    assert refused[0] and np.asarray(prepared.invalid_rows)[0] and weights[0].sum() == 0
    scored = ~refused & (weights.sum(axis=1) > 0)
    assert scored.any()
    assert (np.asarray(prepared.teacher_logps)[scored] != 0).any()
    with pytest.raises(ValueError, match=r"`top_k` must be None when the teacher's tokenizer"):
        prepare_batch(
            broken.to_trace(), learner.teacher, learner.tokenizer, cross_tokenizer=True, top_k=4
        )
    metrics = learner.train(broken)
    assert metrics["refused_rows"] >= 1 and metrics["invalid_rows"] >= metrics["refused_rows"]


def test_encoded_examples_detokenize_exactly_on_both_sides(bpe):
    for example in TaskStream(tiny_job().data).batch(0, 20):
        for tokenizer in (CharTokenizer(), bpe):
            _, answer = encode_example(example, tokenizer)
            assert detokenize_exactly(tokenizer, answer[:-1]).text == example.answer
