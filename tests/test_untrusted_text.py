"""Issue 74, rows 1, 2 and 10: text from a pack, a file's name or a user is printed as it is, in a
real process: rich markup in it is shown, never applied or raised on, and its control characters
are shown escaped, so no escape sequence reaches the terminal."""

import shutil
import subprocess
import sys

import pytest

from mmkv_cli.cli.literal import literal, plain, visible
from tests.conftest import ROOT
from tests.helpers import encode_pack
from tests.mutants import Parts

MARKUP = "[/bold]"
TERMINAL = "\x1b]0;pwned\x07\x1b[2J"  # sets the window's title, clears the screen


def mmkv(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )


def test_controls_and_markup_are_made_visible():
    assert visible(TERMINAL) == "\\x1b]0;pwned\\x07\\x1b[2J"
    assert visible("a\u202eb\nc") == "a\\u202eb\\x0ac"
    assert literal("[red]x[/red]") == "\\[red]x\\[/red]"
    assert plain(MARKUP).plain == MARKUP


@pytest.fixture(scope="module")
def forged(tmp_path_factory, backbones):
    """A folder with a pack whose model, method name and media source are markup and escapes,
    under a file name that is markup too."""
    folder = tmp_path_factory.mktemp("forged")
    honest = folder / "honest.kvpack"
    encode_pack(str(ROOT / "samples" / "clip.mp4"), honest, "demo", "recency", budget=0.5)

    def edit(header):
        header["fingerprint"]["model"] = MARKUP
        header["method"]["name"] = "[link=https://x.example]full[/link]"
        header["media"]["source"] = TERMINAL

    (folder / "a[red]b.kvpack").write_bytes(Parts.with_header(honest, edit))
    honest.unlink()
    return folder


def _shown_literally(result, *texts) -> None:
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr
    for text in texts:
        assert text in result.stdout, (text, result.stdout)


def test_inspect_and_ls_show_a_packs_strings_as_they_are(forged):
    pack = str(forged / "a[red]b.kvpack")
    shown = mmkv("inspect", pack)
    assert shown.returncode == 0, shown.stderr
    _shown_literally(shown, "a[red]b.kvpack", MARKUP, "[link=https://x.example]full[/link]")
    assert "\\x1b]0;pwned\\x07" in shown.stdout
    listed = mmkv("ls", str(forged))
    assert listed.returncode == 0, listed.stderr
    _shown_literally(listed, "a[red]b.kvpack", MARKUP)


@pytest.mark.parametrize(
    ("args", "code", "shown"),
    [
        (["verify", "[/x].kvpack"], 4, "[/x].kvpack"),
        (["inspect", "no\x1b[2Jsuch.kvpack"], 4, "no\\x1b[2Jsuch.kvpack"),
        (["ls", "DIR[/x]"], 4, "DIR[/x]"),
    ],
)
def test_an_error_naming_outside_text_is_one_literal_line(tmp_path, args, code, shown):
    result = mmkv(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and shown in lines[0] and "\x1b" not in lines[0]


def test_questions_with_markup_are_asked_and_shown_as_typed(forged, tmp_path):
    pack = tmp_path / "q.kvpack"
    shutil.copy(next(forged.glob("*.kvpack")), pack)
    result = mmkv(
        "ask", str(pack), "what color [/x]", "which [bold]shape", "--no-server", "--model", "demo"
    )
    assert result.returncode == 0, result.stderr
    assert "what color [/x]" in result.stderr and "which [bold]shape" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_logged_request_line_shows_its_controls_escaped():
    """serve's access log and mmkv's own logs: a request path or a pack's name as it came."""
    import logging

    from mmkv_cli.cli.log_lines import VisibleFormatter

    record = logging.LogRecord("mmkv.access", logging.INFO, "", 0, "GET /%s 404", (TERMINAL,), None)
    line = VisibleFormatter("%(message)s").format(record)
    assert line == "GET /\\x1b]0;pwned\\x07\\x1b[2J 404"
