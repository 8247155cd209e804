"""Matching an issue against known-bug clusters: tokens, evidence, scoring, the decision."""

from bot.matching.boilerplate import Boilerplate, learn_boilerplate
from bot.matching.model import ScoreModel
from bot.matching.scoring import Matcher, decide
from bot.matching.types import IssueText, Match, MatchEvidence, MatchPolicy

__all__ = [
    "Boilerplate",
    "IssueText",
    "Match",
    "MatchEvidence",
    "MatchPolicy",
    "Matcher",
    "ScoreModel",
    "decide",
    "learn_boilerplate",
]
