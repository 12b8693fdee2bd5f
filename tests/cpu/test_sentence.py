"""sentence-transformers as a real client: all-MiniLM-L6-v2 (real weights) loaded from its
package's folder, its transformer replaced by opfuse.sentence.optimize in one line, then
encode() on real sentences of varying lengths and batch sizes: embeddings equal the
unoptimized model's, one dynamic plan, no re-plan."""

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer  # noqa: E402

import opfuse.sentence  # noqa: E402
from opfuse.models import SENTENCES, minilm_dir, package_sentences  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    ref = SentenceTransformer(str(minilm_dir()), device="cpu")
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    fused = opfuse.sentence.optimize(st, SENTENCES)
    return ref, st, fused


def test_package_sentences_are_real_and_varied():
    sents = package_sentences(60)
    assert len(sents) == 60 and len(set(sents)) == 60
    lengths = sorted(len(s.split()) for s in sents)
    assert lengths[0] >= 4 and lengths[-1] > 3 * lengths[0]


@pytest.mark.parametrize("batch_size", [8, 5])
def test_encode_equal_and_one_plan(pair, batch_size):
    ref, st, fused = pair
    sents = package_sentences(40) + ["Short.", "A sentence of a few words."]
    a = ref.encode(sents, batch_size=batch_size, convert_to_tensor=True)
    b = st.encode(sents, batch_size=batch_size, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(a, b)
    assert a.shape == b.shape == (len(sents), 384)
    assert float(cos.min()) >= 0.99999, float(cos.min())
    assert fused.report.dynamic.get("dims") and len(fused.reports) == 1 and fused.replans == []


def test_single_sentence_and_not_a_sentence_transformer(pair):
    ref, st, _ = pair
    one = ["Operator fusion"]
    cos = torch.nn.functional.cosine_similarity(ref.encode(one, convert_to_tensor=True),
                                                st.encode(one, convert_to_tensor=True))
    assert float(cos.min()) >= 0.99999
    with pytest.raises(opfuse.sentence.SentenceTransformerError, match="holds no Hugging Face model"):
        opfuse.sentence.optimize(torch.nn.Sequential(torch.nn.Linear(2, 2)))
