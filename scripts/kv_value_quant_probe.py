"""Probe: what 4-bit values cost beside 4-bit keys (issue 28's q4_0 target), the companion of
``kv_key_quant_probe.py``.

Fake-quantizes the values (and only the values) of SmolLM2-135M's attention in transformers the
way the q4_0 cache keeps them (Hadamard-rotated rows, blocks of 32 with an fp16 scale), through
transformers' attention interface, and scores one window of WikiText-2 test against the float
model: perplexity and mean KL(float || quantized) with its standard error. Variants:

- ``ref``: the cache's rounding today;
- ``mu``: values stored as v - mu, mu the mean value per (layer, KV head) over the calibration
  tokens (exact: attention's weights sum to 1, so sum p (v - mu) + mu = sum p v);
- ``vs``: values stored as v / s, s = rms(v) ** 0.5 per channel (scaled to mean square 1), the
  output multiplied back by s (exact); ``mu+vs``: both; ``ls`` (with any of them): the key probe's
  least-squares block scale instead of ggml's rounding; ``gq``: ggml's blocks rounded with GPTQ's
  error feedback along each row under the Gram matrix of the output projection's columns the KV
  head's query heads feed (``vs+gq``: smoothed too).

    PYTHONPATH=src:scripts python scripts/kv_value_quant_probe.py --tokens 4096
"""

from __future__ import annotations

import argparse

import torch
import transformers.models.llama.modeling_llama as llama
from kv_key_quant_probe import WIKITEXT, gptq_q4_0, ls_q4_0, ref_q4_0, report

from fastdecode.data.corpora import calibration_text
from fastdecode.kernels.kv_formats import hadamard
from fastdecode.loading import load_model


class ValueProbe:
    """transformers' Llama attention with its values fake-quantized (one variant at a time)."""

    def __init__(self, model) -> None:
        self.model, self.layer, self.variant, self.stats = model, 0, None, []
        self.n_layers = model.config.num_hidden_layers
        real = llama.ALL_ATTENTION_FUNCTIONS.get_interface

        def get_interface(name, default):
            return self._wrap(real(name, default))

        llama.ALL_ATTENTION_FUNCTIONS.get_interface = get_interface

    def _wrap(self, attend):
        def attention(module, q, k, v, *args, **kwargs):  # v: [1, KV, T, D]
            layer, self.layer = self.layer, (self.layer + 1) % self.n_layers
            if self.variant == "capture":
                self.stats.append((v[0].mean(1), v[0].pow(2).mean(1).sqrt()))  # [KV, D] each
            elif self.variant is not None:
                mean, rms = (t[None, :, None, :] for t in self.stats[layer])
                mu = mean if "mu" in self.variant else 0
                s = rms.sqrt() / rms.sqrt().pow(2).mean(-1, keepdim=True).sqrt() if "vs" in self.variant else 1
                if "gq" in self.variant:  # error feedback under the output projection's Gram matrix
                    w = module.o_proj.weight.float()  # [hidden, H D]
                    d, kv = v.shape[-1], v.shape[1]
                    heads = w.view(w.shape[0], kv, -1, d)  # [hidden, KV, G, D]
                    gram = torch.einsum("okgd,okge->kde", heads, heads)  # [KV, D, D]
                    scale = (s[0, :, 0] if torch.is_tensor(s) else torch.ones(kv, d)).expand(kv, d)
                    v = hadamard(gptq_q4_0(hadamard((v - mu) / s), gram, scale)) * s + mu
                else:
                    quantize = ls_q4_0 if "ls" in self.variant else ref_q4_0
                    v = hadamard(quantize(hadamard((v - mu) / s))) * s + mu
            return attend(module, q, k, v, *args, **kwargs)

        return attention

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, variant: str | None) -> torch.Tensor:
        self.layer, self.variant = 0, variant
        return torch.log_softmax(self.model(ids).logits[0, :-1].float(), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="WikiText-2 test tokens scored (one window)")
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--variants", default="ref,mu,vs,mu+vs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")[:2]
    probe = ValueProbe(model.float().eval())
    probe.logprobs(tokenizer(calibration_text(), return_tensors="pt").input_ids[:, : args.calib_tokens], "capture")
    with open(WIKITEXT) as fh:
        ids = tokenizer(fh.read(), return_tensors="pt").input_ids[:, : args.tokens]
    report(probe.logprobs, ids, args.variants.split(","), top1=False)


if __name__ == "__main__":
    main()
