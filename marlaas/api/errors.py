"""The HTTP status of each error of `marlaas.errors`, and the classes the HTTP client raises by name.

Each class maps to one HTTP status (`STATUS`); the server answers `{"error": {"type", "message"}}` with
the class name as type, and the HTTP client raises the same class from that envelope.
"""

from __future__ import annotations

from marlaas.errors import (
    ApiUnavailable,  # noqa: F401  (re-exported)
    BaseModelError,
    Conflict,
    Forbidden,
    MarlaasError,
    NotFound,
    RateLimited,
    ServerError,
    SpecError,
    StoreFull,
    StoreUnavailable,
    TooLarge,
    Unauthorized,
)

# Most specific first: the first class a raised error is an instance of gives the status.
STATUS: tuple[tuple[type[MarlaasError], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (Conflict, 409),
    (TooLarge, 413),
    (SpecError, 422),
    (BaseModelError, 422),
    (RateLimited, 429),
    (StoreUnavailable, 503),
    (MarlaasError, 400),
)

# The error classes the HTTP client can raise, by the type name the server sends.
BY_NAME: dict[str, type[MarlaasError]] = {
    c.__name__: c
    for c in (Unauthorized, Forbidden, NotFound, Conflict, TooLarge, SpecError, BaseModelError, RateLimited,
              StoreFull, StoreUnavailable, ServerError, MarlaasError)
}


def status_of(err: MarlaasError) -> int:
    """The HTTP status of an error (400 for a MarlaasError without a more specific one)."""
    return next(code for cls, code in STATUS if isinstance(err, cls))
