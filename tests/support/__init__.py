"""Helpers shared by the test modules: test modules import these, never each other."""
