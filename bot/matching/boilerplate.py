"""What a repository's own issue templates put into every issue, learned from the templates.

An issue form renders its labels as headings ("### Hermes version"), its checkbox options as
"- [x] I searched existing issues", and reporters often leave descriptions and placeholders in.
That text is the same in every issue of the repository, so it is evidence of nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml

from bot.matching.text import strip_comments

_FORM_TEXT_KEYS = ("label", "description", "placeholder", "value", "title", "about", "name")
_FRONT_MATTER = re.compile(r"\A---\s*\n.*?\n---\s*\n", re.S)
_MD_MARKUP = re.compile(r"^\s*(?:#{1,6}\s*|[-*+]\s+(?:\[[ xX]\]\s*)?|\d+\.\s+|>\s*)")
_LINE_PUNCT = re.compile(r"[*_`>#:|\[\]()]+")
# Under re.I these non-ASCII characters match ASCII letters (and no others do); str.lower() alone
# would not bring them to those letters. Every other character lower-cases to one character.
_ASCII_FOLD = str.maketrans({"\u0130": "i", "\u0131": "i", "\u017f": "s", "\u212a": "k"})


def normalise_line(line: str) -> str:
    """The comparable form of a line: no markup, no punctuation runs, lower-case, single spaces."""
    # _MD_MARKUP is anchored at the start and never matches empty: at most one match, there.
    m = _MD_MARKUP.match(line)
    if m:
        line = line[m.end() :]
    if "<!--" in line:
        # A comment ends on its line (a template option may hold a line break): the pieces
        # between breaks are stripped apart, in linear time (text.strip_comments).
        line = "\n".join(map(strip_comments, line.split("\n")))
    # re's \s is exactly what str.split() splits on: collapsing runs and stripping in one.
    return " ".join(_LINE_PUNCT.sub(" ", line).split()).lower()


def _fold(text: str) -> str:
    """Lower-case, with the few non-ASCII characters that re.I matches to ASCII letters folded to
    them, so that an ASCII phrase that re.I finds in ``text`` is a substring of the result."""
    if not text.isascii() and (
        "\u0130" in text or "\u0131" in text or "\u017f" in text or "\u212a" in text
    ):
        text = text.translate(_ASCII_FOLD)
    return text.lower()


@lru_cache(maxsize=1024)
def _phrase_pattern(phrase: str) -> tuple[re.Pattern[str], str | None]:
    """The phrase's case-insensitive pattern, and its folded form when a substring test can
    rule a match out (ASCII phrases)."""
    return re.compile(re.escape(phrase), re.I), (phrase.lower() if phrase.isascii() else None)


@dataclass(frozen=True)
class Boilerplate:
    """Lines (normalised) that the repository's templates put into issues, and longer phrases that
    may appear inside a line the reporter edited."""

    lines: frozenset[str] = frozenset()
    phrases: tuple[str, ...] = field(default_factory=tuple)

    def strip(self, body: str) -> str:
        """The body without template lines and template phrases."""
        if not body or (not self.lines and not self.phrases):
            return body
        kept: list[str] = []
        for line in body.splitlines():
            if not line:
                continue
            norm = normalise_line(line)
            if not norm or norm in self.lines:
                continue
            kept.append(line)
        out = "\n".join(kept)
        if self.phrases:
            # A case-insensitive regex scan per phrase is slow; most phrases are not in the body,
            # which one substring test on the folded body shows.
            folded = _fold(out)
            for phrase in self.phrases:
                pattern, folded_phrase = _phrase_pattern(phrase)
                if folded_phrase is not None and folded_phrase not in folded:
                    continue
                out, n = pattern.subn(" ", out)
                if n:
                    folded = _fold(out)
        return out


def _walk_form(node: Any, out: list[str]) -> None:
    # Issue forms nest their text under body[].attributes.{label,description,placeholder,value,
    # options[].label}; collect every string found under those keys, wherever it sits.
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _FORM_TEXT_KEYS and isinstance(value, str):
                out.extend(value.splitlines())
            if key == "options" and isinstance(value, list):
                for option in value:
                    if isinstance(option, str):
                        out.append(option)
            _walk_form(value, out)
    elif isinstance(node, list):
        for item in node:
            _walk_form(item, out)


def _template_lines(text: str) -> list[str]:
    stripped = text.lstrip()
    if stripped.startswith(("name:", "body:", "description:")) or "\nbody:" in text:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict):
            out: list[str] = []
            _walk_form(data, out)
            return out
    # Markdown template: drop the front matter, keep every line (headings, prompts, checklists).
    return _FRONT_MATTER.sub("", text).splitlines()


def learn_boilerplate(template_texts: Iterable[str]) -> Boilerplate:
    """Learn the template lines and phrases of one repository from its issue templates
    (``.github/ISSUE_TEMPLATE/*.md`` and ``*.yml`` issue forms)."""
    lines: set[str] = set()
    phrases: set[str] = set()
    for text in template_texts:
        for raw in _template_lines(text):
            norm = normalise_line(raw)
            if len(norm) < 3:
                continue
            lines.add(norm)
            # Inside an edited line only a phrase of several words is safely template text;
            # a single word ("Logs") may be the reporter's own.
            if len(norm.split()) >= 3:
                phrases.add(re.sub(r"\s+", " ", _MD_MARKUP.sub("", raw)).strip().strip("*_:# "))
    # Longest first (a phrase inside a longer one must not cut it up), then alphabetical: set
    # order changes between processes, and overlapping phrases of one length would strip
    # differently from one run to the next.
    ordered = sorted((p for p in phrases if len(p.split()) >= 3), key=lambda p: (-len(p), p))
    return Boilerplate(lines=frozenset(lines), phrases=tuple(ordered))
