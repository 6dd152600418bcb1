"""Decoding options on the embedded SmolLM2-135M: a JSON schema through its real BPE
vocabulary (llguidance's view of a Hugging Face tokenizer), speculative == plain; prompt
log-probabilities equal transformers' own forward; the CLI's --json-schema."""

from __future__ import annotations

import json

import pytest
import torch

from fastdecode import Engine, GrammarSpec, build_drafter
from fastdecode.cli import main

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPT = "Describe a person called Ada, aged 36, who has a cat, as JSON."


def test_json_schema_on_a_real_vocabulary_is_lossless(smollm2):
    model, tokenizer = smollm2
    grammar = GrammarSpec.json_schema(SCHEMA)
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram", k=5))
    options = dict(max_new_tokens=48, grammar=grammar, frequency_penalty=0.2)
    plain = engine.generate(PROMPT, speculate=False, **options)
    spec = engine.generate(PROMPT, **options)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "eos"
    jsonschema.validate(json.loads(spec.text), SCHEMA)
    assert spec.acceptance.accepted_tokens > 0  # drafts survived the grammar's cut


def test_prompt_logprobs_equal_transformers(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is Paris, and the capital of Spain is Madrid.")["input_ids"]
    result = Engine(model, tokenizer).generate(ids, max_new_tokens=1, prompt_logprobs=1)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert [e.logprob for e in result.prompt_logprobs[1:]] == pytest.approx(expected, abs=1e-4)


def test_cli_json_schema(capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    args = ["generate", "--prompt", PROMPT, "--max-new-tokens", "48", "--json-schema", str(path), "--json"]
    assert main([*args, "--drafter", "ngram"]) == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
