"""Plumbing every room may use, importing nothing of fastdecode but its errors: ``files`` (input
text read as UTF-8, outputs written whole, never half), ``commands`` (argparse value types, notes
on stderr, the error wrapper of a command), ``progress`` (a progress bar on stderr, drawn only
on a terminal) and ``quiet`` (transformers' and huggingface_hub's logging hushed, neither imported for it)."""
