"""A transformers causal LM as a target, with a DynamicCache rolled back by crop.

It is one sequence (``SequenceModel``) and adapts to the engine's batched contract as an
executor that runs one sequence at a time (``batched`` False): a forward over one entry
resets, rolls back or extends its own cache, and the paged cache the engine is given only
keeps the block books."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.architectures import context_length_of
from fastdecode.backends.base import BatchEntry, Executor, SequenceModel
from fastdecode.errors import IncompatibleDrafterError


class HFTarget(Executor, SequenceModel):
    name = "hf"
    weights = "float"
    batched = False

    def __init__(self, model) -> None:
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = model.get_output_embeddings().out_features
        self.context_length = context_length_of(config)
        self.device = next(model.parameters()).device
        self._cache = None
        self.reset()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams: all but the input embedding
        (of which one row is read), counting a tied LM head once."""
        from fastdecode.quant.api import model_weight_bytes

        total = model_weight_bytes(self.model)
        for module in self.model.modules():  # RoPE frequency tables are buffers, not weights
            if type(module).__name__.endswith("RotaryEmbedding"):
                total -= sum(b.numel() * b.element_size() for b in module.buffers())
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings()
        tied = getattr(head, "weight", None) is not None and head.weight.data_ptr() == embed.data_ptr()
        return total if tied else total - embed.numel() * embed.element_size()

    def kv_block_bytes(self, block_size: int) -> int:
        return 0  # its cache is its own DynamicCache; the engine's block pool only keeps the books

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        from fastdecode.kv.cache import BlockPool, PagedKVCache

        return PagedKVCache(BlockPool(num_blocks, block_size, False), [], [])

    def forward_batch(self, cache, entries: Sequence[BatchEntry]) -> torch.Tensor:
        (e,) = entries  # one sequence at a time: the engine runs one request (``batched`` False)
        if e.start == 0:
            self.reset()
        elif self.cache_len < e.start:
            raise RuntimeError("the single-sequence target lost its cache")
        self.truncate(e.start)
        return self.forward(list(e.token_ids), e.num_logits)

    def release(self) -> None:
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        # No config: every layer keeps all positions, so a crop restores the
        # cache exactly even for sliding-window models (whose attention masks
        # still apply the window); a window-trimmed cache could not roll back.
        self._cache = DynamicCache()

    @property
    def cache_len(self) -> int:
        return self._cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        ids = torch.as_tensor([list(token_ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=self._cache, use_cache=True, logits_to_keep=num_logits)
        return out.logits[0, -num_logits:].float()

    def truncate(self, length: int) -> None:
        excess = self.cache_len - length
        if excess > 0:
            if not self._cache.is_croppable:
                raise IncompatibleDrafterError(
                    "this model's KV cache cannot be rolled back, so it cannot verify drafts; use --drafter none"
                )
            # negative = "remove this many": the one meaning crop has in every transformers version
            self._cache.crop(-excess)
