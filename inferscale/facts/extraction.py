"""``add(..., infer=True)``: fact extraction with the served LLM, and reconciliation.

Extraction asks the LLM for a JSON list of short facts. The prompt is short on purpose:
the default model (SmolLM2-135M, 8k context) cannot take Mem0's ~8.5k-token prompt.
Parsing is forgiving: a JSON list anywhere in the reply, a ``{"facts": [...]}`` object,
or bulleted / numbered lines.

Reconciliation decides, for each extracted fact against the scope's most similar stored
facts, one of Mem0's events: ``ADD`` (new), ``UPDATE`` (supersedes a close fact),
``DELETE`` (contradicts one: the old fact goes, the new one is added) or ``NOOP``
(duplicate). The default :class:`SimilarityReconciler` decides by cosine similarity and
negation cues, which a 135M model cannot be trusted to do; both parts are pluggable:
``Memory(extractor=..., reconciler=...)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from inferscale.facts.writes import FactService
from inferscale.store.records import FactRecord, Scope
from inferscale.store.turns import Turn
from inferscale.types import FactInput, WriteEvent

EXTRACTION_SYSTEM = "List the facts about the user in the conversation as a JSON list of short sentences."
#: One worked example (user turn, assistant reply): SmolLM2-135M answered with invented
#: JSON objects without it, and with clean lists of facts with it (greedy, tried by hand).
EXTRACTION_EXAMPLE = (
    "Conversation:\nuser: I'm Bob, I work as a nurse and I hate coffee.\n\nFacts:",
    '["The user is called Bob.", "The user works as a nurse.", "The user hates coffee."]',
)

#: ``generate(messages) -> reply text``: chat completion with the served LLM.
ChatFn = Callable[[list[dict]], str]


class FactExtractor(Protocol):
    def __call__(self, turns: Sequence[Turn], chat: ChatFn) -> list[str]:
        """Facts (short strings) found in ``turns``."""


class Reconciler(Protocol):
    def decide(self, fact: str, candidates: Sequence[tuple[FactRecord, float]]) -> "Decision":
        """What to do with ``fact`` given the stored facts most similar to it (best first)."""


@dataclass(frozen=True)
class Decision:
    """A reconciliation event: ``ADD`` / ``UPDATE`` / ``DELETE`` / ``NOOP``, and the stored fact it concerns."""

    event: str
    target: FactRecord | None = None


def parse_facts(reply: str, max_facts: int = 20) -> list[str]:
    """Facts from an LLM reply: a JSON list, ``{"facts": [...]}``, or bullet / numbered lines.

    Returns:
        Up to ``max_facts`` distinct non-empty strings, in order.
    """
    items: list = []
    start, end = reply.find("["), reply.rfind("]")
    if start != -1:
        body = reply[start : end + 1] if end > start else reply[start:]  # a list cut off by the token budget
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            items = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
        if not isinstance(items, list):
            items = []
    if not items:
        try:
            obj = json.loads(reply[reply.find("{") : reply.rfind("}") + 1])
            items = obj.get("facts", []) if isinstance(obj, dict) else []
        except (json.JSONDecodeError, ValueError):
            items = []
    if not items:
        items = [m.group(1) for m in re.finditer(r"^\s*(?:[-*\u2022]|\d+[.)])\s+(.+?)\s*$", reply, re.MULTILINE)]
    out: list[str] = []
    for item in items:
        text = item.get("fact", item.get("text", "")) if isinstance(item, dict) else item
        if isinstance(text, str) and text.strip() and text.strip() not in out:
            out.append(text.strip())
    return out[:max_facts]


#: Words that say nothing about what a fact is grounded in (the extraction prompt's own
#: phrasing, "The user is ...", and function words).
_FILLER = frozenset(
    "a an the and or but of to in on at for with by from as is are was were be been being am has have had "
    "do does did not no user user's users their they them he she his her him it its i me my you your "
    "this that these those who which called named name longer anymore never".split()
)
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")  # letters and digits of any script


def grounding(fact: str, conversation: str) -> float:
    """Share of ``fact``'s content words that the conversation also uses (0.0 to 1.0).

    Words are lower-cased and compared by their first 4 characters, so "lives" and
    "live", "adopted" and "adopt" match; :data:`_FILLER` words are ignored. A fact with
    no content words scores 0.0. Words are runs of letters and digits of any script, so
    this suits languages that separate words with spaces, not Chinese or Japanese
    (give those ``min_grounding=0``).
    """
    words = [w for w in _WORD.findall(fact.lower()) if w not in _FILLER]
    if not words:
        return 0.0
    source = {w[:4] for w in _WORD.findall(conversation.lower())}
    return sum(w[:4] in source for w in words) / len(words)


class LLMFactExtractor:
    """Extracts facts with the served LLM and :data:`EXTRACTION_SYSTEM`.

    A small model copies facts from the prompt's worked example into its answer (with
    SmolLM2-135M, "I adopted a dog called Max." gave "The user hates coffee.", from
    :data:`EXTRACTION_EXAMPLE`). Each extracted fact must therefore be grounded in the
    conversation: at least ``min_grounding`` of its content words (:func:`grounding`)
    must occur there; the others are dropped. Paraphrases that share no words with the
    conversation are dropped too: lower ``min_grounding`` (0 keeps everything) or plug in
    your own extractor for a model that paraphrases reliably.

    Args:
        max_facts: cap on facts per call.
        min_grounding: 0.0 to 1.0, see above.

    Raises:
        ValueError: ``min_grounding`` outside 0.0 to 1.0.
    """

    def __init__(self, max_facts: int = 20, min_grounding: float = 0.5) -> None:
        if not 0.0 <= min_grounding <= 1.0:
            raise ValueError(f"min_grounding must be between 0.0 and 1.0, got {min_grounding!r}")
        self.max_facts = max_facts
        self.min_grounding = min_grounding

    def __call__(self, turns: Sequence[Turn], chat: ChatFn) -> list[str]:
        conversation = "\n".join(t.render() for t in turns)
        reply = chat([
            {"role": "system", "content": EXTRACTION_SYSTEM},
            {"role": "user", "content": EXTRACTION_EXAMPLE[0]},
            {"role": "assistant", "content": EXTRACTION_EXAMPLE[1]},
            {"role": "user", "content": f"Conversation:\n{conversation}\n\nFacts:"},
        ])
        return [f for f in parse_facts(reply, self.max_facts) if grounding(f, conversation) >= self.min_grounding]


_NEGATION = re.compile(r"\b(not|no longer|never|n't|stopped|quit|no)\b", re.IGNORECASE)


class SimilarityReconciler:
    """Decides by cosine similarity to the closest stored fact.

    Args:
        noop_at: at or above, the fact is a duplicate (``NOOP``).
        related_at: at or above (and below ``noop_at``), the fact concerns the same thing:
            ``DELETE`` the old one when exactly one of the two is negated (a contradiction),
            else ``UPDATE`` it with the new text.
    """

    def __init__(self, noop_at: float = 0.92, related_at: float = 0.75) -> None:
        if not -1.0 <= related_at <= noop_at <= 1.0:
            raise ValueError("need -1 <= related_at <= noop_at <= 1")
        self.noop_at, self.related_at = noop_at, related_at

    def decide(self, fact: str, candidates: Sequence[tuple[FactRecord, float]]) -> Decision:
        if not candidates:
            return Decision("ADD")
        best, score = candidates[0]
        if best.text.strip().lower() == fact.strip().lower() or score >= self.noop_at:
            return Decision("NOOP", best)
        if score >= self.related_at:
            contradicts = bool(_NEGATION.search(fact)) != bool(_NEGATION.search(best.text))
            return Decision("DELETE" if contradicts else "UPDATE", best)
        return Decision("ADD")


def extract_and_reconcile(
    facts: FactService, scope: Scope, turns: Sequence[Turn], metadata: dict, extractor: FactExtractor,
    reconciler: Reconciler, chat: ChatFn,
) -> list[WriteEvent]:
    """Extract facts from logged ``turns`` and apply each one's reconciliation event.

    Facts are applied one by one, so a later fact sees the earlier ones. Every applied
    event is recorded in the history by :class:`FactService`.

    Returns:
        One :class:`WriteEvent` per applied event, in order.
    """
    provenance = tuple(t.turn_id for t in turns)
    results: list[WriteEvent] = []
    for fact in extractor(turns, chat):
        try:
            facts.check_length(fact)
        except ValueError:
            continue  # an extracted "fact" longer than any fact may be is noise
        with facts.transaction():
            decision = reconciler.decide(fact, facts.search(scope, fact, 5))
            target = decision.target
            if decision.event == "UPDATE" and target is not None:
                try:
                    facts.update(scope, target.id, fact)
                    results.append(WriteEvent(target.id, fact, "UPDATE", target.text))
                    continue
                except ValueError:  # another stored fact already says this
                    decision = Decision("NOOP", target)
            if decision.event == "NOOP" and target is not None:
                results.append(WriteEvent(target.id, target.text, "NOOP"))
                continue
            if decision.event == "DELETE" and target is not None:
                facts.delete(scope, [target.id])
                results.append(WriteEvent(target.id, target.text, "DELETE"))
            results.extend(facts.add(scope, [FactInput(fact, provenance, metadata)]))
    return results
