"""What the store holds and says: scopes, fact records, the store's error and schema version.

Plain data, no storage: every layer names a memory's owner (:class:`Scope`) and passes
memories (:class:`FactRecord`) without importing Chroma.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from inferscale.store.scope_ids import check_scope_id

#: The layout of stored records; a store written by a newer version is refused.
SCHEMA_VERSION = 1

#: longest user_id / agent_id / run_id (characters): ids are keys, repeated in every record,
#: index entry and KV job of the scope (Mem0 sets no limit; 256 covers emails, UUIDs and URLs)
MAX_SCOPE_ID_CHARS = 256

#: the metadata key of a memory's expiry (epoch seconds): once it has passed, search and chat
#: no longer find the memory (it stays listed by ``get_all`` until deleted)
EXPIRES_AT = "expires_at"


@dataclass(frozen=True)
class Scope:
    """Who a memory belongs to; at least one field is set."""

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None

    @property
    def key(self) -> str:
        """A stable string for the scope, used as partition key everywhere."""
        return json.dumps([self.user_id, self.agent_id, self.run_id])

    @classmethod
    def of(cls, user_id: str | None, agent_id: str | None, run_id: str | None) -> "Scope":
        """Validate and build a scope.

        Raises:
            TypeError: a field is not a string.
            ValueError: no field is given, or one is empty, not printable text, longer than
                :data:`MAX_SCOPE_ID_CHARS`, not in NFKC form or of mixed scripts
                (:func:`~inferscale.store.scope_ids.check_scope_id`).
        """
        for name, value in (("user_id", user_id), ("agent_id", agent_id), ("run_id", run_id)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
            if value is not None and not value.strip():
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
            if value is not None and not value.isprintable():  # NUL, newlines, lone surrogates
                raise ValueError(f"{name} must be printable text, got {value!r}: control characters and lone "
                                 "surrogates cannot be stored")
            if value is not None and len(value) > MAX_SCOPE_ID_CHARS:
                raise ValueError(f"{name} is {len(value):,} characters ({value[:40]!r}...); an id is at most "
                                 f"{MAX_SCOPE_ID_CHARS} characters: use a stable short id, such as a hash of "
                                 "a long one")
            if value is not None:
                check_scope_id(name, value)
        if not (user_id or agent_id or run_id):
            raise ValueError("one of user_id, agent_id or run_id is required, e.g. memory.add(..., user_id='alice')")
        return cls(user_id, agent_id, run_id)

    @classmethod
    def from_key(cls, key: str) -> "Scope":
        """The scope whose :attr:`key` is ``key``."""
        user_id, agent_id, run_id = json.loads(key)
        return cls(user_id, agent_id, run_id)

    def check_metadata(self, metadata: dict | None, what: str = "metadata") -> None:
        """Refuse metadata whose ``user_id``, ``agent_id`` or ``run_id`` names another scope than
        this one, where the memory is stored (a reader filtering on the field would take it for
        another scope's). A field equal to the scope's, or ``None`` in a patch (removed), passes.

        Raises:
            ValueError: naming the field, its value and the scope's (issue 53).
        """
        for name in ("user_id", "agent_id", "run_id"):
            if metadata and metadata.get(name) is not None and metadata[name] != getattr(self, name):
                raise ValueError(f"{what} names {name}={metadata[name]!r}, but the memory is stored under "
                                 f"{name}={getattr(self, name)!r}: drop {name} from the metadata, or store the "
                                 f"memory under {name}={metadata[name]!r}")

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in (("user_id", self.user_id), ("agent_id", self.agent_id), ("run_id", self.run_id)) if v}


@dataclass(frozen=True)
class FactRecord:
    """One stored fact (a "memory" in Mem0's terms).

    Attributes:
        id: memory id (uuid4 hex).
        text: the fact.
        hash: sha256 of the text (hex).
        scope: owner scope.
        source_turn_ids: ids of the turns the fact came from.
        metadata: user metadata.
        created_at: ISO 8601 UTC timestamp of the ADD.
        updated_at: ISO 8601 UTC timestamp of the last change.
    """

    id: str
    text: str
    hash: str
    scope: Scope
    source_turn_ids: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""

    def filter_fields(self) -> dict:
        """What metadata filters see: the user metadata plus ``created_at`` / ``updated_at``."""
        return {**self.metadata, "created_at": self.created_at, "updated_at": self.updated_at}

    def to_item(self, score: float | None = None) -> dict:
        """Mem0's memory item: ``{"id", "memory", "hash", "metadata", "source_turn_ids",
        "created_at", "updated_at"}`` plus the scope's ids (and ``score`` when given); the
        metadata is a copy."""
        item = {
            "id": self.id, "memory": self.text, "hash": self.hash, "metadata": copy.deepcopy(self.metadata),
            "source_turn_ids": list(self.source_turn_ids), "created_at": self.created_at,
            "updated_at": self.updated_at, **self.scope.as_dict(),
        }
        if score is not None:
            item["score"] = score
        return item

    def to_chroma_metadata(self) -> dict:
        meta = {
            "scope": self.scope.key,
            "hash": self.hash,
            "source_turn_ids": json.dumps(list(self.source_turn_ids)),
            "metadata": json.dumps(self.metadata),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }
        meta.update(self.scope.as_dict())
        return meta

    @classmethod
    def from_chroma(cls, fact_id: str, text: str, meta: dict) -> "FactRecord":
        return cls(
            id=fact_id,
            text=text,
            hash=meta["hash"],
            scope=Scope(meta.get("user_id"), meta.get("agent_id"), meta.get("run_id")),
            source_turn_ids=tuple(json.loads(meta.get("source_turn_ids", "[]"))),
            metadata=json.loads(meta.get("metadata", "{}")),
            created_at=meta.get("created_at", ""),
            updated_at=meta.get("updated_at", meta.get("created_at", "")),
        )


class StoreError(RuntimeError):
    """The store on disk cannot be used as is; the message says why and what to do."""
