"""The run contract a phase resumes under (distill/job.py)."""

from distill.config import JobConfig, load_config
from distill.job import LATER_FIELDS, job_tokenizer, phase_contract

TOPOLOGY = {"process_count": 1, "device_count": 1, "platform": "cpu", "device_kind": "cpu"}


def _contract(*overrides: str) -> dict:
    job = load_config("deploy/configs/agree.yaml", JobConfig, list(overrides))
    return phase_contract(job, job_tokenizer(job), "opd", topology=TOPOLOGY)


def test_fields_added_later_are_left_out_at_their_unused_value_so_older_runs_resume():
    contract = _contract()
    for (section, field), _ in LATER_FIELDS.items():
        assert field not in contract[section], (section, field)


def test_fields_added_later_are_recorded_once_used():
    contract = _contract(
        "student.planner_hidden=16",
        "rollout.commit_rule=planner",
        "loss.forward_cost=0.5",
    )
    assert contract["student"]["planner_hidden"] == 16
    assert contract["loss"]["forward_cost"] == 0.5
    assert contract["rollout"]["commit_rule"] == "planner"
