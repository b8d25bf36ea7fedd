"""Typed, validated configuration for models, rollout, objectives, losses, data and jobs.

Every config is a frozen pydantic model that forbids unknown fields. Construction failures
raise :class:`ConfigError` whose lines read "`section.field` must ...; received ...".
Choice fields are ``Literal`` types; the supported combinations of the rollout contract are
listed once, in :data:`SUPPORTED_CONTRACTS`.

YAML files are loaded with :func:`load_config`, with dotted command-line overrides such as
``model.n_layers=4`` applied before validation.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

AttentionType = Literal["causal", "block_diffusion"]
DType = Literal["float32", "bfloat16"]
RopeScaling = Literal["none", "linear", "llama3"]
Alignment = Literal["same_position", "shifted"]
Canvas = Literal["all_masked", "seed_and_mask"]
Context = Literal["clean", "corrupted"]
CommitRule = Literal["threshold", "schedule", "planner"]
Confidence = Literal["max_prob", "sampled_prob"]
ScheduleStrategy = Literal["confidence", "random", "entropy", "margin"]
ObjectiveKind = Literal["block_ce", "mdlm", "self_corrupted", "coordination", "cmd"]
# What a warm-up row holds after its stop token: `block` fills the rest of the stop's block
# with stop ids (trained), as the rollout's canvas has masks there; `none` leaves padding,
# which tells the student where the completion ends (the pre-2026-12-07 layout).
StopFill = Literal["block", "none"]
LossKind = Literal["reverse_kl", "forward_kl", "reverse_kl_full", "jsd"]
Advantage = Literal["token", "return_to_go", "mean_to_go", "sequence"]
TaskName = Literal["copy", "reverse", "sort", "addition", "addition_lsb", "agree", "sudoku"]

# The only (alignment, canvas) pairs accepted anywhere; everything else fails closed.
SUPPORTED_CONTRACTS: frozenset[tuple[str, str]] = frozenset(
    {("same_position", "all_masked"), ("shifted", "seed_and_mask")}
)


class ConfigError(ValueError):
    """A configuration failed validation; the message names every offending field."""


def _describe(error: Mapping[str, Any], prefix: str) -> str:
    location = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
    message = str(error["msg"])
    if message.startswith("Value error, "):
        # Our validators phrase "`field` must ...; received ..." with the field relative to
        # their own model; prefix it with where that model sits.
        message = message.removeprefix("Value error, ")
        if location and message.startswith("`"):
            message = f"`{location}.{message[1:]}"
        return message
    received = error.get("input")
    if error["type"] == "extra_forbidden":
        return f"`{location}` is not a known field; received {received!r}"
    if error["type"] == "missing":
        return f"`{location}` must be given; it is missing"
    if message.startswith("Input should"):
        message = "must" + message.removeprefix("Input should")
    else:
        message = f"must be valid ({message})"
    return f"`{location}` {message}; received {received!r}"


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """Render a pydantic error as one "`field` must ...; received ..." line per problem."""
    return "\n".join(_describe(item, prefix) for item in error.errors())


def _field_error(field: str, requirement: str, received: Any) -> ValueError:
    return ValueError(f"`{field}` must {requirement}; received {received!r}")


def check_contract(alignment: str, canvas: str, *, prefix: str = "") -> None:
    """Fail closed unless (alignment, canvas) is one of :data:`SUPPORTED_CONTRACTS`."""
    if (alignment, canvas) not in SUPPORTED_CONTRACTS:
        supported = ", ".join(f"{a}+{c}" for a, c in sorted(SUPPORTED_CONTRACTS))
        raise _field_error(
            f"{prefix}canvas",
            f"pair with {prefix}alignment as one of {supported}",
            f"{alignment}+{canvas}",
        )


_NESTING: contextvars.ContextVar[int] = contextvars.ContextVar("config_nesting", default=0)


class ConfigModel(BaseModel):
    """Base of every config (here and in ``services/``): frozen, no unknown fields, errors
    re-raised as :class:`ConfigError` with one "`field` must ...; received ..." line per
    problem (``section`` prefixes the fields). Validators raise ``ValueError`` with that
    wording, the field relative to their own model."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    section: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        # pydantic calls a custom __init__ for nested configs too; only the outermost call
        # formats, so nested locations come out once, as "outer.inner.field".
        depth = _NESTING.set(_NESTING.get() + 1)
        try:
            super().__init__(**data)
        except ValidationError as error:
            if _NESTING.get() > 1:
                raise
            raise ConfigError(format_validation_error(error, self.section)) from None
        finally:
            _NESTING.reset(depth)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self:
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"`{cls.section or 'config'}` must be a mapping; received {data!r}")
        return cls(**dict(data or {}))


_Config = ConfigModel  # the name the configs below were written against


class ModelConfig(_Config):
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    section: ClassVar[str] = "model"

    vocab_size: int = Field(gt=0)
    d_model: int = Field(default=64, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    n_kv_heads: int = Field(default=2, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    d_ff: int = Field(default=128, gt=0)
    rope_theta: float = Field(default=10_000.0, gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)
    tie_embeddings: bool = True
    param_dtype: DType = "float32"
    dtype: DType = "float32"
    attention_type: AttentionType = "block_diffusion"
    block_size: int = Field(default=4, gt=0)
    max_length: int = Field(default=256, gt=0)
    init_std: float = Field(default=0.02, gt=0)
    # Biases on the q/k/v projections (Qwen2); the output projection never has one.
    attention_bias: bool = False
    # RoPE frequency scaling, as in Hugging Face configs: "linear" divides every inverse
    # frequency by rope_scaling_factor; "llama3" (Llama 3.1) divides low frequencies by it and
    # interpolates between rope_high_freq_factor and rope_low_freq_factor wavelength bands of
    # rope_original_max_position.
    rope_scaling: RopeScaling = "none"
    rope_scaling_factor: float = Field(default=1.0, gt=0)
    rope_low_freq_factor: float = Field(default=1.0, gt=0)
    rope_high_freq_factor: float = Field(default=4.0, gt=0)
    rope_original_max_position: int = Field(default=8192, gt=0)
    # Width of the commit-planner head (distill/models/planner.py) on the final hidden
    # states: the commit policy of `rollout.commit_rule: planner`. None: no planner (the
    # parameters and outputs are exactly those of a student without one).
    planner_hidden: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check_heads(self) -> Self:
        if self.n_heads % self.n_kv_heads:
            raise _field_error("n_kv_heads", f"divide n_heads={self.n_heads}", self.n_kv_heads)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise _field_error(
                "d_model",
                f"be divisible by n_heads={self.n_heads} when head_dim is unset",
                self.d_model,
            )
        if self.planner_hidden is not None and self.attention_type != "block_diffusion":
            raise _field_error(
                "planner_hidden",
                "be None unless attention_type is 'block_diffusion' (a commit planner decides "
                "which masked slots a denoising step commits)",
                self.planner_hidden,
            )
        if self.resolved_head_dim % 2:
            raise _field_error("head_dim", "be even (RoPE rotates pairs)", self.resolved_head_dim)
        if (
            self.rope_scaling == "llama3"
            and self.rope_high_freq_factor <= self.rope_low_freq_factor
        ):
            raise _field_error(
                "rope_high_freq_factor",
                f"be > rope_low_freq_factor={self.rope_low_freq_factor} for llama3 scaling",
                self.rope_high_freq_factor,
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads


class RolloutConfig(_Config):
    """Low-confidence block denoising: contract, commit rule and sampling settings."""

    section: ClassVar[str] = "rollout"

    alignment: Alignment = "same_position"
    canvas: Canvas = "all_masked"
    commit_rule: CommitRule = "threshold"
    # 1.0 is "never clears" rather than "confidence >= 1": a confidence that rounds to 1.0 in
    # float32 must not turn the one-token-per-step setting into a multi-token one.
    threshold: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="threshold rule: every pending slot whose confidence is >= threshold "
        "commits, when threshold < 1 (none clearing: the single best one). threshold = 1.0 "
        "never clears, even for a confidence of exactly 1.0: one token per step. 0.0 commits "
        "a whole block in one step.",
    )
    confidence: Confidence = "max_prob"
    schedule_steps: int | None = Field(default=None, gt=0)
    strategy: ScheduleStrategy = "confidence"
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    greedy: bool = False
    # None: the longest answer the job's tasks can have (see distill/job.py); set it to cap
    # (or extend) the completion horizon of every rollout and evaluation.
    max_completion_length: int | None = Field(default=None, gt=0)
    stop_when_done: bool = True
    top_k: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_contract(self.alignment, self.canvas)
        if not self.greedy and self.temperature == 0.0:
            raise _field_error("temperature", "be > 0 unless greedy is true", self.temperature)
        if self.commit_rule == "schedule" and self.schedule_steps is None:
            raise _field_error("schedule_steps", "be set when commit_rule is 'schedule'", None)
        if self.top_k is not None or self.top_p is not None:
            # Replay must renormalize exactly as rollout does; until both paths implement the
            # same filter, refusing is the only way to keep replay exact.
            raise _field_error(
                "top_k" if self.top_k is not None else "top_p",
                "be unset (filtered sampling is not replayed exactly yet)",
                self.top_k if self.top_k is not None else self.top_p,
            )
        return self


class ObjectiveConfig(_Config):
    """Block-diffusion warm-up objective and its weights."""

    section: ClassVar[str] = "objective"

    kind: ObjectiveKind = "mdlm"
    alignment: Alignment = "same_position"
    canvas: Canvas = "all_masked"
    context: Context = "clean"
    min_noise: float = Field(default=0.05, gt=0.0, le=1.0)
    antithetic: bool = False
    k_frac: float = Field(default=0.5, ge=0.0, le=1.0)
    ramp_steps: int = Field(default=1000, ge=0)
    group: int = Field(default=4, gt=0)
    alpha: float = Field(default=1.0, ge=0.0)
    beta: float = Field(default=1.0, ge=0.0)
    repair_weight: float = Field(default=1.0, ge=0.0)
    stop_fill: StopFill = "block"

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_contract(self.alignment, self.canvas)
        return self


class LossConfig(_Config):
    """On-policy distillation loss."""

    section: ClassVar[str] = "loss"

    kind: LossKind = "reverse_kl"
    advantage: Advantage = "mean_to_go"
    ppo_clip: float | None = Field(default=None, gt=0.0)
    teacher_top_k: int | None = Field(default=None, gt=0)
    task_reward_weight: float = Field(default=0.0, ge=0.0)
    kl_reference_weight: float = Field(default=0.0, ge=0.0)
    # Policy versions a rollout may lag the learner by when it is trained (0: strictly
    # on-policy, rollout and update alternate; 1: rollouts of step t+1 overlap step t's
    # update). Older traces are dropped and counted; younger ones are importance-corrected
    # with the trace's behaviour log-probs (the `ratio` of the policy gradient).
    max_staleness: int = Field(default=1, ge=0)
    # Rollouts per prompt: each batch holds data.batch_size prompts x group_size rows; the
    # GRPO task reward is normalized within each prompt's group.
    group_size: int = Field(default=1, gt=0)
    # Reward charged per denoising step (one student forward) a row spends, in the units of
    # the per-token log-ratio; trained only through the planner's commit decisions
    # (`rollout.commit_rule: planner`, docs/opd.md).
    forward_cost: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.task_reward_weight > 0 and self.group_size < 2:
            raise _field_error(
                "group_size",
                "be >= 2 when task_reward_weight > 0 (GRPO normalizes within a group)",
                self.group_size,
            )
        return self


class DataConfig(_Config):
    """A deterministic stream of synthetic tasks: spec + seed."""

    section: ClassVar[str] = "data"

    tasks: tuple[TaskName, ...] = ("copy", "agree")
    seed: int = Field(default=0, ge=0)
    batch_size: int = Field(default=16, gt=0)
    min_length: int = Field(default=2, gt=0)
    max_length: int = Field(default=6, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.tasks:
            raise _field_error("tasks", "name at least one task", list(self.tasks))
        if len(set(self.tasks)) != len(self.tasks):
            raise _field_error("tasks", "not repeat a task", list(self.tasks))
        if self.min_length > self.max_length:
            raise _field_error("min_length", f"be <= max_length={self.max_length}", self.min_length)
        return self


class OptimizerConfig(_Config):
    section: ClassVar[str] = "optimizer"

    learning_rate: float = Field(default=1e-3, gt=0.0)
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = Field(default=0.0, ge=0.0)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    microbatches: int = Field(default=1, gt=0)


class PhaseConfig(_Config):
    """One training phase (teacher training, student warm-up, OPD): length, optimizer,
    checkpoint cadence and evaluation size."""

    section: ClassVar[str] = "phase"

    steps: int = Field(default=200, ge=0)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    checkpoint_every: int = Field(default=100, gt=0)
    eval_examples: int = Field(default=64, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        warmup = self.optimizer.warmup_steps
        if self.optimizer.schedule == "cosine" and self.steps and self.steps <= warmup:
            raise _field_error(
                "steps", f"exceed optimizer.warmup_steps={warmup} for a cosine schedule", self.steps
            )
        return self


class GuardConfig(_Config):
    """Stops an OPD run that is making the student worse, before it trains on.

    The signal is the teacher's per-token log-prob of the student's own rollouts (the
    ``opd/teacher_logp`` curve): OPD raises it while it helps. When the mean over the last
    ``window`` steps falls more than ``max_teacher_logp_drop`` nats below its value on the
    first step's rollouts (the policy OPD started from), the learner stops with
    :class:`distill.opd.guard.PolicyRegression` before saving that update. ``None`` (the
    default): no guard. Changing it on resume is allowed: it decides when to stop, not what
    is trained."""

    section: ClassVar[str] = "guard"

    max_teacher_logp_drop: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    window: int = Field(default=10, gt=0)


StudentInit = Literal["scratch", "teacher"]


class JobConfig(_Config):
    """One distillation job: models, rollout, objective, loss, data and the three phases."""

    student: ModelConfig
    teacher: ModelConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    teacher_training: PhaseConfig = Field(default_factory=PhaseConfig)
    student_warmup: PhaseConfig = Field(default_factory=PhaseConfig)
    opd: PhaseConfig = Field(default_factory=PhaseConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    # "teacher": copy the trained teacher's weights into the student (AR initialization;
    # pairs with the shifted + seed_and_mask contract, whose causal head it keeps).
    student_init: StudentInit = "scratch"
    tokenizer: dict[str, Any] = Field(default_factory=lambda: {"kind": "char"})
    # The teacher's own tokenizer, when it differs from the student's (same spec format as
    # `tokenizer`; None: the teacher uses the job's tokenizer). The teacher then scores text
    # and its log-probs are mapped onto the student's tokens by byte offsets
    # (distill/cross_tokenizer.py): only reverse_kl with a sequence-level advantage applies.
    teacher_tokenizer: dict[str, Any] | None = None
    # The student's vocabulary is the teacher's plus one appended mask token (a student
    # initialized from a pretrained checkpoint: distill.models.hf / gguf.init_student, see
    # docs/models.md): student.vocab_size must then be teacher.vocab_size + 1.
    mask_appended: bool = False
    seed: int = Field(default=0, ge=0)

    def _check_teacher_tokenizer(self) -> None:
        """A teacher tokenizer spec names a known kind, and the loss works across
        tokenizers (the full spec is checked when the tokenizer is built: distill/job.py)."""
        kind = self.teacher_tokenizer.get("kind")
        if kind not in ("char", "hf"):
            raise _field_error("teacher_tokenizer.kind", "be one of 'char', 'hf'", kind)
        from distill.cross_tokenizer import check_cross_tokenizer_loss

        check_cross_tokenizer_loss(self.loss.kind, self.loss.advantage, self.loss.teacher_top_k)

    def _check_row_lengths(self) -> None:
        """Under character tokenizers (one id per character) both models hold the stream's
        longest row (bos, prompt, answer, stop); other tokenizers are not checked here."""
        kinds = {self.tokenizer.get("kind"), (self.teacher_tokenizer or {}).get("kind", "char")}
        if kinds != {"char"}:
            return
        from distill.data.tasks import DataError, max_sequence_length

        try:
            rows = max_sequence_length(self.data.tasks, self.data.min_length, self.data.max_length)
        except DataError:
            return  # a length a task refuses: the stream names it (TaskStream)
        for name in ("teacher", "student"):
            model = getattr(self, name)
            if model.max_length < rows:
                raise _field_error(
                    f"{name}.max_length",
                    f"hold the data stream's longest row of {rows} ids (bos, prompt, answer and "
                    f"stop of {', '.join(self.data.tasks)} at length {self.data.max_length})",
                    model.max_length,
                )

    def _check_planner(self) -> None:
        """The planner rule needs a student with a planner head and the joint reverse-KL
        policy gradient; the per-forward cost only trains planner decisions."""
        planner = self.rollout.commit_rule == "planner"
        if planner and self.student.planner_hidden is None:
            raise _field_error(
                "student.planner_hidden",
                "be set when rollout.commit_rule is 'planner' (the head that gives each "
                "masked slot its commit probability)",
                None,
            )
        if planner and self.loss.kind != "reverse_kl":
            raise _field_error(
                "loss.kind",
                "be 'reverse_kl' when rollout.commit_rule is 'planner' (the joint policy "
                "gradient over token values and commit decisions)",
                self.loss.kind,
            )
        if planner and self.loss.task_reward_weight > 0:
            raise _field_error(
                "loss.task_reward_weight",
                "be 0 when rollout.commit_rule is 'planner' (not part of the joint loss yet)",
                self.loss.task_reward_weight,
            )
        if self.loss.forward_cost > 0 and not planner:
            raise _field_error(
                "loss.forward_cost",
                "be 0 unless rollout.commit_rule is 'planner' (only planner decisions can "
                "trade forwards for reward)",
                self.loss.forward_cost,
            )
        if self.teacher.planner_hidden is not None:
            raise _field_error("teacher.planner_hidden", "be None", self.teacher.planner_hidden)

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.teacher.attention_type != "causal":
            raise _field_error("teacher.attention_type", "be 'causal'", self.teacher.attention_type)
        if self.student.attention_type != "block_diffusion":
            raise _field_error(
                "student.attention_type", "be 'block_diffusion'", self.student.attention_type
            )
        rows = self.data.batch_size * self.loss.group_size
        microbatches = self.opd.optimizer.microbatches
        if rows % microbatches:
            raise _field_error(
                "opd.optimizer.microbatches",
                f"divide the OPD batch's {rows} rows (data.batch_size x loss.group_size)",
                microbatches,
            )
        if self.loss.task_reward_weight > 0 and (rows // microbatches) % self.loss.group_size:
            # GRPO normalizes within a prompt's group: a slice must hold whole groups.
            raise _field_error(
                "opd.optimizer.microbatches",
                f"keep whole groups of loss.group_size={self.loss.group_size} in each slice",
                microbatches,
            )
        self._check_planner()
        for field in ("alignment", "canvas"):
            if getattr(self.rollout, field) != getattr(self.objective, field):
                raise _field_error(
                    f"rollout.{field}",
                    f"equal objective.{field}={getattr(self.objective, field)!r} (the student "
                    "is rolled out under the contract it was trained with)",
                    getattr(self.rollout, field),
                )
        if self.objective.canvas == "seed_and_mask" and self.student.block_size < 2:
            # Every slot of a one-slot block is an anchor, never corrupted: the warm-up would
            # train on nothing and rollout would be plain left-to-right decoding.
            raise _field_error(
                "student.block_size",
                "be >= 2 with the shifted + seed_and_mask contract (a block of 1 is all anchor: "
                "nothing is ever corrupted)",
                self.student.block_size,
            )
        if self.student_init == "teacher" and self.teacher_tokenizer is not None:
            raise _field_error(
                "student_init",
                "be 'scratch' when teacher_tokenizer is set (the teacher's vocabulary is not "
                "the student's)",
                self.student_init,
            )
        if self.student_init == "teacher":
            same = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim")
            for field in same:
                if getattr(self.student, field) != getattr(self.teacher, field):
                    raise _field_error(
                        f"student.{field}",
                        f"equal teacher.{field}={getattr(self.teacher, field)} when "
                        "student_init is 'teacher'",
                        getattr(self.student, field),
                    )
        self._check_row_lengths()
        if self.teacher_tokenizer is not None:
            self._check_teacher_tokenizer()
        elif self.student.vocab_size != self.teacher.vocab_size + self.mask_appended:
            wanted = self.teacher.vocab_size + self.mask_appended
            appended = " (teacher.vocab_size + 1: mask_appended)" if self.mask_appended else ""
            raise _field_error(
                "student.vocab_size",
                f"equal {wanted}{appended}" if appended else f"equal teacher.vocab_size={wanted}",
                self.student.vocab_size,
            )
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"`override` must be a dotted path like a.b=value; received {dotted!r}")
    node = tree
    for index, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: index + 1])
            raise ConfigError(f"`{prefix}` must be a section to set {dotted}; received {child!r}")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` applied (value parsed as YAML)."""
    merged = yaml.safe_load(yaml.safe_dump(dict(data))) or {}
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"`override` must have the form a.b=value; received {override!r}")
        path, raw = override.split("=", 1)
        _set_dotted(merged, path.strip(), _parse_yaml(raw, "override", repr(override)))
    return merged


def _parse_yaml(text: str, field: str, source: str) -> Any:
    """``yaml.safe_load(text)``; a syntax error becomes a ConfigError naming ``field``, the
    ``source`` (file or override) and the line and column YAML reports, not a traceback."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(
            f"`{field}` must hold valid YAML; received {source} with a syntax error{at}: {problem}"
        ) from None


ConfigT = TypeVar("ConfigT", bound=_Config)


def load_config(
    path: str | Path | None,
    cls: type[ConfigT] = JobConfig,  # type: ignore[assignment]
    overrides: Sequence[str] = (),
    *,
    path_field: str = "path",
) -> ConfigT:
    """Load a YAML file (or start empty when ``path`` is None), apply overrides, validate.

    A missing file, a YAML syntax error or a non-mapping document is a :class:`ConfigError`
    naming ``path_field`` (a command line names its argument, e.g. ``config``)."""
    data: Any = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                f"`{path_field}` must name an existing YAML file; received {str(file)!r}"
            )
        data = _parse_yaml(file.read_text(), path_field, repr(str(file))) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"`{path_field}` must hold a YAML mapping; received {type(data).__name__}"
            )
    return cls.from_dict(apply_overrides(data, overrides))
