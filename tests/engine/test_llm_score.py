"""vLLM's ``LLM.score`` on an embedding model: per pair the cosine similarity of the two texts'
embeddings, which here are transformers' final hidden states of each text alone, last token
(SmolLM2, float32: the vectors agree to ~1e-6); one text against many, or pairwise."""
import pytest
import torch

from tests.engine.test_embed import hf_vector

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower stands in Paris."]


def test_score_is_the_cosine_of_transformers_embeddings(smollm2_llm, smollm2_hf):
    llm = smollm2_llm
    body = smollm2_hf.model

    def want(a: str, b: str) -> float:
        va, vb = (hf_vector(body, llm.tokenize(t)) for t in (a, b))
        return float(torch.nn.functional.cosine_similarity(va, vb, dim=0))

    one_to_many = llm.score(QUERY, DOCS)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([want(QUERY, d) for d in DOCS], abs=1e-4)
    assert len({round(o.outputs.score, 4) for o in one_to_many}) == 3   # (the texts are told apart)
    pairwise = llm.score(DOCS, DOCS[::-1])
    assert [o.outputs.score for o in pairwise] == pytest.approx([want(a, b) for a, b in zip(DOCS, DOCS[::-1])],
                                                                abs=1e-4)
    assert pairwise[1].outputs.score == pytest.approx(1.0, abs=1e-5)   # a text against itself
    assert pairwise[0].prompt_token_ids == llm.tokenize(DOCS[0]) + llm.tokenize(DOCS[2])
    with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
        llm.score(DOCS[:2], DOCS)
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
