"""Everything that imports vLLM: the engine, the KV connector, the version shims.

vLLM is imported here first so that its logger starts quiet (:mod:`inferscale.runtime.logs`).
"""

from inferscale.runtime.logs import vllm_import_level

with vllm_import_level():
    import vllm.logger  # noqa: F401  (configures vLLM's logging from VLLM_LOGGING_LEVEL)
