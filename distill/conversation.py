"""Chat conversations -> (prompt ids, completion ids) for the project's own tokenizers.

A conversation is a sequence of :class:`Turn` (``role`` in ``"system"``, ``"user"``,
``"assistant"``; ``content`` a non-empty ``str``); a mapping with exactly the keys ``"role"``
and ``"content"`` is accepted in place of a :class:`Turn`. :class:`ChatFormat` renders it as::

    [bos]                                    (unless fmt.bos is False)
    [default system turn]                    (fmt.default_system, when the first turn is not
                                              a system turn)
    for each turn:
        system / user:  encode(marker) + encode(content) + encode(end_of_turn)
        assistant:      encode(marker) + encode(content) + [stop_ids[0]]

or, with ``fmt.stop_ends_turn`` (ChatML: :data:`CHATML`), every turn, whatever its role, as
``encode(marker) + encode(content) + [stop_ids[0]] + encode(end_of_turn)``; the completion of
an assistant turn is still ``content + [stop_ids[0]]``: the ``end_of_turn`` after the stop id
is context for a later turn, never generated, scored or trained.

With the default format (markers ``"system:"``, ``"user:"``, ``"assistant:"``, end of turn
``"\\n"``) and a :class:`~distill.tokenizer.CharTokenizer`, ``[user "1+1", assistant "2"]``
reads ``<bos>user:1+1\\nassistant:2<eos>``. An assistant turn is ended by the tokenizer's
first stop id, not by ``end_of_turn``: that is the token the student emits to end its answer
in on-policy distillation, and earlier assistant turns kept as context end the same way. Each
piece (marker, content, end of turn) is encoded on its own and the ids are concatenated, so
every turn boundary and the prompt / completion boundary is a token boundary (no merge across
pieces with a subword tokenizer). Everything goes through the
:class:`~distill.tokenizer.Tokenizer` protocol (``encode`` and ``special``), so any tokenizer
of the project works; Jinja chat templates are never executed here: a template is matched
to an equivalent format (:func:`distill.models.gguf.chat_format` for SmolLM2's ChatML).

:func:`canonicalize` splits a conversation around its *final assistant span*, the last
assistant turn in the conversation:

* prompt = ``[bos]`` (if ``fmt.bos``) + the default system turn (if any) + every turn before
  it (earlier assistant turns included: they are context, not trained) + the assistant marker;
* completion = its content + ``[stop_ids[0]]`` (the reference answer, e.g. for SFT warm-up);
* turns after it are cut: they appear in no tokens, positions or segments.

The prompt must hold at least one system or user turn before the final assistant turn
(otherwise the prompt would be only ``[bos]`` + marker, refused as an empty prompt; a
``fmt.default_system`` turn does not count).
:meth:`CanonicalExample.to_row` gives one row of the sequence contract (positions
``0..n-1``, segment id 1 on real tokens, the completion one contiguous suffix after the
prompt). :func:`prompt_for_rollout` gives the prompt the student completes in on-policy
distillation: the whole conversation + the assistant marker when it ends with a system or user
turn, or the same prompt as :func:`canonicalize` when it ends with an assistant turn (that turn
is cut; it will be regenerated).

Fail-closed rules (each raises :class:`ConversationError`, a ``ValueError``, reading
"`field` must ...; received ..."): the conversation is a non-empty sequence (not a ``str``);
every turn, cut or not, has a known role and non-empty ``str`` content; for the turns that are
encoded, the content encodes (a tokenizer error is re-raised naming `conversation[i].content`,
chained to the original), to at least one id, with no stop id and no mask id, and system / user
content does not contain ``end_of_turn`` (the turn would appear to end early; not checked with
``fmt.stop_ends_turn``, where the stop id ends the turn); a completion needs an assistant turn,
non-empty context before it; format pieces (markers, a non-empty ``end_of_turn``,
``default_system``) encode to at least one id with no stop id and no mask id. Turns may come in any order (consecutive turns of one role are
allowed). The batch helpers name the failing conversation as `conversations[j]...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np

from distill.tokenizer import Tokenizer

__all__ = [
    "CHATML",
    "DEFAULT_FORMAT",
    "ROLES",
    "CanonicalBatch",
    "CanonicalExample",
    "ChatFormat",
    "ConversationError",
    "ExampleRow",
    "Turn",
    "canonicalize",
    "canonicalize_batch",
    "prompt_for_rollout",
    "prompts_for_rollout",
    "render_text",
]

Role = Literal["system", "user", "assistant"]

#: The accepted roles, in the order their markers appear in :class:`ChatFormat`.
ROLES: tuple[str, str, str] = ("system", "user", "assistant")


class ConversationError(ValueError):
    """Invalid conversation or format. Messages read "`field` must ...; received ..."."""


def _error(field: str, must: str, received: str) -> ConversationError:
    return ConversationError(f"`{field}` must {must}; received {received}")


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of a conversation. Not validated on construction: :func:`canonicalize` and
    :func:`prompt_for_rollout` check every turn and name it by its index."""

    role: Role
    content: str


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """Role markers, the end-of-turn text and where bos and stop ids go (module docstring).

    * ``system`` / ``user`` / ``assistant``: the role markers, non-empty and distinct.
    * ``end_of_turn``: ends system / user turns (``stop_ends_turn=False``: a non-empty ``str``
      that no marker contains), or follows the stop id that ends every turn
      (``stop_ends_turn=True``: may be ``""``, and markers and contents may contain it).
    * ``bos``: whether rendering starts with the tokenizer's bos id (ChatML: no; its bos token,
      if any, is not placed before the first marker).
    * ``stop_ends_turn``: every turn ends with the tokenizer's first stop id followed by
      ``end_of_turn`` (ChatML: ``<|im_end|>`` then ``"\n"``; the tokenizer's first stop token
      must then be the end-of-turn token). Assistant turns always end with that stop id.
    * ``default_system``: when set (a non-empty ``str``), a system turn with this content is
      rendered first whenever the conversation's first turn is not a system turn, as some
      chat templates do (SmolLM2's).

    The defaults are the project's plain format (:data:`DEFAULT_FORMAT`).
    """

    system: str = "system:"
    user: str = "user:"
    assistant: str = "assistant:"
    end_of_turn: str = "\n"
    bos: bool = True
    stop_ends_turn: bool = False
    default_system: str | None = None

    def __post_init__(self) -> None:
        for name in ROLES:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _error(f"fmt.{name}", "be a non-empty str", repr(value))
        for name in ("bos", "stop_ends_turn"):
            if not isinstance(getattr(self, name), bool):
                raise _error(f"fmt.{name}", "be a bool", repr(getattr(self, name)))
        if not isinstance(self.end_of_turn, str) or not (self.end_of_turn or self.stop_ends_turn):
            must = "be a str" if self.stop_ends_turn else "be a non-empty str"
            raise _error("fmt.end_of_turn", must, repr(self.end_of_turn))
        if self.default_system is not None and (
            not isinstance(self.default_system, str) or not self.default_system
        ):
            raise _error(
                "fmt.default_system", "be None or a non-empty str", repr(self.default_system)
            )
        markers = [self.system, self.user, self.assistant]
        if len(set(markers)) != len(markers):
            raise _error("fmt", "have three distinct role markers", repr(markers))
        if self.stop_ends_turn:
            return  # the stop id ends a turn: markers and contents may hold end_of_turn
        for name in ROLES:
            if self.end_of_turn in getattr(self, name):
                raise _error(
                    f"fmt.{name}",
                    f"not contain `fmt.end_of_turn` ({self.end_of_turn!r})",
                    repr(getattr(self, name)),
                )
        if self.default_system is not None and self.end_of_turn in self.default_system:
            raise _error(
                "fmt.default_system",
                f"not contain `fmt.end_of_turn` ({self.end_of_turn!r})",
                repr(self.default_system),
            )

    def marker(self, role: str) -> str:
        """The marker of ``role`` (one of :data:`ROLES`)."""
        if role not in ROLES:
            raise _error("role", f"be one of {ROLES!r}", repr(role))
        return getattr(self, role)


#: ``system:`` / ``user:`` / ``assistant:`` markers, ``"\n"`` ends system and user turns.
DEFAULT_FORMAT = ChatFormat()

#: ChatML (``<|im_start|>{role}\n{content}<|im_end|>\n``): no bos, every turn ends with the
#: tokenizer's first stop id, which must be ``<|im_end|>``, then ``"\n"``. A model whose
#: template adds a default system turn needs ``dataclasses.replace(CHATML,
#: default_system=...)`` (:func:`distill.models.gguf.chat_format` knows SmolLM2's).
CHATML = ChatFormat(
    system="<|im_start|>system\n",
    user="<|im_start|>user\n",
    assistant="<|im_start|>assistant\n",
    end_of_turn="\n",
    bos=False,
    stop_ends_turn=True,
)


class ExampleRow(NamedTuple):
    """One row of the sequence contract, numpy arrays of shape ``[L]``.

    ``tokens``/``positions``/``segment_ids`` are int32, the masks bool. Real tokens have
    positions ``0..n-1`` and segment id 1; padding (only with ``to_row(length)``) holds the pad
    id, position 0, segment 0 and no mask. ``validity_mask`` is ``segment_ids != 0``.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_mask: np.ndarray

    @property
    def validity_mask(self) -> np.ndarray:
        return self.segment_ids != 0


@dataclasses.dataclass(frozen=True)
class CanonicalExample:
    """A conversation split around its final assistant span (module docstring).

    ``assistant_index`` is the index of that turn in the input conversation and ``num_cut``
    the number of turns after it that were dropped. ``pad_id`` is the tokenizer's pad id, used
    only to pad :meth:`to_row`.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    assistant_index: int
    num_cut: int
    pad_id: int

    @property
    def length(self) -> int:
        """Number of real tokens, prompt plus completion."""
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_row(self, length: int | None = None) -> ExampleRow:
        """The example as one row: prompt then completion, right-padded to ``length`` if given.

        The completion is one contiguous suffix of the real tokens, so no prompt token follows
        a completion token.
        """
        n = self.length
        if length is None:
            length = n
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < n:
            raise _error("length", f"be an int >= {n} (the example's token count)", repr(length))
        length = int(length)
        prompt = len(self.prompt_ids)
        tokens = np.full(length, self.pad_id, np.int32)
        tokens[:n] = self.prompt_ids + self.completion_ids
        positions = np.zeros(length, np.int32)
        positions[:n] = np.arange(n, dtype=np.int32)
        segment_ids = np.zeros(length, np.int32)
        segment_ids[:n] = 1
        prompt_mask = np.zeros(length, bool)
        prompt_mask[:prompt] = True
        completion_mask = np.zeros(length, bool)
        completion_mask[prompt:n] = True
        return ExampleRow(tokens, positions, segment_ids, prompt_mask, completion_mask)


class CanonicalBatch(NamedTuple):
    """Output of :func:`canonicalize_batch`: one prompt and one completion id list per input."""

    prompts: list[list[int]]
    completions: list[list[int]]


def _check_fmt(fmt: object) -> ChatFormat:
    if not isinstance(fmt, ChatFormat):
        raise _error("fmt", "be a ChatFormat", repr(fmt))
    return fmt


def _check_tokenizer(tokenizer: object) -> Tokenizer:
    if not isinstance(tokenizer, Tokenizer):
        raise _error("tokenizer", "implement the Tokenizer protocol", repr(type(tokenizer)))
    return tokenizer


def _check_conversation(conversation: object, name: str) -> list[Turn]:
    """Structural checks of every turn; returns the turns as :class:`Turn`."""
    if isinstance(conversation, str | bytes | Mapping) or not isinstance(conversation, Sequence):
        raise _error(name, "be a sequence of turns", repr(conversation))
    if not conversation:
        raise _error(name, "hold at least one turn", "an empty conversation")
    turns: list[Turn] = []
    for index, turn in enumerate(conversation):
        field = f"{name}[{index}]"
        if isinstance(turn, Mapping):
            if set(turn) != {"role", "content"}:
                raise _error(
                    field,
                    "be a Turn or a mapping with exactly the keys 'role' and 'content'",
                    f"keys {sorted(map(repr, turn))}",
                )
            role, content = turn["role"], turn["content"]
        elif isinstance(turn, Turn):
            role, content = turn.role, turn.content
        else:
            raise _error(field, "be a Turn or a mapping with keys 'role' and 'content'", repr(turn))
        if not isinstance(role, str) or role not in ROLES:
            raise _error(f"{field}.role", f"be one of {ROLES!r}", repr(role))
        if not isinstance(content, str):
            raise _error(f"{field}.content", "be a str", repr(content))
        if not content:
            raise _error(f"{field}.content", "be non-empty", repr(content))
        turns.append(Turn(role, content))
    return turns


class _Encoder:
    """Encodes format pieces (once) and turn contents with the fail-closed checks."""

    def __init__(self, tokenizer: Tokenizer, fmt: ChatFormat, name: str) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.name = name
        special = tokenizer.special
        self.bos_id = special.bos_id
        self.stop_id = special.stop_ids[0]
        self.forbidden = {stop: "a stop id" for stop in special.stop_ids}
        self.forbidden[special.mask_id] = "the mask id"
        self.pieces = {
            piece: self.encode(f"fmt.{piece}", getattr(fmt, piece))
            for piece in (*ROLES, "end_of_turn")
            if getattr(fmt, piece)
        }
        self.pieces.setdefault("end_of_turn", [])  # "" (allowed with stop_ends_turn)
        self.default_system = (
            None
            if fmt.default_system is None
            else self.encode("fmt.default_system", fmt.default_system)
        )

    def encode(self, field: str, text: str) -> list[int]:
        try:
            ids = list(self.tokenizer.encode(text))
        except ValueError as exc:
            raise _error(field, "be encodable by the tokenizer", f"{text!r} ({exc})") from exc
        if not ids:
            raise _error(field, "encode to at least one id", f"{text!r} (no ids)")
        for offset, token_id in enumerate(ids):
            what = self.forbidden.get(token_id)
            if what is not None:
                raise _error(
                    field,
                    f"not encode to {what} ({token_id})",
                    f"{text!r} (id {token_id} at token {offset})",
                )
        return ids

    def end(self, role: str) -> list[int]:
        """The ids that end a turn of ``role``."""
        if self.fmt.stop_ends_turn:
            return [self.stop_id, *self.pieces["end_of_turn"]]
        return [self.stop_id] if role == "assistant" else self.pieces["end_of_turn"]

    def turn(self, index: int, turn: Turn) -> list[int]:
        field = f"{self.name}[{index}].content"
        if (
            not self.fmt.stop_ends_turn
            and turn.role != "assistant"
            and self.fmt.end_of_turn in turn.content
        ):
            raise _error(
                field,
                f"not contain `fmt.end_of_turn` ({self.fmt.end_of_turn!r}) in a {turn.role} turn",
                repr(turn.content),
            )
        content = self.encode(field, turn.content)
        return [*self.pieces[turn.role], *content, *self.end(turn.role)]

    def start(self, turns: Sequence[Turn]) -> list[int]:
        """``[bos]`` (if ``fmt.bos``) + the default system turn (if the first turn is not a
        system turn)."""
        ids = [self.bos_id] if self.fmt.bos else []
        if self.default_system is not None and (not turns or turns[0].role != "system"):
            ids += [*self.pieces["system"], *self.default_system, *self.end("system")]
        return ids

    def prompt(self, turns: Sequence[Turn], conversation: Sequence[Turn]) -> list[int]:
        """The start (:meth:`start` of the whole ``conversation``) + ``turns`` + the assistant
        marker."""
        ids = self.start(conversation)
        for index, turn in enumerate(turns):
            ids.extend(self.turn(index, turn))
        ids.extend(self.pieces["assistant"])
        return ids


def _context_check(turns: Sequence[Turn], end: int, name: str) -> None:
    """Refuse a prompt with no system or user turn among ``turns[:end]``."""
    if not any(turn.role != "assistant" for turn in turns[:end]):
        raise _error(
            name,
            "have a system or user turn before the assistant turn to complete",
            f"none before turn {end} (roles {[turn.role for turn in turns]})",
        )


def _canonicalize(
    conversation: Sequence[Turn | Mapping[str, str]],
    tokenizer: Tokenizer,
    fmt: ChatFormat,
    name: str,
) -> CanonicalExample:
    turns = _check_conversation(conversation, name)
    encoder = _Encoder(tokenizer, fmt, name)
    final = max((i for i, turn in enumerate(turns) if turn.role == "assistant"), default=None)
    if final is None:
        raise _error(
            name,
            "hold an assistant turn (the completion)",
            f"roles {[turn.role for turn in turns]}",
        )
    _context_check(turns, final, name)
    prompt_ids = encoder.prompt(turns[:final], turns)
    completion_ids = [*encoder.encode(f"{name}[{final}].content", turns[final].content)]
    completion_ids.append(encoder.stop_id)
    return CanonicalExample(
        prompt_ids=tuple(prompt_ids),
        completion_ids=tuple(completion_ids),
        assistant_index=final,
        num_cut=len(turns) - final - 1,
        pad_id=tokenizer.special.pad_id,
    )


def canonicalize(
    conversation: Sequence[Turn | Mapping[str, str]],
    tokenizer: Tokenizer,
    fmt: ChatFormat = DEFAULT_FORMAT,
) -> CanonicalExample:
    """Split ``conversation`` around its final (last) assistant turn (module docstring).

    Prompt: ``[bos]`` + the turns before it + the assistant marker; completion: its content +
    the first stop id; later turns are cut. Raises :class:`ConversationError` with no
    assistant turn, no system or user turn before the last one, or any invalid turn.
    """
    return _canonicalize(conversation, _check_tokenizer(tokenizer), _check_fmt(fmt), "conversation")


def _prompt_for_rollout(
    conversation: Sequence[Turn | Mapping[str, str]],
    tokenizer: Tokenizer,
    fmt: ChatFormat,
    name: str,
) -> list[int]:
    turns = _check_conversation(conversation, name)
    encoder = _Encoder(tokenizer, fmt, name)
    end = len(turns) - 1 if turns[-1].role == "assistant" else len(turns)
    _context_check(turns, end, name)
    return encoder.prompt(turns[:end], turns)


def prompt_for_rollout(
    conversation: Sequence[Turn | Mapping[str, str]],
    tokenizer: Tokenizer,
    fmt: ChatFormat = DEFAULT_FORMAT,
) -> list[int]:
    """Prompt ids for the student to complete with an assistant turn.

    If the conversation ends with a system or user turn, the prompt is ``[bos]`` + every turn
    + the assistant marker. If it ends with an assistant turn, that turn is cut (it is to be
    regenerated) and the prompt equals ``canonicalize(conversation).prompt_ids``. Either way
    the prompt must hold a system or user turn.
    """
    return _prompt_for_rollout(
        conversation, _check_tokenizer(tokenizer), _check_fmt(fmt), "conversation"
    )


def _check_batch(conversations: object) -> Sequence[object]:
    if isinstance(conversations, str | bytes | Mapping) or not isinstance(conversations, Sequence):
        raise _error("conversations", "be a sequence of conversations", repr(conversations))
    if not conversations:
        raise _error("conversations", "hold at least one conversation", "an empty batch")
    return conversations


def canonicalize_batch(
    conversations: Sequence[Sequence[Turn | Mapping[str, str]]],
    tokenizer: Tokenizer,
    fmt: ChatFormat = DEFAULT_FORMAT,
) -> CanonicalBatch:
    """:func:`canonicalize` each conversation; errors name `conversations[j]...`.

    Returns ``(prompts, completions)``, id lists ready for
    :func:`distill.diffusion.layout.build_training_layout`.
    """
    tokenizer, fmt = _check_tokenizer(tokenizer), _check_fmt(fmt)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    for index, conversation in enumerate(_check_batch(conversations)):
        example = _canonicalize(conversation, tokenizer, fmt, f"conversations[{index}]")
        prompts.append(list(example.prompt_ids))
        completions.append(list(example.completion_ids))
    return CanonicalBatch(prompts, completions)


def prompts_for_rollout(
    conversations: Sequence[Sequence[Turn | Mapping[str, str]]],
    tokenizer: Tokenizer,
    fmt: ChatFormat = DEFAULT_FORMAT,
) -> list[list[int]]:
    """:func:`prompt_for_rollout` for each conversation; errors name `conversations[j]...`."""
    tokenizer, fmt = _check_tokenizer(tokenizer), _check_fmt(fmt)
    return [
        _prompt_for_rollout(conversation, tokenizer, fmt, f"conversations[{index}]")
        for index, conversation in enumerate(_check_batch(conversations))
    ]


def render_text(
    conversation: Sequence[Turn | Mapping[str, str]],
    fmt: ChatFormat = DEFAULT_FORMAT,
    *,
    bos_text: str = "<bos>",
    stop_text: str = "<eos>",
    add_generation_prompt: bool = False,
) -> str:
    """The text of every turn of ``conversation`` (none cut), for logs and tests.

    ``bos_text`` / ``stop_text`` stand for the bos and stop ids (the defaults are the names a
    :class:`~distill.tokenizer.CharTokenizer` decodes them to with ``skip_special=False``;
    pass ``""`` to match ``skip_special=True``; with :data:`CHATML` and SmolLM2's tokenizer
    pass ``stop_text="<|im_end|>"``). With ``add_generation_prompt`` the assistant marker is
    appended. Only the structure is checked (roles, non-empty ``str`` content).
    """
    fmt = _check_fmt(fmt)
    turns = _check_conversation(conversation, "conversation")
    parts = [bos_text] if fmt.bos else []
    if fmt.default_system is not None and turns[0].role != "system":
        turns = [Turn("system", fmt.default_system), *turns]
    for turn in turns:
        if fmt.stop_ends_turn:
            end = stop_text + fmt.end_of_turn
        else:
            end = stop_text if turn.role == "assistant" else fmt.end_of_turn
        parts.extend((fmt.marker(turn.role), turn.content, end))
    if add_generation_prompt:
        parts.append(fmt.assistant)
    return "".join(parts)
