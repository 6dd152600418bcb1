"""Drafters, built by name through one registry (``build_drafter``)."""

# Importing a drafter module registers it.
from fastdecode.drafters import model, ngram, prompt_lookup, recycling, suffix  # noqa: E402,F401
from fastdecode.drafters.base import Draft, Drafter, available_drafters, build_drafter, register_drafter

__all__ = ["Draft", "Drafter", "available_drafters", "build_drafter", "register_drafter"]
