"""Configs: validation names the field, YAML + dotted overrides, contract combinations."""

from pathlib import Path

import pytest

from distill.config import (
    SUPPORTED_CONTRACTS,
    ConfigError,
    JobConfig,
    ModelConfig,
    ObjectiveConfig,
    RolloutConfig,
    apply_overrides,
    load_config,
)

JOB_YAML = """
student: {vocab_size: 50, attention_type: block_diffusion, block_size: 4}
teacher: {vocab_size: 50, attention_type: causal}
rollout: {threshold: 0.8}
objective: {kind: cmd, alpha: 0.5}
"""


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"vocab_size": 0}, "model.vocab_size"),
        ({"vocab_size": 10, "n_layers": -1}, "model.n_layers"),
        ({"vocab_size": 10, "n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads"),
        ({"vocab_size": 10, "d_model": 30, "n_heads": 4}, "model.d_model"),
        ({"vocab_size": 10, "attention_type": "sliding"}, "model.attention_type"),
        ({"vocab_size": 10, "param_dtype": "float16"}, "model.param_dtype"),
        ({"vocab_size": 10, "hidden": 3}, "model.hidden"),
        ({}, "model.vocab_size"),
    ],
)
def test_bad_model_config_names_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ModelConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"threshold": 1.5}, "rollout.threshold"),
        ({"temperature": 0.0}, "rollout.temperature"),
        ({"commit_rule": "schedule"}, "rollout.schedule_steps"),
        ({"confidence": "entropy"}, "rollout.confidence"),
        ({"top_p": 0.9}, "rollout.top_p"),
        ({"alignment": "shifted", "canvas": "all_masked"}, "rollout.canvas"),
    ],
)
def test_bad_rollout_config_names_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        RolloutConfig(**fields)


def test_error_message_has_the_must_received_form():
    with pytest.raises(ConfigError) as error:
        ModelConfig(vocab_size=10, n_layers=-1)
    assert str(error.value) == "`model.n_layers` must be greater than 0; received -1"


@pytest.mark.parametrize(("alignment", "canvas"), sorted(SUPPORTED_CONTRACTS))
def test_supported_contracts_are_accepted(alignment, canvas):
    assert RolloutConfig(alignment=alignment, canvas=canvas).canvas == canvas
    assert ObjectiveConfig(alignment=alignment, canvas=canvas).alignment == alignment


def test_unknown_objective_and_negative_weight_are_refused():
    with pytest.raises(ConfigError, match="`objective.kind`"):
        ObjectiveConfig(kind="bert")
    with pytest.raises(ConfigError, match="`objective.alpha`"):
        ObjectiveConfig(alpha=-1.0)
    with pytest.raises(ConfigError, match="`objective.stop_fill`"):
        ObjectiveConfig(stop_fill="horizon")


def test_warm_up_rows_fill_the_stop_block_by_default():
    assert ObjectiveConfig().stop_fill == "block"


def test_job_config_loads_from_yaml_with_dotted_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    job = load_config(path, JobConfig, ["student.n_layers=3", "rollout.greedy=true", "seed=7"])
    assert job.student.n_layers == 3 and job.rollout.greedy is True and job.seed == 7
    assert job.rollout.threshold == 0.8 and job.objective.kind == "cmd"


def test_nested_errors_carry_the_full_dotted_path(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    with pytest.raises(ConfigError, match="`student.n_heads`|`student.n_kv_heads`"):
        load_config(path, JobConfig, ["student.n_kv_heads=3"])
    with pytest.raises(ConfigError, match="`loss.kind`"):
        load_config(path, JobConfig, ["loss.kind=mse"])
    with pytest.raises(ConfigError, match="`rollout.wat` is not a known field"):
        load_config(path, JobConfig, ["rollout.wat=1"])


def test_job_config_refuses_wrong_roles_and_vocab_mismatch(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    with pytest.raises(ConfigError, match="`teacher.attention_type`"):
        load_config(path, JobConfig, ["teacher.attention_type=block_diffusion"])
    with pytest.raises(ConfigError, match="`student.vocab_size`"):
        load_config(path, JobConfig, ["student.vocab_size=51"])


def test_bad_overrides_and_paths_are_named():
    with pytest.raises(ConfigError, match="`override`"):
        apply_overrides({}, ["no_equals_sign"])
    with pytest.raises(ConfigError, match="`seed`"):
        apply_overrides({"seed": 1}, ["seed.x=2"])
    with pytest.raises(ConfigError, match="`path`"):
        load_config("/does/not/exist.yaml", JobConfig)


def test_configs_are_frozen():
    config = ModelConfig(vocab_size=10)
    with pytest.raises(Exception, match="frozen"):
        config.n_layers = 5  # type: ignore[misc]


def test_opd_microbatches_must_divide_the_rows_and_keep_groups_whole(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    rows = ["data.batch_size=4", "loss.group_size=2"]  # 8 rows per OPD step
    with pytest.raises(ConfigError, match=r"^`opd\.optimizer\.microbatches` must divide .*3$"):
        load_config(path, JobConfig, [*rows, "opd.optimizer.microbatches=3"])
    assert load_config(path, JobConfig, [*rows, "opd.optimizer.microbatches=4"])
    grpo = [*rows, "loss.task_reward_weight=1.0"]
    with pytest.raises(ConfigError, match="keep whole groups of loss.group_size=2"):
        load_config(path, JobConfig, [*grpo, "opd.optimizer.microbatches=8"])
    assert load_config(path, JobConfig, [*grpo, "opd.optimizer.microbatches=4"])


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_temperature_and_threshold_are_refused(value):
    with pytest.raises(ConfigError, match=r"^`rollout\.temperature` must be a finite number"):
        RolloutConfig(temperature=value)
    with pytest.raises(ConfigError, match=r"^`rollout\.threshold` must"):
        RolloutConfig(threshold=value)


def test_block_size_one_with_shifted_seed_and_mask_is_refused_by_name(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    shifted = [
        "rollout.alignment=shifted",
        "rollout.canvas=seed_and_mask",
        "objective.alignment=shifted",
        "objective.canvas=seed_and_mask",
    ]
    with pytest.raises(ConfigError, match=r"^`student\.block_size` must be >= 2 .*; received 1$"):
        load_config(path, JobConfig, [*shifted, "student.block_size=1"])
    assert load_config(path, JobConfig, [*shifted, "student.block_size=2"]).student.block_size == 2
    # same_position + all_masked corrupts a one-slot block like any other.
    assert load_config(path, JobConfig, ["student.block_size=1"]).student.block_size == 1


def test_threshold_description_says_one_never_clears():
    description = RolloutConfig.model_fields["threshold"].description
    assert "1.0 never clears" in description and "one token per step" in description


def test_mask_appended_allows_exactly_one_more_student_id(tmp_path):
    # A student initialized from a pretrained teacher has the teacher's ids plus the mask.
    path = tmp_path / "job.yaml"
    path.write_text(JOB_YAML)
    job = load_config(path, JobConfig, ["student.vocab_size=51", "mask_appended=true"])
    assert (job.student.vocab_size, job.teacher.vocab_size) == (51, 50)
    for size in (50, 52):
        with pytest.raises(ConfigError, match=r"`student.vocab_size` must equal 51 \(teacher"):
            load_config(path, JobConfig, [f"student.vocab_size={size}", "mask_appended=true"])
    from distill.job import job_tokenizer

    # The default char tokenizer has 51 ids: the teacher's 50 rows plus the mask.
    assert job_tokenizer(job).vocab_size == 51
    with pytest.raises(ValueError, match=r"`teacher.vocab_size` must equal the tokenizer's 51 - 1"):
        job_tokenizer(
            job.model_copy(update={"teacher": job.teacher.model_copy(update={"vocab_size": 51})})
        )


def test_a_yaml_syntax_error_names_the_file_or_override_and_the_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("seed: 0\nstudent: {d_model: 64\n")
    with pytest.raises(
        ConfigError, match=r"`path` must hold valid YAML; received '.*job.yaml' .* line 3"
    ):
        load_config(path, JobConfig)
    with pytest.raises(
        ConfigError, match=r"`override` must hold valid YAML; received 'data.tasks=\[copy'"
    ):
        load_config(None, JobConfig, ["data.tasks=[copy"])


def test_models_too_short_for_the_streams_longest_row_are_refused_by_name():
    # 32-digit sums: 1 + 70 + 33 + 1 = 105 ids
    path = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "long-tasks.yaml"
    for model in ("teacher", "student"):
        with pytest.raises(ConfigError, match=rf"^`{model}.max_length` must hold .* 105 ids"):
            load_config(path, JobConfig, [f"{model}.max_length=104"])
    exact = ["teacher.max_length=105", "student.max_length=105"]
    assert load_config(path, JobConfig, exact).teacher.max_length == 105
    # Another tokenizer's ids per character are not known here: not refused.
    hf = [
        "teacher_tokenizer={kind: hf, name: x}",
        "teacher.max_length=16",
        "loss.advantage=sequence",
    ]
    assert load_config(path, JobConfig, hf).teacher.max_length == 16
