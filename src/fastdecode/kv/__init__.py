"""The KV cache above its kernels: ``cache`` (the block pool, block tables, prefix sharing,
``PagedKVCache`` - the pool's K and V tensors beside its books - and ``BatchEntry``, one
sequence's rows of a pass placed on its blocks), ``calibration`` (the key affine of a q4_0 cache,
fitted once per target on the shipped calibration text), ``attention`` (what a policy asks of the
backend: H2O's attention per layer and KV head, and keys re-rotated when they move) and
``policy`` (what a request's cache keeps once full: full, sinks, H2O). The rows' formats and the
C that reads and writes them are the kernels' (``kernels/kv_formats.py``, ``kv.c``); perplexity
under each policy is measured in ``evaluation/kv_policies.py``. The backends use every module
here but ``policy``, which only the engine and the front ends read."""
