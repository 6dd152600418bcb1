"""Prometheus metrics for ``GET /metrics``, named after vLLM's (``vllm:`` -> ``fastdecode:``).

Conventions (as vLLM's):

* ``kv_cache_usage_perc`` is a fraction, 0 to 1, of the KV blocks held by
  running requests (cached blocks no request holds count as free);
  ``kv_cache_used_bytes`` is those blocks' bytes as stored (a q8_0 / q4_0 cache's
  blocks count their int8 / 4-bit values and scales), of ``kv_cache_bytes`` allocated;
* prefix cache queries and hits are counted in prompt tokens;
* a *draft* is one verification step that drafted at least one token;
  ``spec_decode_num_accepted_tokens_per_pos{position="i"}`` counts accepted
  draft tokens at draft position i (0-based);
* inter-token latency: a step that appends m tokens to a request after dt
  seconds counts m latencies of dt / m (speculation appends several at once);
* time to first token and end-to-end latency run from the moment the engine
  thread queued the request.

Every method but ``render`` is called from the engine thread only. Each
server gets its own registry, so several servers can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Histogram buckets, vLLM's.
# fmt: off
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
# fmt: on

# Engine finish reasons -> OpenAI's (and the label of request_success_total).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort"}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"fastdecode:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"fastdecode:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"fastdecode:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests decoding in the batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for a slot or KV blocks.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by running requests (1 = full)."
        )
        self.kv_cache_bytes = gauge("kv_cache_bytes", "Bytes of the KV cache allocated (K and V as stored).")
        self.kv_cache_used_bytes = gauge("kv_cache_used_bytes", "Bytes of the KV blocks held by running requests.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS_S)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS_S
        )
        self.num_preemptions = counter(
            "num_preemptions",
            "Preemptions: a request's KV blocks taken back for older ones, or its slot for a new one after its "
            "time slice (recomputed on resuming).",
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Verification steps that drafted tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Accepted draft tokens.")
        self._per_pos = Counter(
            "fastdecode:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0-based).",
            ["model_name", "position"],
            registry=r,
        )
        self._success = Counter(
            "fastdecode:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self._prefix_seen = (0, 0)  # (queries, hits) already counted
        self._preemptions_seen = 0

    def observe_output(self, out, tracked, now: float) -> None:
        """One RequestOutput of a tracked request (``tracked``: arrival, last output time, prompt length)."""
        m = len(out.token_ids)
        if not m:
            return
        if tracked.t_last is None:
            self.prompt_tokens.inc(tracked.num_prompt_tokens)
            self.time_to_first_token.observe(now - tracked.t_arrival)
        else:
            latency = (now - tracked.t_last) / m
            for _ in range(m):
                self.inter_token_latency.observe(latency)
        self.generation_tokens.inc(m)
        if out.num_drafted:
            self.spec_decode_num_drafts.inc()
            self.spec_decode_num_draft_tokens.inc(out.num_drafted)
            self.spec_decode_num_accepted_tokens.inc(out.num_accepted)
            for position in range(out.num_accepted):
                self._per_pos.labels(self._model_name, str(position)).inc()
        if out.finished:
            self.e2e_request_latency.observe(now - tracked.t_arrival)

    def observe_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self._model_name, FINISH_REASONS.get(finish_reason or "abort", "abort")).inc()

    def observe_engine(self, engine) -> None:
        self.num_requests_running.set(engine.num_running)
        self.num_requests_waiting.set(engine.num_waiting)
        preemptions = engine.scheduler.num_preemptions
        if preemptions > self._preemptions_seen:
            self.num_preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        cache = engine.kv_cache
        if cache is None:  # not allocated yet (the engine allocates it on the first request)
            self.kv_cache_usage_perc.set(0.0)
            self.kv_cache_bytes.set(0)
            self.kv_cache_used_bytes.set(0)
            return
        pool = cache.pool
        self.kv_cache_usage_perc.set(pool.usage)
        block_bytes = cache.block_bytes()
        self.kv_cache_bytes.set(pool.num_blocks * block_bytes)
        self.kv_cache_used_bytes.set((pool.num_blocks - pool.num_free) * block_bytes)
        # The pool's counters can step back when admission is retried; count only new highs.
        queries, hits = self._prefix_seen
        if pool.prefix_queries_tokens > queries:
            self.prefix_cache_queries.inc(pool.prefix_queries_tokens - queries)
            queries = pool.prefix_queries_tokens
        if pool.prefix_hits_tokens > hits:
            self.prefix_cache_hits.inc(pool.prefix_hits_tokens - hits)
            hits = pool.prefix_hits_tokens
        self._prefix_seen = (queries, hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)
