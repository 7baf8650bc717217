"""LoCoMo loader (Maharana et al., "Evaluating Very Long-Term Conversational Memory of
LLM Agents", ACL 2024; data ``locomo10.json`` from the public snap-research/LoCoMo repo).

Gives, per conversation sample: the turns (speaker, session date, ``dia_id``), the
observations as facts with their source ``dia_id`` s, and the QA items with evidence and
category. Also LoCoMo's token F1, as its ``task_eval/evaluation.py`` computes it: drop
commas, lower-case, strip punctuation and the words a/an/the/and, Porter-stem each
token (nltk), then F1 over the token multisets.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from tqdm import tqdm

from inferscale.types import FactInput

if TYPE_CHECKING:
    from inferscale.memory import Memory

#: Where the public file lives (used only when no local copy is given or found).
LOCOMO_URL = "https://raw.githubusercontent.com/snap-research/LoCoMo/3eb6f2c5/data/locomo10.json"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


class LocomoFormatError(ValueError):
    """The file is not LoCoMo data; the message names what is missing."""


@dataclass(frozen=True)
class LocomoTurn:
    dia_id: str
    speaker: str
    text: str
    session: int
    session_date: str


@dataclass(frozen=True)
class LocomoFact:
    """An observation: ``text`` derived from the turns ``dia_ids`` of ``session``."""

    text: str
    speaker: str
    dia_ids: tuple[str, ...]
    session: int
    session_date: str

    def dated_text(self) -> str:
        """The fact prefixed with its session's date, so temporal questions can be answered."""
        day = self.session_date.split(" on ")[-1] if self.session_date else ""
        return f"({day}) {self.text}" if day else self.text


@dataclass(frozen=True)
class LocomoQA:
    question: str
    answer: str
    evidence: tuple[str, ...]
    category: int


@dataclass(frozen=True)
class LocomoSample:
    sample_id: str
    speakers: tuple[str, str]
    turns: tuple[LocomoTurn, ...]
    facts: tuple[LocomoFact, ...]
    qa: tuple[LocomoQA, ...]


def _split_ids(raw) -> list[str]:
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for item in items:
        out.extend(x.strip() for x in re.split(r"[,;\s]+", str(item)) if x.strip())
    return out


def _parse_sample(i: int, raw: dict) -> LocomoSample:
    for key in ("sample_id", "conversation", "observation", "qa"):
        if key not in raw:
            raise LocomoFormatError(f"sample {i} has no {key!r}: this is not LoCoMo data (locomo10.json)")
    try:
        return _parse_fields(raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        what = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise LocomoFormatError(f"sample {i} ({raw.get('sample_id')!r}) is malformed ({what}): expected LoCoMo's "
                                "locomo10.json layout") from exc


def _str(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _parse_fields(raw: dict) -> LocomoSample:
    conv = raw["conversation"]
    sessions = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
    turns = []
    for s in sessions:
        date = conv.get(f"session_{s}_date_time", "")
        for t in conv[f"session_{s}"]:
            text = _str(t.get("text", ""))
            if t.get("blip_caption"):
                text = f"{text} [shares a photo of {t['blip_caption']}]".strip()
            turns.append(LocomoTurn(_str(t["dia_id"]), _str(t["speaker"]), text, s, date))
    known = {t.dia_id for t in turns}
    facts = []
    for key, by_speaker in raw["observation"].items():
        m = re.fullmatch(r"session_(\d+)_observation", key)
        if not m:
            continue
        s = int(m.group(1))
        for speaker, items in by_speaker.items():
            for item in items:
                text, ids = _str(item[0]), [d for d in _split_ids(item[1]) if d in known]
                if text.strip():
                    facts.append(LocomoFact(text.strip(), speaker, tuple(ids), s, conv.get(f"session_{s}_date_time", "")))
    qa = [
        LocomoQA(_str(q["question"]), str(q.get("answer", q.get("adversarial_answer", ""))),
                 tuple(_split_ids(q.get("evidence", []))), int(q["category"]))
        for q in raw["qa"]
    ]
    return LocomoSample(str(raw["sample_id"]), (conv.get("speaker_a", ""), conv.get("speaker_b", "")), tuple(turns), tuple(facts), tuple(qa))


def load_locomo(path: Path) -> list[LocomoSample]:
    """Read ``locomo10.json``.

    Raises:
        FileNotFoundError: no file at ``path``.
        LocomoFormatError: the file is not JSON, or not LoCoMo's shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no LoCoMo file at {path}: check the path (--data takes the path of LoCoMo's locomo10.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LocomoFormatError(f"{path} is not JSON ({exc}): expected LoCoMo's locomo10.json") from exc
    if not isinstance(raw, list) or not raw or not all(isinstance(s, dict) for s in raw):
        raise LocomoFormatError(f"{path} is not a JSON list of conversation samples: expected LoCoMo's locomo10.json")
    return [_parse_sample(i, s) for i, s in enumerate(raw)]


def store_conversation(memory: Memory, sample: LocomoSample, user_id: str, *,
                       facts: Sequence[LocomoFact] | None = None, batch: int = 32,
                       progress: str | None = None) -> int:
    """Log a conversation's turns and store its observations as dated facts with provenance.

    The one loader behind the demo, the benchmarks and the tests. Each turn is logged
    with its ``dia_id`` as turn id (so facts' ``source_turn_ids`` point at it) and its
    session and date as metadata; each fact is :meth:`LocomoFact.dated_text` with its
    ``dia_ids`` as provenance and speaker and session as metadata. Whether KV is encoded
    now depends on the memory's ``precompute_kv``.

    Idempotent and resumable: turns are logged only into a scope with no turns yet;
    when every asked fact is already stored (by text hash) nothing is embedded again,
    and otherwise facts already stored come back as NOOPs. Facts stored earlier that
    are not asked for stay: the caller checks the scope's size where that matters.

    Args:
        facts: the observations to store (default: all of ``sample.facts``).
        batch: facts per :meth:`Memory.add_facts` call (embedding batch).
        progress: a tqdm label, or ``None`` for no progress bar.

    Returns:
        The number of facts newly added.
    """
    if memory.count_turns(user_id=user_id) == 0:
        memory.log_turns(
            [{"id": t.dia_id, "role": "user", "name": t.speaker, "content": t.text,
              "metadata": {"session": t.session, "date": t.session_date}} for t in sample.turns],
            user_id=user_id,
        )
    chosen = sample.facts if facts is None else facts
    inputs = [FactInput(f.dated_text(), f.dia_ids, {"speaker": f.speaker, "session": f.session}) for f in chosen]
    texts = {f.text for f in inputs}
    if memory.count(user_id=user_id) >= len(texts) and len(memory.find_texts(list(texts), user_id=user_id)) == len(texts):
        return 0
    added = 0
    for start in tqdm(range(0, len(inputs), batch), desc=progress, unit="batch", disable=progress is None,
                      leave=False):
        res = memory.add_facts(inputs[start : start + batch], user_id=user_id)
        added += sum(r["event"] == "ADD" for r in res["results"])
    return added


def default_locomo_path() -> Path:
    """``../shared/data/locomo/locomo10.json`` from the working directory when it exists,
    else a copy in the cache, downloaded once from the public LoCoMo repository.

    Raises:
        FileNotFoundError: neither is there and the download failed (no network).
    """
    from inferscale.config import cache_dir

    for base in (Path.cwd(), *Path.cwd().parents):
        candidate = base / "shared" / "data" / "locomo" / "locomo10.json"
        if candidate.is_file():
            return candidate
    cached = cache_dir() / "data" / "locomo10.json"
    if not cached.is_file():
        import urllib.request

        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".part")
        try:
            urllib.request.urlretrieve(LOCOMO_URL, tmp)  # noqa: S310 - fixed https URL
        except OSError as exc:  # URLError, no network
            raise FileNotFoundError(
                f"no LoCoMo data: shared/data/locomo/locomo10.json is not in {Path.cwd()} or a folder above it, "
                f"and downloading it failed ({exc}): pass --data path/to/locomo10.json") from None
        tmp.replace(cached)
    return cached


def normalize_answer(text: str) -> str:
    """LoCoMo's answer normalisation: lower-case, no punctuation, no articles, single spaces."""
    text = str(text).lower().replace(",", "")
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between normalised prediction and gold answer, in [0, 1]."""
    from nltk.stem import PorterStemmer

    stem = PorterStemmer().stem
    pred = [stem(w) for w in normalize_answer(prediction).split()]
    ref = [stem(w) for w in normalize_answer(gold).split()]
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)
