"""How good the numbers fastdecode computes are, as commands that print figures: ``quality``
(``fastdecode eval``: perplexity, agreement and KL of the numeric model fastdecode runs against
the float one, over sliding windows of the evaluation text) and ``kv_policies`` (perplexity
under each KV policy over a text several times the window, StreamingLLM's evaluation;
``python -m fastdecode.evaluation.kv_policies``)."""
