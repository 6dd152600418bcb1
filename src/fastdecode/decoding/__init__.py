"""The pure pieces of decoding the engine puts together, each a function of tokens and logits
that holds no model: ``verify`` (accept or reject a draft: greedy and speculative sampling),
``sampling`` (``SamplingParams`` and one row's draw), ``logits_process`` (penalties,
``logit_bias``, ``min_tokens``, a grammar's mask, applied per row with that row's history),
``structured`` (a grammar and one request's parser state over llguidance), ``tokenization``
(prompt to token ids, the chat template), ``detokenize`` (token ids to text, incrementally, and
stop strings) and ``metrics`` (acceptance statistics and a generation's result). They import
nothing of fastdecode but its errors."""
