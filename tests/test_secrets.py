"""No credential ever reaches a log record, a comment or the ledger: the webhook secret, the App's
private key, the App JWT and the installation tokens, with DEBUG logging on for every logger
(the bot's, aiohttp's, gidgethub's), over the whole flow and its failure paths. Only the key's
SHA256 fingerprint is shown, so operators can compare it with the App's settings page."""

from __future__ import annotations

import base64
import hashlib
import logging
import traceback
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from pydantic import SecretStr

from bot.settings import PrivateKey, Settings, SettingsError
from bot.web.app import SERVICES, WORKER
from tests.conftest import REPO, SECRET, BotFactory, issue_payload
from tests.fake_github import FakeGitHub

RESET_HANG = {
    "title": "Telegram bot stops answering after I tap the confirm button for /new",
    "body": ("After sending /new on Telegram and pressing the confirmation button the whole bot "
             "goes silent. I think it hangs in `_handle_reset_command` in "
             "gateway/slash_commands.py while the old agent is cleaned up on the event loop.\n"),
}
LOGGERS = ("", "dejafix", "aiohttp", "aiohttp.access", "aiohttp.client", "aiohttp.server",
           "aiohttp.web", "aiohttp.internal", "gidgethub", "asyncio")


def pem_body_lines(pem: str) -> list[str]:
    return [line for line in pem.splitlines() if line and not line.startswith("-----")]


def expected_fingerprint(pem: str) -> str:
    """Computed here, independently of bot.settings: SHA-256 of the DER public key, base64."""
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    der = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode()


def record_texts(record: logging.LogRecord) -> list[str]:
    """Everything of a record a handler could write: message, raw msg and args, exception and
    stack text, and the record fully formatted."""
    texts = [str(record.msg), repr(record.args), record.exc_text or "", record.stack_info or ""]
    try:
        texts.append(record.getMessage())
    except Exception as exc:  # a bad format string still must not hide a leak in its args
        texts.append(repr(exc))
    texts.append(logging.Formatter("%(name)s %(levelname)s %(message)s").format(record))
    if record.exc_info and record.exc_info[1] is not None:
        texts.append("".join(traceback.format_exception(record.exc_info[1])))
    return texts


def leaks(texts: list[str], secrets: dict[str, str]) -> list[str]:
    return [f"{name} in {text[:120]!r}" for text in texts for name, value in secrets.items()
            if value in text]


def secrets_of(fake: FakeGitHub, pem: str) -> dict[str, str]:
    """Every credential of the run: the webhook secret, the key's body lines, every token the
    fake minted and every App JWT the bot sent (with its signature part alone)."""
    found = {"webhook secret": SECRET}
    for i, line in enumerate(pem_body_lines(pem)):
        found[f"PEM line {i + 1}"] = line
    for i, token in enumerate(fake.tokens):
        found[f"installation token {i + 1}"] = token
    jwts = {r.headers["Authorization"][7:] for r in fake.requests
            if r.path.startswith("/app") and r.headers.get("Authorization", "")[:7].lower()
            == "bearer "}
    for i, jwt in enumerate(sorted(jwts)):
        found[f"App JWT {i + 1}"] = jwt
        found[f"App JWT {i + 1} signature"] = jwt.rsplit(".", 1)[1]
    return found


def test_leak_detector_finds_each_kind(key_pair: tuple[str, str]) -> None:
    """The check below is not vacuous: a record carrying any of them, in any part, is caught."""
    secrets = {"secret": SECRET, "pem": pem_body_lines(key_pair[0])[3], "token": "ghs_abc123"}
    for value in secrets.values():
        in_args = logging.LogRecord("x", logging.INFO, __file__, 1, "got %s", (value,), None)
        try:
            raise RuntimeError(f"boom {value}")
        except RuntimeError as exc:
            in_exc = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), None)
            in_exc.exc_info = (type(exc), exc, exc.__traceback__)
        assert leaks(record_texts(in_args), secrets)
        assert leaks(record_texts(in_exc), secrets)


async def test_no_secret_in_logs_comments_or_ledger_over_the_whole_flow(
        make_bot: BotFactory, key_pair: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name or None)
    bot = await make_bot()
    fake = bot.github
    bot.app[WORKER].retry_base = 0.0
    fake.add_file(REPO, ".github/dejafix.yml", "label: known-fix\n")

    # Failure paths first: a forged delivery, a refused token mint, a refused config read
    # (the token is forgotten and a fresh one minted), all before the comment is posted.
    forged = await bot.deliver("issues", issue_payload(**RESET_HANG), secret="not-the-secret")
    assert forged.status == 401
    unsigned = await bot.deliver("issues", issue_payload(**RESET_HANG), secret=None)
    assert unsigned.status == 401
    ignored = await bot.deliver("issues", issue_payload("labeled", **RESET_HANG))  # DEBUG line
    assert ignored.status == 202
    fake.failures["POST /app/installations/77/access_tokens"] = [401]
    fake.failures["POST /graphql"] = [401]  # the cold read of the config and templates
    resp = await bot.deliver("issues", issue_payload(**RESET_HANG), delivery="d-secrets")
    assert resp.status == 202
    await bot.settle()
    # An edit re-renders and PATCHes: one more authenticated write.
    edited = issue_payload("edited", **{**RESET_HANG, "title": RESET_HANG["title"] + "!"},
                           changes={"title": {"from": RESET_HANG["title"]}})
    await bot.deliver("issues", edited)
    await bot.settle()

    # The flow did happen, every step of it.
    posts = fake.calls("POST", f"/repos/{REPO}/issues/90001/comments")
    assert len(posts) == 1
    assert fake.calls("POST", "/issues/90001/labels")
    assert len(fake.calls("POST", "/access_tokens")) >= 3  # refused, first, after the 401
    assert len(fake.tokens) >= 2
    assert fake.calls("POST", "/graphql")  # the config and templates were read
    store = bot.app[SERVICES].store
    assert store.failed_count() == 0

    secrets = secrets_of(fake, key_pair[0])
    assert any(name.startswith("App JWT") for name in secrets)
    assert sum(name.startswith("installation token") for name in secrets) >= 2
    assert caplog.records, "nothing was logged: the check below would be vacuous"
    assert any(r.name.startswith("aiohttp") for r in caplog.records), "aiohttp not captured"
    assert any(r.levelno == logging.DEBUG for r in caplog.records), "DEBUG not captured"
    assert any(r.exc_info or r.levelno >= logging.WARNING for r in caplog.records)

    found = [hit for record in caplog.records for hit in leaks(record_texts(record), secrets)]
    assert found == [], found
    written = [str(r.body) for r in fake.writes()]
    assert written and leaks(written, secrets) == []
    # The ledger on disk (payloads, last errors) holds none either.
    db = Path(store.path)
    ledger = b"".join(p.read_bytes() for p in db.parent.iterdir() if p.is_file())
    assert [name for name, value in secrets.items() if value.encode() in ledger] == []

    # The startup line names the key by its fingerprint, as GitHub shows it.
    fingerprint = expected_fingerprint(key_pair[0])
    startup = [r.getMessage() for r in caplog.records if " ready: " in r.getMessage()]
    assert len(startup) == 1 and fingerprint in startup[0], startup
    assert fingerprint.startswith("SHA256:") and len(fingerprint) == len("SHA256:") + 44


def test_settings_repr_and_str_hold_no_secret(key_pair: tuple[str, str]) -> None:
    settings = Settings(app_id="1", private_key=PrivateKey(key_pair[0], source="test"),
                        webhook_secret=SecretStr(SECRET))
    secrets = {"webhook secret": SECRET, "PEM header": "PRIVATE KEY"}
    secrets |= {f"PEM line {i}": line for i, line in enumerate(pem_body_lines(key_pair[0]))}
    texts = [repr(settings), str(settings), f"{settings!s}", repr(settings.model_dump()),
             str(settings.private_key), repr(settings.private_key)]
    assert leaks(texts, secrets) == []
    assert expected_fingerprint(key_pair[0]) in repr(settings)


def _error_texts(exc: BaseException) -> list[str]:
    return [str(exc), repr(exc), "".join(traceback.format_exception(exc))]


def _corrupted(pem: str) -> str:
    """The real key with one body line changed: still PEM, no longer a key."""
    lines = pem.splitlines()
    middle = len(lines) // 2
    lines[middle] = "A" * len(lines[middle])
    return "\n".join(lines) + "\n"


def _encrypted_pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(b"passphrase")).decode()


@pytest.mark.parametrize("case", ["bad app id", "no app id", "corrupted key", "encrypted key",
                                  "escaped newlines, bad app id", "unreadable key path"])
def test_settings_errors_hold_no_key(key_pair: tuple[str, str], tmp_path: Path,
                                     case: str) -> None:
    pem = key_pair[0]
    env = {"DEJAFIX_WEBHOOK_SECRET": SECRET}
    if case == "bad app id":
        env |= {"DEJAFIX_APP_ID": "not-a-number", "DEJAFIX_PRIVATE_KEY": pem}
    elif case == "no app id":
        env |= {"DEJAFIX_PRIVATE_KEY": pem}
    elif case == "corrupted key":
        pem = _corrupted(pem)
        env |= {"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY": pem}
    elif case == "encrypted key":
        pem = _encrypted_pem()
        env |= {"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY": pem}
    elif case == "escaped newlines, bad app id":
        env |= {"DEJAFIX_APP_ID": "x1", "DEJAFIX_PRIVATE_KEY": pem.replace("\n", "\\n")}
    else:
        env |= {"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY_PATH": str(tmp_path)}  # a folder
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    secrets = {"webhook secret": SECRET}
    secrets |= {f"PEM line {i}": line for i, line in enumerate(pem_body_lines(pem))
                if len(set(line)) > 1}  # the corrupted all-"A" line is no secret
    assert leaks(_error_texts(info.value), secrets) == []
    assert "DEJAFIX_" in str(info.value)  # it names the variable instead
