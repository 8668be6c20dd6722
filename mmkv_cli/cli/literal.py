"""Text from outside (a pack's header, a file's name, a question, an error naming either) shown as
it is: never read as rich markup, and its control characters made visible, so that no escape
sequence reaches the terminal (a title set, a screen cleared) and no line is broken or overwritten.

Every surface that prints such text goes through here: `literal` for a string placed inside markup
(an error line, a note), `plain` for a table cell or a whole line (a `Text`, never parsed)."""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text

# C0 and C1 controls and DEL, and the invisible marks that reorder or hide text (bidirectional
# overrides and isolates, zero-width characters): each shown as its escape
_HIDDEN = [*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x200B, 0x2010), *range(0x202A, 0x202F)]
_HIDDEN += [*range(0x2066, 0x206A), 0xFEFF]
_VISIBLE = {code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}") for code in _HIDDEN}


def visible(text: object) -> str:
    """`text` as a string with every control or invisible mark written as its escape (\\x1b)."""
    return str(text).translate(_VISIBLE)


def literal(text: object) -> str:
    """`text` for a markup string: visible, and its brackets escaped so rich prints them."""
    return escape(visible(text))


def plain(text: object, style: str = "") -> Text:
    """`text` as a rich Text (never parsed as markup), visible."""
    return Text(visible(text), style=style)
