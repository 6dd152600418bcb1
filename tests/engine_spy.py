"""A test's view of the passes an engine runs (not a test module)."""


def record_passes(engine, describe) -> list:
    """Wrap ``engine``'s forward_batch: each pass appends ``describe(entries)`` (its
    ``BatchEntry`` list) to the list returned, then runs as before."""
    passes = []
    forward_batch = engine.target.forward_batch

    def spy(cache, entries):
        passes.append(describe(entries))
        return forward_batch(cache, entries)

    engine.target.forward_batch = spy
    return passes


def draft_lengths(entries) -> list[int]:
    """The draft length of each decoding entry of a pass (the rows after its re-fed last token)."""
    return [len(e.token_ids) - 1 for e in entries if e.num_logits == len(e.token_ids)]
