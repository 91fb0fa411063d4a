"""Kubernetes API calls with a timeout, retried through what heals while a budget lasts.

`retry_delay` decides (pure): a transient failure (429, 5xx, a timeout, a cut connection) or a
used-up quota is tried again after an exponential backoff, or after the server's `Retry-After`;
anything else, or a budget spent, ends the call. `ApiRetry.call` applies it, logs each retry
and keeps the latest lines in `notices` (what the platform shows of the API's health).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from master.platform.k8s_errors import (
    ApiFailure,
    FailureKind,
    K8sApiError,
    classify_api_error,
    describe,
    short_reason,
)
from master.platform.k8s_settings import ENV_API_RETRY_BUDGET_SECONDS

log = logging.getLogger(__name__)

RETRY_MIN_SECONDS = 0.2
RETRY_MAX_SECONDS = 10.0
CONNECT_TIMEOUT_MAX_SECONDS = 10.0
MAX_NOTICES = 50

T = TypeVar("T")


def retry_delay(failure: ApiFailure, attempt: int, remaining_seconds: float) -> float | None:
    """Seconds to wait before attempt `attempt + 1`, or None: give up now.

    The server's Retry-After wins over the backoff; a wait the budget cannot afford ends the
    call, except the backoff, which is shortened to one last try at the budget's end.
    """
    if not failure.kind.retryable or remaining_seconds <= 0:
        return None
    if failure.retry_after_seconds is not None:
        wait = failure.retry_after_seconds
        return wait if wait <= remaining_seconds else None
    backoff = min(RETRY_MIN_SECONDS * 2 ** max(attempt - 1, 0), RETRY_MAX_SECONDS)
    return min(backoff, remaining_seconds)


class ApiRetry:
    """Runs API calls with the request timeout and the retry budget of the platform's settings."""

    def __init__(self, namespace: str, budget_seconds: float, timeout_seconds: float) -> None:
        self.namespace = namespace
        self.budget_seconds = budget_seconds
        # (connect, read): the kubernetes client's `_request_timeout`.
        self.request_timeout = (min(timeout_seconds, CONNECT_TIMEOUT_MAX_SECONDS), timeout_seconds)
        self._lock = threading.Lock()
        self._notices: collections.deque[str] = collections.deque(maxlen=MAX_NOTICES)
        self.retries = 0  # calls tried again so far

    def notices(self) -> list[str]:
        """The latest retry and give-up lines, oldest first."""
        with self._lock:
            return list(self._notices)

    def call(
        self,
        action: str,
        fn: Callable[..., T],
        *args: Any,
        stop: threading.Event | None = None,
        budget_seconds: float | None = None,
        **kwargs: Any,
    ) -> T:
        """`fn(*args, **kwargs)` until it answers; K8sApiError when it cannot (or `stop` is set).

        `action` names the call in messages ("create pod tfjob-worker-1-7").
        """
        kwargs.setdefault("_request_timeout", self.request_timeout)
        budget = self.budget_seconds if budget_seconds is None else budget_seconds
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # classified: only what heals is tried again
                failure = classify_api_error(e)
                elapsed = time.monotonic() - started
                delay = retry_delay(failure, attempt, budget - elapsed)
                if delay is None or (stop is not None and stop.is_set()):
                    raise self._give_up(action, failure, attempt, elapsed, budget) from None
                self.note(
                    logging.WARNING,
                    f"k8s API: {action}: {short_reason(failure)}; retrying in {delay:.1f}s "
                    f"(attempt {attempt + 1}, {max(budget - elapsed, 0):.0f}s of the "
                    f"{budget:.0f}s retry budget left)",
                )
                with self._lock:
                    self.retries += 1
                if stop is not None:
                    if stop.wait(delay):
                        raise self._give_up(action, failure, attempt, elapsed, budget) from None
                else:
                    time.sleep(delay)
                continue
            if attempt > 1:
                self.note(
                    logging.INFO,
                    f"k8s API: {action} succeeded at attempt {attempt}, "
                    f"{time.monotonic() - started:.1f}s after its first try",
                )
            return result

    def _give_up(
        self, action: str, failure: ApiFailure, attempts: int, elapsed: float, budget: float
    ) -> K8sApiError:
        message = describe(action, failure, self.namespace)
        if failure.kind.retryable:
            message += (
                f"; gave up after {attempts} attempts in {elapsed:.0f}s (the retry budget, "
                f"{ENV_API_RETRY_BUDGET_SECONDS}, is {budget:.0f}s)"
            )
        if failure.kind not in (FailureKind.NOT_FOUND, FailureKind.CONFLICT):
            self.note(logging.ERROR, f"k8s API: {message}")
        return K8sApiError(message, failure)

    def note(self, level: int, line: str) -> None:
        """Log a line about the cluster and keep it among the notices."""
        log.log(level, "%s", line)
        with self._lock:
            self._notices.append(time.strftime("%H:%M:%S ") + line)
