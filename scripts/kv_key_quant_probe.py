"""Probe: what 4-bit keys cost, and what a better key quantizer would buy (issue 28's q4_0 target).

Fake-quantizes the keys (and only the keys) of SmolLM2-135M's attention in transformers, after
RoPE, the way the q4_0 cache keeps them (Hadamard-rotated rows, blocks of 32 with an fp16 scale,
``fastdecode.kernels.kv_formats``), and scores one window of WikiText-2 test against the float
model: perplexity, mean KL(float || quantized) with its standard error, top-1 agreement. KL is
the figure to read: a change of ~1% in a 1,024-token perplexity is within what one rounding
draw moves it, KL's standard error is ~6% of its mean.

Variants (``--variants``, any of):

- ``ref``: ggml's reference rounding (d = max / -8), what the cache writes today;
- ``ls``: a scale searched per block for least squared error (llama.cpp's ``make_qx_quants``:
  19 inverse scales -(8 + 0.1 i) / max, levels rounded, each refit by least squares,
  d = sum(x q) / sum(q q), the best kept);
- ``ip``: ggml's levels with the scale that keeps each block's inner product with itself,
  d = sum(x x) / sum(x q) (ScaNN's parallel error, zeroed);
- ``mu``: keys stored as k - mu, mu the mean post-RoPE key per (layer, KV head) over the first
  ``--calib-tokens`` tokens of the shipped calibration text (softmax is invariant to adding one
  constant to a query's scores, so attention is unchanged in exact arithmetic);
- ``ls+mu``, ``ip+mu``: both;
- ``sa``: keys stored as k / s and queries taken as q * s, s per (layer, KV head, channel)
  = (rms(k) / rms(q)) ** 0.5 over the calibration tokens (QServe's SmoothAttention, alpha = 0.5,
  here on post-RoPE channels; q.k is unchanged in exact arithmetic): the channels where keys
  are large against their queries get a finer grid; ``sa+mu`` centers first, then scales;
  ``sals``: ``sa`` with ``ls``'s rounding;
- ``pmu``: keys stored as k - R(p) m, m the mean key before RoPE, turned to each key's own
  position p (``sa+pmu``: smoothed too);
- ``gq`` (``sagq``): ggml's blocks rounded with GPTQ's error feedback along each row, fitted to the
  queries' second moment over the calibration tokens (what the q4_0 cache does since session 17);
- ``sax4`` (any N): ``sa`` with the first N positions' keys left unrounded (IntactKV's sinks);
- a suffix ``+vc``: each score less half its rounding variance (sum over blocks of d^2 / 12 times
  the query's squared block): the expected exp(score) of the float key;
- a suffix ``~N``: another rounding draw of the same variant (random signs before the rotation,
  seed N): a one-window perplexity moves ~1% between draws, KL by ~10%.

    PYTHONPATH=src python scripts/kv_key_quant_probe.py --tokens 1024
    PYTHONPATH=src python scripts/kv_key_quant_probe.py --tokens 4096 --calib-tokens 4096 --variants ref,mu,sa,sa+mu
    PYTHONPATH=src python scripts/kv_key_quant_probe.py --tokens 4096 --calib-tokens 4096 --variants sa+mu~1,sagq+mu~1,gq+mu~1
"""

from __future__ import annotations

import argparse
import math

import torch
import transformers.models.llama.modeling_llama as llama

from fastdecode.data.corpora import calibration_text
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.kernels.kv_formats import hadamard
from fastdecode.loading import load_model

WIKITEXT = "src/fastdecode/data/wikitext-2-raw/wiki.test.raw"


def ref_q4_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] through ggml's q4_0 (the cache's bytes) and back."""
    flat = x.reshape(-1, x.shape[-1])
    return BlockTensor.quantize(flat, "q4_0").dequantize().view(x.shape)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = x.reshape(*x.shape[:-1], -1, 32)
    return b, b.gather(-1, b.abs().argmax(-1, keepdim=True))  # the blocks, each one's signed extreme


def ls_q4_0(x: torch.Tensor) -> torch.Tensor:
    """make_qx_quants' search: the candidate levels whose least-squares scale leaves the least error."""
    b, mx = _blocks(x)
    best_err, best = None, None
    for i in range(-9, 10):
        levels = torch.clamp(torch.round(b * (-(8 + 0.1 * i) / mx)), -8, 7)
        d = ((b * levels).sum(-1, keepdim=True) / (levels * levels).sum(-1, keepdim=True)).half().float()
        err = ((b - d * levels) ** 2).sum(-1, keepdim=True)
        if best is None:
            best_err, best = err, d * levels
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, d * levels, best)
    return best.reshape(x.shape)


def ip_q4_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's levels, the scale that keeps sum(x x) = sum(x d q) per block."""
    b, mx = _blocks(x)
    d = mx / -8
    levels = torch.clamp(torch.floor(b / torch.where(d == 0, torch.ones_like(d), d) + 8.5), 0, 15) - 8
    xq = (b * levels).sum(-1, keepdim=True)
    d = torch.where(xq == 0, d, (b * b).sum(-1, keepdim=True) / torch.where(xq == 0, torch.ones_like(xq), xq))
    return (levels * d.half().float()).reshape(x.shape)


def gptq_q4_0(x: torch.Tensor, qq: torch.Tensor, scale: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """x [1, KV, T, D] (rotated rows) through q4_0 blocks, each element rounded in turn and its error
    spread over the row's later elements (GPTQ) to minimize e^T C e, C = the queries' second moment
    in x's domain: H diag(scale) qq diag(scale) H. qq [KV, D, D], scale [KV, D]."""
    kv, d = qq.shape[0], qq.shape[-1]
    h = hadamard(torch.eye(d))
    out = torch.empty_like(x)
    for head in range(kv):
        c = h @ (scale[head][:, None] * qq[head] * scale[head][None, :]) @ h
        c = c + damp * c.diagonal().mean() * torch.eye(d)
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(c.double())), upper=True).float()
        w = x[0, head].clone()  # [T, D]
        for j in range(d):
            if j % 32 == 0:
                blk = w[:, j : j + 32]
                mx = blk.gather(-1, blk.abs().argmax(-1, keepdim=True))
                dd = (mx / -8).half().float()
                inv = torch.where(dd == 0, torch.zeros_like(dd), 1 / dd)
            level = torch.clamp(torch.floor(w[:, j : j + 1] * inv + 8.5), 0, 15) - 8
            qv = level * dd
            err = (w[:, j : j + 1] - qv) / u[j, j]
            w[:, j + 1 :] -= err * u[j, j + 1 :][None]
            out[0, head, :, j : j + 1] = qv
    return out


QUANTIZERS = {"ref": ref_q4_0, "ls": ls_q4_0, "ip": ip_q4_0}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class KeyProbe:
    """transformers' Llama attention with its post-RoPE keys fake-quantized (one variant at a time)."""

    def __init__(self, model) -> None:
        self.model, self.layer, self.variant, self.mu, self.smooth = model, 0, None, None, None
        self.n_layers = model.config.num_hidden_layers
        self._rope = llama.apply_rotary_pos_emb
        llama.apply_rotary_pos_emb = self._rope_and_quantize
        self.captured: list[torch.Tensor] = []

    def _rope_and_quantize(self, q, k, cos, sin, *args, **kwargs):
        q, k = self._rope(q, k, cos, sin, *args, **kwargs)  # k: [1, KV, T, D]
        layer, self.layer = self.layer, (self.layer + 1) % self.n_layers
        if self.variant == "capture":
            kv = k.shape[1]
            grouped = q[0].reshape(kv, -1, q.shape[-1])  # a KV head's query heads' rows, [KV, G * T, D]
            pre = k[0] * cos[0][None] - _rotate_half(k[0]) * sin[0][None]  # the keys before RoPE
            second = grouped.transpose(1, 2) @ grouped / grouped.shape[1]  # [KV, D, D]: E q q^T
            self.captured.append(
                (k[0].mean(1), k[0].pow(2).mean(1).sqrt(), grouped.pow(2).mean(1).sqrt(), pre.mean(1), second)
            )
        elif self.variant is not None:
            variant, _, seed = self.variant.partition("~")  # ``sa+mu~3``: another rounding draw (random signs)
            signs = 1
            if seed:
                g = torch.Generator().manual_seed(int(seed))
                signs = torch.randint(0, 2, (k.shape[-1],), generator=g).float() * 2 - 1
            variant, vc = variant.removesuffix("+vc"), variant.endswith("+vc")
            name, _, centered = ("ref+" + variant if variant in ("mu", "pmu") else variant).partition("+")
            mu = self.mu[layer][None, :, None, :] if centered == "mu" else 0
            if centered == "pmu":  # R(p) m: the pre-RoPE mean turned to each key's own position
                m = self.m_pre[layer][None, :, None, :]
                mu = m * cos[:, None] + _rotate_half(m) * sin[:, None]
            smooth, name = name.startswith("sa"), (name.removeprefix("sa") or "ref")
            s = self.smooth[layer][None, :, None, :] if smooth else 1  # the query's side: q * s
            rotated = hadamard((k - mu) / s * signs)
            exact = int(name.partition("x")[2] or 0)  # ``sax4+mu``: the first 4 positions' keys unrounded
            name = name.partition("x")[0] or "ref"
            if name == "gq":  # error feedback along the row under the queries' second moment
                scale = (s * signs)[0, :, 0] if torch.is_tensor(s) else torch.ones(k.shape[1], k.shape[-1]) * signs
                quantized = hadamard(gptq_q4_0(rotated, self.qq[layer], scale)) * signs * s + mu
            else:
                quantized = hadamard(QUANTIZERS[name](rotated)) * signs * s + mu
            k = torch.cat([k[:, :, :exact], quantized[:, :, exact:]], 2)
            if vc:  # each score less half its rounding variance: E exp(score) as the float key's
                mx = _blocks(rotated)[1]
                d2 = (mx / -8).half().float().pow(2)[..., 0]  # [1, KV, T, D / 32]
                grp = q.shape[1] // k.shape[1]
                sq = s.repeat_interleave(grp, 1) if torch.is_tensor(s) else 1
                qb = _blocks(hadamard(q * sq))[0].pow(2).sum(-1)  # [1, H, T, D / 32]
                scaling = q.shape[-1] ** -0.5
                q = torch.cat([q, -0.5 * scaling * qb / 12], -1)
                k = torch.cat([k, d2], -1)
        return q, k

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, variant: str | None) -> torch.Tensor:
        self.layer, self.variant = 0, variant
        return torch.log_softmax(self.model(ids).logits[0, :-1].float(), -1)  # [T - 1, vocab]

    def calibrate(self, ids: torch.Tensor) -> None:
        """mu [layers, KV, D]: the mean post-RoPE key over ``ids`` (positions 0 .. len - 1); smooth
        [layers, KV, D]: SmoothAttention's s = (rms k / rms q) ** 0.5, scaled to mean square 1."""
        self.captured = []
        self.logprobs(ids, "capture")
        self.mu = torch.stack([c[0] for c in self.captured])
        self.m_pre = torch.stack([c[3] for c in self.captured])
        self.qq = torch.stack([c[4] for c in self.captured])  # [layers, KV, D, D]
        s = torch.stack([(c[1] / c[2]).sqrt() for c in self.captured])
        self.smooth = s / s.pow(2).mean(-1, keepdim=True).sqrt()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="WikiText-2 test tokens scored (one window)")
    parser.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens for mu")
    parser.add_argument("--variants", default="ref,ls,ip,mu,ls+mu,ip+mu,sa,sa+mu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m")[:2]
    model = model.float().eval()
    probe = KeyProbe(model)
    with open(WIKITEXT) as fh:
        ids = tokenizer(fh.read(), return_tensors="pt").input_ids[:, : args.tokens]
    probe.calibrate(tokenizer(calibration_text(), return_tensors="pt").input_ids[:, : args.calib_tokens])
    report(probe.logprobs, ids, args.variants.split(","))


def report(logprobs, ids: torch.Tensor, variants, top1: bool = True) -> None:
    """Print float32's perplexity over ``ids``, then each variant's, its KL(float || variant) with the
    standard error, and (``top1``) its top-1 agreement. ``logprobs(ids, variant)``: [T - 1, vocab]."""
    ref = logprobs(ids, None)
    target = ids[0, 1:]
    base = math.exp(-ref.gather(-1, target[:, None]).mean().item())
    print(f"{'float32':8s} perplexity {base:.3f}")
    for variant in variants:
        lp = logprobs(ids, variant)
        ppl = math.exp(-lp.gather(-1, target[:, None]).mean().item())
        kl = (ref.exp() * (ref - lp)).sum(-1)  # [T - 1]
        agree = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(
            f"{variant:8s} perplexity {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)  "
            f"KL {kl.mean().item():.5f} +- {kl.std().item() / math.sqrt(kl.numel()):.5f}"
            + (f"  top-1 {agree:.4f}" if top1 else "")
        )


if __name__ == "__main__":
    main()
