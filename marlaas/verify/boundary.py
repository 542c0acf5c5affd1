"""Verifier names at the boundary: what a tenant's spec may name, checked where the store is.

A job names verifiers in `verifier` and in a grader's `builtin` nodes. At spec validation a name must
be a built-in, a registered-name shape, or (operator and in-process client only) a strict import path
that resolves here (`check_spec_verifier`); at submit, where the store is, a tenant's names must be
built-ins or registered (`check_submit`); the operator registers names (`register`), imported once
here so a typo is refused now rather than in every verify worker.
"""

from __future__ import annotations

from marlaas.errors import SpecError, VerifierError
from marlaas.verify.graders import builtin_names
from marlaas.verify.registry import NAME, check_name, import_function
from marlaas.verify.verifiers import BUILTIN, check_verifier_name


def register(store, name: str, path: str) -> None:
    """Register (or replace) `name -> path` (operator only: the caller checks who asks). The path is
    checked and imported here, so a typo is refused now rather than in every verify worker."""
    check_name(name)
    if name in BUILTIN:
        raise VerifierError(f"{name!r} is a built-in verifier; pick another name")
    import_function(path)
    store.register_verifier(name, path)


def check_spec_verifier(name: str) -> None:
    """A job spec's `verifier`: a built-in, a registered name (whether it IS registered is checked at
    submit, where the store is: `check_submit`) or a strict import path that resolves here."""
    if name in BUILTIN or (isinstance(name, str) and NAME.fullmatch(name)):
        return
    check_verifier_name(name)


def check_submit(store, tenant: str | None, grader, verifier: str | None) -> None:
    """At submit: a tenant names only built-ins and registered verifiers (in `verifier` or in
    `grader`'s `builtin` nodes); the operator and the in-process client (tenant None) may also name
    an import path."""
    names = builtin_names(grader) if grader is not None else set()
    if verifier is not None:
        names.add(verifier)
    registered = None
    for name in sorted(names - set(BUILTIN)):
        if ":" in name:
            if tenant is not None:
                raise SpecError(f"invalid job spec: verifier {name!r}: tenants name registered verifiers only, "
                                "not import paths (ask the operator to register it)")
            continue
        registered = store.registered_verifiers() if registered is None else registered
        if name not in registered:
            raise SpecError(f"invalid job spec: verifier {name!r} is not registered: ask the operator to register it")
