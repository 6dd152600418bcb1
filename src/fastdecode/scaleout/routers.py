"""The request routers of ``serve --routing``: Ray Serve's own, with a longer queue-length probe.

Before it sends a request, Ray Serve's router asks its chosen replica (or replicas) for its
queue length, unless a fresh answer is cached, and passes over a replica that has not answered
within ``queue_len_response_deadline_s`` (0.1 s by default), taking its next choice. A
fastdecode replica answers on an event loop that shares the GIL with its engine thread; on a
busy machine (two cores, a forward pass in flight, other processes) 0.1 s can be missed, and
then the prefix-affinity router sends a prompt to the replica without its prefix and round
robin skips a turn (read from Ray Serve's source; the likely cause of the prefix test's
failures in CI, whose logs did not say). The routers here wait 2 s (growing to 10 s after
repeated misses, as Ray Serve's own deadline grows), which still passes over a replica that is
truly stuck. The class attribute is the request-router API's own knob.

Each class is named by its import path in the deployment's ``RequestRouterConfig``, so the
ingress replica imports this module.
"""

from __future__ import annotations

# The default router's class: Ray Serve names it by this path (DEFAULT_REQUEST_ROUTER_PATH)
# and exports it nowhere else.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from fastdecode.scaleout.ray_util import prefix_router_class, round_robin_router_class

PROBE_DEADLINE_S = 2.0
MAX_PROBE_DEADLINE_S = 10.0


class Pow2Router(PowerOfTwoChoicesRequestRouter):
    """Power of two choices: of two replicas drawn at random, the one with the shorter queue."""

    queue_len_response_deadline_s = PROBE_DEADLINE_S
    max_queue_len_response_deadline_s = MAX_PROBE_DEADLINE_S


class RoundRobinRouter(round_robin_router_class()):
    """Each request to the next replica in turn (blind to load and prompts)."""

    queue_len_response_deadline_s = PROBE_DEADLINE_S
    max_queue_len_response_deadline_s = MAX_PROBE_DEADLINE_S


class PrefixAffinityRouter(prefix_router_class()):
    """Ray Serve LLM's PrefixCacheAffinityRouter: a prompt to the replica that saw its longest prefix."""

    queue_len_response_deadline_s = PROBE_DEADLINE_S
    max_queue_len_response_deadline_s = MAX_PROBE_DEADLINE_S


ROUTERS = {"pow2": Pow2Router, "roundrobin": RoundRobinRouter, "prefix": PrefixAffinityRouter}
