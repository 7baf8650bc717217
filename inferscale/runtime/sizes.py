"""Default sizes, in bytes, shared by the settings and by vLLM's engine process (which
imports this module and nothing else of the settings)."""

#: Bytes of fact KV a process keeps on its device tier (2 GiB): ~46k tokens, about 1,500
#: facts of ~30 tokens, of SmolLM2 in fp32 (30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB/token).
DEFAULT_DEVICE_KV_BUDGET_BYTES = 2 << 30
#: vLLM's paged KV cache (1 GiB): at SmolLM2's 45 KiB/token in fp32, about 23k tokens.
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
#: Bytes of fact KV kept in pinned host memory below a CUDA device tier (4 GiB): a GPU's device
#: tier lets go of cold facts there instead of dropping them to disk.
DEFAULT_HOST_KV_BUDGET_BYTES = 4 << 30
