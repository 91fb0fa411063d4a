"""The exit codes of `dlrover submit` and `dlrover master`: one per way a job ends."""

from __future__ import annotations

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1  # the job failed, or its master was lost for good
EXIT_USAGE = 2  # a bad command line, job spec or setup: the job did not run
EXIT_STOPPED = 3  # stopped before it ended (Ctrl-C, SIGTERM)

EXIT_CODES_HELP = (
    f"exit codes: {EXIT_SUCCEEDED} the job succeeded; {EXIT_FAILED} it failed (or its master "
    f"was lost); {EXIT_USAGE} bad usage, job spec or setup; {EXIT_STOPPED} it was stopped "
    "(Ctrl-C, SIGTERM) before it ended"
)


def job_exit_code(state: str) -> int:
    """The exit code of a job that ended in `state` ("succeeded", "failed" or "stopped")."""
    if state == "succeeded":
        return EXIT_SUCCEEDED
    return EXIT_STOPPED if state == "stopped" else EXIT_FAILED
