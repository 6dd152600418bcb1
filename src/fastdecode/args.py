"""``EngineArgs``: every option of the model, its target, the drafter and the batching, declared once.

After vLLM's ``EngineArgs``: a front end adds the options it takes to its parser (:meth:`EngineArgs.add_cli_args`),
reads them back (:meth:`EngineArgs.from_cli_args`) and builds what it needs from them
(:meth:`~EngineArgs.create_target`, :meth:`~EngineArgs.create_engine`). ``generate``, ``serve``, ``demo``, the
benchmarks and ``fastdecode.accelerate`` all go through it; none of them declares one of these flags itself.

Each option is a field with its flag's declaration (:class:`Flag`) in the field's metadata; a field without one
(``max_num_batched_tokens``, ``num_kv_blocks``, ``block_size``, ``enable_prefix_caching``) is an option of the
Python API only. A benchmark that measures several values of an option in one run takes the option's *sweep* form
(:class:`Sweep`): a comma list, or a repeatable flag, under the same name.

Nothing heavy is imported here at module level: ``fastdecode --help`` builds every parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastdecode.errors import ConfigError
from fastdecode.util.commands import draft_tree_arg, int_list, positive_float, positive_int, positive_int_or_off

if TYPE_CHECKING:
    from fastdecode.backends.base import Executor
    from fastdecode.drafters.base import Drafter
    from fastdecode.drafters.factory import DrafterOptions
    from fastdecode.engine import Engine, GenerationConfig


# ---------------------------------------------------------------- how an option reads on the command line


@dataclass(frozen=True)
class Sweep:
    """The form a benchmark takes an option in when it measures several values of it in one run.
    ``help`` may name ``{choices}``; ``action="append"``: a repeatable flag instead of a comma list."""

    help: str
    type: Callable[[str], Any] | None = None  # None: the comma list as text, split by the benchmark
    flag: str | None = None  # None: the option's own flag
    default: Any = None  # None: the option's default
    action: str | None = None


@dataclass(frozen=True)
class Flag:
    """An option's command-line flag: ``--`` and the field name with dashes."""

    help: str
    type: Callable[[str], Any] | None = None
    choices: Callable[[], Sequence[str]] | None = None  # looked up when a parser is built (registries)
    action: Any = None
    metavar: str | None = None
    sweep: Sweep | None = None


def _option(default: Any = None, flag: Flag | None = None, *, factory: Callable[[], Any] | None = None) -> Any:
    metadata = {"flag": flag} if flag is not None else {}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _default_model() -> str:
    from fastdecode.loading import DEFAULT_MODEL

    return DEFAULT_MODEL


def _backends() -> tuple[str, ...]:
    from fastdecode.backends import BACKENDS

    return BACKENDS


def _float_kernels() -> tuple[str, ...]:
    from fastdecode.backends import FLOAT_KERNELS

    return FLOAT_KERNELS


def _kv_cache_dtypes() -> tuple[str, ...]:
    from fastdecode.backends import KV_CACHE_DTYPES

    return KV_CACHE_DTYPES


def _weight_formats() -> tuple[str, ...]:
    from fastdecode.formats import weight_format_names

    return ("auto", *weight_format_names())


def _draft_quants() -> tuple[str, ...]:
    from fastdecode.formats import draft_quant_names

    return draft_quant_names()


def _drafters() -> list[str]:
    from fastdecode.drafters import available_drafters

    return ["none", *available_drafters()]


def _int_csv(text: str) -> list[int]:
    return list(int_list(text))


# ---------------------------------------------------------------- the options

MODEL_OPTIONS = (
    "model",
    "dtype",
    "device",
    "trust_remote_code",
    "backend",
    "weights",
    "float_kernel",
    "kv_cache_dtype",
    "threads",
)
DRAFTER_OPTIONS = (
    "drafter",
    "draft_k",
    "adaptive_k",
    "cost_aware_k",
    "draft_tree",
    "speculation_guard",
    "ngram_n",
    "ngram_min_count",
    "ngram_min_prob",
    "draft_model",
    "draft_quant",
    "exit_layer",
    "skip_layers",
)
BATCHING_OPTIONS = ("max_num_seqs", "kv_cache_gb", "long_prefill_token_threshold", "time_slice_tokens", "kv_policy")
GROUPS = {"model": MODEL_OPTIONS, "drafter": DRAFTER_OPTIONS, "batching": BATCHING_OPTIONS}
# fastdecode.engine.Engine's keyword-only arguments
ENGINE_KEYWORDS = (
    *(name for name in BATCHING_OPTIONS if name != "kv_policy"),  # (a request's option, the engine's default)
    *("max_num_batched_tokens", "num_kv_blocks", "block_size", "enable_prefix_caching"),
)
# Drafter settings whose None means "not given": given with a drafter that does not read them, they are an error.
NGRAM_SETTINGS = ("ngram_n", "ngram_min_count", "ngram_min_prob")


@dataclass
class EngineArgs:
    """What to load, how the target runs it, which drafter drafts, and how requests are batched."""

    # -- the model and its target
    model: str = _option(
        flag=Flag(
            "built-in name, .gguf file, model directory or hub id (default: %(default)s)",
            sweep=Sweep("model spec, repeatable (default: {default_model})", action="append"),
        ),
        factory=_default_model,
    )
    dtype: str = _option(
        "float32",
        Flag(
            "float32 | bfloat16 | float16 (default: %(default)s)",
            sweep=Sweep("dtype(s), comma-separated (default: %(default)s)"),
        ),
    )
    device: str = _option("cpu", Flag("cpu | cuda | cuda:N | auto (default: %(default)s)"))
    trust_remote_code: bool = _option(
        False, Flag("allow a hub model's own Python code to run (off by default)", action="store_true")
    )
    backend: str = _option(
        "auto",
        Flag(
            "native decoder or transformers (default: native where supported)",
            choices=_backends,
            sweep=Sweep(
                "target backend(s), comma-separated: {choices} (default: %(default)s; auto = native where supported)"
            ),
        ),
    )
    weights: str = _option(
        "auto",
        Flag(
            "precision of the target's linear weights (default: auto = gguf, at the size of the file, for a GGUF file "
            "on the native backend, unless the drafter drafts with the target's own model; else float, the model's "
            "dtype); q8_0/q4_0/q4_1: GGUF block formats on integer dot products, gguf: the GGUF file's own blocks",
            choices=_weight_formats,
            sweep=Sweep("target linear weight precision(s), comma-separated: {choices} (default: %(default)s)"),
        ),
    )
    float_kernel: str = _option(
        "auto",
        Flag(
            "native GEMM for float32/int8 weights: fastdecode's row-invariant kernels or torch's (default: rowgemm "
            "where they build)",
            choices=_float_kernels,
            sweep=Sweep(
                "native GEMM(s) for float32/int8 weights, comma-separated: {choices} (default: %(default)s; "
                "auto = rowgemm where it builds)"
            ),
        ),
    )
    kv_cache_dtype: str = _option(
        "auto",
        Flag(
            "what the KV cache holds (native backend; default: the model's dtype): float16 halves it (llama.cpp's "
            "default cache); q8_0 and q4_0 hold ggml's blocks of 32 values with an fp16 scale (0.27x and 0.14x "
            "float32's bytes, so --kv-cache-gb fits more requests); KEYS/VALUES types them apart, as llama.cpp's "
            "-ctk/-ctv",
            choices=_kv_cache_dtypes,
        ),
    )
    threads: int | None = _option(
        None,
        Flag(
            "worker threads of the kernels, fixed (default: the cores free for this process, followed while it "
            "runs: torch's default within its affinity and cgroup CPU quota, less the cores other processes keep "
            "busy - a core counts as free when they use under a quarter of it, measured from /proc/stat)",
            type=positive_int,
            metavar="N",
        ),
    )

    # -- the drafter (fastdecode.drafters.factory.DrafterOptions) and the draft length policy
    drafter: str = _option(
        "none",
        Flag(
            "draft method (default: %(default)s = plain decoding)",
            choices=_drafters,
            sweep=Sweep(
                "comma list; 'none' (the baseline) is always included (default: %(default)s)", flag="--drafters"
            ),
        ),
    )
    draft_k: int = _option(
        7,
        Flag(
            "K: tokens drafted per step (ANPD default 7)",
            type=int,
            sweep=Sweep("K, tokens drafted per step, comma list (default: 7)", type=_int_csv, default=[7]),
        ),
    )
    adaptive_k: bool = _option(
        False, Flag("grow K after full acceptance, shrink after rejection", action=argparse.BooleanOptionalAction)
    )
    cost_aware_k: bool = _option(
        False, Flag("pick K each step from measured verify cost and acceptance (up to 2*K)", action="store_true")
    )
    draft_tree: int | str = _option(
        1,
        Flag(
            "candidate paths verified per step: 1 = one chain (default), N = the chain and up to N-1 alternatives, "
            "auto = up to 3, each only while the measured cost says it pays (native backend)",
            type=draft_tree_arg,
            metavar="auto|N",
        ),
    )
    speculation_guard: bool = _option(
        True,
        Flag(
            "stop a request's drafting while it measures slower than plain decoding, probing again now and then "
            "(default: on; --no-speculation-guard drafts whatever it costs, to measure a drafter itself)",
            action=argparse.BooleanOptionalAction,
        ),
    )
    ngram_n: int | None = _option(
        None,
        Flag(
            "N: longest n-gram order of the ngram and recycling drafters (ANPD default 5)",
            type=int,
            sweep=Sweep("N of the ngram drafter, comma list (default: 5)", type=_int_csv, default=[5]),
        ),
    )
    ngram_min_count: int | None = _option(
        None, Flag("ngram drafter: minimum count for a level's prediction (default 1)", type=int)
    )
    ngram_min_prob: float | None = _option(
        None, Flag("ngram drafter: minimum probability for a level's prediction (default 0)", type=float)
    )
    draft_model: str | None = _option(
        None, Flag("draft-model drafter: the draft model spec (default: the target itself)")
    )
    draft_quant: str = _option(
        "none",
        Flag(
            "quantize the draft model's weights (a quantized drafter)",
            choices=_draft_quants,
            sweep=Sweep(
                "comma list: the draft model's weights (draft-model, hybrid drafters), one config each "
                "({choices}; default: %(default)s)"
            ),
        ),
    )
    exit_layer: int | None = _option(
        None, Flag("layer-skip drafter: draft with the first L layers (default: half)", type=int)
    )
    skip_layers: tuple[int, ...] | None = _option(
        None, Flag("layer-skip drafter: comma-separated layers to skip instead", type=int_list)
    )

    # -- continuous batching and the KV cache (fastdecode.engine.Engine's keywords)
    max_num_seqs: int = _option(
        8,
        Flag(
            "requests decoded at once by continuous batching (native backend; default %(default)s)", type=positive_int
        ),
    )
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int | None = _option(
        None,
        Flag(
            "while other requests decode, a prompt advances at most N tokens a step: lower inter-token latency for "
            "them, a later first token for it (default: generate none, serve 64)",
            type=positive_int,
            metavar="N",
        ),
    )
    time_slice_tokens: int | None = _option(
        None,
        Flag(
            "a request that has generated N tokens since it was admitted yields its running slot to a new request "
            "waiting for one, resuming later with the same tokens (0: never; default: generate 0, serve 32)",
            type=positive_int_or_off,
            metavar="N",
        ),
    )
    kv_cache_gb: float | None = _option(
        None,
        Flag(
            "KV cache budget in GiB, checked against the memory this process can have; a request holds the blocks of "
            "its tokens so far, and when the cache runs out the newest running request waits to resume (default: a "
            "full context per sequence, within 1 GiB and half the memory left)",
            type=positive_float,
        ),
    )
    kv_policy: str = _option(
        "full",
        Flag(
            "what a request's KV cache keeps once full (native backend): full (default; stops at the context length), "
            "sinks[:S[,W]] (StreamingLLM: S sink tokens, default 4, and the W most recent, default the rest of the "
            "context; generation goes on past the context), h2o[:BUDGET[,RECENT[,SINKS[,EVICT]]]] (per layer and "
            "KV head: heavy hitters by mean attention, a recent window and sink tokens; BUDGET the slots kept, a "
            "count or a fraction of the context, default 0.2; RECENT a fraction of it, default 0.5; SINKS default "
            "4; EVICT tokens dropped at a time, default 4). A request may set its own",
            metavar="POLICY",
        ),
    )
    num_kv_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True

    # ------------------------------------------------------------ the command line

    @classmethod
    def add_cli_args(
        cls,
        parser,
        groups: Sequence[str] = ("model", "drafter", "batching"),
        *,
        only: Sequence[str] | None = None,
        sweep: Sequence[str] = (),
        defaults: dict[str, Any] | None = None,
        help_text: dict[str, str] | None = None,
    ):
        """Add the flags of ``groups`` ("model", "drafter", "batching"), or of the options ``only``
        names, in that order, to ``parser`` (a parser or an argument group); returns it.

        ``sweep``: options taken in their sweep form (a benchmark's comma lists); ``defaults``: a
        front end's own defaults; ``help_text``: a front end's own words for what it does with an option.
        """
        names = list(only) if only is not None else [n for g in groups for n in GROUPS[g]]
        flags = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            spec: Flag = flags[name].metadata["flag"]
            kwargs = _flag_kwargs(spec, name in sweep, flags[name])
            if defaults and name in defaults:
                kwargs["default"] = defaults[name]
            if help_text and name in help_text:
                kwargs["help"] = help_text[name]
            flag = spec.sweep.flag if name in sweep and spec.sweep.flag else "--" + name.replace("_", "-")
            parser.add_argument(flag, **kwargs)
        return parser

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values option ``name`` takes (for a front end that checks a comma list of them)."""
        spec = {f.name: f for f in dataclasses.fields(cls)}[name].metadata["flag"]
        return tuple(spec.choices())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineArgs:
        """The options a parsed command line holds (those it has no flag for keep their defaults);
        ``overrides`` set fields directly, e.g. one value of an option a benchmark sweeps."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    # ------------------------------------------------------------ validation

    def drafter_options(self) -> DrafterOptions:
        """The drafter these options describe, checked: one ConfigError for a drafter flag the chosen
        drafter would ignore, or a draft length policy without a drafter."""
        from fastdecode.drafters.factory import DrafterOptions, check_drafter_flags

        given = {name: getattr(self, name) for name in NGRAM_SETTINGS if getattr(self, name) is not None}
        check_drafter_flags(self.drafter, given)
        if self.drafter == "none" and (
            self.adaptive_k or self.cost_aware_k or self.draft_tree != 1 or not self.speculation_guard
        ):
            raise ConfigError(
                "--adaptive-k, --cost-aware-k, --draft-tree and --no-speculation-guard set how a drafter drafts: "
                "choose a --drafter"
            )
        return DrafterOptions(
            name=self.drafter,
            k=self.draft_k,
            draft_model=self.draft_model,
            draft_quant=self.draft_quant,
            exit_layer=self.exit_layer,
            skip_layers=self.skip_layers,
            **given,
        )

    def validate(self) -> None:
        """Raise one ConfigError for options that contradict each other, or ask for more memory
        than this process can have (before anything loads)."""
        from fastdecode.kv.policy import KVPolicy

        self.check_threads()
        self.drafter_options()
        policy = KVPolicy.parse(self.kv_policy)
        if not policy.is_full and self.backend == "hf":
            raise ConfigError(
                f"--kv-policy {self.kv_policy}: the transformers backend keeps the full cache; use native"
            )
        gb = self.kv_cache_gb
        if (
            isinstance(gb, (int, float)) and not isinstance(gb, bool) and 0 < gb < float("inf")
        ):  # (else: Engine's error)
            from fastdecode.util.memory import check_fits

            device = "cuda" if str(self.device).startswith("cuda") else "cpu"
            what = f"--kv-cache-gb {self.kv_cache_gb:g}"
            check_fits(int(self.kv_cache_gb * 2**30), what, "lower --kv-cache-gb", device)

    def clamped(self) -> tuple[EngineArgs, list[str]]:
        """These options with each value beyond what can take effect brought within it, and a note
        for each (a front end prints them): ``threads`` within the CPUs this process may run on,
        ``draft_k`` within one step's row budget (``max_num_batched_tokens``, less the last token's row)."""
        from fastdecode.kernels.threads import affinity_cpus

        changes, notes = {}, []
        cpus = affinity_cpus()
        if isinstance(self.threads, int) and self.threads > cpus:
            changes["threads"] = cpus
            notes.append(f"--threads {self.threads}: this process may run on {cpus} CPUs; using {cpus} threads")
        most = self.max_num_batched_tokens - 1
        if isinstance(self.draft_k, int) and self.draft_k > most:
            changes["draft_k"] = most
            notes.append(
                f"--draft-k {self.draft_k}: a step verifies at most {most} draft tokens ({self.max_num_batched_tokens} "
                f"rows, one for the last token); drafting {most}"
            )
        return dataclasses.replace(self, **changes), notes

    # ------------------------------------------------------------ building

    def generation_config(self, **defaults) -> GenerationConfig:
        """The engine's default request options: the draft length policy here, and ``defaults``
        (``max_new_tokens``, ``sampling``, ``stop``) from the front end."""
        from fastdecode.engine import GenerationConfig

        return GenerationConfig(
            draft_k=self.draft_k,
            adaptive_k=self.adaptive_k,
            cost_aware_k=self.cost_aware_k,
            draft_tree=self.draft_tree,
            speculation_guard=self.speculation_guard,
            kv_policy=self.kv_policy,
            **defaults,
        )

    def target_weights(self) -> str:
        """``weights`` as given; for ``auto``, ``float`` where these options need float weights (``--backend hf``, a drafter
        over the target's own model), else ``auto``: ``make_target`` resolves it on the model (``resolve_weights``)."""
        if self.weights == "auto" and (self.backend == "hf" or self.drafter_options().drafts_with_target):
            return "float"
        return self.weights

    def load_model(self):
        """``(model, tokenizer)`` of ``self.model``."""
        from fastdecode.loading import load_model

        # Low-bit weights are read layer by layer, no float model built; auto: only a GGUF file (load_model's default)
        lazy = {"float": False, "auto": None}.get(self.target_weights(), self.backend != "hf")
        where = dict(dtype=self.dtype, device=self.device, trust_remote_code=self.trust_remote_code)
        return load_model(self.model, **where, lazy=lazy)

    def apply_threads(self) -> int:
        """Size the kernels' thread pool (torch's) to ``threads``, or by default to torch's default within
        the CPUs this process may use (``fastdecode.kernels.threads.apply_threads``); returns the count."""
        from fastdecode.kernels.threads import apply_threads

        self.check_threads()
        return apply_threads(self.threads)

    def check_threads(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be an integer >= 1, got {self.threads!r}")

    def create_target(self, model, tokenizer=None) -> Executor:
        """The target that runs ``model``: backend, weight format, kernels and KV cache dtype (and the
        kernels' thread count, :meth:`apply_threads`); the ``tokenizer`` calibrates a q4_0 cache's keys
        (``backends/kv_calibration.py``)."""
        from fastdecode.backends import make_target

        self.apply_threads()
        weights = self.target_weights()
        return make_target(model, self.backend, weights, self.float_kernel, self.kv_cache_dtype, tokenizer)

    def batching(self) -> dict[str, Any]:
        """The Engine's batching and KV cache keywords."""
        return {name: getattr(self, name) for name in ENGINE_KEYWORDS}

    def create_engine(
        self,
        config: GenerationConfig | None = None,
        *,
        model=None,
        tokenizer=None,
        target: Executor | None = None,
        drafter: Drafter | None = None,
    ) -> Engine:
        """The engine these options describe, its default request options ``config`` (default:
        :meth:`generation_config`). A front end may hand in what it already has: a loaded ``model``
        and ``tokenizer``, a ``target`` to share, a ``drafter`` built its own way.

        The options are checked first, and a drafter that needs only its settings is built (and
        checked) before the model loads; one that drafts with a model is built after it."""
        from fastdecode.engine import Engine

        self.validate()
        options = self.drafter_options()
        if drafter is None and not options.needs_target:
            drafter = options.build()
        if model is None:
            model, tokenizer = self.load_model()
        if drafter is None and options.needs_target:
            drafter = options.build(model, tokenizer, dtype=self.dtype, device=self.device)
        if target is None:
            target = self.create_target(model, tokenizer)
        return Engine(
            model,
            tokenizer,
            drafter=drafter,
            target=target,
            config=config if config is not None else self.generation_config(),
            **self.batching(),
        )


def _flag_kwargs(spec: Flag, as_sweep: bool, f: dataclasses.Field) -> dict[str, Any]:
    """argparse keywords of one option's flag, in its plain or its sweep form."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    choices = tuple(spec.choices()) if spec.choices is not None else None
    if as_sweep:
        s = spec.sweep
        text = s.help.format(choices=", ".join(choices or ()), default_model=_default_model())
        kwargs: dict[str, Any] = {"help": text, "default": s.default if s.default is not None else default}
        if s.action is not None:
            kwargs.update(action=s.action, default=s.default)
        elif s.type is not None:
            kwargs["type"] = s.type
        return kwargs
    kwargs = {"help": spec.help, "default": default}
    if spec.action is not None:
        kwargs["action"] = spec.action
    if spec.type is not None:
        kwargs["type"] = spec.type
    if choices is not None:
        kwargs["choices"] = list(choices)
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    return kwargs


def kernel_notes(engine: Engine) -> list[str]:
    """Why the engine runs a slower path than asked (its target's and its draft model's kernels),
    for a front end to print."""
    notes = [engine.target.kernel_note]
    # a checkpoint made by another tool: which layers run on which kernel, which fell back to float
    notes.append(getattr(getattr(engine.model, "config", None), "fastdecode_checkpoint_note", None))
    # A drafter with a model of its own runs it on an executor of its own (drafters/model.py: ``executor``).
    draft_note = getattr(getattr(engine.drafter, "executor", None), "kernel_note", None)
    notes.append(draft_note and f"draft model: {draft_note.replace('--weights', '--draft-quant')}")
    return [note for note in notes if note]
