"""Integration tests (see tests/conftest.py for the shared fixtures)."""
