"""Test data shared by several test files, in one place (test files do not import each other):
reports of the shipped sample clusters' bugs, a repository that learns from its own fix, small
synthetic clusters for the matcher, and payload builders."""

from __future__ import annotations

from typing import Any

from bot.clusters.models import Cluster
from bot.matching import IssueText, MatchPolicy
from bot.settings import ServiceConfig
from tests.conftest import SAMPLE_CLUSTERS, issue_payload
from tests.fake_github import FakeGitHub

# --- reports of the sample clusters' bugs (config/clusters) ---------------------------------------

# A reporter's own words for the seed bug "Telegram /new confirm button hangs": different title,
# naming the file and the function the fix changed.
RESET_HANG = {
    "title": "Telegram bot stops answering after I tap the confirm button for /new",
    "body": (
        "After sending /new on Telegram and pressing the confirmation button the whole bot goes "
        "silent until I restart the gateway.\n\nI think it hangs in `_handle_reset_command` in "
        "gateway/slash_commands.py while the old agent is cleaned up on the event loop.\n"
    ),
}
# The seed bug about interrupt state leaking from the tool executor.
INTERRUPT_LEAK = {
    "title": "Tools report 'interrupted' right away after a tool raised an exception",
    "body": (
        "After one tool call raised, every later tool scheduled on the same ThreadPoolExecutor "
        "worker is instantly interrupted. Looks like `_run_tool` in agent/tool_executor.py "
        "leaves the thread id in _interrupted_threads when _invoke_tool raises.\n"
    ),
}
UNRELATED = {
    "title": "Docs: add a dark theme to the documentation website",
    "body": "The docs site is very bright at night. A dark colour scheme would be nice.",
}

# These tests are about what happens once an issue matched, not about how well it matches: a
# threshold well under the sample issue's score keeps them apart from the matcher's calibration.
REGRESSION_POLICY = MatchPolicy(threshold=0.5)
SAMPLES = ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], matching=REGRESSION_POLICY)

# The sample bug (cluster 35994, fixed by #52090), reported again by someone the fix broke.
CAUSED = {"title": RESET_HANG["title"],
          "body": RESET_HANG["body"] + "\nThis is a regression from #52090, it worked before.\n"}


# --- learning from a merged fix ------------------------------------------------------------------

# A repository with no cluster files that learns from its own merged fix (#50 fixes #10),
# and the next report of the same bug.
LEARN_REPO = "octo/widgets"
LEARN_PATCH = ("@@ -40,7 +40,9 @@ def flush_queue(self, timeout):\n"
         "-        self._worker.join()\n"
         "+        self._worker.join(timeout=timeout)\n"
         "+        if self._worker.is_alive():\n"
         "+            raise QueueFlushTimeout(timeout)\n")


def seed_history(fake: FakeGitHub) -> None:
    fake.add_issue(LEARN_REPO, {"number": 10, "title": "Exporter hangs forever on shutdown",
                          "state": "closed", "created_at": "2026-01-05T00:00:00Z",
                          "body": "flush_queue never returns when the worker thread is stuck"})
    fake.pr_files[(LEARN_REPO, 50)] = [
        {"filename": "widgets/exporter/queue.py", "patch": LEARN_PATCH},
        {"filename": "tests/exporter/test_queue.py", "patch": "@@ -1 +1 @@\n+def test(): pass"},
    ]


def merged_pr(number: int = 50, title: str = "fix(exporter): bound flush_queue with a timeout",
               body: str = "Fixes #10") -> dict[str, Any]:
    return {"action": "closed", "number": number,
            "pull_request": {"number": number, "title": title, "body": body, "merged": True,
                             "merged_at": "2026-01-09T12:00:00Z", "state": "closed"},
            "repository": {"full_name": LEARN_REPO}, "installation": {"id": 77},
            "sender": {"login": "maintainer", "type": "User"}}


NEW_REPORT = {
    "title": "Exporter hangs on shutdown, flush_queue never returns",
    "body": "When the app stops, widgets/exporter/queue.py blocks in `flush_queue` forever.",
}


# --- issue comments ------------------------------------------------------------------------------

AUTHOR = "reporter"


def comment_payload(body: str, *, login: str = AUTHOR, number: int = 90001,
                    author: str = AUTHOR, user_type: str = "User",
                    issue: dict[str, Any] | None = None) -> dict[str, Any]:
    payload = issue_payload("created", number=number, login=author, **(issue or {}))
    payload["comment"] = {"id": 777, "body": body, "user": {"login": login, "type": user_type}}
    payload["sender"] = {"login": login, "type": user_type}
    return payload


# --- synthetic clusters for the matcher ----------------------------------------------------------

# The matcher on small synthetic clusters of one repository: a bug (``TARGET``), a look-alike of
# the same subsystem in another file, filler, and a report of the bug with a traceback.
MATCH_REPO = "acme/widget"


def cluster(
    cid: str,
    label: str,
    *,
    summary: str = "",
    titles: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
    hunks: dict[str, list[str]] | None = None,
    repo: str = MATCH_REPO,
    status: str = "merged",
    stale: bool = False,
    pr: int | None = None,
    subsystem: str | None = None,
) -> Cluster:
    number = int(cid)
    pr_number = pr if pr is not None else number + 1000
    members: list[dict[str, Any]] = [
        {"kind": "issue", "number": number, "title": t, "state": "closed"} for t in titles
    ]
    members.append(
        {
            "kind": "pr",
            "number": pr_number,
            "title": None,
            "state": "merged",
            "merged": True,
            "is_fix_pr": True,
            "files_changed": list(files),
            "fix_hunks": [{"file": f, "hunks": h} for f, h in (hunks or {}).items()],
        }
    )
    return Cluster.model_validate(
        {
            "repo": repo,
            "public_id": cid,
            "display_label": label,
            "summary": summary,
            "subsystem": subsystem,
            "landed_fix": {"status": status, "pr": pr_number},
            "freshness": {"state": "stale" if stale else "verified", "is_stale": stale},
            "members": members,
        }
    )


FRAME_HUNK = (
    "@@ -40,7 +40,9 @@ def compute_frame_budget(self, fps: float) -> float:\n"
    "-    return 1000 / fps\n"
    "+    if fps <= 0:\n"
    "+        return DEFAULT_FRAME_BUDGET_MS\n"
    "+    return 1000 / fps\n"
)

FILLER = [
    cluster("201", "Tooltip flickers on hover over toolbar icons", files=("widget/ui/tooltip.py",)),
    cluster("202", "Settings dialog forgets window size", files=("widget/ui/settings.py",)),
    cluster("203", "Export to PDF drops embedded fonts", files=("widget/export/pdf.py",)),
    cluster("204", "Clipboard paste of rich text loses colours"),
    cluster("205", "Plugin loader ignores disabled flag", files=("widget/plugins/loader.py",)),
    cluster("206", "Keyboard shortcut for undo does nothing on Linux"),
    cluster("207", "Autosave writes a corrupt backup file when the disk is full"),
    cluster("208", "Spellchecker marks every word after a hyphen"),
]

TARGET = cluster(
    "101",
    "Renderer crashes with ZeroDivisionError when the frame rate is zero",
    summary="compute_frame_budget divided by fps without a guard; paused animations set fps=0.",
    titles=("Crash: division by zero in renderer while animation paused",),
    files=("widget/render/frame.py", "tests/render/test_frame.py"),
    hunks={"widget/render/frame.py": [FRAME_HUNK]},
    subsystem="render",
)
# Same subsystem, same words, a different bug in a different file.
LOOKALIKE = cluster(
    "102",
    "Renderer crashes when the frame rate is too high on external monitors",
    summary="Vsync negotiation overflowed the swap interval on 240 Hz displays.",
    titles=("Crash in renderer at high frame rate",),
    files=("widget/render/vsync.py",),
    hunks={
        "widget/render/vsync.py": ["@@ -5,3 +5,4 @@ def negotiate_swap_interval(mode):\n+    x\n"]
    },
    subsystem="render",
)

ISSUE = IssueText(
    number=9001,
    title="Renderer crashes with ZeroDivisionError when animation is paused",
    body="""### Steps to Reproduce
1. Pause any animation.

Traceback (most recent call last):
  File "/home/u/.venv/lib/python3.12/site-packages/widget/render/frame.py", line 41, in \
compute_frame_budget
    return 1000 / fps
ZeroDivisionError: division by zero
""",
)


# --- files for the offline commands (match, eval) -------------------------------------------------

# A renderer's bugs as cluster records (JSON Lines rows), and a report of the first one whose
# traceback names the fix's file and function.
OFFLINE_CLUSTERS: list[dict[str, Any]] = [
    {
        "repo": "acme/widget",
        "public_id": "101",
        "display_label": "Renderer crashes with ZeroDivisionError when the frame rate is zero",
        "summary": "compute_frame_budget divided by fps without a guard.",
        "landed_fix": {"status": "merged", "pr": 1101},
        "members": [
            {"kind": "issue", "number": 101, "title": "Division by zero in renderer when paused"},
            {
                "kind": "pr",
                "number": 1101,
                "title": "fix(render): guard zero fps",
                "merged": True,
                "is_fix_pr": True,
                "files_changed": ["widget/render/frame.py"],
            },
        ],
    },
    {
        "repo": "acme/widget",
        "public_id": "102",
        "display_label": "Export to PDF drops embedded fonts",
        "landed_fix": {"status": "merged", "pr": 1102},
        "members": [{"kind": "pr", "number": 1102, "merged": True, "is_fix_pr": True}],
    },
    {
        "repo": "acme/widget",
        "public_id": "103",
        "display_label": "Tooltip flickers on hover over toolbar icons",
        "landed_fix": {"status": "merged", "pr": 1103},
        "members": [{"kind": "pr", "number": 1103, "merged": True, "is_fix_pr": True}],
    },
]
RENDER_CRASH = {
    "title": "Renderer crashes with ZeroDivisionError when animation paused",
    "body": 'File "/x/site-packages/widget/render/frame.py", line 3, in compute_frame_budget\n'
    "ZeroDivisionError: division by zero",
}
