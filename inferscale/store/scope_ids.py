"""Scope ids that cannot be mistaken for one another: one spelling of each, one script each.

Two ids that look alike on a page are two scopes to the store, so an id that only looks like
another would show one user's memories under another's name (``аlice``, with a Cyrillic
``а``, beside ``alice``; ``é`` composed and decomposed). :func:`check_scope_id` refuses,
rather than maps, what could be mistaken (docs/decisions.md, "Confusable scope ids"):

- an id that is not in Unicode's NFKC form (RFC 8265's identifier profiles, and UTS #39,
  normalise before comparing): decomposed accents, fullwidth or ligature letters. The error
  names the NFKC spelling to send instead. Refused, not normalised: a silent mapping would
  merge two ids an earlier version stored apart;
- an id whose letters, digits and marks come from more than one script, except the
  combinations Japanese, Chinese and Korean write with (UTS #39 section 5.2, "Highly
  Restrictive": Latin with Han and Hiragana and Katakana; with Han and Bopomofo; with Han and
  Hangul). ASCII digits, punctuation, modifier letters and the marks every script uses belong
  to no script here; a digit or mark of a script belongs to it (``b౦b``, a Telugu zero);
- an id holding a character that shows nothing (:data:`INVISIBLE`: a combining grapheme
  joiner, a variation selector, a Hangul filler, a blank braille pattern), which would make
  it look like the same id without it.

Ids of one script that look like ids of another (Cyrillic ``аре`` and Latin ``ape``) are still
two scopes; the page at ``/ui`` shows the code points of every id that is not plain ASCII.
"""

from __future__ import annotations

import unicodedata

#: the script combinations one id may mix (UTS #39 section 5.2, Highly Restrictive)
ALLOWED_MIXES = (frozenset({"LATIN", "HAN", "HIRAGANA", "KATAKANA"}), frozenset({"LATIN", "HAN", "BOPOMOFO"}),
                 frozenset({"LATIN", "HAN", "HANGUL"}))
_HAN_WORDS = ("CJK", "IDEOGRAPHIC")
#: first words of character names that name no script (ASCII digits, modifier letters such as
#: Hawaiian's okina, marks shared by every script)
_NO_SCRIPT = frozenset({"DIGIT", "MODIFIER", "COMBINING", "VARIATION", "ZERO", "SUPERSCRIPT", "SUBSCRIPT"})
#: scripts a combining mark may name after ``COMBINING`` (``COMBINING CYRILLIC TITLO``)
_MARK_SCRIPTS = frozenset({"LATIN", "GREEK", "CYRILLIC", "ARMENIAN", "HEBREW", "ARABIC", "GEORGIAN", "GLAGOLITIC"})
#: code points that show nothing (Unicode's Default_Ignorable_Code_Point, DerivedCoreProperties.txt,
#: plus the blank braille pattern): an id holding one looks like the id without it
INVISIBLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
             (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x2800, 0x2800),
             (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8),
             (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF))


def invisible(ch: str) -> bool:
    """Whether ``ch`` shows nothing (:data:`INVISIBLE`)."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in INVISIBLE)


def letter_script(ch: str) -> str | None:
    """The script of a letter, a digit or a mark, from its Unicode name (``LATIN``, ``CYRILLIC``,
    ``GREEK``, ``TELUGU`` for a Telugu digit, ``HAN`` for CJK ideographs ...), ``None`` for what
    belongs to no one script (ASCII digits, punctuation, modifier letters, marks every script
    uses, the Japanese prolonged sound mark). A digit of another script counts: ``b౦b`` (a
    Telugu zero) is not ``bob``."""
    category = unicodedata.category(ch)
    if not (category.startswith("L") or category.startswith("M") or category == "Nd"):
        return None
    words = unicodedata.name(ch, "").split(" ")
    word = words[0]
    if word == "COMBINING" and len(words) > 1 and words[1] in _MARK_SCRIPTS:
        return words[1]
    if not word or "-" in word or word in _NO_SCRIPT:  # KATAKANA-HIRAGANA PROLONGED SOUND MARK is both
        return None
    return "HAN" if word in _HAN_WORDS else word


def check_scope_id(name: str, value: str) -> None:
    """Refuse an id that could be mistaken for another (module docstring).

    Args:
        name: the field, for the message (``"user_id"``).
        value: the id (a printable string, checked by the caller).

    Raises:
        ValueError: ``value`` holds a character that shows nothing, is not in NFKC form (the
            message gives the form to send), or mixes scripts (the message names them).
    """
    if value.isascii():
        return
    hidden = [c for c in value if invisible(c)]
    if hidden:
        raise ValueError(f"{name} {value!r} ({code_points(value)}) holds {code_points(''.join(hidden))}, which shows "
                         "nothing: an id with it looks like the id without it; send the id without it")
    nfkc = unicodedata.normalize("NFKC", value)
    if nfkc != value:
        raise ValueError(f"{name} {value!r} ({code_points(value)}) is not in Unicode's NFKC form: send {nfkc!r} "
                         f"({code_points(nfkc)}); ids that look alike must be spelled alike")
    scripts = {s for s in map(letter_script, value) if s is not None}
    if len(scripts) > 1 and not any(scripts <= mix for mix in ALLOWED_MIXES):
        raise ValueError(f"{name} {value!r} ({code_points(value)}) mixes letters of the {', '.join(sorted(scripts))} "
                         "scripts: an id is written in one script (as 'alice' or 'алиса', not both), so that it "
                         "cannot pass for another")


def code_points(value: str) -> str:
    """``value``'s characters as ``U+0430 U+006C ...`` (how ``/ui`` tells ids that look alike apart)."""
    return " ".join(f"U+{ord(c):04X}" for c in value)
