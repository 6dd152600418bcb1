"""Build any drafter from flat options: the one path the CLI and the benchmark share.

Each drafter declares, where it is defined, how it is built from these options and which of
them it reads (``drafters.base.register_builder``); :meth:`DrafterOptions.build` looks it up
in that registry. The n-gram drafters need nothing but their settings; model drafters also
need the target (layer-skip drafts with its layers; a draft model defaults to the target
itself, which with ``draft_quant`` makes the quantized self-drafter of Zhang & Li,
*Speculative Decoding with Quantized Drafters*).

Importing this module imports ``drafters.model``, so the model drafters' builders are
registered wherever these options are built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fastdecode.drafters import model  # noqa: F401  (registers the model drafters' builders)
from fastdecode.drafters.base import BUILDERS, Drafter, DraftTarget, build_drafter, readers
from fastdecode.errors import ConfigError
from fastdecode.formats import draft_quant_names

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
        given = {
            "draft_model": self.draft_model is not None,
            "draft_quant": self.draft_quant != "none",
            "exit_layer": self.exit_layer is not None,
            "skip_layers": self.skip_layers is not None,
        }
        check_drafter_flags(self.name, [setting for setting, is_given in given.items() if is_given])
        builder = BUILDERS.get(self.name) if self.name in BUILDERS else None
        if builder is not None and builder.check is not None:
            builder.check(self)

    @property
    def needs_target(self) -> bool:
        return self.name in BUILDERS and BUILDERS.get(self.name).needs_target

    @property
    def drafts_with_target(self) -> bool:
        """Whether the drafter drafts with the target's own model (layer-skip; draft-model and hybrid
        without ``draft_model``): its weights, quantized or not, from the target's float weights."""
        return self.needs_target and self.draft_model is None

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
