"""Text a user can influence (settings, error messages, names) shown as itself: Markdown never turns it into a
link, an image, HTML, code or maths."""
from __future__ import annotations

import re

# What lets Markdown make a link, an image, HTML, code, emphasis or maths out of text; and bare URLs (autolinks).
_MARKUP = re.compile(r"([\\`*\[\]<>!$])")
_AUTOLINK = re.compile(r"(?i)(\w):(?=//)|\b(www)\.")


def escape(text: str) -> str:
    """Text shown as itself inside Markdown: whatever could become a link, an image, HTML, code or maths is
    backslash-escaped (so is the colon of "http://" and the dot of "www."); plain words and punctuation stay."""
    text = _MARKUP.sub(r"\\\1", str(text))
    return _AUTOLINK.sub(lambda m: f"{m.group(1)}\\:" if m.group(1) else f"{m.group(2)}\\.", text)
