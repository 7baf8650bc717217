"""Scope ids that cannot be mistaken for one another: one spelling of each, one script each.

Two ids that look alike on a page are two scopes to the store, so an id that only looks like
another would show one user's memories under another's name (``аlice``, with a Cyrillic
``а``, beside ``alice``; ``é`` composed and decomposed). :func:`check_scope_id` refuses,
rather than maps, what could be mistaken (docs/decisions.md, "Confusable scope ids"):

- an id that is not in Unicode's NFKC form (RFC 8265's identifier profiles, and UTS #39,
  normalise before comparing): decomposed accents, fullwidth or ligature letters. The error
  names the NFKC spelling to send instead. Refused, not normalised: a silent mapping would
  merge two ids an earlier version stored apart;
- an id whose letters come from more than one script, except the combinations Japanese,
  Chinese and Korean write with (UTS #39 section 5.2, "Highly Restrictive": Latin with Han
  and Hiragana and Katakana; with Han and Bopomofo; with Han and Hangul). Digits,
  punctuation and marks belong to no script here.

Ids of one script that look like ids of another (Cyrillic ``аре`` and Latin ``ape``) are still
two scopes; the page at ``/ui`` shows the code points of every id that is not plain ASCII.
"""

from __future__ import annotations

import unicodedata

#: the script combinations one id may mix (UTS #39 section 5.2, Highly Restrictive)
ALLOWED_MIXES = (frozenset({"LATIN", "HAN", "HIRAGANA", "KATAKANA"}), frozenset({"LATIN", "HAN", "BOPOMOFO"}),
                 frozenset({"LATIN", "HAN", "HANGUL"}))
_HAN_WORDS = ("CJK", "IDEOGRAPHIC")


def letter_script(ch: str) -> str | None:
    """The script of a letter, from the first word of its Unicode name (``LATIN``, ``CYRILLIC``,
    ``GREEK``, ``HAN`` for CJK ideographs ...), ``None`` for what is not a letter of one script
    (digits, punctuation, marks, the Japanese prolonged sound mark)."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    word = unicodedata.name(ch, "").split(" ", 1)[0]
    if not word or "-" in word:  # KATAKANA-HIRAGANA PROLONGED SOUND MARK is both
        return None
    return "HAN" if word in _HAN_WORDS else word


def check_scope_id(name: str, value: str) -> None:
    """Refuse an id that could be mistaken for another (module docstring).

    Args:
        name: the field, for the message (``"user_id"``).
        value: the id (a printable string, checked by the caller).

    Raises:
        ValueError: ``value`` is not in NFKC form (the message gives the form to send), or mixes
            scripts (the message names them).
    """
    if value.isascii():
        return
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
