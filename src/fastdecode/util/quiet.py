"""transformers and huggingface_hub, kept quiet: they print progress bars, warnings and retry
notices while converting a GGUF file or reaching the hub. Their loggers write to the stderr they
captured at import, which ``redirect_stderr`` does not reach: hence their levels. Neither is
imported to be quieted (transformers' import costs a load over a second): ``uses_transformers``
says the block is about to use them, else only those already imported are set."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings


@contextlib.contextmanager
def quiet(uses_transformers: bool = False):
    loggers = []
    if uses_transformers or "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        loggers.append(hf_logging)
    if uses_transformers or "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import logging as hub_logging

        loggers.append(hub_logging)
    previous = [lib.get_verbosity() for lib in loggers]
    for lib in loggers:
        lib.set_verbosity_error()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lib, level in zip(loggers, previous):
            lib.set_verbosity(level)
