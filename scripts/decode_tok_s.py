"""Decode tok/s of ROWS requests decoding together (plain greedy, no drafter) on MODEL at WEIGHTS,
timed after every request's prefill; prints one line ``WEIGHTS ROWS TOK_S``. For A/B runs of two
weight formats alternated by an outside timer (docs/benchmarks.md §12, sparse24-f32 against float):

    PYTHONPATH=src python scripts/decode_tok_s.py MODEL WEIGHTS ROWS [NEW_TOKENS (default 64)]
"""

import sys
import time

from fastdecode.args import EngineArgs

model, weights, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
new = int(sys.argv[4]) if len(sys.argv) > 4 else 64
engine = EngineArgs(model=model, weights=weights, drafter="none", max_num_seqs=rows).create_engine()
topics = ["the sea", "a city", "winter", "a robot", "music", "a garden", "the moon", "a river"]
for i in range(rows):  # min_tokens: every request decodes all its tokens
    engine.add_request(f"Write a long story about {topics[i % 8]}.", max_new_tokens=new, min_tokens=new)
started = set()
while len(started) < rows:  # prefill: until every request has its first token
    started.update(o.request_id for o in engine.step() if o.token_ids)
t0, tokens = time.perf_counter(), 0
while engine.has_unfinished():
    tokens += sum(len(o.token_ids) for o in engine.step())
print(f"{weights} {rows} {tokens / (time.perf_counter() - t0):.2f}")
