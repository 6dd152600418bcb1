"""Drafters, built by name through one registry (``build_drafter``), and from the command line's
flat options through each drafter's builder (``factory.DrafterOptions``)."""

# Importing a drafter module registers it and its builder.
from fastdecode.drafters import factory, model, ngram, prompt_lookup, recycling, suffix  # noqa: F401
from fastdecode.drafters.base import Draft, Drafter, available_drafters, build_drafter, register_drafter

__all__ = ["Draft", "Drafter", "available_drafters", "build_drafter", "register_drafter"]
