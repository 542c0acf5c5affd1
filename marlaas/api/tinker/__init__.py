"""The Tinker wire protocol on the API server (routes, protobuf codec); see docs/tinker.md."""
