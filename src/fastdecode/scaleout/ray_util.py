"""Ray, imported on demand with one clear error when it is missing."""

from __future__ import annotations

from fastdecode.errors import ConfigError

INSTALL_HINT = "pip install 'fastdecode[ray]' (or: pip install 'ray[serve,data]')"


def import_ray(what: str):
    """The ``ray`` module; a ConfigError naming ``what`` needs it and how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{what} needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def prefix_router_class():
    """Ray Serve LLM's PrefixCacheAffinityRouter (a request router for the request-router API).

    Its public alias, ``ray.serve.llm.request_router``, imports ``ray.serve.llm``, which refuses
    to load without vLLM or SGLang; the router itself needs neither, so it is taken from the
    module that defines it when the alias cannot load."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        try:
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
                PrefixCacheAffinityRouter,
            )
        except ImportError:
            raise ConfigError(
                "--routing prefix needs Ray Serve's PrefixCacheAffinityRouter (Ray >= 2.47): pip install -U 'ray[serve]'"
            ) from None
    return PrefixCacheAffinityRouter


def round_robin_router_class():
    """Ray Serve's RoundRobinRouter (``ray.serve.experimental``): each request to the next
    replica in turn, blind to load and prompts, so where a sequence of requests lands is known."""
    try:
        from ray.serve.experimental.round_robin_router import RoundRobinRouter
    except ImportError:
        raise ConfigError(
            "--routing roundrobin needs Ray Serve's RoundRobinRouter (Ray >= 2.60): pip install -U 'ray[serve]'"
        ) from None
    return RoundRobinRouter
