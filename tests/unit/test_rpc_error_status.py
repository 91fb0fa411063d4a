"""One mapper turns every servicer's domain errors into gRPC statuses; bugs are raised."""

from __future__ import annotations

import grpc
import pytest

from master.job.migration import MigrationFailedError
from master.nodes.manager import MasterResumingError, StaleNodeError
from master.rendezvous.rounds import StaleRoundError
from master.rpc.guard import MAX_DETAIL_CHARS, error_status, guard
from master.sharding.ledger import BadReportError, StaleShardError
from master.sharding.service import DatasetConflictError, UnknownDatasetError

S = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (MasterResumingError("retry"), S.UNAVAILABLE),
        (StaleNodeError("old id"), S.FAILED_PRECONDITION),
        (StaleRoundError("old round"), S.FAILED_PRECONDITION),
        (StaleShardError("old shard"), S.FAILED_PRECONDITION),
        (UnknownDatasetError("train"), S.NOT_FOUND),
        (DatasetConflictError("other spec"), S.ALREADY_EXISTS),
        (BadReportError("too many"), S.INVALID_ARGUMENT),
        (ValueError("bad field"), S.INVALID_ARGUMENT),
        (MigrationFailedError("gone"), S.ABORTED),
        (TimeoutError(), S.DEADLINE_EXCEEDED),
    ],
)
def test_each_domain_error_has_its_status(error, code):
    status = error_status(error)
    assert status is not None and status[0] == code


def test_a_bug_has_no_status_and_a_long_message_is_cut():
    assert error_status(KeyError("bug")) is None
    code, detail = error_status(ValueError("x" * 10 * MAX_DETAIL_CHARS))
    assert code == S.INVALID_ARGUMENT and len(detail) < 2 * MAX_DETAIL_CHARS
    assert detail.endswith(f"({10 * MAX_DETAIL_CHARS:,} characters in all)")


class _Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(code, details)


class _Servicer:
    @guard
    def Call(self, request, context):  # noqa: N802 (gRPC method names)
        raise request


def test_a_guarded_method_aborts_with_the_status_or_raises_a_bug():
    with pytest.raises(RuntimeError) as aborted:
        _Servicer().Call(StaleRoundError("round 3 is over"), _Context())
    assert aborted.value.args == (S.FAILED_PRECONDITION, "round 3 is over")
    with pytest.raises(KeyError):
        _Servicer().Call(KeyError("bug"), _Context())
