"""Strings a client chose (export names, certificate names, meta context names) as
they appear in log lines: one helper, so a name holding a newline or an escape
sequence can never forge a log line or repaint a terminal.

Every character that str.isprintable() rejects (C0/C1 controls, U+2028/U+2029,
format characters, unassigned code points) becomes a Python-style escape, and a
backslash is doubled, so the escaped text is unambiguous.
"""

from __future__ import annotations


def shown(text: str) -> str:
    """text with its control and other non-printable characters escaped (\\n, \\x1b, \\u2028)."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)
