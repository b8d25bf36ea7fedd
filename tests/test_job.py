"""The run contract a phase resumes under (distill/job.py)."""

from distill.config import JobConfig, load_config
from distill.job import LATER_FIELDS, job_tokenizer, phase_contract

TOPOLOGY = {"process_count": 1, "device_count": 1, "platform": "cpu", "device_kind": "cpu"}


def _contract(*overrides: str, phase: str = "opd") -> dict:
    job = load_config("deploy/configs/agree.yaml", JobConfig, list(overrides))
    return phase_contract(job, job_tokenizer(job), phase, topology=TOPOLOGY)


def test_fields_added_later_are_left_out_at_their_unused_value_so_older_runs_resume():
    unused = [
        f"{section}.{field}={'null' if value is None else value}"
        for (section, field), value in LATER_FIELDS.items()
    ]
    checked = set()
    for phase in ("student_warmup", "opd"):
        contract = _contract(*unused, phase=phase)
        for section, field in LATER_FIELDS:
            if section in contract:
                assert field not in contract[section], (phase, section, field)
                checked.add((section, field))
    assert checked == set(LATER_FIELDS)


def test_a_warm_up_on_the_filled_layout_does_not_resume_one_saved_before_it():
    assert _contract(phase="student_warmup")["objective"]["stop_fill"] == "block"


def test_fields_added_later_are_recorded_once_used():
    contract = _contract(
        "student.planner_hidden=16",
        "rollout.commit_rule=planner",
        "loss.forward_cost=0.5",
    )
    assert contract["student"]["planner_hidden"] == 16
    assert contract["loss"]["forward_cost"] == 0.5
    assert contract["rollout"]["commit_rule"] == "planner"
