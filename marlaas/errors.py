"""Every user-facing error of marlaas: one flat hierarchy, one clear line each.

Each class carries its HTTP status (`status`, inherited unless set): the API server answers
`{"error": {"type", "message"}}` with that status and the class name as type, and the HTTP client
raises the same class from that envelope (`by_name`). There is no other status table.
"""


class MarlaasError(Exception):
    """Base of every error marlaas raises on purpose; str(e) is one line for the user."""

    status: int = 400
    """The HTTP status the API answers it with."""


class SpecError(MarlaasError):
    """A job spec or dataset is invalid; nothing was stored."""

    status = 422


class NotFound(MarlaasError):
    """No such job (or not visible to this tenant)."""

    status = 404


class Forbidden(MarlaasError):
    """The caller's token does not allow this."""

    status = 403


class StoreUnavailable(MarlaasError):
    """No Redis reachable: start the embedded stack (`marlaas up`) or set MARLAAS_REDIS_URL."""

    status = 503


class ArtifactError(StoreUnavailable):
    """The artifact store cannot give an object back whole: missing, corrupt (its sha256 differs from
    its name) or unreachable (HTTP 503)."""


class StorageQuotaExceeded(MarlaasError):
    """The tenant's stored bytes reached its plan's `storage_bytes` (HTTP 413): delete ended jobs'
    artifacts (DELETE /v1/jobs/{id}) or checkpoints."""

    status = 413


class StoreFull(StoreUnavailable):
    """The store is near its memory cap: new work is refused until jobs finish (HTTP 503)."""


class BaseModelError(MarlaasError):
    """The base model is missing or is not the one this deployment serves."""

    status = 422


class VerifierError(SpecError):
    """A verifier name cannot be resolved (an invalid spec: HTTP 422)."""


class BaseImportError(BaseModelError):
    """A base model cannot be imported or is not a loadable causal LM."""


class TaskSourceError(SpecError, ValueError):
    """A task source (e.g. a reasoning-gym task name or config) is not usable."""


class LimitsError(MarlaasError, ValueError):
    """The model and request sizes cannot be served on this host."""


class Unauthorized(Forbidden):
    """No token, or a token this deployment does not know (HTTP 401). A Forbidden, so callers that
    catch Forbidden keep working."""

    status = 401


class Conflict(MarlaasError):
    """The job is not in a state that allows this (e.g. resuming a job that is not paused; HTTP 409)."""

    status = 409


class Gone(MarlaasError):
    """The object has ended for good (a Tinker session finished or expired; HTTP 410)."""

    status = 410


class TooLarge(MarlaasError):
    """A request body or an uploaded file is over the server's limit (HTTP 413)."""

    status = 413


class RateLimited(MarlaasError):
    """The token sent more requests than its rate allows (HTTP 429); retry after `retry_after` s."""

    status = 429

    def __init__(self, message: str, retry_after: float = 1.0, hold_s: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after
        self.hold_s = hold_s
        """Seconds the server waits before it answers (the API's rate limit: a client that ignores
        Retry-After and asks again at once is answered no faster than it was told it may retry)."""


class ServerError(MarlaasError):
    """The server failed on its side (HTTP 5xx other than 503)."""

    status = 500


class ApiUnavailable(MarlaasError):
    """No marlaas API server answers at the client's URL."""

    status = 503


class GraderLoadError(MarlaasError):
    """A grader that cannot be used at all (e.g. a registered name that no longer resolves)."""

    status = 422


class SandboxError(MarlaasError):
    """The sandbox itself failed (could not start, crashed or overran the batch limit); no verdicts."""

    status = 500


class UserError(MarlaasError, ValueError):
    """A Tinker request the client got wrong (its future fails with category 'user')."""


class SampleError(UserError):
    """A Tinker sample request this engine cannot serve (its future fails with category 'user')."""


def by_name(name: str) -> type[MarlaasError]:
    """The error class of this name (what the API sends as the error's type); MarlaasError if unknown."""
    cls = globals().get(name)
    return cls if isinstance(cls, type) and issubclass(cls, MarlaasError) else MarlaasError


def one_line(what: BaseException | str, limit: int = 300, typed: bool = False) -> str:
    """A message on one line (whitespace runs become one space), at most `limit` characters (cut with
    "..."). An exception gives its message, prefixed "Type: " when `typed`, or its type's name when
    it has no message."""
    if isinstance(what, BaseException):
        msg = " ".join(str(what).split())
        text = f"{type(what).__name__}: {msg}" if typed else (msg or type(what).__name__)
    else:
        text = " ".join(str(what).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact_url(url: str) -> str:
    """A URL safe to print, log or put in an error: its password replaced by ***."""
    from urllib.parse import urlparse

    u = urlparse(url)
    if not u.password:
        return url
    return u._replace(netloc=u.netloc.replace(f":{u.password}@", ":***@", 1)).geturl()


class TrainStateError(MarlaasError):
    """The trainer cannot take this step: no state for the version, or a state that does not fit."""
