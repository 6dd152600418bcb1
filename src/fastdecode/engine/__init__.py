"""The engine: many requests at once, decoded by continuous batching with speculative
decoding at any batch size.

One loop serves every front end: ``Engine.add_request`` queues a request, and each
``Engine.step`` runs one forward pass over ragged rows of every running request and
returns what each gained; ``generate``, ``stream``, the CLI, the server and the
benchmarks are loops over those two. Plain decoding is the same loop with an empty
draft, so every drafter shares one code path for stopping, streaming, timing and
sampling. The engine owns the paged KV cache; drafters only propose.

The rooms, in the order a step visits them:

* ``config``: a request's options (``GenerationConfig``) and its draft-length policy;
* ``request``: one request's state, its outputs, position-keyed sampling randomness;
* ``core``: ``Engine`` (``add_request``, ``abort``, ``step``);
* ``scheduler``: admission, KV blocks, chunked prefill, the row budget;
* ``planning`` and ``policy``: draft lengths, source cuts, alternative paths, the
  batch draft policy's cost model;
* ``tree``: token trees and their copy-on-write branches;
* ``verifier``: sampling and accepting drafts, per request;
* ``output``: emitting, stopping, results;
* ``frontends``: ``generate`` and ``stream``.
"""

from fastdecode.engine.config import AdaptiveK, GenerationConfig
from fastdecode.engine.core import Engine
from fastdecode.engine.frontends import GenerationStream, Step
from fastdecode.engine.policy import BatchDraftPolicy
from fastdecode.engine.request import Request, RequestOutput, Status

__all__ = [
    "AdaptiveK",
    "BatchDraftPolicy",
    "Engine",
    "GenerationConfig",
    "GenerationStream",
    "Request",
    "RequestOutput",
    "Status",
    "Step",
]
