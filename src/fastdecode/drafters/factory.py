"""Build any drafter from flat options: the one path the CLI and the benchmark share.

The n-gram drafters need nothing but their settings; model drafters also need
the target (layer-skip drafts with its layers; a draft model defaults to the
target itself, which with ``draft_quant`` makes the quantized self-drafter of
Zhang & Li, *Speculative Decoding with Quantized Drafters*).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.drafters.base import Drafter, build_drafter
from fastdecode.errors import ConfigError

MODEL_DRAFTERS = ("draft-model", "layer-skip", "hybrid")
# int8 / int4: torch-packed round-to-nearest; int4-gptq: GPTQ; the GGUF block formats (q8_0, q4_0,
# q4_1, or gguf: a GGUF file's own blocks) on the native decoder's integer dot products.
BLOCK_QUANTS = ("q8_0", "q4_0", "q4_1", "gguf")
DRAFT_QUANTS = ("none", "int8", "int4", "int4-gptq", *BLOCK_QUANTS)


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
        if self.draft_quant not in DRAFT_QUANTS:
            raise ConfigError(f"unknown draft quantization {self.draft_quant!r}; choose one of {', '.join(DRAFT_QUANTS)}")
        if self.name not in MODEL_DRAFTERS and (self.draft_model is not None or self.draft_quant != "none"):
            raise ConfigError(f"--draft-model/--draft-quant apply to the draft-model and hybrid drafters, not {self.name!r}")
        if self.name == "layer-skip" and (self.draft_model is not None or self.draft_quant not in ("none", "int8", "int4")):
            raise ConfigError("layer-skip drafts with the target's own layers: it takes no --draft-model, and --draft-quant int8|int4 only")
        if self.name != "layer-skip" and (self.exit_layer is not None or self.skip_layers is not None):
            raise ConfigError(f"--exit-layer/--skip-layers apply to the layer-skip drafter, not {self.name!r}")

    @property
    def needs_target(self) -> bool:
        return self.name in MODEL_DRAFTERS

    def build(self, target_model=None, target_tokenizer=None, *, dtype="float32", device="cpu") -> Drafter | None:
        """The drafter these options describe (None for plain decoding)."""
        if self.name == "none":
            return None
        if self.name == "ngram":
            return build_drafter("ngram", n=self.ngram_n, k=self.k, min_count=self.ngram_min_count, min_prob=self.ngram_min_prob)
        if self.name == "prompt-lookup":
            return build_drafter("prompt-lookup", k=self.k)
        if self.name == "suffix":
            return build_drafter("suffix", k=self.k)
        if self.name == "recycling":
            return build_drafter("recycling", k=self.k, n=self.ngram_n)
        if not self.needs_target:
            return build_drafter(self.name)
        if target_model is None:
            raise ConfigError(f"the {self.name} drafter needs the target model")
        weights = self.draft_quant if self.draft_quant in ("int8", "int4", *BLOCK_QUANTS) else "float"
        if self.name == "layer-skip":
            return build_drafter(
                "layer-skip", model=target_model, exit_layer=self.exit_layer,
                skip_layers=self.skip_layers, k=self.k, weights=weights,
            )
        model, tokenizer = self._draft_model(target_model, target_tokenizer, dtype, device)
        if self.name == "hybrid":
            return build_drafter("hybrid", model=model, tokenizer=tokenizer, k=self.k, n=self.ngram_n, weights=weights)
        return build_drafter("draft-model", model=model, tokenizer=tokenizer, k=self.k, weights=weights)

    def _draft_model(self, target_model, target_tokenizer, dtype, device):
        from fastdecode.backends import native_support
        from fastdecode.loading import load_model

        same = self.draft_model is None
        # RTN int8/int4 on the native path packs its own low-bit copy, so the
        # target's float weights can be shared. GPTQ, or low-bit on the
        # transformers path, rewrites modules in place: that needs a private copy.
        private = self.draft_quant == "int4-gptq" or (
            self.draft_quant in ("int8", "int4") and native_support(target_model) is not None
        )
        if same and not private:
            return target_model, target_tokenizer
        if same:
            import copy

            model, tokenizer = copy.deepcopy(target_model), target_tokenizer
        else:
            model, tokenizer = load_model(self.draft_model, dtype=dtype, device=device)
        if self.draft_quant == "int4-gptq":
            from fastdecode.quant.api import config_from_method, quantize_

            quantize_(model, config_from_method("int4-gptq"), tokenizer=tokenizer, skip=())
        return model, tokenizer
