"""The HTTP API app: settings read here (the process edge), one Service, one limiter, the routers.

    marlaas.api.app.serve("127.0.0.1", 8400)          # or: uvicorn marlaas.api.app:create_app --factory

Invariants:
- `create_app` is the only place the API reads settings (ApiSettings and the deployment's Settings);
  it passes them down: `app.state.service` (a `Service` with its `access.Limits`), `app.state.limiter`
  (one `RateLimiter` for every door), `app.state.settings` (the ApiSettings).
- Every route but /v1/health (and /docs, /openapi.json) is authenticated and rate limited by
  `deps.Caller`; errors are the one JSON envelope of `middleware` with the status of their class.
- The operator credential is $MARLAAS_HOME/operator_token (made on first use, mode 0600). An open
  server (`open=True`: no token needed while no tenant exists) is refused on a non-loopback bind,
  and even then only loopback peers are let in without a token.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from marlaas.api.access import Limits
from marlaas.api.deps import loopback
from marlaas.api.middleware import BodyLimit, install_error_handlers
from marlaas.api.ratelimit import PlanLimiter, RateLimiter
from marlaas.api.responses import allowed_methods, bound_integers
from marlaas.api.routes import aliases, files, graders, health, jobs, openai, tenants, tinker, verifiers
from marlaas.api.service import Service
from marlaas.api.settings import ApiSettings
from marlaas.errors import MarlaasError
from marlaas.settings import get_settings
from marlaas.store import Store


def create_app(store_url: str | None = None, home: Path | None = None, *, open: bool | None = None,
               settings: ApiSettings | None = None) -> FastAPI:
    """The API app over the store at `store_url` (default: MARLAAS_REDIS_URL or the embedded one), with
    the operator token and uploaded files under `home` (default: MARLAAS_HOME). `open` (default
    MARLAAS_API_OPEN) lets loopback requests without a token in while no tenant exists."""
    s = settings or ApiSettings()
    deployment = get_settings()
    service = Service(Store(store_url), home or deployment.home, Limits.from_settings(deployment),
                      open_single_user=s.open if open is None else open)
    app = FastAPI(title="marlaas", version="0.1.0",
                  description="Multi-tenant asynchronous RL fine-tuning of LLMs with LoRA adapters.")
    limiter = RateLimiter(s.rate, s.burst, service.store.r.connection_pool)  # one budget across API processes
    app.state.service, app.state.settings, app.state.limiter = service, s, limiter
    app.state.plan_limiter = PlanLimiter(service.store.r.connection_pool)  # the plans' per-tenant budgets
    app.add_middleware(BodyLimit, max_body=s.max_body_bytes, max_file=s.max_file_bytes, upload_path=files.PATH)
    install_error_handlers(app)
    keep_http_headers(app)
    openapi = app.openapi
    app.openapi = lambda: bound_integers(openapi())  # type: ignore[method-assign]  # the body check's 64 bits
    # tinker, openai: other wires
    for module in (health, jobs, files, tenants, graders, verifiers, aliases, tinker, openai):
        app.include_router(module.router)
    return app


def keep_http_headers(app: FastAPI) -> None:
    """Starlette's own HTTP errors keep their headers in the envelope: a 405 names the methods the path
    allows (`Allow`, as RFC 9110 requires): those of every documented route of the path (Starlette's
    names only the first route it matched)."""
    envelope = app.exception_handlers[StarletteHTTPException]

    async def with_headers(request: Request, exc: StarletteHTTPException) -> Response:
        response = await envelope(request, exc)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405 and (allowed := allowed_methods(request)):
            response.headers["Allow"] = ", ".join(allowed)
        return response

    app.add_exception_handler(StarletteHTTPException, with_headers)


def serve(host: str = "127.0.0.1", port: int | None = None, *, open: bool | None = None,
          store_url: str | None = None) -> None:
    """Run the API with uvicorn (blocking). An open server is refused on a non-loopback bind."""
    import uvicorn

    s = ApiSettings()
    is_open = s.open if open is None else open
    if is_open and not loopback(host):
        raise MarlaasError(f"refusing to serve without tokens (--open) on {host}: bind 127.0.0.1 or register "
                           "a tenant and drop --open")
    app = create_app(store_url, open=is_open, settings=s)
    uvicorn.run(app, host=host, port=port or s.port, log_level="info", proxy_headers=False)
