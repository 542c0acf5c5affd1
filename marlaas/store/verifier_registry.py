"""The store's registry of operator-registered verifiers: name -> "package.module:function".

Key (part of the store schema): `m:verifiers`, a hash name -> import path. Empty by default: no
custom verifier exists until the operator registers one (`marlaas.verify.boundary.register`).
"""

from __future__ import annotations

from marlaas.store.keys import P

VERIFIERS = P + "verifiers"


class VerifierRegistryOps:
    """The verifier registry (mixed into marlaas.store.Store); callers validate names and paths."""

    def register_verifier(self, name: str, path: str) -> None:
        self.r.hset(VERIFIERS, name, path)

    def unregister_verifier(self, name: str) -> bool:
        return bool(self.r.hdel(VERIFIERS, name))

    def registered_verifiers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(VERIFIERS).items()}
