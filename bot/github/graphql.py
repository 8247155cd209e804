"""The backfill's GraphQL queries, and the conversion of their nodes into the REST-shaped dicts
learning reads (``bot.clusters.learning`` takes plain API data), so that both walks learn the same
clusters.

Query sizes, against GitHub's documented limits (at most 500,000 nodes a query; a query costs
its requested connections divided by 100, at least 1 point, out of 5,000 points an hour):

- pulls: 100 PRs x (10 closing issues + 100 files) = 11,100 nodes, 1 + 100 + 100 = 201
  requests, so 2 points a page (the same points a PR as 50 a page, in half the calls). A page
  GitHub fails on (its 10 s query timeout: long bodies, many files) is asked again at half the
  size, down to 10.
- issues: 100 issues x 10 comments = 1,100 nodes, 1 point.
- one PR's extra files or closing references, and up to 100 issues looked up by number: 1 point.

Both listings ask for their ``totalCount`` (a count, no extra nodes), the denominator of the
backfill's progress.
"""

from __future__ import annotations

import re
from typing import Any

PULLS_PAGE = 100
# The smallest page a failing (too heavy) pulls query is retried with.
PULLS_PAGE_MIN = 10
ISSUES_PAGE = 100
CLOSING_FIRST = 10
# The REST walk reads the first 50 links (``RepoClient.closing_issue_numbers``).
CLOSING_MAX = 50
FILES_FIRST = 100
COMMENTS_LAST = 10
LOOKUP_MAX = 100

_ISSUE = "number title body url state createdAt repository{nameWithOwner}"
_RATE = "rateLimit{cost remaining resetAt}"

# Built by concatenation (not f-strings) so the braces read as GraphQL's.
PULLS_QUERY = (
    "query DejafixBackfillPulls($owner:String!,$name:String!,$first:Int!,$after:String){"
    + _RATE + " repository(owner:$owner,name:$name){"
    "pullRequests(states:MERGED,first:$first,after:$after,"
    "orderBy:{field:CREATED_AT,direction:ASC}){totalCount pageInfo{hasNextPage endCursor} "
    "nodes{number title body url mergedAt "
    "closingIssuesReferences(first:" + str(CLOSING_FIRST) + "){totalCount nodes{" + _ISSUE
    + "}}%FILES%}}}}")
_FILES = (" files(first:" + str(FILES_FIRST) + "){totalCount pageInfo{hasNextPage endCursor} "
          "nodes{path}}")

PR_FILES_QUERY = (
    "query DejafixBackfillPullFiles($owner:String!,$name:String!,$number:Int!,$after:String){"
    + _RATE + " repository(owner:$owner,name:$name){pullRequest(number:$number){"
    "files(first:" + str(FILES_FIRST) + ",after:$after){pageInfo{hasNextPage endCursor} "
    "nodes{path}}}}}")

PR_REFS_QUERY = (
    "query DejafixBackfillPullRefs($owner:String!,$name:String!,$number:Int!){"
    + _RATE + " repository(owner:$owner,name:$name){pullRequest(number:$number){"
    "closingIssuesReferences(first:" + str(CLOSING_MAX) + "){totalCount nodes{" + _ISSUE
    + "}}}}}")

ISSUES_QUERY = (
    "query DejafixBackfillIssues($owner:String!,$name:String!,$first:Int!,$after:String,"
    "$since:DateTime){"
    + _RATE + " repository(owner:$owner,name:$name){"
    "issues(states:CLOSED,first:$first,after:$after,orderBy:{field:CREATED_AT,direction:ASC},"
    "filterBy:{since:$since}){totalCount pageInfo{hasNextPage endCursor} "
    "nodes{number title body url state stateReason createdAt "
    "comments(last:" + str(COMMENTS_LAST) + "){totalCount nodes{body}}}}}}")


def pulls_query(with_files: bool = True) -> str:
    """The pulls page query; without files when the fix's files come from REST (with patches)."""
    return PULLS_QUERY.replace("%FILES%", _FILES if with_files else "")


def lookup_query(count: int) -> str:
    """Issues (or PRs) by number, ``count`` of them in one query: ``i0`` answers ``$n0``..."""
    args = "".join(f",$n{i}:Int!" for i in range(count))
    fields = " ".join(f"i{i}:issueOrPullRequest(number:$n{i})" + "{__typename ...on Issue{"
                      + _ISSUE + "}}" for i in range(count))
    return ("query DejafixBackfillLookup($owner:String!,$name:String!" + args + "){" + _RATE
            + " repository(owner:$owner,name:$name){" + fields + "}}")


# What a GitHub (Enterprise) without a field or type of these queries answers: the walk goes
# back to REST. Anything else (an outage, a refused token) is an error the run stops on.
_SCHEMA_CODES = frozenset({"undefinedField", "undefinedType", "argumentNotAccepted",
                           "undefinedEnumValue", "missingRequiredArguments"})
_SCHEMA_MESSAGE = re.compile(r"doesn't exist on type|isn't a defined input type|"
                             r"No such type|has an invalid value|doesn't accept argument",
                             re.IGNORECASE)


def schema_errors(errors: Any) -> list[str]:
    """The messages of the errors saying this GitHub lacks part of the schema; empty when any
    error is of another kind (then it is not a missing feature, and falling back would hide it)."""
    if not isinstance(errors, list) or not errors:
        return []
    found = []
    for error in errors:
        if not isinstance(error, dict):
            return []
        code = (error.get("extensions") or {}).get("code") if isinstance(
            error.get("extensions"), dict) else None
        message = str(error.get("message") or "")
        if code not in _SCHEMA_CODES and not _SCHEMA_MESSAGE.search(message):
            return []
        found.append(message[:200])
    return found


def issue_dict(node: dict[str, Any]) -> dict[str, Any]:
    """An Issue node as the REST issue JSON fields learning reads."""
    return {"number": int(node["number"]), "title": node.get("title"), "body": node.get("body"),
            "html_url": node.get("url"), "state": str(node.get("state") or "").lower() or None,
            "created_at": node.get("createdAt")}


def in_repo(node: dict[str, Any], repo: str) -> bool:
    """Whether a closing reference is an issue of ``repo`` (GitHub links other repositories'
    issues too; their numbers mean nothing here)."""
    owner = (node.get("repository") or {}).get("nameWithOwner")
    return owner is None or str(owner).lower() == repo.lower()


def pr_dict(node: dict[str, Any]) -> dict[str, Any]:
    """A PullRequest node as the REST pull request JSON fields learning reads."""
    return {"number": int(node["number"]), "title": node.get("title"), "body": node.get("body"),
            "html_url": node.get("url"), "merged_at": node.get("mergedAt"), "state": "closed"}
