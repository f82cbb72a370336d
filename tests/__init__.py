"""Test suite (a package so tests can share `tests.reference`)."""
