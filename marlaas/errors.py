"""Every user-facing error of marlaas: one flat hierarchy, one clear line each."""


class MarlaasError(Exception):
    """Base of every error marlaas raises on purpose; str(e) is one line for the user."""


class SpecError(MarlaasError):
    """A job spec or dataset is invalid; nothing was stored."""


class NotFound(MarlaasError):
    """No such job (or not visible to this tenant)."""


class Forbidden(MarlaasError):
    """The caller's token does not allow this."""


class StoreUnavailable(MarlaasError):
    """No Redis reachable: start the embedded stack (`marlaas up`) or set MARLAAS_REDIS_URL."""


class BaseModelError(MarlaasError):
    """The base model is missing or is not the one this deployment serves."""


class VerifierError(MarlaasError):
    """A verifier name cannot be resolved."""
