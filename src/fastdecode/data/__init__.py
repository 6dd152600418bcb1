"""The texts and prompts that ship with fastdecode, each beside its licence and source, and the
functions that read them: ``corpora`` (a text to evaluate on, WikiText-2's test split, and one to
calibrate on, from Tiny Shakespeare) and ``suite`` (the built-in offline prompt suite the
benchmark and the demo run)."""
