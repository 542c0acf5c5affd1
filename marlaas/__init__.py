"""marlaas: multi-tenant asynchronous RL fine-tuning of LLMs as a service.

Many tenants share one base model; each job trains its own LoRA adapter. Generation, verification
and training run as decoupled Celery stations over Redis (see the README and docs/architecture.md). This package
is the library: it never imports celery (`tasks/` and `workers/` do).
"""

from marlaas.errors import MarlaasError
from marlaas.spec import JobSpec, LoraSpec, RLSpec

__all__ = ["Client", "Job", "JobSpec", "LoraSpec", "RLSpec", "MarlaasError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Client", "Job"):  # tenants speak HTTP to the API (marlaas.api.http_client)
        from marlaas.api import http_client

        return getattr(http_client, name)
    raise AttributeError(name)
