"""`mmkv live -` ends cleanly on every way out (issue 49): a signal with no frame yet, with frames
flowing, with the pipe open and idle; the stall; junk. Exit 0 with a final pack that verifies, or 3
with one line: never an abort (exit 134) from a reader thread holding stdin's buffer at shutdown."""

from __future__ import annotations

import pytest

from tests.abuse import STDIN_ENDINGS, end_live_from_stdin


@pytest.mark.parametrize("case", list(STDIN_ENDINGS))
def test_live_from_stdin_ends_cleanly(tmp_path, case):
    code, lines, verified = end_live_from_stdin(case, tmp_path)
    ready = [line for line in lines if line.startswith("ready: - gave its first frame")]
    lines = [line for line in lines if line not in ready]
    assert code == STDIN_ENDINGS[case][-1] and len(lines) == 1, lines
    assert len(ready) == (STDIN_ENDINGS[case][0] == "all"), ready  # once the first frame is in
    if code == 0:
        assert verified and lines[0].startswith("wrote ")
    else:
        assert lines[0].startswith("error: ") and verified is None
