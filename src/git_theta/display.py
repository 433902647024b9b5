"""Untrusted text (tensor names, paths, dtypes from a repository) made safe to print.

A cloned repository chooses its tensor names and file names, and what we print goes to
a terminal: an escape sequence there can recolour, rewrite or hide lines, and a bidi
override can make a name read as another. Every character Python does not call
printable (controls, ESC, DEL, C1, format characters such as bidi overrides and
zero-width joiners, line separators, lone surrogates) is written as an escape instead,
``\\x1b`` style, the way ``repr`` writes them.
"""

from __future__ import annotations

_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape_char(char: str) -> str:
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str) -> str:
    """Return ``text`` with every non-printable character written as an escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def quote(text: str) -> str:
    """Return ``text`` escaped and in single quotes, for a name inside a message."""
    return f"'{escape(text)}'"
