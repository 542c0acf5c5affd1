"""Settings of the HTTP API server, from environment variables (prefix MARLAAS_API_).

| variable | meaning | default |
|---|---|---|
| MARLAAS_API_URL | the server the HTTP client talks to | http://127.0.0.1:$MARLAAS_API_PORT |
| MARLAAS_API_PORT | port of the embedded server (`marlaas api`) | 8400 |
| MARLAAS_API_OPEN | 1: with no tenant registered, requests without a token act as the single user (loopback only) | 0 |
| MARLAAS_API_RATE | requests per second each token (or address, without one) may send; 0 = no limit | 20 |
| MARLAAS_API_BURST | requests a token may send at once before the rate applies | 40 |
| MARLAAS_API_MAX_BODY_BYTES | largest request body other than a file upload | 16 MiB |
| MARLAAS_API_MAX_FILE_BYTES | largest uploaded dataset file | 256 MiB |
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    """The server's knobs; read once per app (`create_app`)."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_API_", extra="ignore")

    url: str | None = None
    """The server the HTTP client talks to; None = the embedded one on 127.0.0.1:`port`."""
    port: int = Field(8400, ge=1, le=65535)
    """Port of the embedded server."""
    open: bool = False
    """With no tenant registered: serve requests without a token as the single user. Only on a
    loopback bind, and only from loopback peers; ignored once a tenant exists."""
    rate: float = Field(20.0, ge=0)
    """Sustained requests per second per token (token bucket); 0 disables the limit."""
    burst: int = Field(40, ge=1)
    """Bucket size: requests a token may send back to back."""
    max_body_bytes: int = Field(16 << 20, ge=1024)
    """Largest JSON request body (a job spec with inline rows); larger ones get 413 unread."""
    max_file_bytes: int = Field(256 << 20, ge=1024)
    """Largest uploaded dataset file (POST /v1/files); larger ones get 413."""
    sse_poll_s: float = Field(0.5, gt=0, le=10)
    """How often an event stream looks for new events of its job."""

    @property
    def default_url(self) -> str:
        return self.url or f"http://127.0.0.1:{self.port}"
