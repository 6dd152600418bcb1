"""Build any drafter from flat options: the one path the CLI and the benchmark share.

Each drafter declares, where it is defined, how it is built from these options and which of
them it reads (``drafters.base.register_builder``); :meth:`DrafterOptions.build` looks it up
in that registry. The n-gram drafters need nothing but their settings; model drafters also
need the target (layer-skip drafts with its layers; a draft model defaults to the target
itself, which with ``draft_quant`` makes the quantized self-drafter of Zhang & Li,
*Speculative Decoding with Quantized Drafters*).

The builders of the model drafters (``drafters/model.py``) are registered at the end of this
file for now, in the same shape; they move beside their drafters when that file next changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fastdecode.drafters.base import BUILDERS, Drafter, DraftTarget, build_drafter, readers, register_builder
from fastdecode.errors import ConfigError
from fastdecode.formats import draft_quant_names, weight_format_names

# The flags of the shared settings, checked together: one the chosen drafter does not read is an
# error naming the drafters that read the group's first setting.
FLAG_GROUPS = (
    (("ngram_n",), "--ngram-n is an option of the {readers}, not of {name!r}"),
    (("ngram_min_count",), "--ngram-min-count is an option of the {readers}, not of {name!r}"),
    (("ngram_min_prob",), "--ngram-min-prob is an option of the {readers}, not of {name!r}"),
    (("draft_model", "draft_quant"), "--draft-model/--draft-quant apply to the {readers}, not {name!r}"),
    (("exit_layer", "skip_layers"), "--exit-layer/--skip-layers apply to the {readers}, not {name!r}"),
)


def _the_drafters(names: list[str]) -> str:
    """["ngram"] -> "ngram drafter"; ["a", "b", "c"] -> "a, b and c drafters"."""
    if len(names) == 1:
        return f"{names[0]} drafter"
    return ", ".join(names[:-1]) + " and " + names[-1] + " drafters"


def check_drafter_flags(name: str, given: Iterable[str]) -> None:
    """ConfigError if one of the settings ``given`` (those the user set) is one the ``name``
    drafter does not read."""
    reads = set(BUILDERS.get(name).reads) if name in BUILDERS else set()
    given = set(given)
    for settings, message in FLAG_GROUPS:
        if given & set(settings) and not reads & set(settings):
            raise ConfigError(message.format(readers=_the_drafters(readers(settings[0])), name=name))


@dataclass(frozen=True)
class DrafterOptions:
    name: str = "none"
    k: int = 7  # K; the engine's draft_k should match
    ngram_n: int = 5
    ngram_min_count: int = 1
    ngram_min_prob: float = 0.0
    draft_model: str | None = None  # a load_model spec; None = the target itself
    draft_quant: str = "none"
    exit_layer: int | None = None
    skip_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        quants = draft_quant_names()
        if self.draft_quant not in quants:
            raise ConfigError(f"unknown draft quantization {self.draft_quant!r}; choose one of {', '.join(quants)}")
        given = {"draft_model": self.draft_model is not None, "draft_quant": self.draft_quant != "none",
                 "exit_layer": self.exit_layer is not None, "skip_layers": self.skip_layers is not None}
        check_drafter_flags(self.name, [setting for setting, is_given in given.items() if is_given])
        builder = BUILDERS.get(self.name) if self.name in BUILDERS else None
        if builder is not None and builder.check is not None:
            builder.check(self)

    @property
    def needs_target(self) -> bool:
        return self.name in BUILDERS and BUILDERS.get(self.name).needs_target

    def build(self, target_model=None, target_tokenizer=None, *, dtype="float32", device="cpu") -> Drafter | None:
        """The drafter these options describe (None for plain decoding)."""
        if self.name == "none":
            return None
        if self.name not in BUILDERS:  # registered without a builder (or unknown: the error lists the drafters)
            return build_drafter(self.name)
        builder = BUILDERS.get(self.name)
        if not builder.needs_target:
            return builder.build(self, None)
        if target_model is None:
            raise ConfigError(f"the {self.name} drafter needs the target model")
        return builder.build(self, DraftTarget(target_model, target_tokenizer, dtype, device))


# ---------------------------------------------------------------- the model drafters (drafters/model.py)

def _draft_weights(options: DrafterOptions) -> str:
    """The draft target's weight format: int8/int4 (round-to-nearest, torch-packed) and the GGUF block formats
    run as such; "none" keeps the model's weights, and int4-gptq quantizes the model itself (``_draft_model``)."""
    return options.draft_quant if options.draft_quant in weight_format_names() else "float"


def _draft_model(options: DrafterOptions, target: DraftTarget):
    """(model, tokenizer) the drafter drafts with: the target's own, a private copy, or ``draft_model`` loaded."""
    from fastdecode.backends import native_support
    from fastdecode.loading import load_model

    same = options.draft_model is None
    # RTN int8/int4 on the native path packs its own low-bit copy, so the
    # target's float weights can be shared. GPTQ, or low-bit on the
    # transformers path, rewrites modules in place: that needs a private copy.
    private = options.draft_quant == "int4-gptq" or (
        options.draft_quant in ("int8", "int4") and native_support(target.model) is not None
    )
    if same and not private:
        return target.model, target.tokenizer
    if same:
        import copy

        model, tokenizer = copy.deepcopy(target.model), target.tokenizer
    else:
        model, tokenizer = load_model(options.draft_model, dtype=target.dtype, device=target.device)
    if options.draft_quant == "int4-gptq":
        from fastdecode.quant.api import config_from_method, quantize_

        quantize_(model, config_from_method("int4-gptq"), tokenizer=tokenizer, skip=())
    return model, tokenizer


@register_builder("draft-model", reads=("draft_model", "draft_quant"), needs_target=True)
def _build_draft_model(options: DrafterOptions, target: DraftTarget) -> Drafter:
    model, tokenizer = _draft_model(options, target)
    return build_drafter("draft-model", model=model, tokenizer=tokenizer, k=options.k, weights=_draft_weights(options))


def _check_layer_skip(options: DrafterOptions) -> None:
    if options.draft_model is not None or options.draft_quant not in ("none", "int8", "int4"):
        raise ConfigError("layer-skip drafts with the target's own layers: it takes no --draft-model, and --draft-quant int8|int4 only")


@register_builder("layer-skip", reads=("draft_quant", "exit_layer", "skip_layers"), needs_target=True,
                  check=_check_layer_skip)
def _build_layer_skip(options: DrafterOptions, target: DraftTarget) -> Drafter:
    return build_drafter("layer-skip", model=target.model, exit_layer=options.exit_layer,
                         skip_layers=options.skip_layers, k=options.k, weights=_draft_weights(options))


@register_builder("hybrid", reads=("ngram_n", "draft_model", "draft_quant"), needs_target=True)
def _build_hybrid(options: DrafterOptions, target: DraftTarget) -> Drafter:
    model, tokenizer = _draft_model(options, target)
    return build_drafter("hybrid", model=model, tokenizer=tokenizer, k=options.k, n=options.ngram_n,
                         weights=_draft_weights(options))
