"""Who may read the dashboard: holders of the job's read-only dashboard token.

The token is its own secret, not the job token: the job token lets a process act as a node (and
scale or migrate the job), while a browser only needs to look, and a link with `?token=` may end
up in its history. It lives next to the job token, in `RUN_DIR/.dashboard_token` (mode 0600), and
survives a master restart, so logged-in browsers stay logged in.

A request is let in by `Authorization: Bearer TOKEN` (scripts, `dlrover status`, Prometheus's
`authorization.credentials_file`) or by the session cookie a browser gets from opening any page
once with `?token=TOKEN`; the server then redirects to the same page without the token. The cookie
holds an HMAC of the token (not the token), is HttpOnly and SameSite=Strict, and is named after
the port, so the dashboards of two jobs on one host keep separate logins. Comparisons are
constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from http.cookies import CookieError, SimpleCookie

TOKEN_FILE = ".dashboard_token"
TOKEN_PARAM = "token"
TOKEN_BYTES = 32
MIN_TOKEN_CHARS = 16
_SESSION_LABEL = b"dlrover-dashboard-session"


def token_path(run_dir: str) -> str:
    """Where a job keeps its dashboard token: next to the job token, in its run dir."""
    return os.path.join(run_dir, TOKEN_FILE)


def load_or_create_token(run_dir: str) -> str:
    """The run's dashboard token: the one in RUN_DIR/.dashboard_token, created (0600) if absent.

    A restarted master finds the file and keeps the token, so links and logins keep working."""
    path = token_path(run_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path)
    token = secrets.token_urlsafe(TOKEN_BYTES)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(token + "\n")
    return token


def read_token(path: str) -> str:
    """The dashboard token stored at path; ValueError naming the file when it cannot be used."""
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
    except FileNotFoundError:
        raise ValueError(
            f"no dashboard token at {path}: it is written to the job's run dir when the master "
            "starts; pass the run dir's .job_token with --token-file so its neighbour is found"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the dashboard token {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the dashboard token in {path} is {len(token)} characters, fewer than "
            f"{MIN_TOKEN_CHARS}; delete the file and restart the master to make a new one"
        )
    return token


class DashboardAuth:
    """Checks requests against one dashboard token (see the module docstring)."""

    def __init__(self, token: str, port: int, secure: bool) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"a dashboard token needs >= {MIN_TOKEN_CHARS} characters")
        self._token = token.encode()
        self._session = hmac.new(self._token, _SESSION_LABEL, hashlib.sha256).hexdigest()
        self.cookie_name = f"dlrover_dashboard_{port}"
        self._secure = secure

    def token_ok(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self._token)

    def allows(self, authorization: str | None, cookie_header: str | None) -> bool:
        """Whether a request with these Authorization and Cookie headers may read."""
        if authorization:
            scheme, _, credentials = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.token_ok(credentials.strip()):
                return True
        if cookie_header:
            try:
                cookies = SimpleCookie(cookie_header)
            except CookieError:
                return False
            morsel = cookies.get(self.cookie_name)
            if morsel is not None and hmac.compare_digest(
                morsel.value.encode(), self._session.encode()
            ):
                return True
        return False

    def session_cookie(self) -> str:
        """The Set-Cookie value that logs a browser in (for the whole dashboard, this port)."""
        flags = "; Secure" if self._secure else ""
        return f"{self.cookie_name}={self._session}; Path=/; HttpOnly; SameSite=Strict{flags}"
