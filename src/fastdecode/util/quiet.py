"""transformers and huggingface_hub, kept quiet: they print progress bars, warnings and retry
notices while converting a GGUF file or reaching the hub. Their loggers write to the stderr they
captured at import, which ``redirect_stderr`` does not reach: hence their levels. Neither is
imported to be quieted (transformers' import costs a load over a second): ``uses_transformers``
says the block is about to use them, else only those already imported are set (one imported
inside the block writes its log to the real stderr afterwards)."""

from __future__ import annotations

import contextlib
import io
import logging
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
    hushed = io.StringIO()
    try:
        with contextlib.redirect_stderr(hushed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lib, level in zip(loggers, previous):
            lib.set_verbosity(level)
        _unbind(hushed)


def _unbind(hushed: io.StringIO) -> None:
    """A library first imported inside the block made its log handler on the stderr of that moment,
    ``hushed``: point it back at the real one, so that its later warnings are seen."""
    for name in ("transformers", "huggingface_hub"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is hushed:
                handler.setStream(sys.stderr)
                handler.flush = sys.stderr.flush  # transformers binds its handler's flush to that stream's
