"""Errors raised inside a Ray actor reach the driver pickled: each error type with its own
constructor must survive a pickle round trip with its message and fields (otherwise Ray
reports "Failed to deserialize exception" instead of the reason)."""

import pickle
from pathlib import Path

import grpc
import pytest

from distill.checkpoint import ContractMismatch, ContractMissing
from services.common.status import StatusError
from services.teacher.client import TeacherServerError

ERRORS = [
    ContractMismatch({"rollout.threshold": (0.0, 0.9)}),
    ContractMissing(Path("/runs/x/opd")),
    StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "`ids` must hold at most 8 rows; received 9"),
    TeacherServerError(grpc.StatusCode.UNAVAILABLE, "down", "127.0.0.1:1", 3, elapsed_s=1.5),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_an_error_survives_pickling_with_its_message_and_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_a_contract_mismatch_names_the_field_after_the_round_trip():
    copy = pickle.loads(pickle.dumps(ERRORS[0]))
    assert copy.differences == {"rollout.threshold": (0.0, 0.9)}
    assert "`rollout.threshold` must equal the saved run's 0.0 to resume; received 0.9" in str(copy)
