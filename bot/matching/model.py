"""The scoring model: a linear relevance over a few evidence features, then a logistic
calibration on (relevance, gap to the next candidate) that gives the chance the match is right.

The coefficients are few on purpose: they are fitted with L2 regularisation, sign constraints
and a bound on each (``bot/eval/fit.py``, run by ``bench/fit.py``) and must carry to
repositories the fit never saw. They live in ``model.json`` beside this module; ``--model FILE``
on the offline commands uses another.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bot.matching.signals import SIGNALS

# The features every matcher computes, in column order: one per signal of the one registry
# (bot/matching/signals.py).
FEATURES: tuple[str, ...] = tuple(s.name for s in SIGNALS)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@dataclass(frozen=True)
class ScoreModel:
    weights: Mapping[str, float] = field(default_factory=dict)
    bias: float = 0.0
    # Calibration: P(right) = sigmoid(cal_bias + cal_rel * relevance + cal_gap * gap).
    cal_bias: float = 0.0
    cal_rel: float = 1.0
    cal_gap: float = 0.0
    # The relevance assumed for "the next candidate" when there is none.
    floor: float = -4.0

    def relevance(self, values: Mapping[str, float]) -> float:
        return self.bias + sum(self.weights.get(k, 0.0) * v for k, v in values.items())

    def probability(self, relevance: float, gap: float) -> float:
        return _sigmoid(self.cal_bias + self.cal_rel * relevance + self.cal_gap * gap)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": dict(self.weights),
            "bias": self.bias,
            "cal_bias": self.cal_bias,
            "cal_rel": self.cal_rel,
            "cal_gap": self.cal_gap,
            "floor": self.floor,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ScoreModel:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a scoring model is a JSON object")
        # A model file keeps the coefficients under "model", beside how they were fitted.
        data = data.get("model", data)
        model = cls(
            weights={k: float(v) for k, v in data.get("weights", {}).items()},
            bias=float(data.get("bias", 0.0)),
            cal_bias=float(data.get("cal_bias", 0.0)),
            cal_rel=float(data.get("cal_rel", 1.0)),
            cal_gap=float(data.get("cal_gap", 0.0)),
            floor=float(data.get("floor", -4.0)),
        )
        model.check()
        return model

    def check(self) -> None:
        """Refuse weights that do not match the signals the matcher computes: one for a signal
        it does not compute would be dropped, and a missing one filled with 0, switching that
        signal off; either way without a word."""
        unknown = set(self.weights) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown features in the model: {', '.join(sorted(unknown))}")
        missing = [name for name in FEATURES if name not in self.weights]
        if missing:
            raise ValueError("the scoring model has no weight for " + ", ".join(missing)
                             + ", which the matcher computes")

    @classmethod
    def load(cls, path: Path) -> ScoreModel:
        return cls.from_json(path.read_text(encoding="utf-8"))


def features_only() -> ScoreModel:
    """A model that weighs every feature 0: for a matcher that only computes features (the fit,
    whose weights are what it computes them for), whatever the shipped model holds."""
    return ScoreModel(weights=dict.fromkeys(FEATURES, 0.0))


MODEL_FILE = Path(__file__).with_name("model.json")

# The fitted model is data, not code: the file holds the coefficients, the constants the fit
# used, a hash of the data it learned from, its cross-validated figures and the command that
# refits it (``python -m bench.fit ... --write FILE``). Loaded once, at import.
DEFAULT_MODEL = ScoreModel.load(MODEL_FILE)
