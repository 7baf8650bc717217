"""``langgraph-checkpoint`` 4.3.2's ``tests/test_store.py`` (written against ``InMemoryStore``)
run on ``InferScaleStore`` (:mod:`langgraph_suites`)."""

from langgraph_suites import (  # noqa: F401 (fixtures)
    CHECKPOINT, fresh_memory, load, suite_front, suite_memory, suite_members, transport,
)

globals().update(suite_members(load(CHECKPOINT, "test_store")))

#: tests of ``InMemoryStore``'s or LangGraph's own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {
    "test_dedupe_ops_maps_repeated_reads_and_puts_to_one_op": "tests LangGraph's _dedupe_ops helper; no store",
    "test_get_text_at_path": "tests LangGraph's get_text_at_path helper; no store",
    "test_get_text_at_path_with_non_dict_mapping": "tests LangGraph's get_text_at_path helper; no store",
    "test_async_batch_store": "tests AsyncBatchedBaseStore over a mocker stub; no store",
    "test_async_batch_store_handles_cancellation": "tests AsyncBatchedBaseStore over its own MockStore; no store",
    "test_validate_op_namespace_rejects_invalid_labels": "tests LangGraph's validate_op_namespace helper; no store",
    "test_validate_op_namespace_allows_empty_prefix_and_wildcards": "tests LangGraph's validate_op_namespace "
                                                                     "helper; no store",
}
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = {}
