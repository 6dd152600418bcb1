"""Past one engine: replicas on Ray Serve and batch jobs on Ray Data (``pip install 'fastdecode[ray]'``).

* ``options`` - the ``serve --replicas`` flags (argparse only: every command builds the parser);
* ``ray_util`` - importing Ray with one clear error, the prefix-cache-affinity router class;
* ``forward`` - an HTTP request carried to a replica as a Python object, and the replica's
  FastAPI app run on it;
* ``routers`` - the request routers of ``serve --routing`` (Ray Serve's, with a patient probe);
* ``serve`` - the Ray Serve application: an ingress deployment and the engine replicas;
* ``cpu_cost`` - a benchmark command: CPU seconds per generated token over a server's processes;
* ``batch`` - ``generate --prompts-file --ray``: Ray Data ``map_batches`` over engine actors,
  resumable, each input id written exactly once.

Nothing here is imported by the rest of the package but the ``serve`` and ``generate``
commands, inside the functions that need Ray.
"""
