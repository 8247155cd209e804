"""Dejafix: a GitHub App that answers newly opened issues with the fix that already landed."""

__version__ = "0.1.0"
