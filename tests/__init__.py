"""Test suite package (lets tests import shared helpers such as `tests.oracle`)."""
