"""Targets: the model the decode loop verifies with, behind one small interface."""

from fastdecode.backends.base import Target
from fastdecode.backends.hf import HFTarget

__all__ = ["Target", "HFTarget"]
