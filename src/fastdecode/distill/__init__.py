"""``fastdecode distill-drafter``: a shallow drafter distilled from a target that has none
(DistillSpec, Zhou et al. 2023). ``command`` runs it end to end (the target's data, training,
saving, and acceptance before and after, judged on held-out prompts), ``model`` builds the
drafter (a few of the target's own decoder layers between copies of its embeddings, final norm
and LM head) and ``train`` holds the settings, the loss and the training loop."""
