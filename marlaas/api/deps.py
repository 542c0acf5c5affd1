"""The API's one authentication and rate limit, as FastAPI dependencies shared by every router.

    from marlaas.api.deps import Caller, service
    @router.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, request: Request, p: Principal = Caller): ...

Invariants:
- A caller is named by `Authorization: Bearer <token>` or by the Tinker SDK's `X-API-Key: tml-<token>`
  (the `tml-` prefix stripped; the key wins when both are sent). A malformed Authorization header is
  401, as is an unknown token.
- Every authenticated request is counted against its caller's rate limit first (keyed by a hash of the
  token, or by the peer address without one; kept in the store's Redis, so one budget across every API
  process): over the rate it is 429 with Retry-After, before the token is even looked up, answered
  after a hold of up to RATE_HOLD_S (on the event loop, no thread): a client that floods without
  waiting gets about one refusal per connection per second, so its refusals cost the API little.
- Without a token, a request is the open single user only when the app was created open, the peer is
  on loopback and no tenant exists (`Service.authenticate`); otherwise 401.
- The app keeps one `Service` (app.state.service), one `RateLimiter` (app.state.limiter) and its
  `ApiSettings` (app.state.settings); `create_app` puts them there.
"""

from __future__ import annotations

import hashlib
import ipaddress

from fastapi import Depends, Header, Request

from marlaas.api.access import Principal
from marlaas.api.service import Service
from marlaas.errors import RateLimited, Unauthorized

TINKER_KEY_PREFIX = "tml-"
RATE_HOLD_S = 1.0
"""Longest hold of a refusal for the rate (its wait, when shorter)."""


def loopback(host: str | None) -> bool:
    """Whether a host name or address is the local machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def service(request: Request) -> Service:
    """The app's Service."""
    return request.app.state.service


def bearer_token(authorization: str | None, x_api_key: str | None) -> str | None:
    """The token a request carries (None: none); Unauthorized for a malformed Authorization header."""
    if x_api_key and x_api_key.strip():
        return x_api_key.strip().removeprefix(TINKER_KEY_PREFIX) or None
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
    return value.strip()


def principal(request: Request, authorization: str | None = Header(None),
              x_api_key: str | None = Header(None)) -> Principal:
    """The authenticated caller of this request, after its rate limit (RateLimited, Unauthorized)."""
    token = bearer_token(authorization, x_api_key)
    peer = request.client.host if request.client else None
    key = "t:" + hashlib.sha256(token.encode()).hexdigest()[:32] if token else f"a:{peer}"
    limiter = request.app.state.limiter
    wait = limiter.take(key)
    if wait > 0:
        raise RateLimited(f"too many requests: at most {limiter.rate:g}/s (burst {limiter.burst}); "
                          f"retry in {wait:.1f} s", wait, hold_s=min(wait, RATE_HOLD_S))
    return service(request).authenticate(token, loopback_peer=loopback(peer))


Caller = Depends(principal)
