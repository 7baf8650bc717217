"""The prompt scaffold: chat template, system prompt, memory block, question.

The served prompt, in token ids::

    [preamble][fact_1]...[fact_k][suffix]
     chat template + system prompt + "Memories:" header
               one "- <fact>\\n" line per fact, best-ranked last (next to the question)
                                  end of system turn, conversation, question, assistant header

``preamble`` and the fact lines form the *memory block*, which KV injection supplies
from the pool; vLLM prefills only ``suffix``. Text mode (Mem0-style prompt injection)
sends the very same token ids and prefills all of them, so the two modes differ only
in where the memory block's KV comes from.

Each piece is tokenized on its own and the ids are concatenated, so every fact has the
same tokens in every prompt it appears in (its KV can be reused).

Templates that render the current date into the system turn (Llama 3.x: "Today Date: 02
Dec 2026", through the template's ``strftime_now``) change the preamble every day. The
served preamble (:attr:`PromptBuilder.preamble_ids`) is rendered again every
``rerender_s`` seconds, so it matches what vLLM's server renders from the same template;
the preamble that facts are *encoded* after (:attr:`PromptBuilder.context_preamble_ids`)
is rendered at a fixed date, so a fact's KV (and its key) does not change with the day.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Sequence

#: The owner of the prompt preamble's segment and KV key, beside the facts' ids.
PREAMBLE_OWNER = "_preamble"

_SENTINEL = "\u27e6INFERSCALE_MEMORY\u27e7"
#: the date the encoding context's preamble is rendered at (any fixed day would do)
CONTEXT_DATE = datetime(2024, 1, 1)


@dataclass(frozen=True)
class Segment:
    """A span of the prompt supplied as precomputed KV.

    Attributes:
        owner: fact id, or ``"_preamble"``.
        start: first token position in the prompt.
        token_ids: the span's tokens.
    """

    owner: str
    start: int
    token_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class PromptLayout:
    """A built prompt and where its memory block sits.

    Attributes:
        token_ids: the whole prompt.
        segments: preamble then one segment per fact, contiguous from position 0.
        memory_end: number of leading tokens covered by ``segments`` (tokens).
    """

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...] = field(default_factory=tuple)

    @property
    def memory_end(self) -> int:
        return self.segments[-1].end if self.segments else 0


class PromptBuilder:
    """Builds :class:`PromptLayout` s for one tokenizer and system prompt.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system_prompt: text before the memory block.
        now: the clock a template's ``strftime_now`` reads (default: local time, as
            transformers' and vLLM's rendering do).
        rerender_s: seconds between renderings of the served preamble (a date in the
            template is then at most this late after midnight; until it is rendered again
            the connector's token check refuses the stale preamble, and vLLM prefills it).

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    memory_header = "\n\nMemories:\n"

    def __init__(self, tokenizer, system_prompt: str, *, now: Callable[[], datetime] = datetime.now,
                 rerender_s: float = 60.0) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; InferScale serves chat models only")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self._now = now
        self.rerender_s = rerender_s
        before, _ = self._split_template(clock=lambda: CONTEXT_DATE)
        #: the preamble facts are encoded after: the template rendered at :data:`CONTEXT_DATE`
        self.context_preamble_ids = tuple(self._tok(before))
        self._render()
        # a fact's line is tokenized once per process, not on every request that retrieves it
        self._line_ids = functools.lru_cache(maxsize=65_536)(self._fact_line_ids)

    def _render(self) -> None:
        before, after = self._split_template()
        self._preamble_ids, self._after_template = tuple(self._tok(before)), after
        self._rendered_at = time.monotonic()

    @property
    def preamble_ids(self) -> tuple[int, ...]:
        """The served preamble's token ids (chat template up to the memory lines), as the
        template renders it now (rendered again every ``rerender_s`` seconds)."""
        if time.monotonic() - self._rendered_at >= self.rerender_s:
            self._render()
        return self._preamble_ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of this tokenizer decodes to, bounded above by its
        longest vocabulary entry (a byte-level BPE entry holds one character per byte; a
        SentencePiece byte-fallback entry ``<0xE3>`` stands for under one). A text of ``n``
        tokens has at most ``n * max_token_chars`` characters, so a longer one is refused
        before it is tokenized."""
        return max(8, max(map(len, self.tokenizer.get_vocab())))

    def _tok(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def system_text(self, fact_texts: Sequence[str], instructions: str | None = None) -> str:
        """The system turn's text: system prompt, ``Memories:`` header, one ``"- <fact>\\n"``
        line per fact (in the order given, best-ranked last), then ``instructions``.

        Rendered by the chat template, its memory part tokenizes (for the supported
        templates) to the preamble plus the fact lines of :meth:`build`; the KV connector
        checks that token by token before it injects anything.
        """
        return self._system("".join(f"- {text}\n" for text in fact_texts), instructions)

    def _system(self, memory: str, instructions: str | None) -> str:
        return self.system_prompt + self.memory_header + memory + (f"\n{instructions}" if instructions else "")

    def _split_template(self, history: Sequence[dict] = (), instructions: str | None = None,
                        followup: Sequence[dict] = (), clock: Callable[[], datetime] | None = None) -> tuple[str, str]:
        system = self._system(_SENTINEL, instructions)
        question = "\u27e6Q\u27e7"
        messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question},
                    *followup]
        now = clock or self._now
        # a render variable shadows the template's global of that name (Jinja), so the
        # template's clock is ours: the live one, or the fixed date of the encoding context
        dated = {"strftime_now": lambda fmt: now().strftime(fmt)}
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          **dated)
        except Exception:  # templates that reject a system turn: put it in the user turn
            if history or followup:
                raise ValueError("this model's chat template has no system turn, so a conversation history cannot "
                                 "follow the memory block: send the question alone") from None
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": system + "\n\n" + question}], tokenize=False, add_generation_prompt=True,
                **dated)
        if rendered.count(_SENTINEL) != 1 or rendered.count(question) != 1:
            raise ValueError("the chat template does not render the memory block exactly once")
        before, after = rendered.split(_SENTINEL)
        return before, after

    def fact_line_ids(self, text: str) -> tuple[int, ...]:
        """Token ids of one memory line, ``"- <text>\\n"`` (cached by text)."""
        return self._line_ids(text)

    def _fact_line_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok(f"- {text}\n"))

    def memory_segments(self, facts: Sequence[tuple[str, str]]) -> list[Segment]:
        """The memory block's segments: the preamble at 0, then one line per ``(fact_id, text)``
        in the order given, contiguous."""
        segments, pos = [Segment(PREAMBLE_OWNER, 0, self.preamble_ids)], len(self.preamble_ids)
        for fact_id, text in facts:
            line = self.fact_line_ids(text)
            segments.append(Segment(fact_id, pos, line))
            pos += len(line)
        return segments

    def build(self, question: str, facts: Sequence[tuple[str, str]], history: Sequence[dict] = (),
              instructions: str | None = None, followup: Sequence[dict] = ()) -> PromptLayout:
        """Lay out a prompt.

        Args:
            question: the user's new message.
            facts: ``(fact_id, text)`` pairs, best-ranked last.
            history: earlier turns of the conversation, ``{"role": "user" | "assistant",
                "content"}`` dicts, oldest first; they follow the memory block, before the question.
            instructions: extra system text, placed after the memory block in the system turn
                (the memory block, and so its KV, stays the same).
            followup: messages after the question (an assistant's tool calls and the tool
                results), ``{"role", "content"}`` dicts, oldest first.

        Returns:
            The :class:`PromptLayout`.

        Raises:
            ValueError: the chat template renders the system turn differently with this
                history, or cannot take a history at all.
        """
        segments = self.memory_segments(facts)  # reads preamble_ids: renders again when due
        ids = [t for seg in segments for t in seg.token_ids]
        after = self._after_template
        if history or instructions or followup:
            before, after = self._split_template(history, instructions, followup)
            if tuple(self._tok(before)) != self.preamble_ids:
                raise ValueError("the chat template changes the system turn when a history is given; "
                                 "send the question alone")
        ids.extend(self._tok(after.replace("\u27e6Q\u27e7", question)))
        return PromptLayout(tuple(ids), tuple(segments))
