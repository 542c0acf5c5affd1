"""The Tinker wire protocol's helpers (request parsing, futures, checkpoints, the protobuf codec); the
routes are `marlaas.api.routes.tinker`. See docs/tinker.md."""
