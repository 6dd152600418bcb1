"""The ``serve`` command's replica flags (``--replicas N`` runs the server on Ray Serve).

Only argparse here: the parser is built for every command, and Ray loads only when asked for.
"""

from __future__ import annotations

import argparse

from fastdecode.errors import ConfigError
from fastdecode.util.commands import bounded, positive_int

_cpus = bounded(float, "a number > 0", low=0, low_open=True)
_gpus = bounded(float, "a number >= 0", low=0)


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (Ray Serve; pip install 'fastdecode[ray]')")
    g.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="serve N engine replicas behind Ray Serve's router (default: one engine, no Ray)",
    )
    g.add_argument("--min-replicas", type=positive_int, default=None, help="autoscaling: fewest replicas (default 1)")
    g.add_argument(
        "--max-replicas", type=positive_int, default=None, help="autoscaling: most replicas (setting it turns it on)"
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=_cpus,
        default=2.0,
        help="autoscaling: requests per replica Ray Serve aims at (default %(default)s)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=positive_int,
        default=16,
        help="requests one replica holds at once, running or waiting in its engine (default %(default)s)",
    )
    g.add_argument("--replica-cpus", type=_cpus, default=1.0, help="CPUs per replica (default %(default)s)")
    g.add_argument("--replica-gpus", type=_gpus, default=0.0, help="GPUs per replica (default %(default)s)")
    g.add_argument(
        "--routing",
        choices=("pow2", "prefix", "roundrobin"),
        default="pow2",
        help="pow2: Ray Serve's power of two choices; prefix: its PrefixCacheAffinityRouter, which sends a prompt "
        "to the replica that saw its prefix, where the prefix cache holds it; roundrobin: its RoundRobinRouter, "
        "each request to the next replica in turn (default %(default)s)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="a Ray cluster to join (ray.init address, e.g. 'auto'; default: start Ray on this machine)",
    )


def wants_replicas(args: argparse.Namespace) -> bool:
    """Whether the command line asks for Ray Serve; a replica flag without --replicas/--max-replicas is an error."""
    if args.replicas is not None or args.max_replicas is not None:
        if args.replicas is not None and args.max_replicas is not None:
            raise ConfigError("--replicas fixes the replica count; --max-replicas autoscales: give one of them")
        if args.min_replicas is not None and args.max_replicas is None:
            raise ConfigError("--min-replicas sets autoscaling's floor: give --max-replicas too")
        if args.min_replicas is not None and args.min_replicas > args.max_replicas:
            raise ConfigError("--min-replicas is above --max-replicas")
        return True
    given = [
        flag
        for flag, value, default in (
            ("--min-replicas", args.min_replicas, None),
            ("--routing", args.routing, "pow2"),
            ("--replica-cpus", args.replica_cpus, 1.0),
            ("--replica-gpus", args.replica_gpus, 0.0),
            ("--ray-address", args.ray_address, None),
        )
        if value != default
    ]
    if given:
        raise ConfigError(f"{', '.join(given)} set(s) how replicas run: give --replicas N (or --max-replicas)")
    return False


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batch jobs (Ray Data; pip install 'fastdecode[ray]')")
    g.add_argument(
        "--ray",
        action="store_true",
        help="run --prompts-file as a Ray Data job over --workers engines, writing --out (resumable: a rerun "
        "skips the ids already in it)",
    )
    g.add_argument("--out", default=None, help="with --ray: the JSON-lines file of results, one per input id")
    g.add_argument("--workers", type=positive_int, default=2, help="with --ray: engine actors (default %(default)s)")
    g.add_argument("--worker-cpus", type=_cpus, default=1.0, help="with --ray: CPUs per worker (default %(default)s)")
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        help="with --ray: prompts a worker decodes together; a lost worker's batch runs again (default %(default)s)",
    )
    g.add_argument("--ray-address", default=None, help="with --ray: a Ray cluster to join (default: start Ray here)")


def wants_batch(args: argparse.Namespace) -> bool:
    """Whether ``generate`` runs as a Ray Data job; one ConfigError for a half-given job."""
    if not args.ray:
        if args.out is not None:
            raise ConfigError("--out is where a --ray batch job writes: give --ray (without it, results go to stdout)")
        return False
    if args.prompts_file is None or args.out is None:
        raise ConfigError("--ray runs a batch job: give --prompts-file IN.jsonl and --out OUT.jsonl")
    return True
