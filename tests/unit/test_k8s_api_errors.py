"""Failed Kubernetes API calls: what heals is retried (with the server's Retry-After), what does
not fails at once naming its cause; the retry loop keeps to its budget."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ProtocolError

from master.platform.k8s_errors import FailureKind, K8sApiError, classify_api_error
from master.platform.k8s_retry import RETRY_MAX_SECONDS, RETRY_MIN_SECONDS, ApiRetry, retry_delay
from tests.k8s_fake.faults import POD_SECURITY_MESSAGE, QUOTA_MESSAGE, RBAC_MESSAGE


def api_exception(status: int, message: str = "", retry_after: str | None = None) -> ApiException:
    """An ApiException as the client raises it for an answer with a Status body."""
    e = ApiException(status=status, reason="Reason")
    e.body = json.dumps({"kind": "Status", "code": status, "message": message})
    e.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return e


@pytest.mark.parametrize(
    "error, kind",
    [
        (api_exception(429, "slow down", "2"), FailureKind.TRANSIENT),
        (api_exception(503, "unavailable"), FailureKind.TRANSIENT),
        (api_exception(500, "etcd timeout"), FailureKind.TRANSIENT),
        (api_exception(504, "timeout"), FailureKind.TRANSIENT),
        (
            ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
            FailureKind.TRANSIENT,
        ),
        (ConnectionRefusedError(111, "refused"), FailureKind.TRANSIENT),
        (api_exception(403, QUOTA_MESSAGE.format(name="p")), FailureKind.QUOTA),
        (api_exception(403, POD_SECURITY_MESSAGE.format(name="p")), FailureKind.POD_SECURITY),
        (api_exception(403, RBAC_MESSAGE), FailureKind.RBAC),
        (api_exception(400, 'admission webhook "x" denied the request: no'), FailureKind.ADMISSION),
        (api_exception(422, "spec.containers: Required value"), FailureKind.INVALID),
        (api_exception(404, "not found"), FailureKind.NOT_FOUND),
        (api_exception(409, "already exists"), FailureKind.CONFLICT),
        (TypeError("a bug, not the cluster"), FailureKind.OTHER),
    ],
)
def test_a_failure_is_classified_by_status_and_message(error, kind):
    failure = classify_api_error(error)
    assert failure.kind == kind
    assert failure.kind.retryable == (kind in (FailureKind.TRANSIENT, FailureKind.QUOTA))


def test_retry_after_comes_from_the_header_or_the_status_details():
    assert classify_api_error(api_exception(429, "x", "3")).retry_after_seconds == 3.0
    e = api_exception(429)
    e.body = json.dumps({"message": "x", "details": {"retryAfterSeconds": 4}})
    assert classify_api_error(e).retry_after_seconds == 4.0
    assert classify_api_error(api_exception(503)).retry_after_seconds is None
    assert classify_api_error(api_exception(429, "x", "9999")).retry_after_seconds == 60.0


def test_retry_delay_honours_retry_after_backs_off_and_keeps_to_the_budget():
    slow = classify_api_error(api_exception(429, "x", "2"))
    assert retry_delay(slow, 1, remaining_seconds=10) == 2.0
    assert retry_delay(slow, 1, remaining_seconds=1) is None  # cannot wait as long as asked
    down = classify_api_error(api_exception(503))
    delays = [retry_delay(down, attempt, 1000) for attempt in range(1, 10)]
    assert delays[0] == RETRY_MIN_SECONDS and delays == sorted(delays)
    assert delays[-1] == RETRY_MAX_SECONDS
    assert retry_delay(down, 5, remaining_seconds=0.5) == 0.5  # one last try at the end
    assert retry_delay(down, 1, remaining_seconds=0) is None
    forbidden = classify_api_error(api_exception(403, RBAC_MESSAGE))
    assert retry_delay(forbidden, 1, 1000) is None


class FlakyCall:
    """Fails with the given errors in turn, then answers; records the timeout it was given."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.timeouts: list[object] = []

    def __call__(self, name: str, *, _request_timeout: object = None) -> str:
        self.calls += 1
        self.timeouts.append(_request_timeout)
        if self.errors:
            raise self.errors.pop(0)
        return f"made {name}"


def test_api_retry_goes_through_what_heals_and_says_so():
    retry = ApiRetry("ns", budget_seconds=10, timeout_seconds=7)
    flaky = FlakyCall(api_exception(503), ProtocolError("cut"), api_exception(429, "x", "0"))
    assert retry.call("create pod p", flaky, "p") == "made p"
    assert flaky.calls == 4 and retry.retries == 3
    assert flaky.timeouts == [(7, 7)] * 4  # every attempt has the request timeout
    notices = retry.notices()
    assert len(notices) == 4 and "create pod p succeeded at attempt 4" in notices[-1]
    assert "503" in notices[0] and "retrying" in notices[0]


def test_api_retry_fails_at_once_on_what_cannot_heal_naming_the_cause():
    retry = ApiRetry("ml", budget_seconds=10, timeout_seconds=7)
    flaky = FlakyCall(api_exception(403, POD_SECURITY_MESSAGE.format(name="p")))
    with pytest.raises(K8sApiError) as e:
        retry.call("create pod p", flaky, "p")
    assert flaky.calls == 1
    assert "Pod Security" in str(e.value) and "'ml'" in str(e.value)
    assert "RBAC" not in str(e.value)


def test_api_retry_gives_up_when_its_budget_is_spent():
    retry = ApiRetry("ns", budget_seconds=0.5, timeout_seconds=7)
    flaky = FlakyCall(*[api_exception(503) for _ in range(100)])
    started = time.monotonic()
    with pytest.raises(K8sApiError) as e:
        retry.call("delete pod p", flaky, "p")
    assert 0.5 <= time.monotonic() - started < 1.5
    assert e.value.failure.kind == FailureKind.TRANSIENT
    assert "gave up after" in str(e.value) and "DLROVER_K8S_API_RETRY_BUDGET_SECONDS" in str(
        e.value
    )
