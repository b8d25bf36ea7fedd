"""Tests for distill.conversation: chat format, canonical split, rows, fail-closed errors."""

import dataclasses

import numpy as np
import pytest

from distill.conversation import (
    CHATML,
    DEFAULT_FORMAT,
    CanonicalExample,
    ChatFormat,
    ConversationError,
    Turn,
    canonicalize,
    canonicalize_batch,
    prompt_for_rollout,
    prompts_for_rollout,
    render_text,
)
from distill.diffusion.layout import build_training_layout
from distill.tokenizer import CharTokenizer

TOK = CharTokenizer()
BOS = TOK.special.bos_id
STOP = TOK.special.stop_ids[0]


def enc(text: str) -> list[int]:
    return TOK.encode(text)


def check_row_contract(row, prompt_len: int, completion_len: int) -> None:
    n = prompt_len + completion_len
    assert row.tokens.dtype == np.int32 and row.positions.dtype == np.int32
    assert row.segment_ids.dtype == np.int32
    assert row.prompt_mask.dtype == bool and row.completion_mask.dtype == bool
    np.testing.assert_array_equal(row.positions[:n], np.arange(n))
    np.testing.assert_array_equal(row.segment_ids[:n], np.ones(n))
    assert not (row.prompt_mask & row.completion_mask).any()
    assert ((row.prompt_mask | row.completion_mask) == row.validity_mask).all()
    # The completion is one contiguous suffix of the real tokens: no prompt after completion.
    np.testing.assert_array_equal(np.flatnonzero(row.prompt_mask), np.arange(prompt_len))
    np.testing.assert_array_equal(np.flatnonzero(row.completion_mask), np.arange(prompt_len, n))


def test_single_turn():
    conversation = [Turn("user", "1+1"), Turn("assistant", "2")]
    example = canonicalize(conversation, TOK)
    assert list(example.prompt_ids) == [BOS, *enc("user:1+1\nassistant:")]
    assert list(example.completion_ids) == [*enc("2"), STOP]
    assert example.assistant_index == 1 and example.num_cut == 0
    row = example.to_row()
    check_row_contract(row, len(example.prompt_ids), len(example.completion_ids))
    assert TOK.decode(row.tokens, skip_special=False) == "<bos>user:1+1\nassistant:2<eos>"
    assert TOK.decode(row.tokens) == "user:1+1\nassistant:2"
    assert prompt_for_rollout(conversation, TOK) == list(example.prompt_ids)


def test_final_span_in_the_middle_cuts_later_turns():
    conversation = [
        Turn("user", "a"),
        Turn("assistant", "b"),
        Turn("user", "c"),
        Turn("assistant", "d"),
        Turn("user", "7"),
    ]
    example = canonicalize(conversation, TOK)
    assert example.assistant_index == 3 and example.num_cut == 1
    # The earlier assistant turn is context (ends with the stop id, not trained).
    expected_prompt = [BOS, *enc("user:a\nassistant:b"), STOP, *enc("user:c\nassistant:")]
    assert list(example.prompt_ids) == expected_prompt
    assert list(example.completion_ids) == [*enc("d"), STOP]
    row = example.to_row()
    assert row.tokens.shape == (len(expected_prompt) + 2,)
    check_row_contract(row, len(expected_prompt), 2)
    assert enc("7")[0] not in row.tokens.tolist()  # the cut user turn is gone
    text = TOK.decode(row.tokens, skip_special=False)
    assert text == render_text(conversation[:4])
    assert text == "<bos>user:a\nassistant:b<eos>user:c\nassistant:d<eos>"
    assert TOK.decode(row.tokens) == render_text(conversation[:4], bos_text="", stop_text="")
    # The earlier assistant turn is in the prompt mask only.
    b_slot = expected_prompt.index(enc("b")[0])
    assert row.prompt_mask[b_slot] and not row.completion_mask[b_slot]


def test_system_turn_and_mappings():
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    example = canonicalize(conversation, TOK)
    assert list(example.prompt_ids) == [BOS, *enc("system:be brief\nuser:2+2\nassistant:")]
    assert list(example.completion_ids) == [*enc("4"), STOP]
    # A system turn alone is context enough.
    only_system = canonicalize([Turn("system", "say 1"), Turn("assistant", "1")], TOK)
    assert list(only_system.prompt_ids) == [BOS, *enc("system:say 1\nassistant:")]


def test_round_trip_text_matches_render():
    conversation = [Turn("system", "s"), Turn("user", "q?"), Turn("assistant", "x y")]
    row = canonicalize(conversation, TOK).to_row()
    assert TOK.decode(row.tokens, skip_special=False) == render_text(conversation)
    prompt = prompt_for_rollout(conversation, TOK)
    assert TOK.decode(prompt, skip_special=False) == render_text(
        conversation[:2], add_generation_prompt=True
    )


def test_no_assistant_refused_for_completion_but_rollout_accepts():
    conversation = [Turn("system", "s"), Turn("user", "hi")]
    with pytest.raises(ConversationError, match=r"^`conversation` must hold an assistant turn"):
        canonicalize(conversation, TOK)
    assert prompt_for_rollout(conversation, TOK) == [BOS, *enc("system:s\nuser:hi\nassistant:")]


def test_rollout_ends_with_user_keeps_all_turns():
    conversation = [Turn("user", "a"), Turn("assistant", "b"), Turn("user", "c")]
    prompt = prompt_for_rollout(conversation, TOK)
    assert prompt == [BOS, *enc("user:a\nassistant:b"), STOP, *enc("user:c\nassistant:")]
    # canonicalize uses the last assistant turn instead and cuts the trailing user turn.
    example = canonicalize(conversation, TOK)
    assert list(example.prompt_ids) == [BOS, *enc("user:a\nassistant:")]
    assert example.num_cut == 1


def test_leading_assistant_turn_is_no_context():
    conversation = [Turn("assistant", "hi"), Turn("user", "q")]
    with pytest.raises(ConversationError, match=r"none before turn 0"):
        canonicalize(conversation, TOK)
    # Rollout completes after the user turn; the leading assistant turn is context there.
    assert prompt_for_rollout(conversation, TOK) == [
        BOS,
        *enc("assistant:hi"),
        STOP,
        *enc("user:q\nassistant:"),
    ]


def test_rollout_cuts_final_assistant_turn():
    conversation = [
        Turn("user", "a"),
        Turn("assistant", "b"),
        Turn("user", "c"),
        Turn("assistant", "d"),
    ]
    assert prompt_for_rollout(conversation, TOK) == list(canonicalize(conversation, TOK).prompt_ids)


@pytest.mark.parametrize(
    "conversation",
    [
        [Turn("assistant", "hi")],
        [Turn("assistant", "hi"), Turn("assistant", "again")],
    ],
)
def test_empty_prompt_refused(conversation):
    with pytest.raises(ConversationError, match=r"^`conversation` must have a system or user turn"):
        canonicalize(conversation, TOK)
    with pytest.raises(ConversationError, match=r"^`conversation` must have a system or user turn"):
        prompt_for_rollout(conversation, TOK)


@pytest.mark.parametrize(
    ("conversation", "pattern"),
    [
        ([], r"^`conversation` must hold at least one turn"),
        ("user:hi", r"^`conversation` must be a sequence of turns"),
        ([Turn("user", "a"), Turn("assistant", "")], r"^`conversation\[1\]\.content` must be non"),
        ([Turn("bot", "a"), Turn("assistant", "b")], r"^`conversation\[0\]\.role` must be one of"),
        ([Turn("user", 3), Turn("assistant", "b")], r"^`conversation\[0\]\.content` must be a str"),
        ([("user", "a")], r"^`conversation\[0\]` must be a Turn"),
        ([{"role": "user"}], r"^`conversation\[0\]` must be a Turn or a mapping"),
        (
            [{"role": "user", "content": "a", "name": "x"}],
            r"^`conversation\[0\]` must be a Turn or a mapping",
        ),
        # Cut turns are still checked structurally.
        (
            [Turn("user", "a"), Turn("assistant", "b"), Turn("tool", "c")],
            r"`conversation\[2\]\.role`",
        ),
        ([Turn("user", "a\nb"), Turn("assistant", "c")], r"^`conversation\[0\]\.content` must not"),
    ],
)
def test_invalid_conversations_name_the_field(conversation, pattern):
    with pytest.raises(ConversationError, match=pattern) as info:
        canonicalize(conversation, TOK)
    assert "; received " in str(info.value)


def test_unencodable_character_names_content_and_chains_tokenizer_error():
    conversation = [Turn("user", "ok"), Turn("assistant", "fine"), Turn("user", "HI")]
    with pytest.raises(ConversationError) as info:
        prompt_for_rollout(conversation, TOK)
    message = str(info.value)
    assert message.startswith("`conversation[2].content` must be encodable by the tokenizer;")
    assert "unknown character 'H'" in message
    assert isinstance(info.value.__cause__, ValueError)
    # The same turn is cut by canonicalize, so it is never encoded there.
    assert canonicalize(conversation, TOK).num_cut == 1
    with pytest.raises(ConversationError, match=r"^`conversation\[1\]\.content` must be enc"):
        canonicalize([Turn("user", "a"), Turn("assistant", "B")], TOK)


def test_stop_id_in_content_refused():
    tok = CharTokenizer(stop_tokens=("<eos>", ";"))
    with pytest.raises(ConversationError, match=r"^`conversation\[1\]\.content` must not encode"):
        canonicalize([Turn("user", "a"), Turn("assistant", "b;c")], tok)
    newline_stop = CharTokenizer(stop_tokens=("\n",))
    with pytest.raises(ConversationError, match=r"^`fmt\.end_of_turn` must not encode to a stop"):
        canonicalize([Turn("user", "a"), Turn("assistant", "b")], newline_stop)
    # With another end of turn the same tokenizer works; the assistant ends with "\n" (stop).
    fmt = ChatFormat(end_of_turn=";")
    example = canonicalize([Turn("user", "a"), Turn("assistant", "b")], newline_stop, fmt)
    assert newline_stop.decode(example.completion_ids, skip_special=False) == "b\n"


def test_custom_format_and_format_validation():
    fmt = ChatFormat(system="s>", user="u>", assistant="a>", end_of_turn="|")
    example = canonicalize([Turn("user", "x"), Turn("assistant", "y")], TOK, fmt)
    assert TOK.decode(example.to_row().tokens, skip_special=False) == "<bos>u>x|a>y<eos>"
    with pytest.raises(ConversationError, match=r"^`fmt\.user` must be a non-empty str"):
        ChatFormat(user="")
    with pytest.raises(ConversationError, match=r"^`fmt` must have three distinct role markers"):
        ChatFormat(user="assistant:")
    with pytest.raises(ConversationError, match=r"^`fmt\.user` must not contain `fmt\.end_of"):
        ChatFormat(user="u\n")
    with pytest.raises(ConversationError, match=r"^`fmt\.user` must be encodable"):
        canonicalize([Turn("user", "x"), Turn("assistant", "y")], TOK, ChatFormat(user="User:"))
    with pytest.raises(ConversationError, match=r"^`fmt` must be a ChatFormat"):
        canonicalize([Turn("user", "x"), Turn("assistant", "y")], TOK, "user:")


def test_to_row_padding():
    example = canonicalize([Turn("user", "1"), Turn("assistant", "2")], TOK)
    n = example.length
    row = example.to_row(n + 3)
    check_row_contract(row, len(example.prompt_ids), len(example.completion_ids))
    np.testing.assert_array_equal(row.segment_ids[n:], 0)
    np.testing.assert_array_equal(row.tokens[n:], TOK.special.pad_id)
    assert not row.validity_mask[n:].any()
    with pytest.raises(ConversationError, match=r"^`length` must be an int >= "):
        example.to_row(n - 1)
    # A real token equal to the pad id stays valid: validity comes from segment ids.
    odd = CanonicalExample((0, 5), (0, STOP), assistant_index=1, num_cut=0, pad_id=0)
    assert odd.to_row(6).validity_mask.tolist() == [True] * 4 + [False] * 2


def test_batch_helpers_report_failing_index():
    good = [Turn("user", "1+1"), Turn("assistant", "2")]
    prompts, completions = canonicalize_batch([good, good[:1] + [Turn("assistant", "3")]], TOK)
    assert prompts == [[BOS, *enc("user:1+1\nassistant:")]] * 2
    assert completions == [[*enc("2"), STOP], [*enc("3"), STOP]]
    layout = build_training_layout(
        prompts,
        completions,
        horizon=4,
        block_size=4,
        pad_id=TOK.special.pad_id,
        mask_id=TOK.special.mask_id,
        vocab_size=TOK.vocab_size,
    )
    assert int(layout.completion_mask.sum()) == 4
    with pytest.raises(ConversationError, match=r"^`conversations\[1\]` must hold an assistant"):
        canonicalize_batch([good, good[:1]], TOK)
    with pytest.raises(ConversationError, match=r"^`conversations\[2\]\[1\]\.content` must be"):
        canonicalize_batch([good, good, [Turn("user", "a"), Turn("assistant", "")]], TOK)
    with pytest.raises(ConversationError, match=r"^`conversations` must hold at least one"):
        canonicalize_batch([], TOK)
    assert prompts_for_rollout([good[:1], good], TOK) == [prompts[0], prompts[0]]
    with pytest.raises(ConversationError, match=r"^`conversations\[0\]\[0\]\.content` must be enc"):
        prompts_for_rollout([[Turn("user", "X")]], TOK)


def test_default_format_encodable_by_default_alphabet():
    for piece in (DEFAULT_FORMAT.system, DEFAULT_FORMAT.user, DEFAULT_FORMAT.assistant):
        assert TOK.decode(enc(piece)) == piece
    assert DEFAULT_FORMAT.marker("user") == "user:"
    with pytest.raises(ConversationError, match=r"^`role` must be one of"):
        DEFAULT_FORMAT.marker("tool")


# ---- bos, stop-ended turns, default system turn (ChatML) ------------------------------------

# ChatML's shape with the CharTokenizer's alphabet: the stop id ends every turn, then "\n".
CHATML_LIKE = ChatFormat(
    system="system\n",
    user="user\n",
    assistant="assistant\n",
    end_of_turn="\n",
    bos=False,
    stop_ends_turn=True,
)


def test_stop_ended_turns_without_bos():
    conversation = [
        Turn("system", "be brief"),
        Turn("user", "two\nlines"),  # end_of_turn inside content: the stop id ends the turn
        Turn("assistant", "ok"),
        Turn("user", "1+1"),
        Turn("assistant", "2"),
    ]
    example = canonicalize(conversation, TOK, CHATML_LIKE)
    prompt = [
        *enc("system\nbe brief"),
        STOP,
        *enc("\nuser\ntwo\nlines"),
        STOP,
        *enc("\nassistant\nok"),
        STOP,
        *enc("\nuser\n1+1"),
        STOP,
        *enc("\nassistant\n"),
    ]
    assert list(example.prompt_ids) == prompt
    assert list(example.completion_ids) == [*enc("2"), STOP]  # no "\n" after the stop
    assert prompt_for_rollout(conversation, TOK, CHATML_LIKE) == prompt
    assert prompt_for_rollout(conversation[:4], TOK, CHATML_LIKE) == prompt
    text = TOK.decode(example.to_row().tokens, skip_special=False)
    assert text + "\n" == render_text(conversation, CHATML_LIKE)
    assert TOK.decode(prompt, skip_special=False) == render_text(
        conversation[:4], CHATML_LIKE, add_generation_prompt=True
    )
    # An empty end of turn: turns end with the stop id alone.
    bare = dataclasses.replace(CHATML_LIKE, end_of_turn="")
    assert prompt_for_rollout(conversation[1:2], TOK, bare) == [
        *enc("user\ntwo\nlines"),
        STOP,
        *enc("assistant\n"),
    ]
    assert render_text(conversation[1:2], bare) == "user\ntwo\nlines<eos>"


def test_default_system_turn_when_the_first_turn_is_not_system():
    fmt = dataclasses.replace(CHATML_LIKE, default_system="be kind")
    default = [*enc("system\nbe kind"), STOP, *enc("\n")]
    user_first = [Turn("user", "hi"), Turn("assistant", "yo")]
    assert list(canonicalize(user_first, TOK, fmt).prompt_ids) == [
        *default,
        *enc("user\nhi"),
        STOP,
        *enc("\nassistant\n"),
    ]
    assert render_text(user_first, fmt).startswith("system\nbe kind<eos>\nuser\nhi")
    # A conversation that starts with its own system turn gets no default one.
    system_first = [Turn("system", "s"), *user_first]
    assert list(canonicalize(system_first, TOK, fmt).prompt_ids)[: len(enc("system\ns"))] == enc(
        "system\ns"
    )
    assert render_text(system_first, fmt) == render_text(system_first, CHATML_LIKE)
    # With the plain format and bos: [bos] + the default turn ended by end_of_turn.
    plain = ChatFormat(default_system="be kind")
    assert prompt_for_rollout([Turn("user", "q")], TOK, plain) == [
        BOS,
        *enc("system:be kind\nuser:q\nassistant:"),
    ]
    # The default turn is not context: a conversation still needs a system or user turn.
    with pytest.raises(ConversationError, match=r"must have a system or user turn"):
        canonicalize([Turn("assistant", "x")], TOK, fmt)


def test_new_format_fields_are_validated():
    with pytest.raises(ConversationError, match=r"^`fmt\.bos` must be a bool; received 1"):
        ChatFormat(bos=1)
    with pytest.raises(ConversationError, match=r"^`fmt\.stop_ends_turn` must be a bool"):
        ChatFormat(stop_ends_turn="yes")
    with pytest.raises(ConversationError, match=r"^`fmt\.end_of_turn` must be a non-empty str"):
        ChatFormat(end_of_turn="")
    with pytest.raises(ConversationError, match=r"^`fmt\.end_of_turn` must be a str"):
        ChatFormat(end_of_turn=None, stop_ends_turn=True)
    with pytest.raises(ConversationError, match=r"^`fmt\.default_system` must be None or a non"):
        ChatFormat(default_system="")
    with pytest.raises(ConversationError, match=r"^`fmt\.default_system` must not contain"):
        ChatFormat(default_system="a\nb")
    # Markers may contain end_of_turn only when the stop id ends turns.
    with pytest.raises(ConversationError, match=r"^`fmt\.system` must not contain `fmt\.end_of"):
        dataclasses.replace(CHATML_LIKE, stop_ends_turn=False)
    with pytest.raises(ConversationError, match=r"^`fmt\.default_system` must be encodable"):
        canonicalize(
            [Turn("user", "x"), Turn("assistant", "y")],
            TOK,
            dataclasses.replace(CHATML_LIKE, default_system="HI"),
        )


def test_chatml_preset_with_a_byte_level_tokenizer(tmp_path):
    # The tiny GGUF of tests/models/test_gguf.py: <|endoftext|>=0, <|im_start|>=1 (bos),
    # <|im_end|>=2 (the stop), then byte-level BPE.
    from distill.models import gguf
    from tests.models.test_gguf import tiny_hf_weights, write_tiny_gguf

    tokenizer = gguf.load_tokenizer(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights()))
    assert (tokenizer.special.bos_id, tokenizer.special.stop_ids) == (1, (2,))
    conversation = [
        Turn("system", "Be brief."),
        Turn("user", "Say\nhello world"),
        Turn("assistant", "hello world"),
    ]
    example = canonicalize(conversation, tokenizer, CHATML)
    text = render_text(conversation, CHATML, stop_text="<|im_end|>")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay\nhello world<|im_end|>\n"
        "<|im_start|>assistant\nhello world<|im_end|>\n"
    )
    # Pieces encoded one by one give the ids of the whole text: every boundary is a token one.
    assert [*example.prompt_ids, *example.completion_ids, *tokenizer.encode("\n")] == (
        tokenizer.encode(text)
    )
    assert example.completion_ids[-1] == 2 and example.prompt_ids[0] == 1  # <|im_start|>
    generation = render_text(conversation[:2], CHATML, stop_text="<|im_end|>", bos_text="")
    prompt = prompt_for_rollout(conversation[:2], tokenizer, CHATML)
    assert (
        prompt
        == list(example.prompt_ids)
        == tokenizer.encode(generation + "<|im_start|>assistant\n")
    )
