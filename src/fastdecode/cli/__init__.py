"""The ``fastdecode`` command, the top room: ``commands`` builds the parser of every subcommand
and runs the one asked for (``main``, the entry point of the ``fastdecode`` script and of
``python -m fastdecode``), ``decoding`` holds ``generate``'s decoding options (logits processors,
a JSON schema, logprobs) and ``demo`` the README's first command. Subcommands that belong to a
room of their own (``bench``, ``serve``, ``distill``, ``eval``...) are added from that room;
nothing in fastdecode imports this one."""

from fastdecode.cli.commands import main

__all__ = ["main"]
