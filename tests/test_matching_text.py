"""Tokens, noise removal, template boilerplate and evidence extraction, on synthetic text."""

from __future__ import annotations

import itertools

from bot.matching import learn_boilerplate
from bot.matching.evidence import (
    extract_issue_evidence,
    is_weak_file,
    normalise_error,
    normalise_path,
    path_suffix_match,
)
from bot.matching.text import clean_body, clean_title, stem, tokens

TRACEBACK = """\
Traceback (most recent call last):
  File "/home/alice/.venv/lib/python3.12/site-packages/widget/render/frame.py", line 88, in draw
    budget = self.compute_frame_budget(fps)
  File "C:\\Users\\bob\\widget\\widget\\render\\timing.py", line 12, in compute_frame_budget
    return 1000 / fps
ZeroDivisionError: division by zero at 0x7f3a2b1c
"""


def test_code_tokens_kept_whole_and_split() -> None:
    toks = tokens(
        "Crash in `_compute_frame_budget()` of FrameScheduler, see widget/render/frame.py"
    )
    assert "compute_frame_budget" in toks
    assert {"compute", "frame", "budget"} <= set(toks)
    assert "framescheduler" in toks and "scheduler" in toks
    assert "widget/render/frame.py" in toks
    assert "render" in toks


def test_dotted_module_kept_whole() -> None:
    assert "widget.render.frame" in tokens("import widget.render.frame failed")


def test_stopwords_dropped_and_light_stemming() -> None:
    toks = tokens("The frames are rendering when the window resizes")
    assert "the" not in toks and "are" not in toks
    assert "frame" in toks and "window" in toks
    assert stem("rendering") == "render"
    assert stem("queries") == "query"
    assert stem("status") == "status"


def test_clean_title_drops_prefixes_keeps_scope() -> None:
    assert clean_title("[Bug]: Frame budget is negative") == "Frame budget is negative"
    assert clean_title("fix(render): guard zero fps") == "render guard zero fps"


def test_clean_body_drops_template_noise() -> None:
    body = """### Steps to Reproduce
1. open the spline editor
### Environment
- OS: Ubuntu 22.04
- Python version: 3.12.1
| key | value |
|-----|-------|
- [x] I searched existing issues
See https://example.com/report and commit 3f9a2b1c4d5e6f708192a3b4 on line 42, v1.2.3.
"""
    cleaned = clean_body(body).lower()
    assert "spline editor" in cleaned
    for gone in (
        "steps to reproduce",
        "ubuntu",
        "3.12.1",
        "example.com",
        "3f9a2b1c",
        "searched existing",
        "line 42",
        "1.2.3",
        "| key",
    ):
        assert gone not in cleaned, gone


def test_learned_boilerplate_from_issue_form_and_markdown() -> None:
    form = """name: Bug report
description: File a bug report for the widget toolkit
body:
  - type: textarea
    attributes:
      label: What happened?
      description: Tell us what you saw and what you expected instead
      placeholder: A clear and concise description of the glitch
  - type: checkboxes
    attributes:
      label: Preflight
      options:
        - label: I have read the troubleshooting guide twice
"""
    markdown = """---
name: Crash
about: Report a crash
---
**Widget build flavour**
Paste the crash dump below this line please
"""
    bp = learn_boilerplate([form, markdown])
    body = """### What happened?
Tell us what you saw and what you expected instead
The spline editor crashes when zooming.
- [x] I have read the troubleshooting guide twice
**Widget build flavour**
Paste the crash dump below this line please
"""
    stripped = bp.strip(body)
    assert "spline editor crashes" in stripped
    for gone in (
        "What happened",
        "Tell us what you saw",
        "troubleshooting",
        "build flavour",
        "crash dump",
    ):
        assert gone not in stripped, gone
    # A phrase from the template inside an edited line is removed, the rest of the line kept.
    edited = "A clear and concise description of the glitch: zoom lens"
    assert "zoom lens" in bp.strip(edited)
    assert "concise" not in bp.strip(edited)


def test_evidence_from_traceback() -> None:
    ev = extract_issue_evidence("Renderer dies\n" + TRACEBACK + "\nCalled `FrameScheduler.tick()`")
    assert "widget/render/frame.py" in ev.files
    assert "widget/widget/render/timing.py" in ev.files or "widget/render/timing.py" in ev.files
    assert not any(f.startswith(("home/", "users/", "c:")) for f in ev.files)
    assert "compute_frame_budget" in ev.symbols
    assert "draw" in ev.symbols
    assert "tick" in ev.symbols


def test_evidence_references_and_modules() -> None:
    ev = extract_issue_evidence("Same as #4521, failing in widget.render.timing")
    assert 4521 in ev.numbers
    assert "widget/render/timing.py" in ev.files


def test_path_helpers() -> None:
    assert normalise_path("/usr/lib/python3/dist-packages/widget/a.py") == "widget/a.py"
    assert normalise_path("C:\\Users\\bob\\proj\\widget\\a.py") == "widget/a.py"
    assert path_suffix_match("render/frame.py", "widget/render/frame.py") == 2
    assert path_suffix_match("frame.py", "widget/render/frame.py") == 1
    assert path_suffix_match("other/frame.py", "widget/render/frame.py") == 0
    assert is_weak_file("tests/render/test_frame.py")
    assert is_weak_file("docs/shot.png")
    assert not is_weak_file("widget/render/frame.py")


def test_normalise_error_blanks_variable_parts() -> None:
    a = normalise_error("KeyError: 'slot_17' at /tmp/x/y.py 0xdeadbeef")
    b = normalise_error("KeyError: 'slot_17' at /var/z.py 0xfeedface")
    assert a == b


def test_learned_phrases_are_in_an_order_that_does_not_depend_on_the_process() -> None:
    """Phrases of one length are tried alphabetically: set order would change with the hash
    seed, and two overlapping phrases would then strip a body differently from run to run."""
    templates = ["name: A\nbody:\n  - type: textarea\n    attributes:\n"
                 f"      label: {label}\n" for label in
                 ("zeta omega alpha beta", "alpha beta gamma delt", "mid words here okay")]
    phrases = learn_boilerplate(templates).phrases
    lengths = [len(p) for p in phrases]
    assert lengths == sorted(lengths, reverse=True)
    for a, b in itertools.pairwise(phrases):
        assert len(a) > len(b) or a < b
